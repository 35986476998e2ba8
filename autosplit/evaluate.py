"""Validation in micro-batches: ``model.evaluate``'s logs, exact, never a large batch.

The validation data go through the same host pipeline as training
(``autosplit.pipeline``), cut into micro-batches; one compiled loop pulls them, runs
the model in inference mode, updates the compiled metrics per micro-batch (padding
weighs 0) and sums every compiled loss's numerator and denominator
(``autosplit.reduction``). The loss and the per-output losses are divided once, over
the whole validation set, and written to Keras's trackers once, so ``val_loss`` and
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
import numpy as np
import tensorflow as tf

from autosplit import _keras
from autosplit.inputs import HOST, InputAdapter, get_input
from autosplit.piece import (
    empty_to_none,
    forward,
    loss_plan,
    update_loss_trackers,
    update_metrics,
    weight_regularization,
    without_padding,
)
from autosplit.pipeline import MicroBatches
from autosplit.reduction import SUM

__all__ = ["Evaluator"]

_CHUNK = 64  # micro-batches per call of the compiled loop


class Evaluator:
    """Evaluates one model on validation data in micro-batches of ``rows``."""

    def __init__(self, model: keras.Model) -> None:
        self.model = model
        self._functions: dict = {}

    def _loop(self, iterator, count):
        model = self.model
        n_terms = len(_keras.flat_losses(model))
        x, y, w, _ = iterator.element_spec
        plan = loss_plan(model, (x, empty_to_none(y), empty_to_none(w)))

        def body(i, numerators, denominators, in_call, rows, stop):
            with tf.device(HOST):
                optional = iterator.get_next_as_optional()
                has = optional.has_value()

            def one():
                x, y, w, valid = optional.get_value()
                x, y, w, valid = without_padding(plan.real_rows_only, x, empty_to_none(y),
                                                 empty_to_none(w), valid)
                y_al, y_pred, terms, losses = forward(model, x, y, w, valid, training=False)
                update_metrics(model, y_al, y_pred, w, valid)
                piece_rows = tf.reduce_sum(valid)
                in_call_sum = tf.add_n(losses) if losses else tf.constant(0.0)
                return (i + 1,
                        [a + t.numerator for a, t in zip(numerators, terms, strict=True)],
                        [a + t.denominator for a, t in zip(denominators, terms, strict=True)],
                        in_call + in_call_sum * piece_rows, rows + piece_rows,
                        tf.constant(False))

            def end():
                return i, numerators, denominators, in_call, rows, tf.constant(True)

            return tf.cond(has, one, end)

        zeros = [tf.constant(0.0)] * n_terms
        _, numerators, denominators, in_call, rows, stop = tf.while_loop(
            lambda i, *rest: tf.logical_and(i < count, tf.logical_not(rest[-1])), body,
            (tf.constant(0), zeros, zeros, tf.constant(0.0), tf.constant(0.0),
             tf.constant(False)), parallel_iterations=1)
        return numerators, denominators, in_call, rows, stop

    def _function(self, spec):
        key = repr(spec)
        if key not in self._functions:
            fn = self._loop
            self._functions[key] = fn if self.model.run_eagerly else tf.function(
                fn, reduce_retracing=True)
        return self._functions[key]

    def __call__(self, pipeline: MicroBatches, *, steps: int | None = None) -> dict[str, float]:
        """Logs over the validation data in ``pipeline`` (``steps`` large batches at most)."""
        model, adapter = self.model, pipeline.adapter
        fn = self._function(pipeline.element_spec())
        limit = None if steps is None else steps * pipeline.per_batch
        kinds = [getattr(f.loss, "reduction", None) for f in _keras.flat_losses(model)]
        weights = [1.0 if f.weight is None else float(f.weight)
                   for f in _keras.flat_losses(model)]
        n_terms = len(kinds)
        numerators = np.zeros(n_terms)
        denominators = np.zeros(n_terms)
        in_call = rows_seen = 0.0
        pulled = 0
        model.reset_metrics()
        adapter.on_epoch_begin()
        iterator = iter(pipeline.dataset())
        while limit is None or pulled < limit:
            count = _CHUNK if limit is None else min(_CHUNK, limit - pulled)
            nums, dens, calls, seen, stop = fn(iterator, tf.constant(count))
            numerators += np.asarray([float(v) for v in nums])
            denominators += np.asarray([float(v) for v in dens])
            in_call += float(calls)
            rows_seen += float(seen)
            pulled += count
            if bool(stop):
                break
        adapter.on_epoch_end()
        per_output = [num if kind == SUM else (num / den if den else 0.0)
                      for num, den, kind in zip(numerators, denominators, kinds, strict=True)]
        loss = float(weight_regularization(model)) + (in_call / rows_seen if rows_seen else 0.0)
        loss += sum(w * v for w, v in zip(weights, per_output, strict=True))
        if rows_seen:
            update_loss_trackers(model, loss, per_output, rows_seen)
        return {name: float(value) for name, value in model.get_metrics_result().items()}


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
