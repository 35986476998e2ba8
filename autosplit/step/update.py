"""One exact large-batch update, kept in variables: micro-steps commit, one apply.

The math of the train step, as Keras's ``train_step`` is the math of ``fit``. Per
micro-batch, :meth:`LargeBatchUpdate.micro_step` runs
``autosplit.step.contribution.compute_contribution`` on every local replica (XLA-compiled
on its own when ``jit_compile``: the iterator stays outside the XLA cluster, as in
Keras's ``steps_per_execution`` loop) and *commits* it:
adds its gradients and loss terms to float32 sums kept in variables
(``autosplit.step.sums``), records how far the element in flight got, and updates the
metrics. :meth:`LargeBatchUpdate.apply` divides the sums by the whole batch's
denominators (``autosplit.step.contribution.combine``), applies the optimizer once and
zeroes the sums.

Why that order: a micro-batch that runs out of memory must cost nothing but itself.
Commits happen only after a micro-batch's gradients exist (under a strategy: after
every local replica's do), so the sums hold exactly the micro-batches before the
failure, and the stash says which rows of the element in flight they hold.

Graph code only: the loops that pull elements (``autosplit.step.loop``) call it, inside
the compiled functions of ``autosplit.step.train_step``.
"""

from __future__ import annotations

import functools
from typing import Any

import keras
import tensorflow as tf

from autosplit.data.sequences.length_factor import ShareFactor, inputs_of, own_shape
from autosplit.data.sequences.lengths import Lengths
from autosplit.data.structure import empty_to_none
from autosplit.errors import UnsupportedModelError
from autosplit.graph import after
from autosplit.keras_hooks.checks import check_trainable
from autosplit.step.compiled import FunctionCache
from autosplit.step.contribution import Contribution, combine, compute_contribution
from autosplit.step.custom_logs import CustomLogs
from autosplit.step.loss_plan import LossPlan, step_plan
from autosplit.step.metrics import update_loss_trackers, update_metrics, without_padding
from autosplit.step.noise_scale import NoiseEpoch, estimate
from autosplit.step.replicas import Replicas, without_replica_axis
from autosplit.step.sums import Stash, Sums

__all__ = ["LargeBatchUpdate"]


class LargeBatchUpdate:
    """The variables of one model's large batch in flight, and the graph code that moves them.

    Args:
        model: a compiled Keras model (TensorFlow backend).
        batch_size: B, the global large batch (under a strategy, across all replicas).
        pooled: pool BatchNormalization's moving statistics over the large batch
            (``autosplit.keras_hooks.batchnorm``: the layers the step calls in training mode, as
            the loss plan's trace found them); False: updated per micro-batch.
        functions: the train step's compiled functions; the XLA-compiled contribution joins them.
        jit: compile each micro-batch's computation with XLA.
        noise: estimate the gradient noise scale from the micro-batches
            (``autosplit.step.noise_scale``): into :attr:`noise_epoch`, where the step
            sums a compiled loss's gradients (not a custom ``train_step``'s).

    :meth:`bind` creates the variables, and keeps them for every split of the same
    element structure.
    """

    # Set by the first bind, which the constructor's caller runs at once.
    plan: LossPlan  # of the element structure bound
    sums: Sums  # the float32 sums of the large batch in flight, in variables
    stash: Stash  # the element in flight, on the host

    def __init__(self, model: keras.Model, batch_size: int, *, pooled: bool,
                 functions: FunctionCache, jit: bool, noise: bool = False) -> None:
        self.model = model
        self.batch_size = batch_size
        self.pooled = pooled
        self.pool: list = []  # the layers pooled, once the plan is known
        self.replicas = Replicas(model.distribute_strategy)
        self._functions = functions
        self._jit = jit
        self._template: Any = None  # the structure of a Contribution, for _unflatten
        self.custom_logs: CustomLogs | None = None  # a custom train_step's, once bound
        self.element_spec: Any = None
        self.micro_batch_spec: Any = None
        self.rows = 0
        # Per model output, the large batch's length over this worker's share's, which
        # each micro-batch cut by length is scaled by (agree_lengths); ones but there.
        self.share_factor = ShareFactor()
        self._noise = noise
        self.noise_epoch: NoiseEpoch | None = None  # the epoch's estimates, once bound
        # The input's lengths (Cut.lengths), by which each replica's micro-batch cut by
        # length is taken back out of its micro-step's stack (own_shape); step_for sets it.
        self.lengths: Lengths | None = None

    def bind(self, element_spec: Any) -> None:
        """Use elements of ``element_spec`` (another micro-batch size) from now on."""
        model, replicas = self.model, self.replicas
        x, y, w, valid = element_spec
        if replicas.local > 1:
            x, y, w, valid = without_replica_axis((x, y, w, valid))
        self.element_spec = element_spec
        self.micro_batch_spec = (x, empty_to_none(y), empty_to_none(w), valid)
        self.rows = valid.shape[0]  # None: each element's own (Cut.tokens)
        self.share_factor.bind(x)
        self.plan = step_plan(model, _static_rows((inputs_of(x), *self.micro_batch_spec[1:3])))
        self.pool = [layer for layer, calls in self.plan.batch_norm_calls
                     if calls] if self.pooled else []
        if not model.optimizer.built:  # a custom step's model, built by its trace
            with replicas.strategy.scope():
                model.optimizer.build(model.trainable_variables)
            check_trainable(model)
        if self.plan.custom is not None and replicas.count > 1:
            raise UnsupportedModelError(
                f"Expected one replica for a model with its own train_step. Received: "
                f"{type(model).__name__} under {type(replicas.strategy).__name__} with "
                f"{replicas.count} replicas; autosplit splits a custom train_step on one "
                "device only (yet).")
        if self.plan.custom is not None and self.custom_logs is None:
            self.custom_logs = CustomLogs(model, self.plan.custom)
        if self._noise and self.plan.custom is None and self.plan.groups \
                and self.noise_epoch is None:
            self.noise_epoch = NoiseEpoch(replicas.strategy)
        # Another input structure (sample weights or not) can change the loss groups,
        # or what is stashed; compiled functions captured the old variables.
        sums: Sums | None = getattr(self, "sums", None)  # None before the first bind
        if sums is None or sums.groups != self.plan.groups:
            self._functions.clear()
            self.sums = Sums(model, self.plan, replicas.strategy, self.pool,
                             noise=self.noise_epoch is not None)
        stash: Stash | None = getattr(self, "stash", None)
        if stash is None or not stash.fits(element_spec):
            self._functions.clear()
            self.stash = Stash(element_spec)

    # ------------------------------------------------------------ one micro-batch

    def loss_scale(self) -> tf.Tensor:
        """The factor the optimizer's loss scaling puts on gradients (1 without it)."""
        return tf.cast(self.model.optimizer.scale_loss(tf.constant(1.0)), tf.float32)

    def contribute(self, x, y, w, valid) -> list:
        """One micro-batch's gradients and terms, flattened (None entries dropped): the
        computation XLA compiles on its own."""
        contribution = compute_contribution(self.model, self.plan, x, y, w, valid,
                                            batch_size=self.batch_size,
                                            scale=self.loss_scale(), pool=self.pool,
                                            noise=self.noise_epoch is not None)
        flat = tf.nest.flatten(contribution)
        self._template = (contribution, [t is not None for t in flat])
        return [t for t in flat if t is not None]

    def _unflatten(self, values: list) -> Contribution:
        contribution, present = self._template
        it = iter(values)
        flat = [next(it) if keep else None for keep in present]
        return tf.nest.pack_sequence_as(contribution, flat)

    def _contribute_function(self):
        if not self._jit:
            return self.contribute
        return self._functions.get(("contribute", repr(self.micro_batch_spec)), self.contribute,
                                   jit_compile=True)

    def _compute(self, x, y, w, valid, all_real=False):
        """Per replica: one micro-batch's contribution, on its real rows alone where the
        plan asks for them (``autosplit.step.contribution.without_padding``;
        ``all_real``: all its rows are real)."""
        strip = (self.plan.real_rows_only or bool(self.pool)) and not all_real
        x, y, w, valid = without_padding(strip, x, empty_to_none(y), empty_to_none(w), valid)
        return self._contribute_function()(x, y, w, valid)

    def _commit_sums(self, values, ready=None):
        """Per replica: add one micro-batch's gradients and loss terms to the sums, after
        ``ready`` (a token as data: control dependencies do not reach a strategy's
        replica threads)."""
        with tf.control_dependencies([] if ready is None else [ready]):
            return self.sums.add(self._unflatten(list(values)))

    def _commit_metrics(self, values, ready=None, all_real=False):
        """Per replica: update the compiled metrics from one contribution (after ``ready``;
        ``all_real``: all its rows are real)."""
        contribution = self._unflatten(list(values))
        if self.custom_logs is not None:  # the step updated its own metrics
            with tf.control_dependencies([] if ready is None else [ready]):
                first = (tf.cast(self.sums.rows.read_value(), tf.float32)
                         <= tf.cast(contribution.rows, tf.float32))
                return self.custom_logs.combine(contribution, first)
        with tf.control_dependencies([] if ready is None else [ready]):
            update_metrics(self.model, contribution.y, contribution.y_pred,
                           contribution.sample_weight, contribution.valid, contribution.masks,
                           all_real=all_real, length_factor=contribution.length_factor)
            return tf.constant(True)

    def keep_metrics(self) -> tf.Tensor:
        """Copy a custom step's metric variables as they stand (after a committed micro-batch)."""
        return tf.constant(True) if self.custom_logs is None else self.custom_logs.keep()

    def restore_metrics(self) -> tf.Tensor:
        """Put back a custom step's metric variables as the last committed micro-batch left them."""
        return tf.constant(True) if self.custom_logs is None else self.custom_logs.restore()

    def micro_step(self, x, y, w, valid, end_row, rows, *, all_real: bool = False) -> tf.Tensor:
        """One micro-step on every local replica: compute, then (only once all of them
        have their gradients) add to the sums and record that the rows up to
        ``end_row`` of the element in flight (of ``rows`` rows) are done, then update
        the metrics.

        Every op depends on the one before: an out-of-memory error anywhere before the
        record leaves the sums and the record as they were, one after it cannot undo it.
        ``all_real``: every row of the micro-batch is real (``TrainStep.rebind``), so no
        padding is dropped before the metrics or a model that needs its real rows alone.
        """
        replicas = self.replicas
        x = self.share_factor.applied(x)
        if replicas.count == 1:
            values = self._compute(x, y, w, valid, all_real)
            with tf.control_dependencies([after(values)]):
                summed = self._commit_sums(values)
        else:
            own = functools.partial(own_shape, lengths=self.lengths, rows_vary=self.rows is None)
            values = replicas.run(functools.partial(self._compute, all_real=all_real),
                                  *replicas.split((x, y, w, valid), own=own))
            summed = replicas.done(replicas.run(self._commit_sums, values,
                                                replicas.done(values)))
        with tf.control_dependencies([summed]):
            recorded = self.stash.record(end_row, rows)
        if replicas.count == 1:
            with tf.control_dependencies([recorded]):
                committed = self._commit_metrics(values, all_real=all_real)
            if self.custom_logs is None:
                return committed
            with tf.control_dependencies([committed]):
                return self.custom_logs.keep()
        commit = functools.partial(self._commit_metrics, all_real=all_real)
        return replicas.done(replicas.run(commit, values, recorded))

    def agree_lengths(self, local: tf.Tensor) -> tf.Tensor:
        """Collective: the large batch's length per model output, the most of every
        worker's ``local`` (``ShareFactor.agree``); the least of every worker's."""
        return self.share_factor.agree(local, self.replicas.bounds)

    # ------------------------------------------------------------ the apply

    def _apply_replica(self, ready=None):
        """Per replica: all-reduce the scalar sums, combine, apply once, zero the sums.

        ``ready``: a token of the loop's end (control dependencies of the caller do not
        reach a strategy's replica threads); everything after reads the sums.
        """
        model = self.model
        with tf.control_dependencies([] if ready is None else [ready]):
            totals = read = self.sums.read()
        local_rows = totals.rows
        if self.replicas.count > 1:
            totals = totals.summed_over_replicas(tf.distribute.get_replica_context())
        scale = self.loss_scale()
        combined = combine(
            model, self.plan, totals, batch_size=self.batch_size, scale=scale,
            replicas=self.replicas.count,
            context=tf.distribute.get_replica_context() if self.replicas.count > 1 else None)
        loss, gradients, per_output = combined.loss, combined.gradients, combined.per_output
        # Read from the gradients before they are applied; it writes no weight.
        noted = [] if self.noise_epoch is None else [self.noise_epoch.add(estimate(
            self.plan, read, totals, gradients, combined.regularization, combined.correction,
            scale=scale, replicas=self.replicas.count))]
        pairs = [(g, v) for g, v in zip(gradients, model.trainable_variables, strict=True)
                 if g is not None]
        norms = [] if self.custom_logs is None else self.custom_logs.gradient_norms(gradients)
        # One loss scale for the whole large batch: a LossScaleOptimizer unscales,
        # checks the summed gradients once and skips the whole step on an overflow.
        # Under a strategy Keras's optimizer all-reduces these gradients: once.
        summed = after([loss] + [g for g, _ in pairs])
        with tf.control_dependencies([summed]):
            model.optimizer.apply_gradients(pairs)
            # BatchNormalization's moving statistics: one update, pooled (keras_hooks/batchnorm.py).
            pooled = [] if self.sums.pool is None else self.sums.pool.apply()
        updates = [] if self.plan.custom is not None else update_loss_trackers(
            model, loss, per_output, local_rows)
        # The gradient sums are zeroed from their own values (Sums.zero): once the
        # optimizer has written every variable (each read is ordered after its writes),
        # so that those zeros never share the apply's peak with the optimizer's own
        # temporaries.
        applied = after([tf.convert_to_tensor(v) for _, v in pairs])
        with tf.control_dependencies([after([summed, applied, *updates, *pooled, *noted])]):
            self.sums.zero(read)
        with tf.control_dependencies(norms):
            return tf.identity(loss)

    def apply(self, ready=None):
        """Apply the summed large batch once (after ``ready``) and zero the sums; returns
        the logs: the compiled metrics' results, or a custom step's last logs."""
        loss = self.replicas.each(self._apply_replica, ready)
        with tf.control_dependencies([after(tf.nest.flatten(self.replicas.results(loss)))]):
            return self.logs_now()

    def logs_now(self):
        """The logs as they stand: the compiled metrics' results, or a custom step's
        last logs."""
        if self.custom_logs is not None:
            return self.custom_logs.read()
        return self.model.get_metrics_result()

    def apply_if_any(self, ready):
        """One replica: :meth:`apply` if the sums hold a real row (after ``ready``), else
        nothing. Returns (applied, logs): an input that ended before the large batch
        began leaves the optimizer untouched."""
        with tf.control_dependencies([ready]):
            any_rows = self.sums.rows.read_value() > 0
        return tf.cond(any_rows, lambda: (tf.constant(True), self.apply()),
                       lambda: (tf.constant(False), self.logs_now()))

    def zero(self) -> tf.Tensor:
        """Forget the sums of a partial large batch, on every replica."""
        self.replicas.each(self.sums.zero)
        return tf.constant(0)


_READ_ROWS = 7  # rows the plan is read at for elements of any row count


def _static_rows(spec: Any) -> Any:
    """``spec`` with a row count where it has none: the step plan tells sums over rows
    from other vectors by their static rows (``autosplit.step.loss_plan``)."""
    return tf.nest.map_structure(
        lambda s: tf.TensorSpec([_READ_ROWS, *s.shape[1:]], s.dtype)
        if isinstance(s, tf.TensorSpec) and s.shape.rank and s.shape[0] is None else s, spec)
