"""One micro-batch's contribution to a large batch, and how the contributions combine.

One micro-batch (:func:`compute_piece`) gives, for every compiled loss, the numerator
of Keras's reduction (``autosplit.reduction``) and the gradients of those numerators,
grouped by what they will be divided by:

- ``"count"``: losses averaged over examples (``sum_over_batch_size`` without a Keras
  mask) and the losses added in ``call()``. Their denominator is the large batch's
  real rows, known only at its end when the input is a stream; the loop scales them by
  the planned batch B and :func:`combine` multiplies by ``B / n`` once (exactly 1.0 for
  every full batch).
- ``"sum"``: ``reduction="sum"`` losses, divided by nothing.
- ``("deferred", j)``: a loss whose denominator the model decides (unmasked tokens,
  the sum of sample weights): its gradient is summed on its own and divided once.

:func:`combine` turns the sums into the full-batch loss and gradients. Graph code only:
where the sums live (loop-carried tensors in ``autosplit.accumulate``, variables in
``autosplit.update``) is the caller's business.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import keras
import tensorflow as tf

from autosplit import _keras
from autosplit.batchnorm import calls_of, counted_all, pooled_layers, recording
from autosplit.compiled import trace as trace_once
from autosplit.custom_step import (
    CustomFacts,
    batch_data,
    custom_facts,
    has_custom_step,
    intercept,
)
from autosplit.errors import DatasetError, ModelNotReadyError
from autosplit.model_state import model_state
from autosplit.reduction import COUNT, SUM, combined_loss, output_terms
from autosplit.traced import repeats_rows, row_reduction

__all__ = [
    "COUNT_GROUP",
    "SUM_GROUP",
    "LossPlan",
    "Piece",
    "Totals",
    "align_targets",
    "combine",
    "compute_piece",
    "empty_to_none",
    "forward",
    "forward_parts",
    "forward_totals",
    "loss_plan",
    "map_present",
    "none_to_empty",
    "step_plan",
    "update_loss_trackers",
    "update_metrics",
    "weight_regularization",
    "without_padding",
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

    @property
    def real_rows_only(self) -> bool:
        """Micro-batches without padding rows: something computes a mean of its own (a
        layer's added loss, a custom step, a loss that returns one value per batch), where
        autosplit cannot weigh padding rows out."""
        return self.forward_losses or self.custom is not None or self.per_batch_losses


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


def weight_regularization(model: keras.Model) -> tf.Tensor:
    """Sum of the weight regularizers: depends on the weights only, counted once."""
    losses = [tf.cast(v.regularizer(v), tf.float32) for v in model.trainable_variables
              if getattr(v, "regularizer", None) is not None]
    return tf.add_n(losses) if losses else tf.constant(0.0, tf.float32)


def _n_weight_regularizers(model: keras.Model) -> int:
    return sum(1 for v in model.trainable_variables if getattr(v, "regularizer", None))


def forward(model, x, y, sample_weight, valid, *, training=True):
    """One micro-batch forward pass: targets, predictions, loss terms, forward losses."""
    y_pred = model(x, training=training) if _keras.call_has_training_arg(model) else model(x)
    y = align_targets(model, y, y_pred)
    terms = []
    for flat in _keras.flat_losses(model):
        y_t = _keras.resolve_path(flat.path, y)
        y_p = _keras.resolve_path(flat.path, y_pred)
        s_w = sample_weight
        if sample_weight is not None and keras.tree.is_nested(sample_weight):
            s_w = _keras.resolve_path(flat.path, sample_weight)
        terms.append(output_terms(flat.loss, y_t, y_p, s_w, valid))
    losses = list(model.losses)
    in_call = losses[: len(losses) - _n_weight_regularizers(model)]
    return y, y_pred, terms, [tf.cast(loss, tf.float32) for loss in in_call]


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
    """``summed`` where an added loss is a sum over the rows at one row more too.

    A vector of one value per unit (``ops.mean(h**2, axis=0)``) has as many entries as a
    micro-batch has rows when the units happen to number m; traced again at m + 1 rows,
    only a vector of one value per row (or a sum of such) grows with them.
    """
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
        cache[key] = LossPlan(kinds=(), per_row=(), folded=(), forward_losses=False,
                              has_grad=facts.has_grad, groups=(COUNT_GROUP,), weights=(),
                              custom=facts, sparse_gradients=facts.sparse_gradients,
                              per_batch_ratios=facts.ratio_loss,
                              batch_norm_calls=facts.batch_norm_calls)
    return cache[key]


class Piece(NamedTuple):
    """One micro-batch's contribution (per replica)."""

    gradients: list  # per group: one float32 tensor per trainable variable (None: no grad)
    numerators: list  # per compiled loss, float32 scalars
    denominators: list
    # the call() losses: [the means' sum times the piece's real rows, the sums' sum]
    forward: tf.Tensor
    rows: tf.Tensor  # real rows in the piece
    y: Any  # targets aligned to y_pred, for the metrics
    y_pred: Any
    masks: Any  # Keras masks of y_pred (lost when y_pred leaves an XLA function)
    logs: Any = None  # a custom train_step's return value
    moments: Any = None  # per pooled BatchNormalization layer: its Moments on the piece
    sample_weight: Any = None  # the rows the piece ran on, for the metrics: their weights
    valid: Any = None  # and real-row marks (padding dropped where ``without_padding`` ran)


def _dense_f32(g) -> tf.Tensor | None:
    # An Embedding yields IndexedSlices with repeated indices; densifying sums the
    # duplicates, which is the true gradient of the summed loss.
    return None if g is None else tf.cast(tf.convert_to_tensor(g), tf.float32)


def compute_piece(model, plan: LossPlan, x, y, sample_weight, valid, *, batch_size: int,
                  scale, pool: list | tuple = ()) -> Piece:
    """Forward and backward of one micro-batch; changes no variable but the model's own
    (BatchNormalization statistics, seed generators; a custom step's metric trackers)."""
    if plan.custom is not None:
        return _custom_piece(model, plan.custom, x, y, sample_weight, valid,
                             batch_size=batch_size, pool=pool)
    variables = model.trainable_variables
    with recording(pool) as records, tf.GradientTape(persistent=len(plan.groups) > 1) as tape:
        y, y_pred, terms, in_call = forward(model, x, y, sample_weight, valid)
        rows = tf.reduce_sum(valid)
        in_call_mean, in_call_sum = forward_parts(in_call, plan.forward_summed)
        objectives = []
        for group in plan.groups:
            if group == COUNT_GROUP:
                # loss_plan folds a "count" loss only when its per_row is static (not None).
                parts = [terms[j].numerator * (plan.weights[j] / (batch_size * plan.per_row[j]))  # type: ignore[operator]
                         for j in range(len(terms)) if plan.folded[j] and plan.kinds[j] == COUNT]
                if in_call:
                    parts.append(in_call_mean * rows / batch_size)
            elif group == SUM_GROUP:
                parts = [terms[j].numerator * plan.weights[j]
                         for j in range(len(terms)) if plan.kinds[j] == SUM]
                if any(plan.forward_summed):
                    parts.append(in_call_sum)
            else:
                j = group[1]
                parts = [terms[j].numerator * plan.weights[j]]
            objectives.append(tf.add_n(parts) * scale)
    gradients = [[_dense_f32(g) for g in tape.gradient(objective, variables)]
                 for objective in objectives]
    del tape
    masks = keras.tree.map_structure(_keras.get_keras_mask, y_pred)
    return Piece(gradients, [t.numerator for t in terms], [t.denominator for t in terms],
                 forward_totals(in_call_mean, in_call_sum, rows), rows, y, y_pred, masks, None,
                 _moments(pool, records), sample_weight, valid)


def _moments(pool, records) -> list | None:
    """Per pooled BatchNormalization layer: the moments of each of its calls in this
    piece, in call order (``batchnorm.Pool`` pools each call over the micro-batches)."""
    if not pool:
        return None
    return [list(calls) for calls in records]


def _custom_piece(model, facts: CustomFacts, x, y, sample_weight, valid, *,
                  batch_size: int, pool) -> Piece:
    """The model's own train_step on one micro-batch of real rows, its apply caught: the
    gradients of its mean over n rows, weighed n / B, or of its sum over them (a
    per-example tape target), unweighed (``autosplit.custom_step``)."""
    rows = tf.reduce_sum(valid)
    with intercept(model, rows, batch_size) as seen, recording(pool) as records:
        logs = model.train_step(batch_data(x, y, sample_weight))
    share = rows / batch_size
    # A gradient of a per-example target is a sum over the rows: added unweighed.
    weights = [1.0 if summed else share for summed in facts.summed]
    gradients = [None if g is None else tf.cast(tf.convert_to_tensor(g), tf.float32) * weight
                 for g, weight in zip(seen.gradients, weights, strict=True)]
    return Piece([gradients], [], [], forward_totals(), rows, None, None, None, logs,
                 _moments(pool, records))


class Totals(NamedTuple):
    """Sums over the micro-batches of one large batch (per replica, or all-reduced)."""

    gradients: list  # per group, per variable (None: no gradient)
    numerators: list
    denominators: list
    forward: tf.Tensor
    rows: tf.Tensor

    def summed_over_replicas(self, context) -> Totals:
        """The scalar sums added up over every replica in one all-reduce; the gradients
        stay this replica's (the optimizer all-reduces those)."""
        numerators, denominators, forward, rows = context.all_reduce(
            tf.distribute.ReduceOp.SUM, (self.numerators, self.denominators, self.forward,
                                         self.rows))
        return Totals(self.gradients, numerators, denominators, forward, rows)


def combine(model, plan: LossPlan, totals: Totals, *, batch_size: int, scale,
            replicas: int = 1) -> tuple[tf.Tensor, list, list]:
    """(loss, gradients, per-output losses) of the large batch from its sums.

    ``totals`` numerators, denominators, forward and rows must already be summed over
    replicas; the gradients are this replica's (the optimizer all-reduces them).
    ``batch_size`` is the global B the loop scaled by; ``scale`` the loss scale the
    gradients carry (the weight regularizer's gradient gets it too). The loss and the
    per-output losses are ``autosplit.reduction.combined_loss``'s, as validation's are.
    """
    variables = model.trainable_variables
    n = totals.rows
    correction = tf.math.divide_no_nan(tf.constant(float(batch_size)), n)
    if plan.custom is not None:
        # The step's own loss (regularisation included, if it adds it) is in its gradients.
        # A sum over the rows (a per-example tape target) needs no correction.
        (sums,) = totals.gradients
        return tf.constant(0.0), [
            None if g is None else tf.cast(g if summed else g * correction, v.dtype)
            for g, v, summed in zip(sums, variables, plan.custom.summed, strict=True)], []
    with tf.GradientTape() as tape:
        # Counted once per large batch: each replica adds its 1/replicas share.
        regularization = weight_regularization(model) / replicas
    reg_grads = tape.gradient(regularization, variables) if variables else []
    loss, per_output = combined_loss(
        totals.numerators, totals.denominators, totals.forward, n, kinds=plan.kinds,
        weights=plan.weights, regularization=regularization * replicas)
    gradients = []
    for index, variable in enumerate(variables):
        parts = []
        for group, sums in zip(plan.groups, totals.gradients, strict=True):
            g = sums[index]
            if g is None:
                continue
            if group == COUNT_GROUP:
                g = g * correction
            elif group != SUM_GROUP:
                g = tf.math.divide_no_nan(g, totals.denominators[group[1]])
            parts.append(g)
        reg = _dense_f32(reg_grads[index]) if reg_grads else None
        if reg is not None:
            parts.append(reg * scale)
        gradients.append(tf.cast(tf.add_n(parts), variable.dtype) if parts else None)
    return loss, gradients, per_output


def update_loss_trackers(model, loss, per_output, rows) -> list:
    """Record a large batch's loss and per-output losses, weighted by its ``rows``, in
    Keras's loss trackers; returns the update ops (graph mode)."""
    tracker = _keras.loss_tracker(model)
    updates = [] if tracker is None else [tracker.update_state(loss, sample_weight=rows)]
    for metric, value in zip(_keras.output_loss_trackers(model), per_output, strict=False):
        updates.append(metric.update_state(value, sample_weight=rows))
    return [u for u in updates if u is not None]


def update_metrics(model, y, y_pred, sample_weight, valid, masks=None, *,
                   full: bool = False) -> None:
    """Update the compiled metrics from one micro-batch's real rows, as ``model.fit``
    updates them from a batch: ``sample_weight`` as given (None without one).

    A padded micro-batch's padding rows are dropped first (:func:`real_rows`), not
    weighed 0: a weight Keras never passes reached every metric, and metrics that
    flatten or broadcast it against their own values broke (``MeanIoU`` on per-pixel
    targets raised; the Keras guide's ``CategoricalTruePositives`` counted m times).
    ``full``: the caller knows every row is real; the rows pass as they are, with their
    static shapes, and no ``tf.cond`` checks for padding.
    """
    unweighted, weighted, flatten = _keras.metric_lists(model)
    if not unweighted and not weighted:
        return
    if masks is None:  # Keras masks ride on y_pred's tensors, which the cut replaces
        masks = keras.tree.map_structure(_keras.get_keras_mask, y_pred)
    if not full:
        y, y_pred, masks, sample_weight = real_rows((y, y_pred, masks, sample_weight), valid)
    if masks is not None:
        for tensor, mask in zip(keras.tree.flatten(y_pred), keras.tree.flatten(masks),
                                strict=False):
            if mask is not None:
                _keras.set_keras_mask(tensor, mask)
    y_flat, p_flat = flatten(y), flatten(y_pred)
    for mls, y_t, y_p in zip(unweighted, y_flat, p_flat, strict=False):
        if mls:
            mls.update_state(y_t, y_p)
    if sample_weight is not None:
        sw_flat = flatten(sample_weight)
        if len(sw_flat) < len(y_flat):
            sw_flat = [sw_flat[0]] * len(y_flat)
    else:
        sw_flat = [None] * len(y_flat)
    for mls, y_t, y_p, s_w in zip(weighted, y_flat, p_flat, sw_flat, strict=False):
        if mls:
            mls.update_state(y_t, y_p, sample_weight=s_w)


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


def map_present(fn: Callable[[Any], Any], structure: Any) -> Any:
    """``tf.nest.map_structure`` that leaves ``None`` (no sample weight) alone."""
    return tf.nest.map_structure(lambda t: None if t is None else fn(t), structure)


def none_to_empty(w: Any) -> Any:
    return () if w is None else w


def empty_to_none(w: Any) -> Any:
    return None if isinstance(w, tuple) and not w else w
