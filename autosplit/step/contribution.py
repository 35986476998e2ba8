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

from autosplit.data.sequences.length_factor import Shortened, inputs_of, output_length_factors
from autosplit.errors import UnsupportedModelError
from autosplit.keras_hooks import internals as _keras
from autosplit.keras_hooks.batchnorm import recording
from autosplit.keras_hooks.custom_step import CustomFacts, batch_data
from autosplit.keras_hooks.interception import intercept
from autosplit.keras_hooks.target import log_parts, replayed
from autosplit.step.forward import forward, forward_parts, forward_totals
from autosplit.step.loss_plan import COUNT_GROUP, SUM_GROUP, LossPlan
from autosplit.step.noise_scale import micro_terms
from autosplit.step.overflow import overflowed, poisoned
from autosplit.step.reduction import COUNT, SUM, combined_loss, weight_regularization
from autosplit.step.totals import Totals
from autosplit.warn import warn_user

__all__ = ["Combined", "Contribution", "combine", "compute_contribution"]

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
    # a micro-batch cut by length: per output (y_pred's structure), its length factor
    # (length_factor.Shortened), a scalar or None
    length_factor: Any = None
    # its numbers for the gradient noise scale (noise_scale.micro_terms), or None
    noise: Any = None


def _dense_f32(g) -> tf.Tensor | None:
    # An Embedding yields IndexedSlices with repeated indices; densifying sums the
    # duplicates, which is the true gradient of the summed loss.
    return None if g is None else tf.cast(tf.convert_to_tensor(g), tf.float32)


def compute_contribution(model, plan: LossPlan, x, y, sample_weight, valid, *,
                         batch_size: int, scale, pool: list | tuple = (),
                         noise: bool = False) -> Contribution:
    """Forward and backward of one micro-batch; changes no variable but the model's own
    (BatchNormalization statistics, seed generators; a custom step's metric trackers).
    ``noise``: with the gradient noise scale's numbers (``noise_scale.micro_terms``)."""
    length_factor = x.length_factor[0] if isinstance(x, Shortened) else None
    x = inputs_of(x)
    if plan.custom is not None:
        return _custom_contribution(model, plan.custom, x, y, sample_weight, valid,
                                    batch_size=batch_size, pool=pool)
    variables = model.trainable_variables
    with recording(pool) as records, tf.GradientTape(persistent=len(plan.groups) > 1) as tape:
        y, y_pred, terms, in_call = forward(model, x, y, sample_weight, valid,
                                            length_factor=length_factor)
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
    denominators = [t.denominator for t in terms]
    return Contribution(gradients, [t.numerator for t in terms], denominators,
                 forward_totals(in_call_mean, in_call_sum, rows), rows, y, y_pred, masks, None,
                 _moments(pool, records), sample_weight, valid,
                 length_factor=output_length_factors(length_factor, y_pred),
                 noise=micro_terms(plan, gradients, rows, denominators) if noise else None)


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


class Combined(NamedTuple):
    """What :func:`combine` gives: the large batch's loss and gradients (per replica)."""

    loss: tf.Tensor  # shape=(), float32
    gradients: list  # per trainable variable, in its dtype (None: no gradient)
    per_output: list  # per compiled loss, its unweighted value
    regularization: list  # this replica's share of the weight regularisers' gradients
    correction: tf.Tensor  # shape=(): B over the real rows, the rows' group's factor


def combine(model, plan: LossPlan, totals: Totals, *, batch_size: int, scale,
            replicas: int = 1, context: Any = None) -> Combined:
    """The large batch's :class:`Combined` loss, gradients and per-output losses, from
    its sums.

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
        return Combined(tf.constant(0.0), poisoned(
            _combined_gradients(variables, plan, totals, correction), overflow), [], [],
            correction)
    with tf.GradientTape() as tape:
        # Counted once per large batch: each replica adds its 1/replicas share.
        regularization = weight_regularization(model) / replicas
    reg_grads = tape.gradient(regularization, variables) if variables else []
    loss, per_output = combined_loss(
        totals.numerators, totals.denominators, totals.forward, n, kinds=plan.kinds,
        weights=plan.weights, regularization=regularization * replicas)
    regs = [None if g is None else _dense_f32(g) * scale for g in reg_grads]
    gradients = _combined_gradients(variables, plan, totals, correction, regs or None)
    return Combined(loss, poisoned(gradients, overflow), per_output, regs, correction)


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


