"""The train step: one model's compiled large-batch functions, built once and cached.

As Keras keeps ``train_step`` (the math), ``make_train_function`` (the ``tf.function``
and the loop) and ``fit`` apart, the train step is three parts:

- the math of one large batch, in variables: micro-steps that commit, one apply
  (``autosplit.step.update``);
- the loops that pull the elements of a large batch from the host iterator and cut
  them into slices, with the stash that makes an out-of-memory error cost one
  micro-batch (``autosplit.step.loop``);
- here, :class:`TrainStep`: those loops and the apply compiled, in one
  ``autosplit.step.compiled.FunctionCache`` (the XLA-compiled piece of ``jit_compile``
  joins it), and the calls that ``fit_large_batch``, its out-of-memory recovery
  (``autosplit.training.recovery``) and the probe's trials make.

:func:`step_for` gives the model's step for a pipeline, built once per model, compile
state and batch size, as Keras keeps ``model.train_function``.
"""

from __future__ import annotations

import functools
import gc
from typing import Any, Literal

import keras
import tensorflow as tf

from autosplit.data.markers import Ends, is_header
from autosplit.data.pipeline import MicroBatches
from autosplit.data.structure import empty_to_none
from autosplit.errors import DatasetError, refusing
from autosplit.keras_hooks import internals as _keras
from autosplit.keras_hooks.checks import check_trainable
from autosplit.keras_hooks.custom_step import has_custom_step
from autosplit.step.compiled import Compilation, FunctionCache
from autosplit.step.loop import Pull, pull
from autosplit.step.mixing import loss_over_whole_batch
from autosplit.step.model_state import model_state, step_key
from autosplit.step.noise_scale import NoiseEpoch
from autosplit.step.reduction import check_reduction
from autosplit.step.replicas import row_count, without_replica_axis
from autosplit.step.update import LargeBatchUpdate
from autosplit.step.whole_batch import WholeBatchStep

__all__ = ["Step", "TrainStep", "build_for", "step_for"]


_INPUT = Ends("input")


def _until(ends: Ends) -> Literal["input", "marker"]:
    """Where a loop that may end early stops (``Pull.ends``): at a marker, or at the
    input's end."""
    return "marker" if ends.stop == "marker" else "input"


class TrainStep:
    """Exact large-batch updates of a compiled Keras model from an iterator of micro-batches.

    Internal: :func:`step_for` makes it (and reuses it) for a pipeline.

    Args:
        model: a compiled Keras model (TensorFlow backend).
        batch_size: B, the global large batch (under a strategy, across all replicas).
        element_spec: the pipeline's element spec ``(x, y, w_or_(), valid)``; with
            several local replicas each part has a leading replica axis.
        compilation: XLA for the per-micro-batch computation, and whether to run
            without ``tf.function``; default what ``model.compile`` resolved.
        batch_norm: ``"pooled"``: BatchNormalization's moving statistics are updated
            once per large batch with the pooled statistics of its micro-batches
            (``autosplit.keras_hooks.batchnorm``); ``"micro"``: once per micro-batch.
        noise_scale: estimate the gradient noise scale from the micro-batches' gradients
            (``autosplit.step.noise_scale``), into :attr:`noise` (changes no weight).

    Variables are created once and reused for every split of the same element
    structure; call :meth:`rebind` to use another micro-batch size.

    ``all_real``: every element the pipeline yields holds real rows only
    (``MicroBatches.all_real``); see :meth:`rebind`.
    """

    # Functions whose collectives must be traced once, in the same order, on every
    # worker: TensorFlow numbers collective instances as they are traced, so a worker
    # that traced one more (for its own micro-batch size) would talk past the others.
    _SHARED = ("finish", "agree", "lengths")

    def __init__(self, model: keras.Model, batch_size: int, element_spec: Any, *,
                 compilation: Compilation | None = None, batch_norm: str = "pooled",
                 all_real: bool = False, rows: int | None = None,
                 noise_scale: bool = False) -> None:
        self.model = model
        self.batch_size = batch_size
        self.strategy = model.distribute_strategy
        self.compilation = compilation or Compilation.of(model)
        for flat in _keras.flat_losses(model):
            check_reduction(flat.loss)
        self._functions = FunctionCache()
        self.update = LargeBatchUpdate(
            model, batch_size, pooled=batch_norm == "pooled",
            functions=self._functions,
            jit=self.compilation.jit_compile and not self.compilation.run_eagerly,
            noise=noise_scale)
        self.replicas = self.update.replicas.count
        self._dirty = False  # the sums may hold a partial large batch
        self._ended: bool | None = False  # the last call reached the end (None: not read)
        self.rebind(element_spec, all_real=all_real, rows=rows)

    @property
    def noise(self) -> NoiseEpoch | None:
        """The epoch's gradient noise scale estimates (None: not estimated: turned off,
        or a custom ``train_step``'s gradients)."""
        return self.update.noise_epoch

    @property
    def rows(self) -> int:
        """Rows per element of the pipeline in use, or with tokens the most an element
        holds (``autosplit.training.recovery``'s ``rows``)."""
        return self.update.rows if self.update.rows is not None else self._most_rows

    def rebind(self, element_spec: Any, *, all_real: bool = False, rows: int | None = None
               ) -> None:
        """Use elements of ``element_spec`` (another micro-batch size) from now on.

        ``all_real``: the pipeline's elements hold real rows only, never padding
        (``MicroBatches.all_real``). Its whole elements then reach the metrics (and a
        model that needs its real rows alone) as they are, where a ``tf.cond`` per
        micro-batch would drop padding rows: a branch pair less to trace and optimise
        with every step and to run with every micro-batch. A redone element's rest, or
        an element cut into slices after an out-of-memory error, keeps the check
        (``autosplit.step.loop``). The default assumes padding may come.

        ``rows``: the most rows an element holds, where their count varies
        (``MicroBatches.element_rows`` is None).
        """
        self.update.bind(element_spec)
        self.all_real = all_real
        self._most_rows = rows or 0

    # ------------------------------------------------------------ compiled functions

    def _function(self, name: str, fn, **static):
        spec = "" if name in self._SHARED else repr(self.update.micro_batch_spec)
        key = (name, spec, tuple(sorted(static.items())))
        call = functools.partial(fn, **static) if static else fn
        return self._functions.get(key, call, run_eagerly=self.compilation.run_eagerly)

    def _fused(self, iterator, count, *, how: Pull):
        return self.update.apply(pull(self.update, iterator, count, how))

    def _fused_if_any(self, iterator, count, *, how: Pull):
        pulled = pull(self.update, iterator, count, how)
        with tf.control_dependencies([pulled]):
            ended = self.update.stash.exhausted.read_value()
        applied, logs = self.update.apply_if_any(pulled)
        return applied, ended, logs

    def _local(self, iterator, count, *, how: Pull):
        return pull(self.update, iterator, count, how)

    @property
    def train_function(self):
        """The compiled function :meth:`run` calls, ``(iterator, count) -> logs``, as
        Keras's ``model.train_function`` (the plain function under ``run_eagerly``)."""
        return self._function("fused", self._fused,
                              how=Pull("counted", all_real=self.all_real))

    def function_if_any(self, ends: Ends = _INPUT):
        """The compiled function :meth:`run_if_any` calls, ``(iterator, count) ->
        (applied, ended, logs)``: it pulls until the input ends (or, as ``ends`` says,
        until an element with no row marks an end), if it ends before ``count``;
        ``ended`` says whether it did."""
        return self._function("fused_if_any", self._fused_if_any,
                              how=Pull(_until(ends), all_real=self.all_real))

    def tracing_count(self) -> int:
        """Traces of every compiled function so far (0 under ``run_eagerly``)."""
        return self._functions.tracing_count()

    # ------------------------------------------------------------ calls

    def run(self, iterator, count: int) -> dict:
        """One large batch of ``count`` elements, applied once; returns the metric logs.

        The iterator must hold ``count`` more elements (an input that knows its length);
        for one whose end only its iterator tells, :meth:`run_if_any`."""
        self._dirty = True
        logs = self.train_function(iterator, tf.constant(count, tf.int32))
        self._dirty = False
        return logs

    def run_if_any(self, iterator, count: int, *, ends: Ends = _INPUT) -> dict | None:
        """:meth:`run` for an input whose end only its iterator tells (one replica): the
        apply runs in the same call, if any row came; None (nothing applied) if the
        input ended (or, as ``ends`` says, a marker came: an epoch's end, or in tokens
        each large batch's) before the large batch began.
        :meth:`input_ended` then says whether this call reached that end."""
        self._dirty = True
        applied, ended, logs = self.function_if_any(ends)(
            iterator, tf.constant(count, tf.int32))
        self._dirty = False
        self._ended = bool(ended)
        return logs if bool(applied) else None

    def run_local(self, iterator, count: int, *, resume: bool = False, slices: int = 1,
                  ends: Ends = _INPUT) -> int:
        """Commit up to ``count`` elements (after the stash, with ``resume``; ``ends`` as
        :meth:`run_if_any` takes it); returns the number pulled. Runs no collective:
        safe for one worker to fail alone."""
        self._dirty = True
        self._ended = None
        fn = self._function("local", self._local, how=Pull(
            _until(ends), all_real=self.all_real, resume=resume, slices=slices))
        return int(fn(iterator, tf.constant(count, tf.int32)))

    def input_ended(self) -> bool:
        """Whether the last call's loop reached the input's end (or the epoch's marker)."""
        if self._ended is None:
            self._ended = bool(self.update.stash.exhausted.numpy())
        return self._ended

    def finish(self) -> dict:
        """Apply the summed large batch once and zero the sums; returns the metric logs."""
        logs = self._function("finish", self.update.apply)()
        self._dirty = False
        return logs

    def agree(self, ok: bool, rows: float) -> tuple[bool, float]:
        """Every worker's verdict on this attempt (collective): all ok, and the rows."""
        failed, total = self._function("agree", self.update.replicas.vote)(
            tf.constant(0.0 if ok else 1.0), tf.constant(rows, tf.float32)).numpy()
        return failed == 0, row_count(total)

    def agree_lengths(self, iterator) -> bool:
        """Pull this worker's next share's header (``markers.is_header``) and agree with
        every worker on the large batch's length per model output (collective), which
        the micro-steps then count (``LargeBatchUpdate.agree_lengths``). A worker
        whose input ended agrees with no length of its own. Returns whether every
        worker read its header; where this one's input failed (a bad record of its
        share), it joins the agreement as one that gave up, then raises its error."""
        scale = self.update.share_factor.variable
        assert scale is not None
        local, failure = tf.zeros(scale.shape), None
        try:
            optional = iterator.get_next_as_optional()
            if bool(optional.has_value()):
                element = optional.get_value()
                if not bool(is_header(element)):
                    raise DatasetError("Expected a share's header before its micro-batches. "
                                       "Received: a micro-batch; the pipeline lost its order.")
                factor = element[0].length_factor  # its first row's (of the first replica)
                local = factor[(0,) * (factor.shape.rank - 1)]
        except (tf.errors.OpError, DatasetError) as error:
            local, failure = -tf.ones(scale.shape), error
        least = self._function("lengths", self.update.agree_lengths)(local)
        if failure is not None:
            raise failure
        return float(least) >= 0

    def local_rows(self) -> float:
        """Real rows committed on this worker since the last finish."""
        values = self.update.replicas.results(self.update.sums.rows)
        return float(sum(float(v) for v in values))

    def progress(self) -> tuple[int, bool, bool]:
        """(elements pulled by the last call, stash holds an unfinished element, input ended)."""
        stash = self.update.stash
        return (int(stash.pulled.numpy()), bool(stash.pending.numpy()),
                bool(stash.exhausted.numpy()))

    def discard(self) -> None:
        """Forget a partial large batch: zero the sums and the stash mark."""
        if self._dirty:
            self._function("zero", self.update.zero)()
            self._dirty = False
        self.update.stash.pending.assign(False)


Step = TrainStep | WholeBatchStep  # a model's compiled large-batch step, of either kind


def step_for(model: keras.Model, pipeline: MicroBatches, *, jit_compile: bool | None = None,
             run_eagerly: bool | None = None, batch_norm: str = "pooled",
             noise_scale: bool = False) -> Step:
    """The model's ``TrainStep`` for ``pipeline``'s micro-batches, built once and reused.

    Builds the model for the pipeline's elements first (:func:`build_for`). As Keras
    keeps ``model.train_function``, a second ``fit_large_batch`` on the same model
    reuses the compiled step (no new trace, no new variables) while its compile state
    (``autosplit.step.model_state``), the batch size and the compile options are the same;
    a ``compile()`` or a change of ``trainable`` in between gives a fresh step.
    """
    spec = pipeline.element_spec()
    compilation = Compilation.of(model, jit_compile, run_eagerly)
    state = model_state(model)
    key = step_key(pipeline.batch_size, compilation, batch_norm, noise_scale)
    step: Step | None = state.steps.get(key)
    # keras-io's Switch Transformer reshapes to a fixed batch_size * tokens.
    with refusing(
            "a model whose call() takes batches of any number of rows",
            f"`{type(model).__name__}`, which autosplit built and traced on micro-batches "
            f"of {pipeline.rows} rows (batch_size={pipeline.batch_size}), as model.fit "
            "would on batches of that size",
            "A model that fixes the batch size in call() (a reshape to batch_size * "
            "tokens) cannot be split: take such sizes from the input "
            "(keras.ops.shape(x)[0]), or train with model.fit."):
        build_for(model, spec, pipeline.local_replicas)
        whole = loss_over_whole_batch(model, pipeline.adapter, without_replica_axis(spec)
                                      if pipeline.local_replicas > 1 else spec)
        if step is None:
            if state.steps:
                # An older batch size: free its sums before allocating new ones (its
                # compiled functions hold it in a reference cycle).
                state.steps.clear()
                gc.collect()
            if whole is not None:  # outputs first, the loss over the batch, then gradients
                step = WholeBatchStep(model, pipeline.batch_size, spec, compilation=compilation,
                                      why=whole, all_real=pipeline.all_real(),
                                      rows=pipeline.rows)
            else:
                step = TrainStep(model, pipeline.batch_size, spec, compilation=compilation,
                                 batch_norm=batch_norm, all_real=pipeline.all_real(),
                                 rows=pipeline.rows, noise_scale=noise_scale)
            state.steps[key] = step
        else:
            step.rebind(spec, all_real=pipeline.all_real(), rows=pipeline.rows)
            step.discard()
    if isinstance(step, TrainStep):
        step.update.lengths = pipeline.cut.lengths
    return step


def build_for(model: keras.Model, element_spec: Any, local_replicas: int = 1) -> None:
    """Build the model (symbolically, as ``model.fit`` does) for pipeline elements."""
    x, y, w, _ = element_spec
    if local_replicas > 1:
        x, y, w = without_replica_axis((x, y, w))
    custom = has_custom_step(model)
    if empty_to_none(y) is None and _keras.has_compiled_loss(model) and not custom:
        raise DatasetError(
            "Expected targets `y` for the compiled loss. Received: inputs without targets. "
            "Pass (x, y), as to model.fit, or compile with loss=None when the model adds "
            "its loss in call().")
    with model.distribute_strategy.scope():
        if custom:
            # As model.fit does: a model with its own train_step is built by tracing
            # that step (the step plan's trace); one already built gets its optimizer.
            if not model.built:
                return
            if model.optimizer is not None and not model.optimizer.built:
                model.optimizer.build(model.trainable_variables)
        else:
            _keras.symbolic_build(model, (x, empty_to_none(y), empty_to_none(w)))
    check_trainable(model)
