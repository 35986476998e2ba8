"""The train step: its compiled functions, built and cached in ``autosplit.compiled``.

A ``TrainStep`` pulls the micro-batches of one large batch from a host iterator
(``autosplit.pipeline``) inside a ``tf.while_loop`` and, per micro-batch, runs
``autosplit.accumulate.compute_piece`` (XLA-compiled on its own when ``jit_compile``:
the iterator stays outside the XLA cluster, as in Keras's ``steps_per_execution``
loop) and *commits* it: adds its gradients and loss terms to float32 sums kept in
variables and updates the metrics. After the loop, ``finish`` divides by the whole
batch's denominators (``autosplit.accumulate.combine``), applies the optimizer once
and zeroes the sums.

Why variables and a stash: a micro-batch that runs out of memory must cost nothing
but itself. Commits happen only after a micro-batch's gradients exist (under a
strategy: after every local replica's do), so the sums hold exactly the micro-batches
before the failure; the element being processed is copied to a host-side stash when
it is pulled, with the rows already committed counted. ``run_local(resume=True,
pieces=q)`` then redoes the stashed element's remaining rows and the rest of the
large batch with each element cut into q smaller pieces, and nothing is lost or
counted twice. ``autosplit.recovery`` drives that.

Nothing with B rows ever enters these functions: their inputs are the iterator and a
micro-batch count, the iterator and the stash are pinned to the host CPU, and the
accelerator sees one micro-batch at a time.
"""

from __future__ import annotations

import functools
import gc
from typing import Any

import keras
import tensorflow as tf

from autosplit import _keras
from autosplit.batchnorm import pooled_layers
from autosplit.compiled import Compilation, FunctionCache
from autosplit.custom_step import has_custom_step
from autosplit.distribute import layout
from autosplit.errors import DatasetError, UnsupportedModelError
from autosplit.inputs import HOST
from autosplit.model_state import model_state, step_key
from autosplit.piece import (
    LossPlan,
    Piece,
    combine,
    compute_piece,
    empty_to_none,
    step_plan,
    update_loss_trackers,
    update_metrics,
    without_padding,
)
from autosplit.pipeline import MicroBatches
from autosplit.reduction import check_reduction
from autosplit.sums import Stash, Sums, after
from autosplit.validation import check_trainable

__all__ = ["TrainStep", "build_for", "step_for"]

def _without_replica_axis(specs: Any) -> Any:
    """Per-replica specs of elements that carry a leading local-replica axis."""
    return tf.nest.map_structure(lambda s: tf.TensorSpec(s.shape[1:], s.dtype), specs)


class TrainStep:
    """Exact large-batch updates of a compiled Keras model from an iterator of micro-batches.

    Args:
        model: a compiled Keras model (TensorFlow backend).
        batch_size: B, the global large batch (under a strategy, across all replicas).
        element_spec: the pipeline's element spec ``(x, y, w_or_(), valid)``; with
            several local replicas each part has a leading replica axis.
        jit_compile: XLA for the per-micro-batch computation; default what
            ``model.compile`` resolved.
        run_eagerly: no ``tf.function`` (debugging); default ``model.run_eagerly``.
        batch_norm: ``"pooled"``: BatchNormalization's moving statistics are updated
            once per large batch with the pooled statistics of its micro-batches
            (``autosplit.batchnorm``); ``"micro"``: once per micro-batch.

    Variables are created once and reused for every split of the same element
    structure; call :meth:`rebind` to use another micro-batch size.
    """

    def __init__(self, model: keras.Model, batch_size: int, element_spec: Any, *,
                 jit_compile: bool | None = None, run_eagerly: bool | None = None,
                 batch_norm: str = "pooled") -> None:
        self.model = model
        self.pool = pooled_layers(model) if batch_norm == "pooled" else []
        self.batch_size = batch_size
        self.strategy = model.distribute_strategy
        where = layout(self.strategy)
        self.replicas = where.replicas
        self.local_replicas = where.local_replicas
        self.jit_compile, self.run_eagerly = Compilation.of(model, jit_compile, run_eagerly)
        for flat in _keras.flat_losses(model):
            check_reduction(flat.loss)
        self._functions = FunctionCache()
        self._template: Any = None
        self._dirty = False  # the sums may hold a partial large batch
        self.sums: Sums | None = None
        self.stash: Stash | None = None
        self.logs: Any = None  # a custom train_step's logs, in variables
        self.rebind(element_spec)

    # ------------------------------------------------------------ set-up

    def rebind(self, element_spec: Any) -> None:
        """Use elements of ``element_spec`` (another micro-batch size) from now on."""
        x, y, w, valid = element_spec
        if self.local_replicas > 1:
            x, y, w, valid = _without_replica_axis((x, y, w, valid))
        self.element_spec = element_spec
        self.piece_spec = (x, empty_to_none(y), empty_to_none(w), valid)
        self.rows = int(valid.shape[0])
        self.plan: LossPlan = step_plan(self.model, self.piece_spec[:3])
        if not self.model.optimizer.built:  # a custom step's model, built by its trace
            with self.strategy.scope():
                self.model.optimizer.build(self.model.trainable_variables)
            check_trainable(self.model)
        if self.plan.custom is not None and self.replicas > 1:
            raise UnsupportedModelError(
                f"Expected one replica for a model with its own train_step. Received: "
                f"{type(self.model).__name__} under {type(self.strategy).__name__} with "
                f"{self.replicas} replicas; autosplit splits a custom train_step on one "
                "device only (yet).")
        if self.plan.custom is not None and self.logs is None:
            # What the step returned for the last micro-batch: the large batch's logs.
            self.logs = tf.nest.map_structure(
                lambda s: tf.Variable(tf.zeros([d or 1 for d in s.shape.as_list()], s.dtype),
                                      trainable=False, shape=tf.TensorShape(None)),
                self.plan.custom.logs)
        # Another input structure (sample weights or not) can change the loss groups,
        # or what is stashed; compiled functions captured the old variables.
        if self.sums is None or self.sums.groups != self.plan.groups:
            self._functions.clear()
            self.sums = Sums(self.model, self.plan, self.strategy, self.pool)
        if self.stash is None or not self.stash.fits(element_spec):
            self._functions.clear()
            self.stash = Stash(element_spec)

    # ------------------------------------------------------------ one micro-batch

    def _loss_scale(self) -> tf.Tensor:
        """The factor the optimizer's loss scaling puts on gradients (1 without it)."""
        return tf.cast(self.model.optimizer.scale_loss(tf.constant(1.0)), tf.float32)

    def _compute(self, x, y, w, valid):
        """Per replica: one piece's gradients and terms, flattened (None entries dropped)."""
        x, y, w, valid = without_padding(self._strip(), x, empty_to_none(y), empty_to_none(w),
                                         valid)
        return self._piece_function()(x, y, w, valid)

    def _piece(self, x, y, w, valid):
        piece = compute_piece(self.model, self.plan, x, y, w, valid,
                              batch_size=self.batch_size, scale=self._loss_scale(),
                              pool=self.pool)
        flat = tf.nest.flatten(piece)
        self._template = (piece, [t is not None for t in flat])
        return [t for t in flat if t is not None]

    def _unflatten(self, values: list) -> Piece:
        piece, present = self._template
        it = iter(values)
        flat = [next(it) if keep else None for keep in present]
        return tf.nest.pack_sequence_as(piece, flat)

    def _commit_sums(self, values, ready=None):
        """Per replica: add one piece's gradients and loss terms to the sums.

        ``ready`` exists once every local replica has its gradients: a strategy runs
        replica functions in threads of their own, where the caller's control
        dependencies do not reach, so the ordering travels as data.
        """
        with tf.control_dependencies([] if ready is None else [ready]):
            return self.sums.add(self._unflatten(list(values)))

    def _commit_metrics(self, values, ready=None):
        """Per replica: update the compiled metrics from one piece (after ``ready``)."""
        piece = self._unflatten(list(values))
        if self.plan.custom is not None:  # the step updated its own metrics
            with tf.control_dependencies([] if ready is None else [ready]):
                return after([v.assign(t) for v, t in zip(
                    tf.nest.flatten(self.logs), tf.nest.flatten(piece.logs), strict=True)])
        with tf.control_dependencies([] if ready is None else [ready]):
            update_metrics(self.model, piece.y, piece.y_pred, piece.sample_weight, piece.valid,
                           piece.masks)
            return tf.constant(True)

    def _strip(self) -> bool:
        """Micro-batches of real rows only (``autosplit.piece.without_padding``)."""
        return self.plan.real_rows_only or bool(self.pool)

    def _piece_function(self):
        if self.jit_compile and not self.run_eagerly:
            return self._functions.get(("piece", repr(self.piece_spec)), self._piece,
                                       jit_compile=True)
        return self._piece

    def _run_piece(self, x, y, w, valid, end_row):
        """One micro-step on every local replica: compute, then (only once all of them
        have their gradients) add to the sums and record that the rows up to
        ``end_row`` of the element in flight are done, then update the metrics.

        Every op depends on the one before: an out-of-memory error anywhere before the
        record leaves the sums and the record as they were, one after it cannot undo it.
        """
        args = (x, y, w, valid)
        if self.replicas == 1:
            values = self._compute(*args)
            with tf.control_dependencies(values):
                summed = self._commit_sums(values)
        else:
            if self.local_replicas > 1:
                args = tf.nest.map_structure(
                    lambda t: _keras.per_replica([t[i] for i in range(self.local_replicas)]),
                    args)
            values = self.strategy.run(self._compute, args=args)
            everything = [t for out in self.strategy.experimental_local_results(values)
                          for t in tf.nest.flatten(out)]
            ready = after(everything)
            summed = after(self.strategy.experimental_local_results(
                self.strategy.run(self._commit_sums, args=(values, ready))))
        with tf.control_dependencies([summed]):
            recorded = self.stash.record(end_row, self.rows)
        if self.replicas == 1:
            with tf.control_dependencies([recorded]):
                return self._commit_metrics(values)
        return after(self.strategy.experimental_local_results(self.strategy.run(
            self._commit_metrics, args=(values, recorded))))

    # ------------------------------------------------------------ one element

    def _process(self, element, pieces: int, first_row=None):
        """All of one element (the rows from ``first_row`` on), in ``pieces`` parts."""
        x, y, w, valid = element
        axis = 1 if self.local_replicas > 1 else 0
        rows = self.rows
        if first_row is not None:
            keep = tf.cast(tf.range(rows) >= first_row, tf.float32)
            valid = valid * (keep[None, :] if axis else keep)
        if pieces == 1:
            return self._run_piece(x, y, w, valid, tf.constant(rows))
        size = -(-rows // pieces)

        def body(p):
            with tf.device(HOST):
                index = p * size + tf.range(size)
                clipped = tf.minimum(index, rows - 1)
                part = tf.nest.map_structure(lambda t: tf.gather(t, clipped, axis=axis),
                                             (x, y, w, valid))
                inside = tf.cast(index < rows, tf.float32)
                part_valid = part[3] * (inside[None, :] if axis else inside)
            done = self._run_piece(part[0], part[1], part[2], part_valid,
                                   tf.minimum((p + 1) * size, rows))
            with tf.control_dependencies([done]):
                return p + 1

        start = tf.constant(0) if first_row is None else first_row // size
        loop = tf.while_loop(lambda p: p < pieces, body, [start], parallel_iterations=1)
        return after([loop])

    # ------------------------------------------------------------ the loop

    def _local(self, iterator, count, resume: bool = False, pieces: int = 1):
        """Pull up to ``count`` elements and commit them; no collective communication."""
        stash = self.stash
        ops = [stash.pulled.assign(0), stash.exhausted.assign(False)]
        if resume:
            with tf.control_dependencies(ops):
                stashed = stash.get(self.element_spec)
                ops = [tf.cond(stash.pending.read_value(),
                               lambda: self._process(stashed, pieces,
                                                     stash.done_rows.read_value()),
                               lambda: tf.constant(True))]

        def cond(i, stop):
            return tf.logical_and(i < count, tf.logical_not(stop))

        def body(i, stop):
            with tf.device(HOST):
                optional = iterator.get_next_as_optional()
                has = optional.has_value()

            def one():
                with tf.device(HOST):
                    element = optional.get_value()
                    marks = stash.put(element)
                with tf.control_dependencies(marks):
                    element = tf.nest.map_structure(tf.identity, element)
                done = self._process(element, pieces)
                with tf.control_dependencies([done]):
                    return i + 1, tf.constant(False)

            def end():
                with tf.control_dependencies([stash.exhausted.assign(True)]):
                    return i, tf.constant(True)

            return tf.cond(has, one, end)

        with tf.control_dependencies(ops):
            start = tf.constant(0, count.dtype if hasattr(count, "dtype") else tf.int32)
        loop = tf.while_loop(cond, body, [start, tf.constant(False)], parallel_iterations=1)
        with tf.control_dependencies(loop):
            return stash.pulled.read_value()

    # ------------------------------------------------------------ after the loop

    def _finish_replica(self, ready=None):
        """Per replica: all-reduce the scalar sums, combine, apply once, zero the sums.

        ``ready``: a token of the loop's end (control dependencies of the caller do not
        reach a strategy's replica threads); everything after reads the sums.
        """
        model = self.model
        with tf.control_dependencies([] if ready is None else [ready]):
            totals = self.sums.read()
        local_rows = totals.rows
        if self.replicas > 1:
            totals = totals.summed_over_replicas(tf.distribute.get_replica_context())
        loss, gradients, per_output = combine(model, self.plan, totals,
                                              batch_size=self.batch_size,
                                              scale=self._loss_scale(), replicas=self.replicas)
        pairs = [(g, v) for g, v in zip(gradients, model.trainable_variables, strict=True)
                 if g is not None]
        # One loss scale for the whole large batch: a LossScaleOptimizer unscales,
        # checks the summed gradients once and skips the whole step on an overflow.
        # Under a strategy Keras's optimizer all-reduces these gradients: once.
        with tf.control_dependencies([loss] + [g for g, _ in pairs]):
            model.optimizer.apply_gradients(pairs)
            # BatchNormalization's moving statistics: one update, pooled (batchnorm.py).
            pooled = [] if self.sums.pool is None else self.sums.pool.apply()
        updates = [] if self.plan.custom is not None else update_loss_trackers(
            model, loss, per_output, local_rows)
        with tf.control_dependencies([g for g, _ in pairs] + [loss] + updates + pooled):
            self.sums.zero()
        return loss

    def _finish(self, ready=None):
        if self.replicas == 1:
            loss = self._finish_replica(ready)
        else:
            loss = self.strategy.run(self._finish_replica, args=(ready,))
        with tf.control_dependencies(tf.nest.flatten(
                self.strategy.experimental_local_results(loss))):
            if self.plan.custom is not None:
                return tf.nest.map_structure(lambda v: v.read_value(), self.logs)
            return self.model.get_metrics_result()

    def _fused(self, iterator, count):
        return self._finish(self._local(iterator, count))

    def _agree(self, failed, rows):
        """Multi-worker: how many replicas failed, and the real rows, summed over all (one
        all-reduce of two floats)."""
        def replica(failed, rows):
            context = tf.distribute.get_replica_context()
            return context.all_reduce(tf.distribute.ReduceOp.SUM, tf.stack([failed, rows]))
        result = self.strategy.run(replica, args=(failed, rows / self.local_replicas))
        return self.strategy.experimental_local_results(result)[0]

    # ------------------------------------------------------------ compiled functions

    # Functions whose collectives must be traced once, in the same order, on every
    # worker: TensorFlow numbers collective instances as they are traced, so a worker
    # that traced one more (for its own micro-batch size) would talk past the others.
    _SHARED = ("finish", "agree")

    def _function(self, name: str, fn, **static):
        spec = "" if name in self._SHARED else repr(self.piece_spec)
        key = (name, spec, tuple(sorted(static.items())))
        call = functools.partial(fn, **static) if static else fn
        return self._functions.get(key, call, run_eagerly=self.run_eagerly)

    def run(self, iterator, count: int) -> dict:
        """One large batch of ``count`` elements, applied once; returns the metric logs."""
        self._dirty = True
        logs = self._function("fused", self._fused)(iterator, tf.constant(count, tf.int32))
        self._dirty = False
        return logs

    def run_local(self, iterator, count: int, *, resume: bool = False, pieces: int = 1) -> int:
        """Commit up to ``count`` elements (after the stash, with ``resume``); returns the
        number pulled. Runs no collective: safe for one worker to fail alone."""
        self._dirty = True
        fn = self._function("local", self._local, resume=resume, pieces=pieces)
        return int(fn(iterator, tf.constant(count, tf.int32)))

    def finish(self) -> dict:
        """Apply the summed large batch once and zero the sums; returns the metric logs."""
        logs = self._function("finish", self._finish)()
        self._dirty = False
        return logs

    def agree(self, ok: bool, rows: float) -> tuple[bool, float]:
        """Every worker's verdict on this attempt (collective): all ok, and the rows."""
        failed, total = self._function("agree", self._agree)(
            tf.constant(0.0 if ok else 1.0), tf.constant(rows, tf.float32)).numpy()
        return failed == 0, float(total)

    def local_rows(self) -> float:
        """Real rows committed on this worker since the last finish."""
        values = self.strategy.experimental_local_results(self.sums.rows)
        return float(sum(float(v) for v in values))

    def progress(self) -> tuple[int, bool, bool]:
        """(elements pulled by the last call, stash holds an unfinished element, input ended)."""
        stash = self.stash
        return (int(stash.pulled.numpy()), bool(stash.pending.numpy()),
                bool(stash.exhausted.numpy()))

    def discard(self) -> None:
        """Forget a partial large batch: zero the sums and the stash mark."""
        if self._dirty:
            self._function("zero", self._zero_function)()
            self._dirty = False
        self.stash.pending.assign(False)

    def _zero_function(self):
        if self.replicas == 1:
            self.sums.zero()
        else:
            self.strategy.run(self.sums.zero)
        return tf.constant(0)

    def graph(self, iterator) -> tf.Graph:
        """The traced graph of :meth:`run` (for tests that walk it: placement, shapes)."""
        fn = self._function("fused", self._fused)
        return fn.get_concrete_function(iterator, tf.constant(1, tf.int32)).graph

    def tracing_count(self) -> int:
        """Traces of every compiled function so far (0 under ``run_eagerly``)."""
        return self._functions.tracing_count()


def step_for(model: keras.Model, pipeline: MicroBatches, *, jit_compile: bool | None = None,
             run_eagerly: bool | None = None, batch_norm: str = "pooled") -> TrainStep:
    """The model's ``TrainStep`` for ``pipeline``'s micro-batches, built once and reused.

    Builds the model for the pipeline's elements first (:func:`build_for`). As Keras
    keeps ``model.train_function``, a second ``fit_large_batch`` on the same model
    reuses the compiled step (no new trace, no new variables) while its compile state
    (``autosplit.model_state``), the batch size and the compile options are the same;
    a ``compile()`` or a change of ``trainable`` in between gives a fresh step.
    """
    spec = pipeline.element_spec()
    build_for(model, spec, pipeline.local_replicas)
    compilation = Compilation.of(model, jit_compile, run_eagerly)
    state = model_state(model)
    key = step_key(pipeline.batch_size, compilation, batch_norm)
    step = state.steps.get(key)
    if step is None:
        if state.steps:
            # An older batch size: free its sums before allocating new ones (its
            # compiled functions hold it in a reference cycle).
            state.steps.clear()
            gc.collect()
        step = TrainStep(model, pipeline.batch_size, spec, jit_compile=compilation.jit_compile,
                         run_eagerly=compilation.run_eagerly, batch_norm=batch_norm)
        state.steps[key] = step
    else:
        step.rebind(spec)
        step.discard()
    return step


def build_for(model: keras.Model, element_spec: Any, local_replicas: int = 1) -> None:
    """Build the model (symbolically, as ``model.fit`` does) for pipeline elements."""
    x, y, w, _ = element_spec
    if local_replicas > 1:
        x, y, w = _without_replica_axis((x, y, w))
    custom = has_custom_step(model)
    if empty_to_none(y) is None and _keras.has_compiled_loss(model) and not custom:
        raise DatasetError(
            "Expected targets `y` for the compiled loss. Received: inputs without targets. "
            "Pass (x, y), as to model.fit, or compile with loss=None when the model adds "
            "its loss in call().")
    with model.distribute_strategy.scope():
        if custom and not model.built:
            # As model.fit does without a strategy: a model whose train_step is its own
            # (and may have no call(), as the Keras VAE) is built by tracing that step
            # (the step plan's throwaway trace); its optimizer right after it.
            return
        _keras.symbolic_build(model, (x, empty_to_none(y), empty_to_none(w)))
    check_trainable(model)
