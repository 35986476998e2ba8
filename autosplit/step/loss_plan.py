"""The loss plan: what a model's loss is made of, learnt once from a trace of its forward
pass (:func:`loss_plan`, :func:`step_plan`): which compiled losses are means over rows,
sums, or ratios the model decides; the losses added in ``call()`` and whether they are
per batch; which gradients are sparse or float16; and the BatchNormalization calls to
pool. The forward pass each micro-batch runs is ``autosplit.step.forward``'s."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import keras
import tensorflow as tf

from autosplit.errors import ModelNotReadyError
from autosplit.keras_hooks import internals as _keras
from autosplit.keras_hooks.batchnorm import calls_of, counted_all, pooled_layers, recording
from autosplit.keras_hooks.custom_step import (
    CustomFacts,
    custom_facts,
    has_custom_step,
)
from autosplit.keras_hooks.traced import repeats_rows, row_reduction, summed_in_float16
from autosplit.keras_hooks.traced import trace as trace_once
from autosplit.step.forward import forward, in_call_losses
from autosplit.step.model_state import model_state
from autosplit.step.reduction import COUNT, SUM, WEIGHT

__all__ = [
    "COUNT_GROUP",
    "SUM_GROUP",
    "LossPlan",
    "loss_plan",
    "own_loss_plan",
    "step_plan",
]

COUNT_GROUP, SUM_GROUP = "count", "sum"


@dataclass(frozen=True)
class LossPlan:
    """Static facts about a model's loss, learned from one throwaway trace."""

    kinds: tuple[str, ...]  # per compiled loss: SUM, COUNT or WEIGHT
    per_row: tuple[int | None, ...]  # loss elements per example
    folded: tuple[bool, ...]  # per compiled loss: in the "count" or "sum" group
    forward_losses: bool  # losses added in call() (activity regularizers, add_loss)
    has_grad: tuple[bool, ...]  # per trainable variable
    groups: tuple  # "count", "sum", ("deferred", j): one gradient sum each
    weights: tuple[float, ...]  # `loss_weights` per compiled loss
    custom: CustomFacts | None = None  # the model's own train_step runs per micro-batch
    per_batch_losses: bool = False  # a compiled loss returns one value per batch
    # ... and it is not a plain mean over the rows (reduction.mean_over_rows): a ratio
    # that weighing by rows need not reproduce (a mean over unmasked tokens)
    per_batch_ratios: bool = False
    # a variable's gradient is tf.IndexedSlices (Embedding) that may name a row twice
    sparse_gradients: bool = False
    # (layer, its calls in training mode per forward pass) for every BatchNormalization
    # layer autosplit can pool (batchnorm.pooled_layers): two calls for an encoder over
    # two views, each a moving-statistics update in Keras; none in inference mode.
    batch_norm_calls: tuple[tuple[Any, int], ...] = ()
    # Per loss added in call(): a sum over the rows (Keras sums a per-example vector
    # given to add_loss, keras-io's CTC endpoint layer; or ops.sum of per-row values),
    # each micro-batch's sum counted whole; the others are weighed as means by rows.
    forward_summed: tuple[bool, ...] = ()
    # per trainable variable: its gradient is a float16 layer's, which the full batch
    # sums over its rows in float16 (traced.summed_in_float16; step.overflow)
    half: tuple[bool, ...] = ()

    @property
    def real_rows_only(self) -> bool:
        """Micro-batches without padding rows: something computes a mean of its own (a
        layer's added loss, a custom step, a loss that returns one value per batch), where
        autosplit cannot weigh padding rows out."""
        return self.forward_losses or self.custom is not None or self.per_batch_losses


def _forward_kind(loss: tf.Tensor, rows: int | None) -> str | None:
    """How a loss added in call() adds up over the rows: "sum" for a vector of one value
    per row (Keras sums it) or a sum over every axis of per-row values, "mean" for a
    mean (Keras's activity regularizers divide by the rows), None when the trace cannot
    tell."""
    if loss.shape.rank:
        return "sum" if rows is not None and loss.shape[0] == rows else None
    kind = row_reduction(loss, None, rows)
    return kind if kind in ("sum", "mean") else None


@tf.autograph.experimental.do_not_convert
def loss_plan(model: keras.Model, specs: tuple, *, training: bool = True) -> LossPlan:
    """Trace one micro-batch of ``specs`` = (x, y, sample_weight) specs; nothing runs.

    ``training=False``: the plan of validation, whose forward pass may add other losses
    (a layer that adds one only in training), matched to them by position.
    """
    key = repr(specs) if training else ("inference", repr(specs))
    cache = model_state(model).plans
    if key in cache:
        return cache[key]
    facts: dict[str, Any] = {}

    def trace(x, y, sample_weight):
        valid = tf.ones([tf.shape(tf.nest.flatten(x)[0])[0]], tf.float32)
        layers = pooled_layers(model)
        with recording(layers) as records, tf.GradientTape() as tape:
            _, _, terms, in_call = forward(model, x, y, sample_weight, valid,
                                           training=training)
            parts = [t.numerator for t in terms] + [tf.reduce_sum(t) for t in in_call]
            total = tf.add_n(parts) if parts else tf.constant(0.0)
        grads = tape.gradient(total, model.trainable_variables)
        rows = tf.nest.flatten(x)[0].shape[0]
        facts.update(terms=terms, forward=bool(in_call),
                     forward_kinds=tuple(_forward_kind(t, rows) for t in in_call),
                     batch_norm_calls=calls_of(layers, records),
                     has_grad=tuple(g is not None for g in grads),
                     half=tuple(summed_in_float16(g) for g in grads),
                     sparse=any(isinstance(g, tf.IndexedSlices) and repeats_rows(g)
                                    for g in grads))
        return total

    trace_once(trace, *specs)
    if not counted_all(model, facts["batch_norm_calls"]):
        trace_once(trace, *specs)  # the first trace built layers: count their calls too
    terms = facts["terms"]
    if not terms and not facts["forward"]:
        raise ModelNotReadyError(
            "Expected a model compiled with a loss, or one that adds its loss in call() "
            "(add_loss). Received: model.compile(loss=None) and no loss added in call(). "
            "Pass `loss=` to `model.compile`.")
    folded = tuple(t.kind == SUM or (t.kind == COUNT and not t.masked and t.per_row is not None)
                   for t in terms)
    kinds = tuple(t.kind for t in terms)
    groups: list = []
    if facts["forward"] or any(f and k == COUNT for f, k in zip(folded, kinds, strict=True)):
        groups.append(COUNT_GROUP)
    forward_summed = tuple(kind == "sum" for kind in facts["forward_kinds"])
    if any(forward_summed):
        forward_summed = _summed_at_other_rows(model, specs, forward_summed, training)
    if any(k == SUM for k in kinds) or any(forward_summed):
        groups.append(SUM_GROUP)
    groups += [("deferred", j) for j, f in enumerate(folded) if not f]
    plan = LossPlan(
        kinds=kinds, per_row=tuple(t.per_row for t in terms), folded=folded,
        forward_losses=facts["forward"], has_grad=facts["has_grad"], groups=tuple(groups),
        half=facts["half"],
        weights=tuple(1.0 if f.weight is None else float(f.weight)
                      for f in _keras.flat_losses(model)),
        per_batch_losses=not all(t.per_example for t in terms),
        per_batch_ratios=not all(t.per_example or t.row_mean for t in terms),
        sparse_gradients=facts["sparse"],
        batch_norm_calls=facts["batch_norm_calls"],
        forward_summed=forward_summed,
    )
    cache[key] = plan
    return plan


def _summed_at_other_rows(model: keras.Model, specs: tuple, summed: tuple[bool, ...],
                          training: bool) -> tuple[bool, ...]:
    """``summed`` where an added loss is a sum over the rows at one row more too: a
    vector per unit matches the rows only when the units happen to number m."""
    rows = tf.nest.flatten(specs[0])[0].shape[0]
    if rows is None:
        return summed

    def grown(spec):
        if not isinstance(spec, tf.TensorSpec) or not spec.shape.rank or spec.shape[0] != rows:
            return spec
        return tf.TensorSpec([rows + 1, *spec.shape[1:]], spec.dtype)

    seen: dict[str, Any] = {}

    def trace(x, y, sample_weight):
        valid = tf.ones([rows + 1], tf.float32)
        *_, in_call = forward(model, x, y, sample_weight, valid, training=training)
        seen["kinds"] = tuple(_forward_kind(t, rows + 1) for t in in_call)
        return tf.constant(0.0)

    trace_once(trace, *tf.nest.map_structure(grown, specs))
    kinds = seen["kinds"]
    return tuple(s and i < len(kinds) and kinds[i] == "sum" for i, s in enumerate(summed))


def step_plan(model: keras.Model, specs: tuple) -> LossPlan:
    """The plan of the train step: the model's own ``train_step`` (or ``compute_loss``)
    when it overrides one, else the compiled loss and the losses added in call()."""
    if not has_custom_step(model):
        return loss_plan(model, specs)
    key = ("custom", repr(specs))
    cache = model_state(model).plans
    if key not in cache:
        facts = custom_facts(model, specs)
        ratios = facts.reading.ratios  # a ("deferred", r) group's denominators
        cache[key] = LossPlan(kinds=(WEIGHT,) * ratios, per_row=(None,) * ratios,
                              folded=(False,) * ratios, forward_losses=False,
                              has_grad=facts.has_grad, groups=facts.reading.groups,
                              half=facts.half,
                              weights=(1.0,) * ratios, custom=facts,
                              sparse_gradients=facts.sparse_gradients,
                              batch_norm_calls=facts.batch_norm_calls)
    return cache[key]


@tf.autograph.experimental.do_not_convert
def own_loss_plan(model: keras.Model, specs: tuple) -> LossPlan:
    """The plan of a model whose ``compute_loss`` is its own, for the whole-batch step
    (``autosplit.step.whole_batch``), which calls it once on the whole batch: which
    weights it reaches and which of their gradients are float16 sums, and whether the
    forward pass adds losses in call(); traced once on ``specs``, nothing runs."""
    key = ("own compute_loss", repr(specs))
    cache = model_state(model).plans
    if key in cache:
        return cache[key]
    facts: dict[str, Any] = {}

    def trace(x, y, sample_weight):
        with tf.GradientTape() as tape:
            y_pred = model(x, training=True)
            facts["forward"] = bool(in_call_losses(model))
            loss = model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight,
                                      training=True)
        grads = tape.gradient(loss, model.trainable_variables)
        facts.update(has_grad=tuple(g is not None for g in grads),
                     half=tuple(summed_in_float16(g) for g in grads))
        return loss

    trace_once(trace, *specs)
    cache[key] = LossPlan(kinds=(), per_row=(), folded=(), forward_losses=facts["forward"],
                          has_grad=facts["has_grad"], groups=(), weights=(),
                          half=facts["half"])
    return cache[key]
