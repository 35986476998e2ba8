"""Models with their own ``train_step`` (or ``compute_loss``): split by running that step
once per micro-batch and catching its one ``apply_gradients``.

Keras's guide teaches overriding ``train_step`` (VAEs, contrastive models, distillers);
Keras's own ``gradient_accumulation_steps`` lives in the optimizer, so it works for
them. autosplit does the same thing inside its loop, exactly:

- Each micro-batch holds real rows only (no padding) and is passed to
  ``model.train_step`` as ``model.fit`` passes a batch: ``x``, ``(x, y)`` or
  ``(x, y, sample_weight)``.
- While the step runs, ``model.optimizer.apply_gradients`` (and ``apply``) records the
  gradients instead of applying them. A step's loss is a mean over its examples, so a
  micro-batch of n rows weighs n / B in the sum; autosplit's loop applies the sum once
  per large batch (times B / N for a short last batch of N rows, as for compiled losses).
  A step whose tape target has a row per example (keras-io's siamese triplet loss,
  ``tape.gradient(per_triplet_loss, ...)``: TensorFlow takes the gradient of its sum)
  adds its micro-batches' gradients unweighed, the sum over the batch's rows as in
  ``model.fit`` (:func:`watch_targets`).
- A metric tracker updated with one scalar and no sample weight (``Mean`` of the step's
  loss: ``self.loss_tracker.update_state(loss)``) is given the weight n / B, so that
  after a full large batch it holds what ``model.fit`` leaves after one step of B rows.
  A count of the rows (a scalar from the batch's shape alone, :func:`counts_rows`)
  adds up over the micro-batches instead.
  Trackers updated per example (``y_true, y_pred``) or with their own weights add up
  as they are.
- The logs are what the step returned for the last micro-batch, read from the trackers
  it updated: for a full large batch, ``model.fit``'s logs. A float scalar it computes
  from the batch and returns as it is (a loss tensor, not a tracker's result:
  :func:`from_batch`) is averaged over the micro-batches, weighed by rows.

A step that applies gradients more than once, or through another optimizer (a GAN's
two), has no exact split in one pass; nor has one that assigns variables of its own
(a moving average of the weights: it would run once per micro-batch). Both are refused
by :func:`custom_facts` with ``UnsupportedModelError``, from a throwaway trace, before
anything changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from autosplit.errors import UnsupportedModelError, noted
from autosplit.keras_hooks import internals as _keras
from autosplit.keras_hooks.batchnorm import calls_of, counted_all, pooled_layers, recording
from autosplit.keras_hooks.interception import (
    check_writes,
    intercept,
    watch_targets,
    watch_writes,
)
from autosplit.keras_hooks.traced import repeats_rows
from autosplit.step.compiled import trace as trace_once

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
    # Per flat log: a float scalar computed from the batch itself (a loss tensor returned
    # as it is), not read from a tracker: averaged over the large batch's rows.
    averaged: tuple[bool, ...]
    # a gradient it applies is tf.IndexedSlices (an Embedding's) that may name a row twice
    sparse_gradients: bool
    batch_norm_calls: tuple[tuple[Any, int], ...] = ()  # as LossPlan.batch_norm_calls
    # Per model.trainable_variables: its gradient is of a target with a row per example
    # (summed by tape.gradient): the micro-batches' gradients add up unweighed.
    summed: tuple[bool, ...] = ()
    # The loss it differentiates divides by a value of the batch (a mean over unmasked
    # tokens): weighed as a mean, it is not the full batch's (warned when split).
    ratio_loss: bool = False


def _check_compiled_reduction(model: keras.Model, *, weighted: bool) -> None:
    """A step's loss must be a mean over its rows for the n / B weighing: refuse a
    compiled loss (built by the step's ``compute_loss``) that sums, or that divides by
    the sample weights' sum when there are sample weights (its micro-batch means weigh
    by weight, not rows). Unchecked, ``reduction="sum"`` ended 2.6 apart from model.fit."""
    for flat in _keras.flat_losses(model):
        reduction = getattr(flat.loss, "reduction", "sum_over_batch_size")
        if reduction == "sum" or (reduction == "mean_with_sample_weight" and weighted):
            raise UnsupportedModelError(
                f"Expected the compiled loss of `{type(model).__name__}`, whose own "
                "train_step autosplit runs once per micro-batch, to be a mean over the "
                f"batch's examples. Received: reduction={reduction!r}"
                f"{' with sample weights' if weighted else ''} ({type(flat.loss).__name__}): "
                "each micro-batch's gradient is weighed by its share of the rows, exact "
                "for a mean only. Compile with the default reduction "
                "('sum_over_batch_size'), or train with model.fit.")


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
        with intercept(model, None, 1) as seen, watch_writes() as written, \
                recording(layers) as records, \
                watch_targets(model, tf.nest.flatten(x)[0].shape[0]) as targets:
            logs = model.train_step(batch_data(x, y, sample_weight))
        inputs = {t.op for t in tf.nest.flatten((x, y, sample_weight)) if t is not None}
        averaged = tuple(from_batch(tf.convert_to_tensor(t), inputs)
                         for t in tf.nest.flatten(logs))
        facts.update(seen=seen, logs=logs, written=written, averaged=averaged,
                     batch_norm_calls=calls_of(layers, records), targets=targets)
        return tf.constant(0.0)

    # Our own refusal (a GAN's second optimizer) passes without the note on rows.
    with noted(f"autosplit traced `{type(model).__name__}.train_step` on a micro-batch of "
               f"{static_rows or 'some'} rows: it cuts every input along its first axis, "
               "one row per example, as a batch of fewer rows. A step that reads positions "
               "along that axis (data[0] and data[1] as anchors and positives, keras-io's "
               "metric learning) or needs the whole batch cannot be split so: give such "
               "parts an axis of their own after the rows, or train with model.fit."):
        trace_once(trace, *specs)
        if not counted_all(model, facts["batch_norm_calls"]):
            trace_once(trace, *specs)  # the first trace built layers: count their calls
    check_writes(model, facts["written"])
    _check_compiled_reduction(model, weighted=specs[2] is not None)
    seen = facts["seen"]
    if seen.calls == 0:
        raise UnsupportedModelError(
            f"Expected `{type(model).__name__}.train_step` to call "
            "`self.optimizer.apply_gradients` once. Received: a step that never does, so "
            "there is nothing to accumulate.")
    logs = tf.nest.map_structure(lambda t: tf.TensorSpec(tf.convert_to_tensor(t).shape,
                                                         tf.convert_to_tensor(t).dtype),
                                 facts["logs"])
    return CustomFacts(has_grad=tuple(g is not None for g in seen.gradients), logs=logs,
                       averaged=facts["averaged"],
                       sparse_gradients=any(isinstance(g, tf.IndexedSlices)
                                            and repeats_rows(g) for g in seen.gradients),
                       batch_norm_calls=facts["batch_norm_calls"],
                       summed=tuple(facts["targets"].summed.get(id(v), False)
                                    for v in model.trainable_variables),
                       ratio_loss=facts["targets"].ratio)


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
