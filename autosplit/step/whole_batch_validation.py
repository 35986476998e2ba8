"""Validation of a loss over the whole batch (:func:`validate_whole_batches`): each
validation batch (``validation_batch_size`` rows, B by default, as ``model.fit``
validates) run forward in micro-batches, its outputs kept, and the loss computed once
over the whole batch, as ``model.fit``'s ``test_step`` computes it; the batches' losses
averaged by their rows, as its ``val_loss`` tracker averages them. The metrics are
updated per micro-batch, as they are row by row."""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from autosplit.data.pipeline import MicroBatches, release
from autosplit.data.structure import empty_to_none, map_present, none_to_empty
from autosplit.graph import HOST
from autosplit.step.compiled import FunctionCache
from autosplit.step.forward import align_targets, forward_parts, in_call_losses
from autosplit.step.loss_plan import loss_plan
from autosplit.step.metrics import update_loss_trackers, update_metrics
from autosplit.step.reduction import weight_regularization, whole_batch_loss

__all__ = ["validate_whole_batches"]


def _batch(model: keras.Model, iterator: Any, count: tf.Tensor) -> tuple:
    """Up to ``count`` micro-batches of one validation batch: its loss, each output's,
    its real rows, and whether the data ended."""
    spec = iterator.element_spec
    x_spec, y_spec, w_spec, _ = spec
    plan = loss_plan(model, (x_spec, empty_to_none(y_spec), empty_to_none(w_spec)),
                     training=False)

    def one(element: Any, y_pred: Any, i: tf.Tensor, arrays: list, added: tf.Tensor) -> tuple:
        _, y, w, valid = element
        y, w = empty_to_none(y), empty_to_none(w)
        update_metrics(model, align_targets(model, y, y_pred), y_pred, w, valid)
        means, sums = forward_parts(in_call_losses(model), plan.forward_summed)
        leaves = tf.nest.flatten((y_pred, none_to_empty(y), none_to_empty(w), valid))
        return ([a.write(i, t) for a, t in zip(arrays, leaves, strict=True)],
                added + means * tf.reduce_sum(valid) + sums)

    with tf.device(HOST):
        first = iterator.get_next_as_optional()
    # The outputs' structure from the first micro-batch, which every call has.
    x, y, w, valid = first.get_value()
    y_pred = model(x, training=False)
    structure = (y_pred, y, w, valid)  # an absent part: () in an element
    kept = [tf.TensorArray(t.dtype, size=0, dynamic_size=True, element_shape=t.shape)
            for t in tf.nest.flatten(structure)]
    kept, added = one(first.get_value(), y_pred, tf.constant(0), kept, tf.constant(0.0))

    def body(i, stop, added, *arrays):
        with tf.device(HOST):
            optional = iterator.get_next_as_optional()

        def more():
            element = optional.get_value()
            written, total = one(element, model(element[0], training=False), i,
                                 list(arrays), added)
            return (i + 1, tf.constant(False), total, *written)

        return tf.cond(optional.has_value(), more,
                       lambda: (i, tf.constant(True), added, *arrays))

    _, stop, added, *kept = tf.while_loop(
        lambda i, stop, *_: tf.logical_and(i < count, tf.logical_not(stop)), body,
        (tf.constant(1), tf.constant(False), added, *kept), parallel_iterations=1)
    flat = [tf.reshape(a.stack(), tf.concat([[-1], tf.shape(a.read(0))[1:]], 0))
            for a in kept]
    outputs, y, w, valid = tf.nest.pack_sequence_as(structure, flat)
    y, w = empty_to_none(y), empty_to_none(w)
    keep = tf.where(valid > 0)[:, 0]
    outputs, y, w = map_present(lambda t: tf.gather(t, keep), (outputs, y, w))
    rows = tf.cast(tf.size(keep), tf.float32)
    loss, per_output = whole_batch_loss(model, align_targets(model, y, outputs), outputs, w)
    loss += weight_regularization(model) + tf.math.divide_no_nan(added, rows)
    return loss, per_output, rows, stop


def validate_whole_batches(model: keras.Model, functions: FunctionCache,
                           pipeline: MicroBatches, steps: int | None,
                           known: int | None) -> None:
    """Run the validation batches of ``pipeline`` (``steps`` at most; ``known``: how
    many the input has) and write their row-weighed losses to Keras's trackers."""
    fn = functions.get(("whole", repr(pipeline.element_spec())),
                       lambda iterator, count: _batch(model, iterator, count),
                       run_eagerly=model.run_eagerly)
    held = [iter(pipeline.dataset())]  # deleted by pipeline.release, off this thread
    rows, loss, per_output = 0.0, 0.0, None
    batch = 0
    while steps is None or batch < steps:
        count = pipeline.elements(batch) if known is not None else pipeline.per_batch
        try:
            value, outputs, n, stop = fn(held[0], tf.constant(count))
        except tf.errors.OutOfRangeError:  # no micro-batch left: the data ended
            break
        n = float(n)
        rows += n
        loss += float(value) * n
        values = [float(v) * n for v in outputs]
        per_output = values if per_output is None else [
            a + b for a, b in zip(per_output, values, strict=True)]
        batch += 1
        if bool(stop):
            break
    release(held)
    if rows:
        update_loss_trackers(model, tf.constant(loss / rows),
                             [tf.constant(v / rows) for v in per_output or []],
                             tf.constant(rows))
