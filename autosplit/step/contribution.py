"""One micro-batch's contribution to a large batch, and how the contributions combine.

One micro-batch (:func:`compute_contribution`) gives, for every compiled loss, the
numerator of Keras's reduction (``autosplit.step.reduction``) and the gradients of those numerators,
grouped by what they will be divided by:

- ``"count"``: losses averaged over examples (``sum_over_batch_size`` without a Keras
  mask) and the losses added in ``call()``. Their denominator is the large batch's
  real rows, known only at its end when the input is a stream; the loop scales them by
  the planned batch B and :func:`combine` multiplies by ``B / n`` once (exactly 1.0 for
  every full batch).
- ``"sum"``: ``reduction="sum"`` losses, divided by nothing.
- ``("deferred", j)``: a loss whose denominator the model decides (unmasked tokens,
  the sum of sample weights): its gradient is summed on its own and divided once.

:func:`combine` turns the sums into the full-batch loss and gradients. Graph code only:
where the sums live (loop-carried tensors in ``autosplit.accumulate``, variables in
``autosplit.step.update``) is the caller's business.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import keras
import tensorflow as tf

from autosplit.data.cuts import Trimmed, inputs_of
from autosplit.errors import UnsupportedModelError
from autosplit.keras_hooks import internals as _keras
from autosplit.keras_hooks.batchnorm import recording
from autosplit.keras_hooks.custom_step import CustomFacts, batch_data
from autosplit.keras_hooks.interception import intercept
from autosplit.keras_hooks.target import log_parts, replayed
from autosplit.step.loss_plan import (
    COUNT_GROUP,
    SUM_GROUP,
    LossPlan,
    forward,
    forward_parts,
    forward_totals,
    output_stretches,
    weight_regularization,
)
from autosplit.step.overflow import overflowed, poisoned
from autosplit.step.reduction import COUNT, SUM, combined_loss
from autosplit.warn import warn_user

__all__ = [
    "Contribution",
    "Totals",
    "combine",
    "compute_contribution",
    "update_loss_trackers",
    "update_metrics",
    "without_padding",
]

class Contribution(NamedTuple):
    """One micro-batch's contribution (per replica)."""

    gradients: list  # per group: one float32 tensor per trainable variable (None: no grad)
    numerators: list  # per compiled loss, float32 scalars
    denominators: list
    # the call() losses: [the means' sum times the micro-batch's real rows, the sums' sum]
    forward: tf.Tensor
    rows: tf.Tensor  # real rows in the micro-batch
    y: Any  # targets aligned to y_pred, for the metrics
    y_pred: Any
    masks: Any  # Keras masks of y_pred (lost when y_pred leaves an XLA function)
    logs: Any = None  # a custom train_step's return value
    moments: Any = None  # per pooled BatchNormalization layer: its Moments here
    sample_weight: Any = None  # the rows it ran on, for the metrics: their weights
    valid: Any = None  # and real-row marks (padding dropped where ``without_padding`` ran)
    # per flat log of a custom step: its parts, each (value, weight in a weighed mean)
    log_parts: Any = None
    # per deferred tracker update of a custom step (interception.weighed_trackers):
    # ([(value, weight)] per part, the row count it was given or None)
    tracker_parts: Any = None
    # a micro-batch cut by length: per output (y_pred's structure), its stretch
    # (cuts.Trimmed.stretch), a scalar or None
    stretch: Any = None


def _dense_f32(g) -> tf.Tensor | None:
    # An Embedding yields IndexedSlices with repeated indices; densifying sums the
    # duplicates, which is the true gradient of the summed loss.
    return None if g is None else tf.cast(tf.convert_to_tensor(g), tf.float32)


def compute_contribution(model, plan: LossPlan, x, y, sample_weight, valid, *,
                         batch_size: int, scale, pool: list | tuple = ()) -> Contribution:
    """Forward and backward of one micro-batch; changes no variable but the model's own
    (BatchNormalization statistics, seed generators; a custom step's metric trackers)."""
    stretch = x.stretch[0] if isinstance(x, Trimmed) else None
    x = inputs_of(x)
    if plan.custom is not None:
        return _custom_contribution(model, plan.custom, x, y, sample_weight, valid,
                                    batch_size=batch_size, pool=pool)
    variables = model.trainable_variables
    with recording(pool) as records, tf.GradientTape(persistent=len(plan.groups) > 1) as tape:
        y, y_pred, terms, in_call = forward(model, x, y, sample_weight, valid, stretch=stretch)
        rows = tf.reduce_sum(valid)
        in_call_mean, in_call_sum = forward_parts(in_call, plan.forward_summed)
        objectives, divisors = [], []
        for group in plan.groups:
            divisor = None
            if group == COUNT_GROUP:
                # loss_plan folds a "count" loss only when its per_row is static (not None).
                parts = [terms[j].numerator * (plan.weights[j] / (batch_size * plan.per_row[j]))  # type: ignore[operator]
                         for j in range(len(terms)) if plan.folded[j] and plan.kinds[j] == COUNT]
                if in_call:
                    parts.append(in_call_mean * rows / batch_size)
            elif group == SUM_GROUP:
                parts = [terms[j].numerator * plan.weights[j]
                         for j in range(len(terms)) if plan.kinds[j] == SUM]
                if any(plan.forward_summed):
                    parts.append(in_call_sum)
            else:
                j = group[1]
                parts = [terms[j].numerator * plan.weights[j]]
                if any(plan.half):  # differentiated as the micro-batch's own ratio
                    divisor = terms[j].denominator
                    parts = [tf.math.divide_no_nan(parts[0], divisor)]
            objectives.append(tf.add_n(parts) * scale)
            divisors.append(divisor)
    # Under mixed_float16 a ratio's gradient is the micro-batch's own mean's, as large in
    # float16 as the full batch's (its numerator's, a sum over the micro-batch's tokens,
    # is as many times larger and overflows where the full batch does not), times its
    # divisor again in float32.
    gradients = [[None if g is None else _dense_f32(g) if d is None else _dense_f32(g) * d
                  for g in tape.gradient(objective, variables)]
                 for objective, d in zip(objectives, divisors, strict=True)]
    del tape
    masks = keras.tree.map_structure(_keras.get_keras_mask, y_pred)
    return Contribution(gradients, [t.numerator for t in terms], [t.denominator for t in terms],
                 forward_totals(in_call_mean, in_call_sum, rows), rows, y, y_pred, masks, None,
                 _moments(pool, records), sample_weight, valid,
                 stretch=output_stretches(stretch, y_pred))


def _moments(pool, records) -> list | None:
    """Per pooled BatchNormalization layer: the moments of each of its calls in this
    micro-batch, in call order (``batchnorm.Pool`` pools each call over the micro-batches)."""
    if not pool:
        return None
    return [list(calls) for calls in records]


def _custom_contribution(model, facts: CustomFacts, x, y, sample_weight, valid, *,
                         batch_size: int, pool) -> Contribution:
    """The model's own train_step on one micro-batch of real rows, its apply caught and
    its gradients answered per group of loss terms, each weighed as its group adds up
    over the micro-batches (``autosplit.keras_hooks.gradients``)."""
    rows = tf.reduce_sum(valid)
    static_rows = tf.nest.flatten(x)[0].shape[0]
    with intercept(model, rows, batch_size, static_rows=static_rows, replay=facts.reading,
                   trackers=facts.tracker_kinds,
                   inputs=(x, y, sample_weight), warn=_untracked) as seen, \
            recording(pool) as records:
        logs = model.train_step(batch_data(x, y, sample_weight))
        parts = [_log_parts(t, kinds, rows, static_rows, seen.split.stop)
                 for kinds, t in zip(facts.log_kinds, tf.nest.flatten(logs), strict=True)]
    none = [None] * len(model.trainable_variables)
    gradients = [[_dense_f32(g) for g in seen.gradients.get(group, none)]
                 for group in facts.reading.groups]
    denominators = [tf.cast(seen.split.denominators[r], tf.float32)
                    for r in range(facts.reading.ratios)]
    return Contribution(gradients, [tf.constant(0.0)] * len(denominators), denominators,
                 forward_totals(), rows, None, None, None, logs, _moments(pool, records),
                 log_parts=parts, tracker_parts=list(seen.deferred))


def _log_parts(value, kinds: tuple[str, ...], rows, static_rows, stop) -> list:
    """A logged value's parts, each as ``(value, weight in its running mean)``
    (``target.LogPart.weight``): those the throwaway trace read (``kinds``;
    ``target.replayed``)."""
    if kinds[0] in ("gradient_norm", "result"):  # computed in update.py
        return [(value, tf.constant(1.0))]
    read = log_parts(value, static_rows, stop)
    parts = replayed(read, kinds)
    if parts is None:
        raise UnsupportedModelError(
            f"Expected a value the train_step returns to read the same in every trace. "
            f"Received: {kinds} on a micro-batch of static rows and "
            f"{tuple(p.kind for p in read)} on one of any rows. Return it from a "
            "tracker (a keras.metrics.Mean updated with it) instead.")
    return [(p.value, p.weight(rows)) for p in parts]


def _untracked(what: str) -> None:
    warn_user(
        f"autosplit: a custom train_step updates the tracker {what} with a value that is "
        "not a mean or a sum over the batch's rows; it receives the micro-batches' values "
        "weighed by rows, which is not exactly what model.fit would log. Return the value "
        "from the step instead (logs combine ratios, maxima and minima exactly).")


class Totals(NamedTuple):
    """Sums over the micro-batches of one large batch (per replica, or all-reduced)."""

    gradients: list  # per group, per variable (None: no gradient)
    numerators: list
    denominators: list
    forward: tf.Tensor
    rows: tf.Tensor

    def summed_over_replicas(self, context) -> Totals:
        """The scalar sums added up over every replica in one all-reduce; the gradients
        stay this replica's (the optimizer all-reduces those)."""
        numerators, denominators, forward, rows = context.all_reduce(
            tf.distribute.ReduceOp.SUM, (self.numerators, self.denominators, self.forward,
                                         self.rows))
        return Totals(self.gradients, numerators, denominators, forward, rows)


def combine(model, plan: LossPlan, totals: Totals, *, batch_size: int, scale,
            replicas: int = 1, context: Any = None) -> tuple[tf.Tensor, list, list]:
    """(loss, gradients, per-output losses) of the large batch from its sums.

    ``totals`` numerators, denominators, forward and rows must already be summed over
    replicas; the gradients are this replica's (the optimizer all-reduces them).
    ``batch_size`` is the global B the loop scaled by; ``scale`` the loss scale the
    gradients carry (the weight regularizer's gradient gets it too). The loss and the
    per-output losses are ``autosplit.step.reduction.combined_loss``'s, as validation's are.
    The gradients are ``inf`` where the full batch's float16 ones overflow
    (``autosplit.step.overflow``; ``context``: the replica context of several replicas,
    which decide together).
    """
    variables = model.trainable_variables
    n = totals.rows
    correction = tf.math.divide_no_nan(tf.constant(float(batch_size)), n)
    # The float16 layers' gradients as the full batch sums them, without the weight
    # penalties' (float32 there too): whether they overflow (None: nothing float16).
    overflow = overflowed(_combined_gradients(variables, plan, totals, correction,
                                              only=plan.half), plan.half, context)
    if plan.custom is not None:  # the step's own loss, regularisation included
        return tf.constant(0.0), poisoned(
            _combined_gradients(variables, plan, totals, correction), overflow), []
    with tf.GradientTape() as tape:
        # Counted once per large batch: each replica adds its 1/replicas share.
        regularization = weight_regularization(model) / replicas
    reg_grads = tape.gradient(regularization, variables) if variables else []
    loss, per_output = combined_loss(
        totals.numerators, totals.denominators, totals.forward, n, kinds=plan.kinds,
        weights=plan.weights, regularization=regularization * replicas)
    regs = [None if g is None else _dense_f32(g) * scale for g in reg_grads]
    gradients = _combined_gradients(variables, plan, totals, correction, regs or None)
    return loss, poisoned(gradients, overflow), per_output


def _combined_gradients(variables, plan: LossPlan, totals: Totals, correction,
                        extra: list | None = None, only: tuple[bool, ...] | None = None
                        ) -> list:
    """Per variable: its groups' gradient sums, each divided as its group divides (a
    ``"count"`` group by the rows, a ``("deferred", j)`` by its denominator's sum), plus
    ``extra`` (the weight regularisers' gradient), in the variable's dtype; with
    ``only``, for the variables it marks (None for the others)."""
    gradients: list = []
    for index, variable in enumerate(variables):
        if only is not None and not (index < len(only) and only[index]):
            gradients.append(None)
            continue
        parts = []
        for group, sums in zip(plan.groups, totals.gradients, strict=True):
            g = sums[index]
            if g is None:
                continue
            if group == COUNT_GROUP:
                g = g * correction
            elif group != SUM_GROUP:
                g = tf.math.divide_no_nan(g, totals.denominators[group[1]])
            parts.append(g)
        if extra is not None and extra[index] is not None:
            parts.append(extra[index])
        gradients.append(tf.cast(tf.add_n(parts), variable.dtype) if parts else None)
    return gradients


def update_loss_trackers(model, loss, per_output, rows) -> list:
    """Record a large batch's loss and per-output losses, weighted by its ``rows``, in
    Keras's loss trackers; returns the update ops (graph mode)."""
    tracker = _keras.loss_tracker(model)
    updates = [] if tracker is None else [tracker.update_state(loss, sample_weight=rows)]
    for metric, value in zip(_keras.output_loss_trackers(model), per_output, strict=False):
        updates.append(metric.update_state(value, sample_weight=rows))
    return [u for u in updates if u is not None]


def update_metrics(model, y, y_pred, sample_weight, valid, masks=None, *,
                   all_real: bool = False, stretch=None) -> None:
    """Update the compiled metrics from one micro-batch's real rows, as ``model.fit``
    updates them from a batch: ``sample_weight`` as given (None without one).

    A padded micro-batch's padding rows are dropped first (:func:`real_rows`), not
    weighed 0: a weight Keras never passes reached every metric, and metrics that
    flatten or broadcast it against their own values broke (``MeanIoU`` on per-pixel
    targets raised; the Keras guide's ``CategoricalTruePositives`` counted m times).
    ``all_real``: the caller knows every row is real; the rows pass as they are, with their
    static shapes, and no ``tf.cond`` checks for padding.

    ``stretch``: a micro-batch cut by length, per output (``y_pred``'s structure;
    ``autosplit.data.cuts.Trimmed``). A Keras metric averages each row's values over
    its length before it weighs rows, so a row padded to ``P`` weighs ``L / P`` times
    what it weighs in the large batch of length ``L``: the metrics of an output with a
    length axis get weights divided by its stretch (``autosplit.step.padding`` checks
    that this gives the large batch's).
    """
    unweighted, weighted, flatten = _keras.metric_lists(model)
    if not unweighted and not weighted:
        return
    if masks is None:  # Keras masks ride on y_pred's tensors, which the cut replaces
        masks = keras.tree.map_structure(_keras.get_keras_mask, y_pred)
    if not all_real:
        y, y_pred, masks, sample_weight = real_rows((y, y_pred, masks, sample_weight), valid)
    if masks is not None:
        for tensor, mask in zip(keras.tree.flatten(y_pred), keras.tree.flatten(masks),
                                strict=False):
            if mask is not None:
                _keras.set_keras_mask(tensor, mask)
    y_flat, p_flat = flatten(y), flatten(y_pred)
    s_flat = [None] * len(p_flat) if stretch is None else flatten(stretch)
    for mls, y_t, y_p, s in zip(unweighted, y_flat, p_flat, s_flat, strict=False):
        if mls:
            mls.update_state(y_t, y_p, **_shrunk(None, y_p, s))
    if sample_weight is not None:
        sw_flat = flatten(sample_weight)
        if len(sw_flat) < len(y_flat):
            sw_flat = [sw_flat[0]] * len(y_flat)
    else:
        sw_flat = [None] * len(y_flat)
    for mls, y_t, y_p, s_w, s in zip(weighted, y_flat, p_flat, sw_flat, s_flat, strict=False):
        if mls:
            mls.update_state(y_t, y_p, **(_shrunk(s_w, y_p, s) or {"sample_weight": s_w}))


def _shrunk(sample_weight, y_pred, stretch) -> dict:
    """``update_metrics``'s weights for one output: ``sample_weight`` (ones if None)
    over ``stretch`` where the output has a length axis; else nothing to add."""
    rank = y_pred.shape.rank
    if stretch is None or rank is None or rank < 2 or y_pred.shape[1] is not None:
        return {}
    shrink = 1.0 / tf.cast(stretch, tf.float32)
    if sample_weight is None:
        # (rows, 1): a Keras mask of (rows, length) multiplies it
        return {"sample_weight": tf.fill([tf.shape(y_pred)[0], 1], shrink)}
    return {"sample_weight": tf.cast(sample_weight, tf.float32) * shrink}


def real_rows(structure: Any, valid: tf.Tensor) -> Any:
    """``structure`` (tensors with a leading row axis, or None) less its padding rows;
    a micro-batch without padding (all but the last of a large batch, usually) passes
    as it is, not copied. The row count becomes dynamic."""
    keep = valid > 0
    leaves = tf.nest.flatten(structure)
    present = [t for t in leaves if t is not None]
    if not present:
        return structure
    kept = tf.cond(tf.reduce_all(keep), lambda: [tf.identity(t) for t in present],
                   lambda: [tf.boolean_mask(t, keep) for t in present])
    it = iter(kept)
    return tf.nest.pack_sequence_as(structure, [None if t is None else next(it) for t in leaves])


def without_padding(strip: bool, x, y, sample_weight, valid) -> tuple:
    """The real rows of a micro-batch alone, where something averages over its rows.

    A layer's own loss (``add_loss(mean(...))``, an endpoint layer's CTC), a loss that
    returns one value per batch, a custom train_step and a BatchNormalization layer whose
    statistics are pooled average over every row they see; padding rows (copies of real
    ones) would enter those means. ``strip``: such models get micro-batches of their
    real rows only (a dynamic row count: under XLA a second compiled shape for the short
    micro-batch); others keep the static shape. A micro-batch without padding (all but
    the last of a large batch, usually) passes as it is, not copied.
    """
    if not strip:
        return x, y, sample_weight, valid
    return tuple(real_rows((x, y, sample_weight, valid), valid))
