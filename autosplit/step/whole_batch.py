"""The whole-batch step: the outputs first, the loss over the whole batch, then the
gradients (:class:`WholeBatchStep`), for a loss that compares a batch's rows with each
other (``autosplit.step.mixing`` finds it): in-batch negatives, supervised contrastive
losses, a statistic of the whole batch.

Summing micro-batch gradients cannot serve such a loss: each micro-batch would see only
its own rows. As GradCache does (Gao et al., 2021), for any model whose forward pass
treats each row on its own:

1. every element of the large batch is pulled first, into a store on the host, so that
   an out-of-memory error later redoes the large batch from it, losing nothing;
2. pass 1 runs each micro-batch forward without a tape and keeps its outputs: the large
   batch's ``y_pred`` on the device (gathered from every replica and worker, in the
   large batch's row order, so that negatives come from the global batch);
3. the compiled loss is computed once on the whole batch, as Keras's ``compute_loss``
   computes it, with the metrics, and its gradient with respect to the outputs;
4. pass 2 runs each micro-batch forward again under a tape, from the same random
   states (Dropout draws what it drew in pass 1), and takes the weights' gradient of
   the sum of its outputs times their gradients from step 3, plus the losses added in
   ``call()``; the sums are applied once, with the weight penalties counted once.

Under ``mixed_float16`` the loss is scaled before its gradient is taken, so the outputs'
gradients and every weight's come out scaled, and the optimizer unscales them and skips
an overflow once per large batch (``autosplit.step.overflow``).
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from autosplit.data.markers import Ends
from autosplit.data.structure import empty_to_none, map_present
from autosplit.errors import UnsupportedModelError
from autosplit.graph import HOST, after, zeros_from
from autosplit.keras_hooks import internals as _keras
from autosplit.keras_hooks.custom_step import overridden_steps
from autosplit.step.compiled import Compilation, FunctionCache
from autosplit.step.forward import align_targets, forward_parts, in_call_losses
from autosplit.step.loss_plan import loss_plan, own_loss_plan
from autosplit.step.metrics import update_loss_trackers, update_metrics
from autosplit.step.mixing import refuse_what_is_not_exact
from autosplit.step.overflow import overflowed, poisoned
from autosplit.step.reduction import weight_regularization, whole_batch_loss
from autosplit.step.replicas import Replicas, row_count, without_replica_axis
from autosplit.step.store import Store, parts_of

__all__ = ["WholeBatchStep", "whole_batch_loss"]

_INPUT = Ends("input")


class WholeBatchStep:
    """Exact large-batch updates of a loss over the whole batch, from an iterator of
    micro-batches (see the module's docstring): the surface of ``TrainStep`` that the
    epochs, the out-of-memory recovery and the probe's trials use.

    Args:
        model: a compiled Keras model (TensorFlow backend), built.
        batch_size: B, the global large batch.
        element_spec: the pipeline's element spec ``(x, y, w_or_(), valid)``, rows of
            one shape in each large batch (never cut by length).
        compilation: XLA for each micro-batch's passes; ``run_eagerly``.
        why: why the loss is over the whole batch (``mixing.whole_batch_reason``).
    """

    _SHARED = ("finish", "agree")

    def __init__(self, model: keras.Model, batch_size: int, element_spec: Any, *,
                 compilation: Compilation, why: str, all_real: bool = False,
                 rows: int | None = None) -> None:
        self.model = model
        self.batch_size = batch_size
        self.strategy = model.distribute_strategy
        self.compilation = compilation
        self.why = why
        self._replicas = Replicas(self.strategy)
        self.replicas = self._replicas.count
        self._functions = FunctionCache()
        self._slices = 1
        self._ended: bool | None = False
        self._store: Store | None = None
        self._trained: tuple[dict, float] | None = None  # (logs, rows) not yet finished
        self._multi_worker = self._replicas.count > self._replicas.local
        self.rebind(element_spec, all_real=all_real, rows=rows)

    # ------------------------------------------------------------ binding

    @property
    def rows(self) -> int:
        """Rows per element of the pipeline in use."""
        return self._rows

    def rebind(self, element_spec: Any, *, all_real: bool = False, rows: int | None = None
               ) -> None:
        """Use elements of ``element_spec`` (another micro-batch size) from now on."""
        x, y, w, valid = (without_replica_axis(element_spec) if self._replicas.local > 1
                          else element_spec)
        self.element_spec = element_spec
        self._rows = int(valid.shape[0] or rows or 1)
        specs = tuple(tf.TensorSpec([self._rows, *s.shape[1:]], s.dtype) if isinstance(
            s, tf.TensorSpec) else s for s in (x, empty_to_none(y), empty_to_none(w)))
        self._own_loss = "compute_loss" in overridden_steps(self.model)
        self.plan = own_loss_plan(self.model, specs) if self._own_loss else loss_plan(
            self.model, specs)
        refuse_what_is_not_exact(self.plan, self.why, self._own_loss, self.replicas)
        self.update = self  # what fit's warnings read of it: .plan, .pool
        self.pool: list = []
        # No gradient noise scale: its micro-batches' gradients are parts of one loss
        # over the whole batch, none an estimate of the large batch's on its own.
        self.noise = None
        if self._store is None or not self._store.fits(element_spec):
            self._functions.clear()
            self._store = Store(element_spec)
        self._store.spec = element_spec

    @property
    def _held(self) -> Store:
        assert self._store is not None
        return self._store

    def _function(self, name: str, fn: Any, **static: Any) -> Any:
        spec = "" if name in self._SHARED else repr(self.element_spec)
        key = (name, spec, tuple(sorted(static.items())))

        def call(*args: Any) -> Any:
            return fn(*args, **static)

        return self._functions.get(key, call, run_eagerly=self.compilation.run_eagerly)

    def tracing_count(self) -> int:
        """Traces of every compiled function so far."""
        return self._functions.tracing_count()

    # ------------------------------------------------------------ the calls

    def run(self, iterator: Any, count: int) -> dict:
        """Pull one large batch of ``count`` elements, train on it once; the logs."""
        return self._function("fused", self._fused, until="counted")(
            iterator, tf.constant(count, tf.int32))

    def run_if_any(self, iterator: Any, count: int, *, ends: Ends = _INPUT) -> dict | None:
        """:meth:`run` for an input whose end only its iterator tells; None (nothing
        applied) where no row came before it ended."""
        applied, ended, logs = self._function("fused_if_any", self._fused_if_any,
                                              until=_until(ends))(
            iterator, tf.constant(count, tf.int32))
        self._ended = bool(ended)
        return logs if bool(applied) else None

    def run_local(self, iterator: Any, count: int, *, resume: bool = False, slices: int = 1,
                  ends: Ends = _INPUT) -> int:
        """Pull up to ``count`` more elements into the store (after those of the large
        batch so far, with ``resume``) and, in one process, train on it in ``slices``
        parts per element: an out-of-memory error in either pass comes out of this call,
        which the recovery redoes in smaller parts. Several workers train on it in
        :meth:`finish`, after their agreement (it runs collectives). The elements pulled."""
        self._slices = slices
        self._ended = None
        pulled = int(self._function("gather", self._held.pull, until=_until(ends),
                                    append=resume)(iterator, tf.constant(count, tf.int32)))
        if not self._multi_worker and self.local_rows():
            rows = self.local_rows()
            self._trained = (self._function("large_batch", self._large_batch,
                                            slices=slices)(), rows)
        return pulled

    def finish(self) -> dict:
        """Train once on the stored large batch (what :meth:`run_local` trained on, in
        one process); the logs."""
        if self._trained is not None:
            logs, self._trained = self._trained[0], None
            return logs
        return self._function("large_batch", self._large_batch, slices=self._slices)()

    def agree(self, ok: bool, rows: float) -> tuple[bool, float]:
        """Every worker's verdict on this attempt (collective): all ok, and the rows."""
        failed, total = self._function("agree", self._replicas.vote)(
            tf.constant(0.0 if ok else 1.0), tf.constant(rows, tf.float32)).numpy()
        return failed == 0, row_count(total)

    def agree_lengths(self, iterator: Any) -> bool:
        raise UnsupportedModelError(
            "Expected shares of one shape for a loss over the whole batch. Received: "
            "shares cut by length; the whole-batch step pads a large batch to its "
            "longest row.")

    def local_rows(self) -> float:
        """Real rows of the large batch in flight: in the store, or trained on already."""
        return self._trained[1] if self._trained is not None else float(
            self._held.real.numpy())

    def progress(self) -> tuple[int, bool, bool]:
        """(elements the last call pulled, False: nothing is half done, input ended)."""
        store = self._held
        return int(store.pulled.numpy()), False, bool(store.exhausted.numpy())

    def input_ended(self) -> bool:
        if self._ended is None:
            self._ended = bool(self._held.exhausted.numpy())
        return self._ended

    def discard(self) -> None:
        """Forget the stored large batch."""
        self._held.forget()
        self._trained = None
        self._slices = 1

    # ------------------------------------------------------------ graph code

    def _fused(self, iterator: Any, count: tf.Tensor, *, until: str) -> Any:
        pulled = self._held.pull(iterator, count, until=until)
        with tf.control_dependencies([pulled]):
            return self._large_batch(slices=1)

    def _fused_if_any(self, iterator: Any, count: tf.Tensor, *, until: str) -> Any:
        pulled = self._held.pull(iterator, count, until=until)
        with tf.control_dependencies([pulled]):
            ended = self._held.exhausted.read_value()
            any_rows = self._held.real.read_value() > 0
        applied, logs = tf.cond(any_rows, lambda: (tf.constant(True), self._large_batch(1)),
                                lambda: (tf.constant(False), self.model.get_metrics_result()))
        return applied, ended, logs

    def _large_batch(self, slices: int) -> Any:
        """Both passes over the stored large batch, each element in ``slices`` parts, the
        loss over the whole of it, one apply; the logs."""
        n, stored = self._held.read()
        if self._multi_worker:  # shares of other sizes: all as many, the rest weightless
            most, _ = self._replicas.bounds(tf.cast(n, tf.float32)[None])
            target = tf.cast(most[0], tf.int32)
            with tf.device(HOST):
                stored = [tf.pad(t, [[0, target - n]] + [[0, 0]] * (t.shape.rank - 1))
                          for t in stored]
            n = target
        if self._replicas.count == 1:
            done = after([self._replica(n, slices, *stored)])
        else:
            per_replica = self._replicas.split(stored, axis=1)
            done = self._replicas.done(self._replicas.run(
                lambda *flat: self._replica(n, slices, *flat), *per_replica))
        with tf.control_dependencies([done]):
            zeroed = self._held.forget()
        with tf.control_dependencies([zeroed]):
            return self.model.get_metrics_result()

    # ------------------------------------------------------------ one replica

    def _replica(self, n: tf.Tensor, slices: int, *stored: tf.Tensor) -> tf.Tensor:
        """This replica's part of a large batch (see the module's docstring); its loss."""
        model = self.model
        leaves, valid, size = parts_of(list(stored), n, slices, self._rows)
        x_spec, y_spec, w_spec, _ = (without_replica_axis(self.element_spec)
                                     if self._replicas.local > 1 else self.element_spec)
        structure = (x_spec, y_spec, w_spec)
        count = n * slices

        def part(p: tf.Tensor) -> tuple:
            with tf.device(HOST):
                flat = [t[p] for t in leaves]
            x, y, w = tf.nest.pack_sequence_as(structure, flat)
            return x, empty_to_none(y), empty_to_none(w)

        seeds = _keras.seed_states(model)
        kept = [tf.identity(tf.convert_to_tensor(s)) for s in seeds]
        outputs = self._pass_one(part, count)
        with tf.device(HOST):
            rows_of = tf.nest.map_structure(lambda t: tf.reshape(t, tf.concat(
                [[-1], tf.shape(t)[2:]], 0)), tf.nest.pack_sequence_as(structure, leaves))
        y, w, valid_all = empty_to_none(rows_of[1]), empty_to_none(rows_of[2]), tf.reshape(
            valid, [-1])
        loss, per_output, outputs_gradient, direct, rows = self._loss(
            outputs, y, w, valid_all, per_element=slices * size,
            x=rows_of[0] if self._own_loss else None)
        with tf.control_dependencies(tf.nest.flatten(outputs_gradient)):
            restored = after([s.assign(k) for s, k in zip(seeds, kept, strict=True)])
        with tf.control_dependencies([restored]):
            gradients, added = self._pass_two(part, count, size, outputs_gradient, valid,
                                              rows)
        # The metrics and trackers once both passes are through: an out-of-memory error
        # before them redoes the large batch, counted once.
        with tf.control_dependencies([after(gradients)]):
            update_metrics(model, align_targets(model, y, outputs), outputs, w, valid_all)
            local_rows = tf.reduce_sum(tf.cast(valid_all > 0, tf.float32))
            updates = update_loss_trackers(model, loss + added, per_output, local_rows)
        with tf.control_dependencies(updates):
            return self._apply(loss + added, [g if d is None else g + d for g, d in zip(
                gradients, direct, strict=True)])

    def _pass_one(self, part: Any, count: tf.Tensor) -> Any:
        """Every part forward without a tape: the outputs, ``[count * size, ...]`` per
        flat output, in ``y_pred``'s structure."""
        model = self.model
        forward = self._compiled("forward", lambda x: _call(model, x))
        first = tf.nest.map_structure(tf.stop_gradient, forward(part(0)[0]))
        flat = tf.nest.flatten(first)
        arrays = [tf.TensorArray(t.dtype, size=count, element_shape=t.shape).write(0, t)
                  for t in flat]

        def body(p, *arrays):
            out = tf.nest.flatten(tf.nest.map_structure(tf.stop_gradient,
                                                        forward(part(p)[0])))
            return (p + 1, *[a.write(p, t) for a, t in zip(arrays, out, strict=True)])

        _, *arrays = tf.while_loop(lambda p, *_: p < count, body, (tf.constant(1), *arrays),
                                   parallel_iterations=1)
        return tf.nest.pack_sequence_as(first, [
            tf.reshape(a.stack(), tf.concat([[-1], tf.shape(t)[1:]], 0))
            for a, t in zip(arrays, flat, strict=True)])

    def _loss(self, outputs: Any, y: Any, w: Any, valid: tf.Tensor, *, per_element: int,
              x: Any = None) -> tuple[tf.Tensor, list, Any, list, tf.Tensor]:
        """The loss over the whole large batch (every replica's rows gathered, in the
        large batch's order), weight penalties included: the loss, each output's, its
        scaled gradient with respect to this replica's ``outputs`` and (this replica's
        share) with respect to the weights directly (the penalties', a ``compute_loss``
        that reads a weight), the batch's real rows. ``x``: the large batch's inputs, for
        a ``compute_loss`` of the model's own (one replica)."""
        model = self.model
        variables = model.trainable_variables
        local = (outputs, y, w, valid)
        context = tf.distribute.get_replica_context() if self.replicas > 1 else None
        whole = local if context is None else map_present(
            lambda t: self._replicas.in_batch_order(context.all_gather(t, axis=0),
                                                    per_element), local)
        outputs_all, y_all, w_all, valid_all = whole
        keep = tf.where(valid_all > 0)[:, 0]
        real = map_present(lambda t: tf.gather(t, keep), (outputs_all, y_all, w_all))
        rows = tf.cast(tf.size(keep), tf.float32)
        scale = tf.cast(model.optimizer.scale_loss(tf.constant(1.0)), tf.float32)
        with tf.GradientTape() as tape:
            tape.watch(tf.nest.flatten(real[0]))
            if x is not None:  # the model's own compute_loss, penalties in model.losses
                per_output: list = []
                loss = tf.cast(model.compute_loss(
                    x=map_present(lambda t: tf.gather(t, keep), x), y=real[1], y_pred=real[0],
                    sample_weight=real[2], training=True), tf.float32)
            else:
                loss, per_output = whole_batch_loss(
                    model, align_targets(model, real[1], real[0]), real[0], real[2])
                loss += weight_regularization(model)
            scaled = loss * scale
        gradient, direct = tape.gradient(scaled, (real[0], variables))
        direct = [None if g is None else tf.cast(tf.convert_to_tensor(g), tf.float32)
                  / float(self.replicas) for g in direct]
        gradient = tf.nest.map_structure(
            lambda g, t: tf.scatter_nd(keep[:, None], g, tf.shape(t, out_type=tf.int64)),
            gradient, outputs_all)
        if context is not None:  # this replica's rows of it
            gradient = tf.nest.map_structure(
                lambda g: self._replicas.rows_of_this(g, context, per_element), gradient)
        return loss, per_output, gradient, direct, rows

    def _pass_two(self, part: Any, count: tf.Tensor, size: int, outputs_gradient: Any,
                  valid: tf.Tensor, rows: tf.Tensor) -> tuple[list, tf.Tensor]:
        """Every part forward again under a tape: the weights' gradient of its outputs
        times their gradient, plus the losses added in ``call()`` (means weighed by the
        part's real rows); summed, and the added losses' share of the loss."""
        model, plan = self.model, self.plan
        variables = model.trainable_variables
        scale = tf.cast(model.optimizer.scale_loss(tf.constant(1.0)), tf.float32)
        parts_gradient = tf.nest.map_structure(
            lambda g: tf.reshape(g, tf.concat([[count, size], tf.shape(g)[1:]], 0)),
            outputs_gradient)

        def backward(x, gradient, mask):
            with tf.GradientTape() as tape:
                y_pred = _call(model, x)
                surrogate = tf.add_n([tf.reduce_sum(tf.cast(t, tf.float32) * tf.cast(g, tf.float32))
                                      for t, g in zip(tf.nest.flatten(y_pred),
                                                      tf.nest.flatten(gradient), strict=True)])
                means, sums = forward_parts(in_call_losses(model), plan.forward_summed)
                added = means * tf.reduce_sum(mask) / tf.maximum(rows, 1.0) + sums
                objective = surrogate + added * scale
            found = tape.gradient(objective, variables)
            return [zeros_from(tf.cast(v, tf.float32)) if g is None else
                    tf.cast(tf.convert_to_tensor(g), tf.float32)
                    for g, v in zip(found, variables, strict=True)], added

        step = self._compiled("backward", backward)

        def body(p, total, *sums):
            x, _, _ = part(p)
            gradient = tf.nest.map_structure(lambda g: g[p], parts_gradient)
            mask = valid[p]
            if plan.forward_losses:  # a mean added in call() over the real rows alone
                keep = mask > 0
                x, gradient, mask = tf.nest.map_structure(
                    lambda t: tf.boolean_mask(t, keep), (x, gradient, mask))
            found, added = step(x, gradient, mask)
            return (p + 1, total + added, *[s + g for s, g in zip(sums, found, strict=True)])

        # zeros from each weight's value: a weight-sized constant, folded when the
        # function first runs, could fail to allocate there under a cap and end the process
        zeros = [zeros_from(tf.cast(v, tf.float32)) for v in variables]
        _, added, *sums = tf.while_loop(lambda p, *_: p < count, body,
                                        (tf.constant(0), tf.constant(0.0), *zeros),
                                        parallel_iterations=1)
        context = tf.distribute.get_replica_context() if self.replicas > 1 else None
        if context is not None:  # the logged loss's share of every replica's rows
            added = context.all_reduce(tf.distribute.ReduceOp.SUM, added)
        return list(sums), added

    def _apply(self, loss: tf.Tensor, summed: list) -> tf.Tensor:
        """The overflow decided as the full batch's, one apply; the loss."""
        model, plan = self.model, self.plan
        variables = model.trainable_variables
        context = tf.distribute.get_replica_context() if self.replicas > 1 else None
        summed = [g if has else None for g, has in zip(summed, plan.has_grad, strict=True)]
        overflow = overflowed(summed, plan.half, context)
        summed = poisoned(summed, overflow)
        pairs = [(tf.cast(g, v.dtype), v) for g, v in zip(summed, variables, strict=True)
                 if g is not None]
        with tf.control_dependencies([after([loss] + [g for g, _ in pairs])]):
            model.optimizer.apply_gradients(pairs)
        applied = after([tf.convert_to_tensor(v) for _, v in pairs])
        with tf.control_dependencies([applied]):
            return tf.identity(loss)

    def _compiled(self, name: str, fn: Any) -> Any:
        """``fn`` compiled with XLA on its own where the step asks for it."""
        if not self.compilation.jit_compile or self.compilation.run_eagerly:
            return fn
        return self._functions.get((name, repr(self.element_spec)), fn, jit_compile=True)


def _call(model: keras.Model, x: Any) -> Any:
    return model(x, training=True) if _keras.call_has_training_arg(model) else model(x)


def _until(ends: Ends) -> str:
    return "marker" if ends.stop == "marker" else "input"
