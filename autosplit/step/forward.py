"""One micro-batch's forward pass (:func:`forward`): its targets aligned to the
model's outputs, its predictions, each compiled loss's numerator and denominator
(``autosplit.step.reduction.output_terms``) and the losses the model added in
``call()``, parted into means and sums over the rows (:func:`forward_parts`)."""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from autosplit.data.sequences.length_factor import output_length_factors
from autosplit.errors import DatasetError
from autosplit.keras_hooks import internals as _keras
from autosplit.step.reduction import output_terms

__all__ = ["align_targets", "forward", "forward_parts", "forward_totals", "in_call_losses"]


def align_targets(model: keras.Model, y: Any, y_pred: Any) -> Any:
    """Give ``y`` the structure of ``y_pred``, as ``CompileLoss`` does."""
    if not keras.tree.is_nested(y) and not keras.tree.is_nested(y_pred):
        return y
    try:
        keras.tree.assert_same_structure(y_pred, y)
        return y
    except (ValueError, TypeError):
        pass
    if isinstance(y_pred, (list, tuple)) and isinstance(y, dict):
        return type(y_pred)(y[name] for name in model.output_names)
    if not keras.tree.is_nested(y) and isinstance(y_pred, (list, tuple)) and len(y_pred) == 1:
        return type(y_pred)([y])  # type: ignore[misc]  # len() == 1 made it tuple[Any]
    flat_y = keras.tree.flatten(y)
    if len(flat_y) == len(keras.tree.flatten(y_pred)):
        return keras.tree.pack_sequence_as(y_pred, flat_y)
    # A loss on some outputs only (`loss=[fn, None]`, as keras-io's miniature GPT
    # compiles): one target per output that has a loss, None for the others.
    losses = _keras.user_losses(model)
    flat_losses = keras.tree.flatten(losses) if keras.tree.is_nested(losses) else [losses]
    with_loss = [i for i, loss in enumerate(flat_losses) if loss is not None]
    if len(with_loss) != len(flat_y) or len(flat_losses) != len(keras.tree.flatten(y_pred)):
        raise DatasetError(
            f"Expected targets `y` matching the model's outputs: one per output, or one per "
            f"output with a loss ({len(with_loss)} here). Received: {len(flat_y)} target "
            f"arrays for {len(keras.tree.flatten(y_pred))} outputs.")
    aligned: list = [None] * len(flat_losses)
    for i, target in zip(with_loss, flat_y, strict=True):
        aligned[i] = target
    return keras.tree.pack_sequence_as(y_pred, aligned)


def _n_weight_regularizers(model: keras.Model) -> int:
    return sum(1 for v in model.trainable_variables if getattr(v, "regularizer", None))


def forward(model, x, y, sample_weight, valid, *, training=True, length_factor=None):
    """One micro-batch forward pass: targets, predictions, loss terms, forward losses
    (``length_factor``: per flat output, ``reduction.output_terms``'s)."""
    y_pred = model(x, training=training) if _keras.call_has_training_arg(model) else model(x)
    y = align_targets(model, y, y_pred)
    length_factors = output_length_factors(length_factor, y_pred)
    terms = []
    for flat in _keras.flat_losses(model):
        y_t = _keras.resolve_path(flat.path, y)
        y_p = _keras.resolve_path(flat.path, y_pred)
        s_w = sample_weight
        if sample_weight is not None and keras.tree.is_nested(sample_weight):
            s_w = _keras.resolve_path(flat.path, sample_weight)
        terms.append(output_terms(flat.loss, y_t, y_p, s_w, valid, None if length_factors is None
                                  else _keras.resolve_path(flat.path, length_factors)))
    return y, y_pred, terms, in_call_losses(model)


def in_call_losses(model: keras.Model) -> list:
    """The losses the model's last call added (``add_loss``, activity regularizers),
    float32: ``model.losses`` without the weight penalties, which come last."""
    losses = list(model.losses)
    in_call = losses[: len(losses) - _n_weight_regularizers(model)]
    return [tf.cast(loss, tf.float32) for loss in in_call]


def forward_parts(in_call: list, summed: tuple[bool, ...]) -> tuple[tf.Tensor, tf.Tensor]:
    """(the losses added in call() that are means, those that are sums over the rows),
    each loss summed to a scalar first, as Keras's ``compute_loss`` sums it."""
    means: list = []
    sums: list = []
    for index, loss in enumerate(in_call):
        value = tf.reduce_sum(loss) if loss.shape.rank else loss
        (sums if index < len(summed) and summed[index] else means).append(value)
    return (tf.add_n(means) if means else tf.constant(0.0),
            tf.add_n(sums) if sums else tf.constant(0.0))


def forward_totals(means: Any = 0.0, sums: Any = 0.0, rows: Any = 0.0) -> tf.Tensor:
    """``Totals.forward``, the losses added in ``call()`` as the micro-batches add them
    up: ``[the means times each micro-batch's real rows, the sums over its rows]``
    (:func:`forward_parts`; zeros where none). ``reduction.combined_loss`` divides the
    first by the large batch's rows."""
    return tf.stack([tf.cast(means, tf.float32) * tf.cast(rows, tf.float32),
                     tf.cast(sums, tf.float32)])
