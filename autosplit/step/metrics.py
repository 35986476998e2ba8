"""What a large batch tells Keras's metrics and loss trackers, as ``model.fit`` tells
them of one batch: the compiled metrics updated from each micro-batch's real rows
(:func:`update_metrics`), the loss trackers once with the large batch's loss
(:func:`update_loss_trackers`), and the real rows alone for whatever averages over them
(:func:`real_rows`, :func:`without_padding`)."""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from autosplit.data.sequences.length_factor import metric_weight
from autosplit.keras_hooks import internals as _keras

__all__ = ["real_rows", "update_loss_trackers", "update_metrics", "without_padding"]


def update_loss_trackers(model, loss, per_output, rows) -> list:
    """Record a large batch's loss and per-output losses, weighted by its ``rows``, in
    Keras's loss trackers; returns the update ops (graph mode)."""
    tracker = _keras.loss_tracker(model)
    updates = [] if tracker is None else [tracker.update_state(loss, sample_weight=rows)]
    for metric, value in zip(_keras.output_loss_trackers(model), per_output, strict=False):
        updates.append(metric.update_state(value, sample_weight=rows))
    return [u for u in updates if u is not None]


def update_metrics(model, y, y_pred, sample_weight, valid, masks=None, *,
                   all_real: bool = False, length_factor=None) -> None:
    """Update the compiled metrics from one micro-batch's real rows, as ``model.fit``
    updates them from a batch: ``sample_weight`` as given (None without one).

    A padded micro-batch's padding rows are dropped first (:func:`real_rows`), not
    weighed 0: a weight Keras never passes reached every metric, and metrics that
    flatten or broadcast it against their own values broke (``MeanIoU`` on per-pixel
    targets raised; the Keras guide's ``CategoricalTruePositives`` counted m times).
    ``all_real``: the caller knows every row is real; the rows pass as they are, with their
    static shapes, and no ``tf.cond`` checks for padding.

    ``length_factor``: a micro-batch cut by length, per output (``y_pred``'s structure;
    ``autosplit.data.sequences.length_factor``). A Keras metric averages each row's values
    over its length before it weighs rows, so a row padded to ``P`` weighs ``L / P`` times
    what it weighs in the large batch of length ``L``: the metrics of an output with a
    length axis get weights divided by its length factor (``autosplit.step.padding`` checks
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
    s_flat = [None] * len(p_flat) if length_factor is None else flatten(length_factor)
    for mls, y_t, y_p, s in zip(unweighted, y_flat, p_flat, s_flat, strict=False):
        if mls:
            mls.update_state(y_t, y_p, **metric_weight(None, y_p, s))
    if sample_weight is not None:
        sw_flat = flatten(sample_weight)
        if len(sw_flat) < len(y_flat):
            sw_flat = [sw_flat[0]] * len(y_flat)
    else:
        sw_flat = [None] * len(y_flat)
    for mls, y_t, y_p, s_w, s in zip(weighted, y_flat, p_flat, sw_flat, s_flat, strict=False):
        if mls:
            mls.update_state(y_t, y_p, **(metric_weight(s_w, y_p, s) or {"sample_weight": s_w}))


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
