"""Validation in micro-batches: ``model.evaluate``'s logs, exact, never a large batch.

The validation data go through the same host pipeline as training
(``autosplit.pipeline``), cut into micro-batches; one compiled loop pulls them, runs
the model in inference mode, updates the compiled metrics per micro-batch (padding
weighs 0) and sums every compiled loss's numerator and denominator
(``autosplit.reduction``). The loss and the per-output losses are divided once, over
the whole validation set, by the train step's own ``combined_loss`` (on the sums
added up in float64), and written to Keras's trackers once, so ``val_loss`` and
``val_<output>_loss`` are the exact means over the validation examples.

That is what ``model.fit`` logs when its validation batches are all the same size.
Keras updates its per-output loss trackers with the static batch dimension of each
batch, which its validation pipeline leaves unknown, so it averages per-batch means
unweighted: with a short last validation batch its ``val_<output>_loss`` is off the
true mean (and depends on ``validation_batch_size``); autosplit's is not.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from autosplit.accumulate import added, sum_loop, zero_totals
from autosplit.compiled import FunctionCache
from autosplit.inputs import HOST, InputAdapter, get_input
from autosplit.piece import (
    LossPlan,
    Totals,
    empty_to_none,
    forward,
    loss_plan,
    update_loss_trackers,
    update_metrics,
    weight_regularization,
    without_padding,
)
from autosplit.pipeline import MicroBatches, release
from autosplit.reduction import combined_loss

__all__ = ["Evaluator"]

_CHUNK = 64  # micro-batches per call of the compiled loop


class Evaluator:
    """Evaluates one model on validation data in micro-batches of ``rows``."""

    def __init__(self, model: keras.Model) -> None:
        self.model = model
        self._functions = FunctionCache()

    def _plan(self, spec) -> LossPlan:
        x, y, w, _ = spec
        return loss_plan(self.model, (x, empty_to_none(y), empty_to_none(w)))

    def _loop(self, iterator, count) -> tuple[Totals, tf.Tensor]:
        """Up to ``count`` micro-batches: their sums, and whether the data ran out."""
        model = self.model
        plan = self._plan(iterator.element_spec)

        def step(_, totals):
            with tf.device(HOST):
                optional = iterator.get_next_as_optional()
                has = optional.has_value()

            def one():
                x, y, w, valid = optional.get_value()
                x, y, w, valid = without_padding(plan.real_rows_only, x, empty_to_none(y),
                                                 empty_to_none(w), valid)
                y, y_pred, terms, in_call = forward(model, x, y, w, valid, training=False)
                update_metrics(model, y, y_pred, w, valid)
                rows = tf.reduce_sum(valid)
                in_call_sum = tf.add_n(in_call) if in_call else tf.constant(0.0)
                piece = Totals([], [t.numerator for t in terms],
                               [t.denominator for t in terms], in_call_sum * rows, rows)
                return added(totals, piece), tf.constant(False)

            return tf.cond(has, one, lambda: (totals, tf.constant(True)))

        return sum_loop(step, count, zero_totals(len(plan.kinds)))

    def _function(self, spec):
        return self._functions.get(repr(spec), self._loop, run_eagerly=self.model.run_eagerly)

    def __call__(self, pipeline: MicroBatches, *, steps: int | None = None) -> dict[str, float]:
        """Logs over the validation data in ``pipeline`` (``steps`` large batches at most)."""
        model, adapter = self.model, pipeline.adapter
        spec = pipeline.element_spec()
        fn, plan = self._function(spec), self._plan(spec)
        limit = None if steps is None else steps * pipeline.per_batch
        # Each call of the loop sums up to _CHUNK micro-batches in float32; the calls are
        # added up in float64, so a long validation set loses no precision to the sum.
        totals = _float64(zero_totals(len(plan.kinds)))
        pulled = 0
        model.reset_metrics()
        adapter.on_epoch_begin()
        held = [iter(pipeline.dataset())]  # deleted by pipeline.release, off this thread
        while limit is None or pulled < limit:
            count = _CHUNK if limit is None else min(_CHUNK, limit - pulled)
            chunk, stop = fn(held[0], tf.constant(count))
            totals = tf.nest.map_structure(tf.add, totals, _float64(chunk))
            pulled += count
            if bool(stop):
                break
        release(held)
        adapter.on_epoch_end()
        loss, per_output = combined_loss(
            totals.numerators, totals.denominators, totals.forward, totals.rows,
            kinds=plan.kinds, weights=plan.weights,
            regularization=tf.cast(weight_regularization(model), tf.float64))
        if float(totals.rows):
            update_loss_trackers(model, float(loss), [float(v) for v in per_output],
                                 float(totals.rows))
        return {name: float(value) for name, value in model.get_metrics_result().items()}


def _float64(totals: Totals) -> Totals:
    return tf.nest.map_structure(lambda t: tf.cast(t, tf.float64), totals)


def validation_input(data: Any) -> InputAdapter:
    """The adapter for ``validation_data`` (any input ``fit_large_batch`` takes)."""
    if isinstance(data, (tuple, list)):
        if len(data) not in (1, 2, 3):
            raise ValueError(
                "Expected `validation_data` to be (x, y), (x, y, sample_weight) or (x,), a "
                "tf.data.Dataset, a keras.utils.PyDataset or a generator. Received: a "
                f"{type(data).__name__} of {len(data)} items.")
        return get_input(*data, shuffle=False, name="validation_data")
    return get_input(data, shuffle=False, name="validation_data")
