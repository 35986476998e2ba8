"""Validation in micro-batches: ``model.evaluate``'s logs, exact, never a large batch.

The validation data go through the same host pipeline as training
(``autosplit.data.pipeline``), cut into micro-batches; one compiled loop pulls them, runs
the model in inference mode, updates the compiled metrics per micro-batch (padding
weighs 0) and sums every compiled loss's numerator and denominator
(``autosplit.step.reduction``). The loss and the per-output losses of each validation batch
are divided by the train step's own ``combined_loss`` (on the sums added up in
float64) and averaged by the batches' rows, as ``model.fit`` weighs its ``val_loss``
tracker; they are written to Keras's trackers once. Where every loss is a mean over
each row's fixed number of elements, the batches' mean is the whole set's: the sums
are then divided once, over the whole set (no call per batch).

Keras updates its per-output loss trackers with the static batch dimension of each
batch, which its validation pipeline leaves unknown, so it averages per-batch values
unweighted: with a short last validation batch its ``val_<output>_loss`` moves from
the rows' mean (and depends on ``validation_batch_size``); autosplit's does not.
"""

from __future__ import annotations

import itertools
import types
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from autosplit.data.adapter import InputAdapter
from autosplit.data.datasets import batched_ancestor
from autosplit.data.inputs import get_input
from autosplit.data.pipeline import MicroBatches, release
from autosplit.data.structure import empty_to_none
from autosplit.graph import HOST
from autosplit.keras_hooks.custom_step import (
    batch_data,
    flat_logs,
    from_batch,
    metrics_or_last,
    runs_own_test_step,
)
from autosplit.keras_hooks.interception import weighed_trackers
from autosplit.keras_hooks.traced import trace
from autosplit.step.compiled import FunctionCache
from autosplit.step.forward import forward, forward_parts, forward_totals
from autosplit.step.loss_plan import LossPlan, loss_plan
from autosplit.step.metrics import update_loss_trackers, update_metrics, without_padding
from autosplit.step.mixing import loss_over_whole_batch
from autosplit.step.reduction import COUNT, combined_loss, weight_regularization
from autosplit.step.totals import Totals, added, sum_loop, zero_totals
from autosplit.step.whole_batch_validation import validate_whole_batches

__all__ = ["Evaluator"]

_CHUNK = 64  # micro-batches per call of the compiled loop


class Evaluator:
    """Evaluates one model on validation data in micro-batches of ``rows``."""

    def __init__(self, model: keras.Model) -> None:
        self.model = model
        self._functions = FunctionCache()
        # Per element spec, for a model's own test_step: which of its flat logs are
        # floats computed from the batch (averaged), and the logs' structure.
        self._facts: dict[str, tuple[tuple[bool, ...], Any]] = {}
        self._traced: tuple[tuple[bool, ...], Any] | None = None

    def _plan(self, spec) -> LossPlan:
        x, y, w, _ = spec
        return loss_plan(self.model, (x, empty_to_none(y), empty_to_none(w)), training=False)

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
                means, sums = forward_parts(in_call, plan.forward_summed)
                piece = Totals([], [t.numerator for t in terms],
                               [t.denominator for t in terms], forward_totals(means, sums, rows),
                               rows)
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
        if runs_own_test_step(self.model):
            return self._own_steps(pipeline, steps, callbacks)
        model, adapter = self.model, pipeline.adapter
        spec = pipeline.element_spec()
        if loss_over_whole_batch(model, adapter, spec) is not None:
            return self._whole_batches(pipeline, steps, callbacks)
        fn, plan = self._function(spec), self._plan(spec)
        known, steps, hooks = _limits(pipeline, steps, callbacks)
        limit = None if steps is None else sum(pipeline.elements(s) for s in range(steps))
        # Each call of the loop sums up to _CHUNK micro-batches in float32, added up in
        # float64, so a long validation set loses no precision to the sum; else a call
        # sums one validation batch (see takes_each_batch).
        per_batch = hooks is not None or not _pools(plan)
        chunk_size = pipeline.per_batch if per_batch else _CHUNK
        totals = _float64(zero_totals(len(plan.kinds)))
        means = _RowMeans()
        pulled = 0
        model.reset_metrics()
        if callbacks is not None:
            callbacks.on_test_begin()
        adapter.on_epoch_begin()
        held = [iter(pipeline.dataset())]  # deleted by pipeline.release, off this thread
        batch = 0
        while limit is None or pulled < limit:
            size = chunk_size if not per_batch or known is None else pipeline.elements(batch)
            count = size if limit is None else min(size, limit - pulled)
            if hooks is not None:
                hooks.on_test_batch_begin(batch)
            chunk, stop = fn(held[0], tf.constant(count))
            pulled += count
            if per_batch:
                chunk = _float64(chunk)
                means.add(*self._loss(chunk, plan), chunk.rows)
            else:
                totals = tf.nest.map_structure(tf.add, totals, _float64(chunk))
            if hooks is not None and float(chunk.rows):
                running = model.get_metrics_result()
                running["loss"] = means.loss
                hooks.on_test_batch_end(batch, {k: float(v) for k, v in running.items()})
                batch += 1
            if bool(stop):
                break
        release(held)
        adapter.on_epoch_end()
        if not per_batch:
            means.add(*self._loss(totals, plan), totals.rows)
        if means.rows:
            update_loss_trackers(model, means.loss, means.per_output, means.rows)
        logs = {name: float(value) for name, value in model.get_metrics_result().items()}
        if callbacks is not None:
            callbacks.on_test_end(logs)
        return logs

    def _whole_batches(self, pipeline: MicroBatches, steps: int | None,
                       callbacks: keras.callbacks.CallbackList | None) -> dict[str, float]:
        """Validation of a loss over the whole batch, each validation batch's computed
        whole (``autosplit.step.whole_batch_validation``)."""
        model = self.model
        known, steps, _ = _limits(pipeline, steps, callbacks)
        model.reset_metrics()
        if callbacks is not None:
            callbacks.on_test_begin()
        pipeline.adapter.on_epoch_begin()
        validate_whole_batches(model, self._functions, pipeline, steps, known)
        pipeline.adapter.on_epoch_end()
        logs = {name: float(value) for name, value in model.get_metrics_result().items()}
        if callbacks is not None:
            callbacks.on_test_end(logs)
        return logs

    def takes_each_batch(self, pipeline: MicroBatches,
                         callbacks: keras.callbacks.CallbackList | None = None) -> bool:
        """Whether the validation batches' boundaries change the logs: where a batch's
        loss is not its rows' mean (a loss summed, or divided by unmasked tokens or
        weights, :func:`_pools`) its loss is taken alone, as ``model.fit`` takes it; a
        model's own ``test_step`` runs per batch; a callback may hear each batch."""
        if runs_own_test_step(self.model) or _limits(pipeline, None, callbacks)[2]:
            return True
        if loss_over_whole_batch(self.model, pipeline.adapter, pipeline.element_spec()):
            return True
        return not _pools(self._plan(pipeline.element_spec()))

    def _own_steps(self, pipeline: MicroBatches, steps: int | None,
                   callbacks: keras.callbacks.CallbackList | None) -> dict[str, Any]:
        """Validation by the model's own ``test_step`` on each micro-batch of real rows, its
        trackers weighed by rows (``weighed_trackers``) so that they add up to
        ``model.fit``'s batch mean; a float it returns is averaged by rows."""
        model, adapter = self.model, pipeline.adapter
        spec = pipeline.element_spec()
        key = repr(spec)
        if key not in self._facts:
            trace(self._own_step, *spec, tf.TensorSpec((), tf.float32))
            assert self._traced is not None
            self._facts[key] = self._traced
        averaged, structure = self._facts[key]
        fn = self._functions.get(("own", key), self._own_step, run_eagerly=model.run_eagerly)
        batch_rows = tf.constant(float(pipeline.batch_size))
        known, steps, hooks = _limits(pipeline, steps, callbacks)
        model.reset_metrics()
        if callbacks is not None:
            callbacks.on_test_begin()
        adapter.on_epoch_begin()
        held = [iter(pipeline.dataset())]  # deleted by pipeline.release, off this thread
        last: dict[str, Any] = {}
        batch = 0
        while steps is None or batch < steps:
            count = pipeline.elements(batch) if known is not None else pipeline.per_batch
            if hooks is not None:
                hooks.on_test_batch_begin(batch)
            rows, pulled, values = 0.0, 0, None
            for x, y, w, valid in itertools.islice(held[0], count):
                pulled += 1
                n = float(tf.reduce_sum(valid))
                if not n:
                    continue  # padding alone: the step would average over no row
                rows += n
                out = [np.asarray(v) for v in tf.nest.flatten(fn(x, y, w, valid, batch_rows))]
                # A float computed from the batch: its running mean over the batch's rows
                # (the first micro-batch's value replaces the last batch's).
                values = out if values is None else [
                    v + (o - v) * (n / rows) if mean else o
                    for v, o, mean in zip(values, out, averaged, strict=True)]
            if values is not None:
                last = flat_logs(tf.nest.pack_sequence_as(structure, values))
                if hooks is not None:
                    hooks.on_test_batch_end(batch, last)
                batch += 1
            if pulled < count:
                break  # the data ended
        release(held)
        adapter.on_epoch_end()
        logs = metrics_or_last(model, last) if last else flat_logs(model.get_metrics_result())
        if callbacks is not None:
            callbacks.on_test_end(logs)
        return logs

    @tf.autograph.experimental.do_not_convert
    def _own_step(self, x, y, w, valid, batch_rows):
        """``model.test_step`` on the real rows of one micro-batch; what it returns."""
        x, y, w, valid = without_padding(True, x, empty_to_none(y), empty_to_none(w), valid)
        rows = tf.reduce_sum(valid)
        with weighed_trackers(self.model, rows, batch_rows):
            logs = self.model.test_step(batch_data(x, y, w))
        if not tf.executing_eagerly():  # what a trace learns (_own_steps keeps it)
            inputs = {t.op for t in tf.nest.flatten((x, y, w)) if t is not None}
            averaged = tuple(from_batch(tf.convert_to_tensor(t), inputs)
                             for t in tf.nest.flatten(logs))
            self._traced = (averaged, tf.nest.map_structure(lambda _: 0, logs))
        return logs

    def _loss(self, totals: Totals, plan: LossPlan) -> tuple[tf.Tensor, list]:
        """The loss and per-output losses of what ``totals`` summed, as ``model.fit``."""
        return combined_loss(
            totals.numerators, totals.denominators, totals.forward, totals.rows,
            kinds=plan.kinds, weights=plan.weights,
            regularization=tf.cast(weight_regularization(self.model), tf.float64))


def _limits(pipeline: MicroBatches, steps: int | None,
            callbacks: keras.callbacks.CallbackList | None
            ) -> tuple[int | None, int | None, keras.callbacks.CallbackList | None]:
    """(large batches the input knows it has, large batches to evaluate, the callbacks
    to call around each large batch: None unless one listens)."""
    known = pipeline.steps()  # large batches, when the input knows its length
    if known is not None:
        steps = known if steps is None else min(steps, known)
    hooks = callbacks if callbacks is not None and _hears_test_batches(callbacks) else None
    return known, steps, hooks


def _hears_test_batches(callbacks: keras.callbacks.CallbackList) -> bool:
    """Whether a callback other than the progress bar (silent during fit's validation)
    overrides ``on_test_batch_begin`` or ``on_test_batch_end``: in its class, or on the
    instance (``LambdaCallback(on_test_batch_end=...)`` sets the attribute)."""
    base = keras.callbacks.Callback

    def overrides(callback: keras.callbacks.Callback, hook: str) -> bool:
        method = getattr(callback, hook)
        return getattr(method, "__func__", method) is not getattr(base, hook)

    return any(
        not isinstance(c, keras.callbacks.ProgbarLogger) and any(
            overrides(c, hook) for hook in ("on_test_batch_begin", "on_test_batch_end"))
        for c in callbacks.callbacks)


def _pools(plan: LossPlan) -> bool:
    """Whether the loss over the whole validation set, divided once, is model.fit's mean
    of its batches' losses by rows: every compiled loss is a mean over the rows' fixed
    number of elements (reduction.COUNT, no mask), the losses added in call() are kept
    times rows. A summed loss, or one divided by unmasked tokens or sample weights, is
    not: its value over a batch depends on which rows the batch holds."""
    return not any(plan.forward_summed) and all(
        kind == COUNT and folded for kind, folded in zip(plan.kinds, plan.folded, strict=True))


class _RowMeans:
    """The loss and per-output losses of validation batches, averaged by their rows
    (``model.fit`` weighs its ``val_loss`` tracker by each batch's rows)."""

    def __init__(self) -> None:
        self.rows = 0.0
        self._loss = 0.0
        self._per_output: list[float] = []

    def add(self, loss: tf.Tensor, per_output: list, rows: tf.Tensor) -> None:
        n = float(rows)
        if not n:
            return
        self.rows += n
        self._loss += float(loss) * n
        values = [float(v) * n for v in per_output]
        self._per_output = values if not self._per_output else [
            a + b for a, b in zip(self._per_output, values, strict=True)]

    @property
    def loss(self) -> float:
        return self._loss / self.rows if self.rows else 0.0

    @property
    def per_output(self) -> list[float]:
        return [v / self.rows for v in self._per_output] if self.rows else []


def _float64(totals: Totals) -> Totals:
    return tf.nest.map_structure(lambda t: tf.cast(t, tf.float64), totals)


def validation_input(data: Any, steps: int | None = None, model: keras.Model | None = None
                     ) -> tuple[InputAdapter, int | None]:
    """The adapter for ``validation_data`` (any input ``fit_large_batch`` takes), and the
    large batches to evaluate (None: all).

    ``steps`` (``validation_steps``) counts batches as ``model.fit`` does: an input that
    comes in batches of its own (a batched dataset, a ``PyDataset``, a generator) is cut
    to its first ``steps`` batches here; arrays and a dataset of examples count large
    batches of ``validation_batch_size`` (or B) rows, returned for the evaluator. Counted
    in large batches everywhere, a ``.batch(32)`` dataset with ``validation_steps=2``
    was scored on 128 rows at B = 64 where ``model.fit`` scores 64.
    """
    if steps is not None and _own_batches(data, model):
        # Decided before any adapter reads the data: one peeks a generator's first batch.
        return _validation_adapter(_first_batches(data, steps), model), None
    return _validation_adapter(data, model), steps


def _own_batches(data: Any, model: keras.Model | None) -> bool:
    return isinstance(data, (keras.utils.PyDataset, types.GeneratorType)) or (
        isinstance(data, tf.data.Dataset) and batched_ancestor(data, model) is not None)


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


def _validation_adapter(data: Any, model: keras.Model | None) -> InputAdapter:
    if isinstance(data, (tuple, list)):
        if len(data) not in (1, 2, 3):
            raise ValueError(
                "Expected `validation_data` to be (x, y), (x, y, sample_weight) or (x,), a "
                "tf.data.Dataset, a keras.utils.PyDataset or a generator. Received: a "
                f"{type(data).__name__} of {len(data)} items.")
        return get_input(*data, shuffle=False, name="validation_data", model=model)
    return get_input(data, shuffle=False, name="validation_data", model=model)
