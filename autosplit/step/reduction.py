"""Keras's loss reduction, taken apart into a numerator and a denominator.

A Keras loss on a batch is ``sum(w * l) / D``: per-element losses ``l`` weighted by
the sample weight and the Keras mask, divided by a denominator ``D`` that depends on
the reduction (``sum_over_batch_size``: the number of loss elements, or of unmasked
ones; ``mean_with_sample_weight``: the sum of the weights; ``sum``: 1). The mean of
per-micro-batch means is NOT the mean of the batch when the micro-batches differ in
size, in weight or in masked tokens. So for every micro-batch autosplit keeps the
numerator and the denominator apart, sums each over the large batch and divides once
(:func:`combined_loss`, the one place the sums become the loss).

``output_terms`` mirrors ``keras.losses.Loss.__call__`` and
``keras.src.losses.loss.reduce_weighted_values`` step for step, with one addition:
``row_valid`` (1.0 for real rows, 0.0 for the padding rows of a short micro-batch)
removes padding rows from both the numerator and the denominator.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import keras
import tensorflow as tf
from keras import tree

from autosplit.errors import UnsupportedModelError
from autosplit.keras_hooks import internals as _keras
from autosplit.keras_hooks.traced import row_reduction

__all__ = [
    "COUNT",
    "SUM",
    "WEIGHT",
    "LossTerms",
    "check_reduction",
    "combined_loss",
    "output_terms",
    "own_call",
    "row_weight",
    "weight_regularization",
    "whole_batch_loss",
]

# What a loss's denominator counts: autosplit's kinds, not Keras's reduction strings
# (``LossTerms.kind``; ``output_terms`` maps one to the other). A denominator that does
# not depend on the model (no Keras mask on the output) is known before the first
# micro-batch runs; one that counts unmasked tokens is not.
SUM = "sum"  # divided by nothing (reduction="sum")
COUNT = "count"  # by the loss elements, or the unmasked ones (sum_over_batch_size)
WEIGHT = "weight"  # by the sum of the sample weights (mean_with_sample_weight)


class LossTerms(NamedTuple):
    """Numerator and denominator of one output's loss on one micro-batch."""

    numerator: tf.Tensor  # shape=(), float32: sum(w * l) over real rows
    denominator: tf.Tensor  # shape=(), float32: what Keras divides by (1 for "sum")
    masked: bool  # static: the denominator depends on a Keras mask from the model
    kind: str  # static: SUM, COUNT or WEIGHT
    per_row: int | None  # static: loss elements per example (None if not static)
    per_example: bool = True  # static: False for a loss that returns one value per batch
    # static: a value per batch that is a plain mean over the batch's rows (ops.mean of
    # per-example losses, times a constant): weighed by rows, exactly the full batch's
    row_mean: bool = False


def row_weight(row_valid: tf.Tensor, like: tf.Tensor) -> tf.Tensor:
    """``row_valid`` of shape (m,) reshaped to broadcast against ``like`` (m, ...)."""
    rank = like.shape.rank
    shape = [-1] + [1] * (rank - 1)
    return tf.reshape(tf.cast(row_valid, like.dtype), shape)


def check_reduction(loss: object) -> str:
    """The loss's reduction, refusing one that does not reduce to a scalar."""
    reduction = getattr(loss, "reduction", "sum_over_batch_size")
    if reduction in (None, "none"):
        raise UnsupportedModelError(
            "Expected the compiled loss to reduce to a scalar. Received: a loss with "
            f"reduction={reduction!r} ({type(loss).__name__}). autosplit needs a "
            "per-example loss it can sum: compile with reduction='sum_over_batch_size' "
            "(the Keras default), 'mean_with_sample_weight' or 'sum'."
        )
    return reduction


def own_call(loss: object) -> bool:
    """Whether ``loss`` computes its value in a ``__call__`` of its own (keras-io's
    ``SupervisedContrastiveLoss``), not in ``call()`` under Keras's ``__call__``, which
    reduces its per-example values (:func:`output_terms` mirrors that reduction)."""
    return (isinstance(loss, keras.losses.Loss)
            and type(loss).__call__ is not keras.losses.Loss.__call__)


def output_terms(loss: keras.losses.Loss, y_true, y_pred, sample_weight, row_valid,
                 length_factor=None) -> LossTerms:
    """The numerator and denominator of ``loss(y_true, y_pred, sample_weight)``.

    Args:
        loss: a ``keras.losses.Loss`` (Keras wraps plain functions in one).
        y_true: targets of one micro-batch, leading dimension m.
        y_pred: model outputs for the micro-batch (possibly carrying a Keras mask).
        sample_weight: the user's sample weights for the micro-batch, or None.
        row_valid: float tensor (m,): 1.0 for real examples, 0.0 for padding.
        length_factor: for a micro-batch padded short of its large batch's length
            (``autosplit.data.sequences.length_factor``), the large batch's length over
            its own: a denominator that counts every loss element along a length counts the
            large batch's.

    Returns:
        ``LossTerms``; the full-batch Keras loss is ``sum(numerators) / sum(denominators)``
        (or ``sum(numerators)`` for ``reduction="sum"``).
    """
    reduction = check_reduction(loss)
    if own_call(loss):
        # Its value is its own (keras-io's SupervisedContrastiveLoss): a value per batch
        # that no sum of micro-batches gives, which only the whole-batch step computes
        # (``autosplit.step.mixing``).
        value = tf.cast(loss(y_true, y_pred, sample_weight), tf.float32)
        return LossTerms(value, tf.constant(1.0, tf.float32), False, SUM, None,
                         per_example=False, row_mean=False)
    dtype = loss.dtype
    in_mask = _keras.get_keras_mask(y_pred)
    y_pred = tree.map_structure(lambda t: keras.ops.convert_to_tensor(t, dtype=dtype), y_pred)
    y_true = tree.map_structure(lambda t: keras.ops.convert_to_tensor(t, dtype=dtype), y_true)
    values = loss.call(y_true, y_pred)
    out_mask = _keras.get_keras_mask(values)
    if in_mask is not None and out_mask is not None:
        mask = tf.logical_and(tf.cast(in_mask, tf.bool), tf.cast(out_mask, tf.bool))
    else:
        mask = in_mask if in_mask is not None else out_mask
    values = keras.ops.convert_to_tensor(values, dtype=dtype)

    # Merge mask and sample weight as keras.src.losses.loss.apply_mask does, minus its
    # `total / valid` rescaling: the division by `valid` happens once, on the large batch.
    weight = None if sample_weight is None else tf.cast(sample_weight, dtype)
    float_mask = None
    if mask is not None:
        float_mask = tf.cast(mask, dtype)
        valid_mask = float_mask * row_weight(row_valid, float_mask)
        if weight is not None:
            float_mask, weight = squeeze(float_mask, weight)
            weight = weight * float_mask
        else:
            weight = float_mask
    if weight is not None:
        values, weight = squeeze(values, weight)
        weighted = values * weight
    else:
        weighted = values
    # Padding rows are copies of real rows: selected out, not multiplied by 0, so a
    # real row whose loss overflowed to inf leaves the sum inf, as Keras logs it (0 *
    # inf was NaN, and TerminateOnNaN's logs read nan where model.fit's read inf).
    weighted = tf.where(row_weight(row_valid, weighted) > 0, weighted,
                        tf.zeros([], weighted.dtype))  # broadcast, as the product was
    numerator = tf.cast(tf.reduce_sum(weighted), tf.float32)
    dims = values.shape[1:].as_list()
    per_row = None if any(d is None for d in dims) else math.prod(dims)
    per_example = values.shape.rank is None or values.shape.rank >= 1
    rows = tf.nest.flatten(y_pred)[0].shape[0] if tf.nest.flatten(y_pred) else None
    row_mean = not per_example and row_reduction(values, (y_true, y_pred), rows) == "mean"

    if reduction == "sum":
        return LossTerms(numerator, tf.constant(1.0, tf.float32), False, SUM, per_row,
                         per_example, row_mean)
    if reduction == "mean_with_sample_weight" and weight is not None:
        denominator = tf.reduce_sum(weight * row_weight(row_valid, weight))
        return LossTerms(numerator, tf.cast(denominator, tf.float32), mask is not None, WEIGHT,
                         per_row, per_example, row_mean)
    if mask is not None and reduction in ("sum_over_batch_size", "mean"):
        denominator = tf.reduce_sum(valid_mask)
        return LossTerms(numerator, tf.cast(denominator, tf.float32), True, COUNT, per_row,
                         per_example, row_mean)
    denominator = tf.reduce_sum(tf.ones_like(values) * row_weight(row_valid, values))
    if length_factor is not None and None in values.shape.as_list()[1:]:
        denominator = denominator * tf.cast(length_factor, denominator.dtype)
    return LossTerms(numerator, tf.cast(denominator, tf.float32), False, COUNT, per_row,
                     per_example, row_mean)


def combined_loss(numerators: Sequence, denominators: Sequence, forward, rows, *,
                  kinds: Sequence[str], weights: Sequence[float],
                  regularization=0.0) -> tuple[Any, list]:
    """The large batch's loss and per-output losses from its sums, each divided once.

    Per compiled loss ``j``: ``numerators[j] / denominators[j]`` (``numerators[j]`` for a
    ``SUM`` kind), Keras's reduction over the whole batch. The loss is
    ``regularization + forward[0] / rows + forward[1] + sum_j weights[j] * per_output[j]``, as
    ``model.compute_loss`` adds it up. A zero denominator (no real rows, no weight)
    gives 0. The arithmetic is TensorFlow's, in the dtype of the sums: float32 in the
    train step, float64 where ``autosplit.step.evaluate`` has added up a whole validation set.

    Args:
        numerators, denominators: per compiled loss, ``LossTerms`` summed over the batch.
        forward: the losses added in ``call()``: ``[means times each micro-batch's real
            rows, sums over the rows]``, each summed over the micro-batches.
        rows: real rows of the batch.
        kinds: per compiled loss, ``SUM``, ``COUNT`` or ``WEIGHT``.
        weights: the compiled ``loss_weights``, per compiled loss.
        regularization: the weight regularizers' sum, counted once per batch.

    Returns:
        ``(loss, per_output)``, per_output one scalar per compiled loss.

    >>> loss, per_output = combined_loss([6.0, 3.0], [4.0, 1.0], [10.0, 0.0], 5.0,
    ...                                  kinds=(COUNT, SUM), weights=(1.0, 0.5))
    >>> float(loss), [float(v) for v in per_output]
    (5.0, [1.5, 3.0])
    """
    per_output = [num if kind == SUM else tf.math.divide_no_nan(num, den)
                  for num, den, kind in zip(numerators, denominators, kinds, strict=True)]
    loss = regularization + tf.math.divide_no_nan(forward[0], rows) + forward[1]
    for weight, value in zip(weights, per_output, strict=True):
        loss += weight * value
    return loss, per_output


def squeeze(x1: tf.Tensor, x2: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """Keras's ``squeeze_or_expand_to_same_rank`` (a rank-1 weight meets (m, 1) losses)."""
    return _keras.squeeze_or_expand_to_same_rank(x1, x2)


def weight_regularization(model: keras.Model) -> tf.Tensor:
    """Sum of the weight regularizers: depends on the weights only, counted once."""
    losses = [tf.cast(v.regularizer(v), tf.float32) for v in model.trainable_variables
              if getattr(v, "regularizer", None) is not None]
    return tf.add_n(losses) if losses else tf.constant(0.0, tf.float32)


def whole_batch_loss(model: keras.Model, y: Any, y_pred: Any, sample_weight: Any
                     ) -> tuple[tf.Tensor, list]:
    """The compiled loss of one whole batch and each output's unweighted value, as
    Keras's ``CompileLoss`` computes them (each loss's own ``__call__``, times its
    ``loss_weights``), undoing the ``1 / replicas`` Keras's reduction puts on a value
    computed inside a strategy's replica: every replica computes the global batch's.
    ``y`` has ``y_pred``'s structure (``forward.align_targets``)."""
    replicas = tf.distribute.get_strategy().num_replicas_in_sync
    total, per_output = tf.constant(0.0), []
    for flat in _keras.flat_losses(model):
        y_t, y_p = _keras.resolve_path(flat.path, y), _keras.resolve_path(flat.path, y_pred)
        s_w = sample_weight
        if sample_weight is not None and keras.tree.is_nested(sample_weight):
            s_w = _keras.resolve_path(flat.path, sample_weight)
        value = tf.cast(flat.loss(y_t, y_p, s_w), tf.float32)
        if replicas > 1 and not own_call(flat.loss):
            value = value * float(replicas)
        per_output.append(value)
        total += value * (1.0 if flat.weight is None else float(flat.weight))
    return total, per_output
