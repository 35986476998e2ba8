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

import itertools
import types
from typing import Any

import keras
import tensorflow as tf

from autosplit.accumulate import added, sum_loop, zero_totals
from autosplit.compiled import FunctionCache
from autosplit.inputs import HOST, InputAdapter, batched_ancestor, get_input
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

    def __call__(self, pipeline: MicroBatches, *, steps: int | None = None,
                 callbacks: keras.callbacks.CallbackList | None = None) -> dict[str, float]:
        """Logs over the validation data in ``pipeline`` (``steps`` large batches at most).

        ``callbacks`` hear ``on_test_begin``, ``on_test_end`` (with these logs) and, when
        one of them listens (not only the progress bar), ``on_test_batch_begin`` and
        ``on_test_batch_end`` around each large batch, as from ``model.fit``'s
        validation (TensorBoard writes its ``evaluation_*_vs_iterations`` there)."""
        model, adapter = self.model, pipeline.adapter
        spec = pipeline.element_spec()
        fn, plan = self._function(spec), self._plan(spec)
        known = pipeline.steps()  # large batches, when the input knows its length
        if known is not None:
            steps = known if steps is None else min(steps, known)
        limit = None if steps is None else sum(pipeline.elements(s) for s in range(steps))
        hooks = callbacks if callbacks is not None and _hears_test_batches(callbacks) else None
        # Each call of the loop sums up to _CHUNK micro-batches (one large batch when a
        # callback hears each) in float32; the calls are added up in float64, so a long
        # validation set loses no precision to the sum.
        chunk_size = _CHUNK if hooks is None else pipeline.per_batch
        totals = _float64(zero_totals(len(plan.kinds)))
        pulled = 0
        model.reset_metrics()
        if callbacks is not None:
            callbacks.on_test_begin()
        adapter.on_epoch_begin()
        held = [iter(pipeline.dataset())]  # deleted by pipeline.release, off this thread
        batch = 0
        while limit is None or pulled < limit:
            size = chunk_size if hooks is None or known is None else pipeline.elements(batch)
            count = size if limit is None else min(size, limit - pulled)
            if hooks is not None:
                hooks.on_test_batch_begin(batch)
            chunk, stop = fn(held[0], tf.constant(count))
            totals = tf.nest.map_structure(tf.add, totals, _float64(chunk))
            pulled += count
            if hooks is not None and float(chunk.rows):
                running = model.get_metrics_result()
                running["loss"] = self._loss(totals, plan)[0]
                hooks.on_test_batch_end(batch, {k: float(v) for k, v in running.items()})
                batch += 1
            if bool(stop):
                break
        release(held)
        adapter.on_epoch_end()
        loss, per_output = self._loss(totals, plan)
        if float(totals.rows):
            update_loss_trackers(model, float(loss), [float(v) for v in per_output],
                                 float(totals.rows))
        logs = {name: float(value) for name, value in model.get_metrics_result().items()}
        if callbacks is not None:
            callbacks.on_test_end(logs)
        return logs

    def _loss(self, totals: Totals, plan: LossPlan) -> tuple[tf.Tensor, list]:
        """The loss and per-output losses of what ``totals`` summed, as ``model.fit``."""
        return combined_loss(
            totals.numerators, totals.denominators, totals.forward, totals.rows,
            kinds=plan.kinds, weights=plan.weights,
            regularization=tf.cast(weight_regularization(self.model), tf.float64))


def _hears_test_batches(callbacks: keras.callbacks.CallbackList) -> bool:
    """Whether a callback other than the progress bar (silent during fit's validation)
    overrides ``on_test_batch_begin`` or ``on_test_batch_end``."""
    base = keras.callbacks.Callback
    return any(
        not isinstance(c, keras.callbacks.ProgbarLogger) and any(
            getattr(type(c), hook) is not getattr(base, hook)
            for hook in ("on_test_batch_begin", "on_test_batch_end"))
        for c in callbacks.callbacks)


def _float64(totals: Totals) -> Totals:
    return tf.nest.map_structure(lambda t: tf.cast(t, tf.float64), totals)


def validation_input(data: Any, steps: int | None = None) -> tuple[InputAdapter, int | None]:
    """The adapter for ``validation_data`` (any input ``fit_large_batch`` takes), and the
    large batches to evaluate (None: all).

    ``steps`` (``validation_steps``) counts batches as ``model.fit`` does: an input that
    comes in batches of its own (a batched dataset, a ``PyDataset``, a generator) is cut
    to its first ``steps`` batches here; arrays and a dataset of examples count large
    batches of ``validation_batch_size`` (or B) rows, returned for the evaluator. Counted
    in large batches everywhere, a ``.batch(32)`` dataset with ``validation_steps=2``
    was scored on 128 rows at B = 64 where ``model.fit`` scores 64.
    """
    if steps is not None and _own_batches(data):
        # Decided before any adapter reads the data: one peeks a generator's first batch.
        return _validation_adapter(_first_batches(data, steps)), None
    return _validation_adapter(data), steps


def _own_batches(data: Any) -> bool:
    return isinstance(data, (keras.utils.PyDataset, types.GeneratorType)) or (
        isinstance(data, tf.data.Dataset) and batched_ancestor(data) is not None)


def _first_batches(data: Any, n: int) -> Any:
    if isinstance(data, tf.data.Dataset):
        return data.take(n)
    if isinstance(data, keras.utils.PyDataset):
        return _FirstBatches(data, n)
    return (batch for batch in itertools.islice(data, n))  # a generator


class _FirstBatches(keras.utils.PyDataset):
    """A ``PyDataset``'s first ``n`` batches."""

    def __init__(self, inner: keras.utils.PyDataset, n: int) -> None:
        super().__init__(workers=inner.workers, use_multiprocessing=inner.use_multiprocessing,
                         max_queue_size=inner.max_queue_size)
        self.inner, self.n = inner, n

    @property
    def num_batches(self) -> int:
        total = self.inner.num_batches
        return self.n if total is None else min(self.n, total)

    def __len__(self) -> int:
        return self.num_batches

    def __getitem__(self, index: int) -> Any:
        return self.inner[index]

    def on_epoch_begin(self) -> None:
        self.inner.on_epoch_begin()

    def on_epoch_end(self) -> None:
        self.inner.on_epoch_end()


def _validation_adapter(data: Any) -> InputAdapter:
    if isinstance(data, (tuple, list)):
        if len(data) not in (1, 2, 3):
            raise ValueError(
                "Expected `validation_data` to be (x, y), (x, y, sample_weight) or (x,), a "
                "tf.data.Dataset, a keras.utils.PyDataset or a generator. Received: a "
                f"{type(data).__name__} of {len(data)} items.")
        return get_input(*data, shuffle=False, name="validation_data")
    return get_input(data, shuffle=False, name="validation_data")
