"""Models with their own ``train_step`` (or ``compute_loss``): split by running that step
once per micro-batch and catching its one ``apply_gradients``.

Keras's guide teaches overriding ``train_step`` (VAEs, contrastive models, distillers);
Keras's own ``gradient_accumulation_steps`` lives in the optimizer, so it works for
them. autosplit does the same thing inside its loop, exactly:

- Each micro-batch holds real rows only (no padding) and is passed to
  ``model.train_step`` as ``model.fit`` passes a batch: ``x``, ``(x, y)`` or
  ``(x, y, sample_weight)``.
- While the step runs, ``model.optimizer.apply_gradients`` (and ``apply``) records the
  gradients instead of applying them, and every ``tape.gradient`` is answered per group
  of the terms of its target (``autosplit.keras_hooks.gradients``): a mean weighed by
  the micro-batch's rows, a sum unweighed, a ratio of sums (a masked mean) by its own
  divisor and divided once by the large batch's; autosplit's loop applies the groups'
  sums once per large batch. A loss that needs the whole batch (``top_k`` of per-row
  losses, a maximum over the batch) and a transform of the gradients before the apply
  (``clip_by_global_norm``) are refused.
- A metric tracker updated with one scalar (``self.loss_tracker.update_state(loss)``)
  is weighed so that the micro-batches add up to one update of the large batch's value
  (``interception.weighed_trackers``).
- The logs are what the step returned, combined over the micro-batches as each value
  combines (``target.log_parts``): a tracker's result as the last micro-batch left it,
  a mean by rows, a ratio by its divisor, a sum, a maximum, a minimum, and a sum of
  such terms (a mean plus a penalty on a sum) part by part. A value that combines none
  of these ways is weighed by rows, with a warning.

A step that applies gradients more than once, or through another optimizer (a GAN's
two), has no exact split in one pass; nor has one that assigns variables of its own
(a moving average of the weights: it would run once per micro-batch). Both are refused
by :func:`custom_facts` with ``UnsupportedModelError``, from a throwaway trace, before
anything changes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from autosplit.errors import UnsupportedModelError, refusing
from autosplit.keras_hooks import internals as _keras
from autosplit.keras_hooks.batchnorm import calls_of, counted_all, pooled_layers, recording
from autosplit.keras_hooks.gradients import Reading
from autosplit.keras_hooks.interception import check_writes, intercept, watch_writes
from autosplit.keras_hooks.patches import object_patches
from autosplit.keras_hooks.target import gradient_norm, log_parts
from autosplit.keras_hooks.traced import repeats_rows, summed_in_float16
from autosplit.keras_hooks.traced import trace as trace_once
from autosplit.warn import warn_user

__all__ = ["CustomFacts", "batch_data", "custom_facts", "flat_logs", "from_batch",
           "has_custom_step", "metrics_or_last", "overridden_steps", "overrides_test_step",
           "runs_own_test_step"]


def overridden_steps(model: keras.Model) -> list[str]:
    """Which of ``train_step`` and ``compute_loss`` the model's class overrides."""
    return [name for name in ("train_step", "compute_loss")
            if getattr(type(model), name, None) is not getattr(keras.Model, name)]


def has_custom_step(model: keras.Model) -> bool:
    """Whether ``model`` overrides ``train_step`` or ``compute_loss``."""
    return bool(overridden_steps(model))


def overrides_test_step(model: keras.Model) -> bool:
    """Whether ``model`` overrides ``test_step`` (what ``model.fit`` validates with)."""
    return getattr(type(model), "test_step", None) is not keras.Model.test_step


def runs_own_test_step(model: keras.Model) -> bool:
    """Whether validation must run ``model.test_step`` to give ``model.fit``'s logs: the
    model overrides it, or ``train_step`` or ``compute_loss`` (Keras's default test_step
    then calls that compute_loss, and reports the step's own trackers)."""
    return has_custom_step(model) or overrides_test_step(model)


@dataclass(frozen=True)
class CustomFacts:
    """What one throwaway trace of the model's ``train_step`` showed."""

    has_grad: tuple[bool, ...]  # per model.trainable_variables: the step applies a gradient
    logs: Any  # tf.TensorSpec structure of what the step returns
    # Per flat log, how each of its parts combines over the micro-batches
    # (target.log_parts): "last" (a tracker's result), "sum", "count" (a mean, by rows),
    # "ratio" (by its divisor), "fixed", "max", "min", "other" (by rows, warned); or
    # ("gradient_norm", variable indices): the norm of the large batch's gradients; or
    # ("result", metric index): a tracker's result(), read after the piece's updates.
    log_kinds: tuple[tuple, ...]
    # a gradient it applies is tf.IndexedSlices (an Embedding's) that may name a row twice
    sparse_gradients: bool
    batch_norm_calls: tuple[tuple[Any, int], ...] = ()  # as LossPlan.batch_norm_calls
    # The groups of the terms of the losses it differentiates (keras_hooks.gradients),
    # replayed by every trace of the step that runs.
    reading: Reading = field(default_factory=Reading)
    # per scalar tracker update, how its parts combine and its metric's index in
    # internals.all_metrics (interception.weighed_trackers)
    tracker_kinds: tuple[tuple[tuple[str, ...], int], ...] = ()
    # per model.trainable_variables: a float16 layer's gradient (traced.summed_in_float16)
    half: tuple[bool, ...] = ()


def flat_logs(result: dict[str, Any]) -> dict[str, Any]:
    """Logs as floats, a nested dict's entries lifted (a custom step may return the
    compiled metrics' ``result()``, a dict, as Keras's guide does)."""
    logs: dict[str, Any] = {}
    for name, value in result.items():
        if isinstance(value, dict):
            logs.update(flat_logs(value))
        elif np.ndim(value):  # a vector a custom step returns: kept as an array, as Keras
            logs[name] = np.asarray(value)
        else:
            logs[name] = float(value)
    return logs


def metrics_or_last(model: keras.Model, last: dict[str, Any]) -> dict[str, Any]:
    """The logs of an epoch or of a validation, as Keras picks them
    (``Trainer._get_metrics_result_or_logs``): the metrics' results, or what the step
    returned last when it names other things."""
    results = flat_logs(model.get_metrics_result())
    return results if set(results) == set(last) else dict(last)


def batch_data(x: Any, y: Any, sample_weight: Any) -> Any:
    """What ``model.fit`` passes to ``train_step``: ``x`` (or ``(x,)`` for a tuple x),
    ``(x, y)`` or ``(x, y, sample_weight)``."""
    return keras.utils.pack_x_y_sample_weight(x, y, sample_weight)


@tf.autograph.experimental.do_not_convert
def custom_facts(model: keras.Model, specs: tuple) -> CustomFacts:
    """Trace ``train_step`` once on ``specs`` = (x, y, sample_weight) specs; nothing runs.

    Raises:
        UnsupportedModelError: the step applies gradients more than once, to other
            variables, through another optimizer, or never; or it assigns variables
            of its own (:func:`watch_writes`).
    """
    if model.optimizer is None:
        raise UnsupportedModelError(
            f"Expected `{type(model).__name__}` with a custom train_step to be compiled "
            "with an optimizer (`model.compile(optimizer=...)`), which autosplit applies "
            "once per large batch. Received: model.optimizer=None (a step that applies its "
            "own optimizers, as a GAN does, has no exact split in one pass).")
    facts: dict[str, Any] = {}
    static_rows = tf.nest.flatten(specs[0])[0].shape[0]

    def trace(x, y, sample_weight):
        layers = pooled_layers(model)
        rows = tf.nest.flatten(x)[0].shape[0]
        with intercept(model, None, 1, static_rows=rows, inputs=(x, y, sample_weight)) as seen, \
                watch_writes() as written, recording(layers) as records, \
                read_results(model) as results:
            logs = model.train_step(batch_data(x, y, sample_weight))
            kinds = tuple(("result", results[id(t)]) if id(t) in results
                          else _log_kinds(t, rows, seen) for t in tf.nest.flatten(logs))
        facts.update(seen=seen, logs=logs, written=written, log_kinds=kinds,
                     batch_norm_calls=calls_of(layers, records))
        return tf.constant(0.0)

    # Our own refusal (a GAN's second optimizer) passes without the note on rows.
    with refusing(
            "a train_step that takes batches of any number of rows, one row per example",
            f"`{type(model).__name__}.train_step`, which autosplit traced on a micro-batch "
            f"of {static_rows or 'some'} rows, every input cut along its first axis",
            "A step that reads positions along that axis (data[0] and data[1] as anchors "
            "and positives, keras-io's metric learning) or needs the whole batch cannot be "
            "split so: give such parts an axis of their own after the rows, or train with "
            "model.fit."):
        trace_once(trace, *specs)
        if not counted_all(model, facts["batch_norm_calls"]):
            trace_once(trace, *specs)  # the first trace built layers: count their calls
    check_writes(model, facts["written"])
    seen = facts["seen"]
    if seen.calls == 0:
        raise UnsupportedModelError(
            f"Expected `{type(model).__name__}.train_step` to call "
            "`self.optimizer.apply_gradients` once. Received: a step that never does, so "
            "there is nothing to accumulate.")
    logs = tf.nest.map_structure(lambda t: tf.TensorSpec(tf.convert_to_tensor(t).shape,
                                                         tf.convert_to_tensor(t).dtype),
                                 facts["logs"])
    gradients = [g for grads in seen.gradients.values() for g in grads]
    other = [name for name, kind in zip(_log_names(facts["logs"]), facts["log_kinds"],
                                        strict=True) if "other" in kind]
    if other:
        warn_user(
            f"autosplit: `{type(model).__name__}.train_step` returns {', '.join(other)}, "
            "computed from the batch in a way that does not combine over micro-batches (not "
            "a mean, sum, ratio of sums, maximum or minimum over the rows); it is logged as "
            "the micro-batches' values weighed by rows, which model.fit's need not equal.")
    return CustomFacts(has_grad=seen.has_grad(), logs=logs, log_kinds=facts["log_kinds"],
                       sparse_gradients=any(isinstance(g, tf.IndexedSlices)
                                            and repeats_rows(g) for g in gradients),
                       batch_norm_calls=facts["batch_norm_calls"],
                       reading=seen.split.reading(), tracker_kinds=tuple(seen.tracker_kinds),
                       half=tuple(any(summed_in_float16(g[i]) for g in seen.gradients.values())
                                  for i in range(len(model.trainable_variables))))


@contextlib.contextmanager
def read_results(model: keras.Model) -> Iterator[dict]:
    """While a step is traced: ``id`` of each tensor a metric's ``result()`` returns ->
    that metric's index in ``internals.all_metrics(model)``. The step's log of it is
    read from the metric after the large batch's updates (a deferred one included)."""
    results: dict = {}
    metrics = _keras.all_metrics(model)

    def recorder(index, original):
        def result(*args, **kwargs):
            value = original(*args, **kwargs)
            if isinstance(value, tf.Tensor):
                results[id(value)] = index
            return value
        return result

    with object_patches([(m, "result", recorder(i, m.result)) for i, m in enumerate(metrics)
                         if isinstance(m, keras.metrics.Metric)]):
        yield results


def _log_kinds(value: Any, rows: int | None, seen: Any) -> tuple:
    """How a logged value's parts combine (``target.log_parts``), or, for a norm of the
    gradients the step applies, ``("gradient_norm", variable indices)``: it is the norm
    of the large batch's gradients, computed once they are summed."""
    kinds = tuple(part.kind for part in log_parts(value, rows, seen.split.stop))
    if kinds == ("other",):
        norm = gradient_norm(value, seen.applied)
        if norm is not None:
            return ("gradient_norm", norm)
    return kinds


def _log_names(logs: Any) -> list[str]:
    """A name per value of ``tf.nest.flatten(logs)``, in its order (a dict's sorted keys)."""
    if isinstance(logs, dict):
        return tf.nest.flatten({name: tf.nest.map_structure(lambda _, name=name: name, value)
                                for name, value in logs.items()})
    return [f"log {i}" for i, _ in enumerate(tf.nest.flatten(logs))]


def from_batch(tensor: tf.Tensor, inputs: set) -> bool:
    """Whether ``tensor``, a float scalar, is computed from the batch (its data inputs
    reach the step's inputs). A tracker's ``result()`` reads its variables only: the
    update that feeds them is ordered by control edges, which this walk does not follow.
    Keras's knowledge-distillation ``Distiller`` returns its loss tensors so; averaged
    over the micro-batches, weighed by rows, they are the large batch's, as in
    ``model.fit`` (the last micro-batch's alone moved with the split)."""
    if tensor.shape.rank != 0 or not tensor.dtype.is_floating:
        return False
    seen, stack = set(), [tensor.op]
    while stack:
        op = stack.pop()
        if op in inputs:
            return True
        if op in seen:
            continue
        seen.add(op)
        stack.extend(t.op for t in op.inputs)
    return False
