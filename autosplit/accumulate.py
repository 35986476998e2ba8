"""Exact gradients of a large batch from its micro-batches: the graph code, no state.

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

:func:`combine` turns the sums into the full-batch loss and gradients. The public
:func:`accumulate_gradients` (a batch in hand) and :func:`accumulate_iterator` (an
iterator of micro-batches) run the micro-batches in a ``tf.while_loop``
(``parallel_iterations=1``: one micro-batch's activations at a time) and return
``Accumulated(loss, gradients)`` for a custom training step. ``autosplit.step`` runs
the same two functions with its sums kept in variables, so that a failed micro-batch
loses nothing that came before it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import keras
import numpy as np
import tensorflow as tf

from autosplit import _keras
from autosplit.errors import BatchSizeError
from autosplit.reduction import COUNT, SUM, output_terms, row_weight
from autosplit.split import Split, balanced_sizes, split_batch

__all__ = [
    "Accumulated",
    "LossPlan",
    "Piece",
    "Totals",
    "accumulate_gradients",
    "accumulate_iterator",
    "align_targets",
    "combine",
    "compute_piece",
    "loss_plan",
    "piece_rows",
    "update_metrics",
]

COUNT_GROUP, SUM_GROUP = "count", "sum"


class Accumulated(NamedTuple):
    """What ``accumulate_gradients`` returns."""

    loss: tf.Tensor  # shape=(), float32: the full-batch loss Keras would report
    gradients: list  # one per model.trainable_variables entry (None where unconnected)


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
        return type(y_pred)([y])
    return keras.tree.pack_sequence_as(y_pred, keras.tree.flatten(y))


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


_PLAN_CACHE_ATTR = "_autosplit_loss_plans"


@tf.autograph.experimental.do_not_convert
def loss_plan(model: keras.Model, specs: tuple) -> LossPlan:
    """Trace one micro-batch of ``specs`` = (x, y, sample_weight) specs; nothing runs."""
    key = repr(specs)
    cache = model.__dict__.setdefault(_PLAN_CACHE_ATTR, {})
    if key in cache:
        return cache[key]
    facts: dict[str, Any] = {}

    def trace(x, y, sample_weight):
        valid = tf.ones([tf.shape(tf.nest.flatten(x)[0])[0]], tf.float32)
        with tf.GradientTape() as tape:
            _, _, terms, in_call = forward(model, x, y, sample_weight, valid)
            total = tf.add_n([t.numerator for t in terms] + in_call)
        grads = tape.gradient(total, model.trainable_variables)
        facts.update(terms=terms, forward=bool(in_call),
                     has_grad=tuple(g is not None for g in grads))
        return total

    tf.function(trace, autograph=False).get_concrete_function(*specs)
    terms = facts["terms"]
    folded = tuple(t.kind == SUM or (t.kind == COUNT and not t.masked and t.per_row is not None)
                   for t in terms)
    kinds = tuple(t.kind for t in terms)
    groups: list = []
    if facts["forward"] or any(f and k == COUNT for f, k in zip(folded, kinds, strict=True)):
        groups.append(COUNT_GROUP)
    if any(k == SUM for k in kinds):
        groups.append(SUM_GROUP)
    groups += [("deferred", j) for j, f in enumerate(folded) if not f]
    plan = LossPlan(
        kinds=kinds, per_row=tuple(t.per_row for t in terms), folded=folded,
        forward_losses=facts["forward"], has_grad=facts["has_grad"], groups=tuple(groups),
        weights=tuple(1.0 if f.weight is None else float(f.weight)
                      for f in _keras.flat_losses(model)),
    )
    cache[key] = plan
    return plan


class Piece(NamedTuple):
    """One micro-batch's contribution (per replica)."""

    gradients: list  # per group: one float32 tensor per trainable variable (None: no grad)
    numerators: list  # per compiled loss, float32 scalars
    denominators: list
    forward: tf.Tensor  # sum of the call() losses times the piece's real rows
    rows: tf.Tensor  # real rows in the piece
    y: Any  # targets aligned to y_pred, for the metrics
    y_pred: Any
    masks: Any  # Keras masks of y_pred (lost when y_pred leaves an XLA function)


def _dense_f32(g) -> tf.Tensor | None:
    # An Embedding yields IndexedSlices with repeated indices; densifying sums the
    # duplicates, which is the true gradient of the summed loss.
    return None if g is None else tf.cast(tf.convert_to_tensor(g), tf.float32)


def compute_piece(model, plan: LossPlan, x, y, sample_weight, valid, *, batch_size: int,
                  scale) -> Piece:
    """Forward and backward of one micro-batch; changes no variable but the model's own
    (BatchNormalization statistics, seed generators)."""
    variables = model.trainable_variables
    with tf.GradientTape(persistent=len(plan.groups) > 1) as tape:
        y, y_pred, terms, in_call = forward(model, x, y, sample_weight, valid)
        rows = tf.reduce_sum(valid)
        in_call_sum = tf.add_n(in_call) if in_call else tf.constant(0.0)
        objectives = []
        for group in plan.groups:
            if group == COUNT_GROUP:
                parts = [terms[j].numerator * (plan.weights[j] / (batch_size * plan.per_row[j]))
                         for j in range(len(terms)) if plan.folded[j] and plan.kinds[j] == COUNT]
                if in_call:
                    parts.append(in_call_sum * rows / batch_size)
            elif group == SUM_GROUP:
                parts = [terms[j].numerator * plan.weights[j]
                         for j in range(len(terms)) if plan.kinds[j] == SUM]
            else:
                j = group[1]
                parts = [terms[j].numerator * plan.weights[j]]
            objectives.append(tf.add_n(parts) * scale)
    gradients = [[_dense_f32(g) for g in tape.gradient(objective, variables)]
                 for objective in objectives]
    del tape
    masks = keras.tree.map_structure(_keras.get_keras_mask, y_pred)
    return Piece(gradients, [t.numerator for t in terms], [t.denominator for t in terms],
                 in_call_sum * rows, rows, y, y_pred, masks)


class Totals(NamedTuple):
    """Sums over the micro-batches of one large batch (per replica, or all-reduced)."""

    gradients: list  # per group, per variable (None: no gradient)
    numerators: list
    denominators: list
    forward: tf.Tensor
    rows: tf.Tensor


def combine(model, plan: LossPlan, totals: Totals, *, batch_size: int, scale,
            replicas: int = 1) -> tuple[tf.Tensor, list, list]:
    """(loss, gradients, per-output losses) of the large batch from its sums.

    ``totals`` numerators, denominators, forward and rows must already be summed over
    replicas; the gradients are this replica's (the optimizer all-reduces them).
    ``batch_size`` is the global B the loop scaled by; ``scale`` the loss scale the
    gradients carry (the weight regularizer's gradient gets it too).
    """
    variables = model.trainable_variables
    n = totals.rows
    with tf.GradientTape() as tape:
        # Counted once per large batch: each replica adds its 1/replicas share.
        regularization = weight_regularization(model) / replicas
    reg_grads = tape.gradient(regularization, variables) if variables else []
    per_output = [num if kind == SUM else tf.math.divide_no_nan(num, den)
                  for num, den, kind in zip(totals.numerators, totals.denominators, plan.kinds,
                                            strict=True)]
    loss = regularization * replicas + tf.math.divide_no_nan(totals.forward, n)
    for weight, value in zip(plan.weights, per_output, strict=True):
        loss += weight * value
    correction = tf.math.divide_no_nan(tf.constant(float(batch_size)), n)
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


def update_metrics(model, y, y_pred, sample_weight, valid, masks=None) -> None:
    """Update the compiled metrics from one micro-batch, padding rows weighted 0."""
    if masks is not None:
        for tensor, mask in zip(keras.tree.flatten(y_pred), keras.tree.flatten(masks),
                                strict=False):
            if mask is not None:
                _keras.set_keras_mask(tensor, mask)
    unweighted, weighted, flatten = _keras.metric_lists(model)
    if not unweighted and not weighted:
        return
    y_flat, p_flat = flatten(y), flatten(y_pred)
    for mls, y_t, y_p in zip(unweighted, y_flat, p_flat, strict=False):
        if mls:
            # Rank of a per-sample value (y_pred less its last axis), so that Keras
            # broadcasts it against a (m, T) mask instead of refusing (m,) * (m, T).
            rank = max(1, y_p.shape.rank - 1)
            mls.update_state(y_t, y_p, sample_weight=tf.reshape(valid, [-1] + [1] * (rank - 1)))
    if sample_weight is not None:
        sw_flat = flatten(sample_weight)
        if len(sw_flat) < len(y_flat):
            sw_flat = [sw_flat[0]] * len(y_flat)
    else:
        sw_flat = [None] * len(y_flat)
    for mls, y_t, y_p, s_w in zip(weighted, y_flat, p_flat, sw_flat, strict=False):
        if mls:
            if s_w is None:
                rank = max(1, y_p.shape.rank - 1)
                s_w = tf.reshape(valid, [-1] + [1] * (rank - 1))
            else:
                s_w = tf.cast(s_w, tf.float32) * row_weight(valid, tf.cast(s_w, tf.float32))
            mls.update_state(y_t, y_p, sample_weight=s_w)


def piece_rows(split: Split) -> tuple[np.ndarray, np.ndarray]:
    """Row numbers (k, r) of each balanced micro-batch of a B-row batch, and validity.

    Padding rows repeat the micro-batch's last real row and weigh 0.

    >>> index, valid = piece_rows(split_batch(5, 2))
    >>> index.tolist(), valid.tolist()
    ([[0, 1], [2, 3], [4, 4]], [[1.0, 1.0], [1.0, 1.0], [1.0, 0.0]])
    """
    k, r = split.accumulation_steps, split.micro_batch_size
    sizes = balanced_sizes(split.batch_size, k)
    starts = np.cumsum([0, *sizes[:-1]])
    offsets = np.arange(r)
    index = starts[:, None] + np.minimum(offsets[None, :], np.array(sizes)[:, None] - 1)
    valid = (offsets[None, :] < np.array(sizes)[:, None]).astype(np.float32)
    return index.astype(np.int32), valid


def _map(fn, structure):
    """``tf.nest.map_structure`` that leaves ``None`` (no sample weight) alone."""
    return tf.nest.map_structure(lambda t: None if t is None else fn(t), structure)


def _none_to_empty(w):
    return () if w is None else w


def _empty_to_none(w):
    return None if isinstance(w, tuple) and not w else w


def _sum_pieces(model, plan: LossPlan, take, count, *, batch_size: int, scale,
                update_metrics_too: bool) -> Totals:
    """Sum ``count`` micro-batches in a while loop; ``take(i) -> (x, y, w, valid)``."""
    variables = model.trainable_variables

    def zeros():
        return [tf.zeros(v.shape, tf.float32) if has else tf.zeros([], tf.float32)
                for v, has in zip(variables, plan.has_grad, strict=True)]

    def body(i, grads, numerators, denominators, in_call, rows):
        x, y, w, valid = take(i)
        w = _empty_to_none(w)
        piece = compute_piece(model, plan, x, y, w, valid, batch_size=batch_size, scale=scale)
        grads = [[acc + g if g is not None else acc for acc, g in zip(sums, new, strict=True)]
                 for sums, new in zip(grads, piece.gradients, strict=True)]
        if update_metrics_too:
            with tf.control_dependencies([g for g in tf.nest.flatten(grads)]):
                update_metrics(model, piece.y, piece.y_pred, w, valid)
        return (i + 1, grads,
                [a + b for a, b in zip(numerators, piece.numerators, strict=True)],
                [a + b for a, b in zip(denominators, piece.denominators, strict=True)],
                in_call + piece.forward, rows + piece.rows)

    n_terms = len(plan.kinds)
    init = (tf.constant(0), [zeros() for _ in plan.groups], [tf.constant(0.0)] * n_terms,
            [tf.constant(0.0)] * n_terms, tf.constant(0.0), tf.constant(0.0))
    # parallel_iterations=1: micro-batches run one after another, so the peak memory
    # is one micro-batch's, not several in flight.
    _, grads, numerators, denominators, in_call, rows = tf.while_loop(
        lambda i, *_: i < count, body, init, parallel_iterations=1)
    grads = [[g if has else None for g, has in zip(sums, plan.has_grad, strict=True)]
             for sums in grads]
    return Totals(grads, numerators, denominators, in_call, rows)


def _replicas() -> tuple[Any, int]:
    context = tf.distribute.get_replica_context()
    return context, (context.num_replicas_in_sync if context is not None else 1)


def _finish(model, plan, totals: Totals, batch_size: int, scale) -> Accumulated:
    """All-reduce the scalar sums across replicas (one call), then combine."""
    context, replicas = _replicas()
    if replicas > 1:
        numerators, denominators, in_call, rows = context.all_reduce(
            tf.distribute.ReduceOp.SUM,
            (totals.numerators, totals.denominators, totals.forward, totals.rows))
        totals = Totals(totals.gradients, numerators, denominators, in_call, rows)
    loss, gradients, _ = combine(model, plan, totals, batch_size=batch_size, scale=scale,
                                 replicas=replicas)
    return Accumulated(loss, gradients)


def _prepare(model, specs) -> LossPlan:
    if not _keras.compile_loss_built(model):
        _keras.symbolic_build(model, specs)
    return loss_plan(model, specs)


def accumulate_gradients(
    model: keras.Model,
    x: Any,
    y: Any,
    sample_weight: Any = None,
    *,
    micro_batch_size: int,
    n_valid: tf.Tensor | int | None = None,
    update_metrics: bool = False,
    loss_scale: tf.Tensor | float | None = None,
) -> Accumulated:
    """Exact gradients and loss of one large batch you hold, computed in micro-batches.

    Equivalent to ``tape.gradient(model.compute_loss(...), model.trainable_variables)``
    on the whole batch; the peak holds one micro-batch's activations (the batch itself
    is yours). Use it inside your own ``tf.function`` and apply the result once. When
    the batch should never sit whole on the device, use :func:`accumulate_iterator`.

    Args:
        model: a Keras model compiled with a loss (the optimizer is not used here).
        x, y, sample_weight: the large batch; leading dimension B static.
        micro_batch_size: upper bound on rows per micro-batch; ``>= B`` means no split.
        n_valid: how many leading rows are real (the rest weigh 0); default B.
        update_metrics: also update the compiled metrics from every micro-batch.
        loss_scale: multiply every micro-batch's loss by this before differentiating
            (mixed precision); the gradients come back scaled, the loss does not.

    Returns:
        ``Accumulated(loss, gradients)`` aligned with ``model.trainable_variables``.

    Example:
        >>> @tf.function
        ... def train_step(x, y):
        ...     loss, grads = autosplit.accumulate_gradients(model, x, y, micro_batch_size=64)
        ...     optimizer.apply_gradients(zip(grads, model.trainable_variables))
        ...     return loss
    """
    first = tf.nest.flatten(x)[0]
    batch = first.shape[0]
    if batch is None:
        raise BatchSizeError(
            "Expected the large batch to have a static leading dimension. Received: x with "
            f"shape {first.shape}. Batch with `drop_remainder=True`, or pass micro-batches "
            "to `autosplit.accumulate_iterator`.")
    split = split_batch(batch, micro_batch_size)
    index, valid = piece_rows(split)
    index, valid = tf.constant(index), tf.constant(valid)
    if n_valid is not None:
        valid = valid * tf.cast(index < tf.cast(n_valid, tf.int32), tf.float32)
    x, y, sample_weight = _map(tf.convert_to_tensor, (x, y, sample_weight))

    def take(i):
        rows = tf.gather(index, i)
        part = _map(lambda t: tf.gather(t, rows), (x, y, sample_weight))
        return (*part[:2], _none_to_empty(part[2]), tf.gather(valid, i))

    specs = _map(lambda t: tf.TensorSpec([split.micro_batch_size, *t.shape[1:]], t.dtype),
                 (x, y, sample_weight))
    plan = _prepare(model, specs)
    scale = tf.constant(1.0) if loss_scale is None else tf.cast(loss_scale, tf.float32)
    # Under a strategy B is this replica's batch; the loss divides by the global one.
    global_batch = batch * _replicas()[1]
    totals = _sum_pieces(model, plan, take, split.accumulation_steps, batch_size=global_batch,
                         scale=scale, update_metrics_too=update_metrics)
    return _finish(model, plan, totals, global_batch, scale)


def accumulate_iterator(
    model: keras.Model,
    iterator: Any,
    steps: int | tf.Tensor,
    *,
    batch_size: int,
    update_metrics: bool = False,
    loss_scale: tf.Tensor | float | None = None,
) -> Accumulated:
    """Exact gradients and loss of one large batch pulled as ``steps`` micro-batches.

    The large batch never exists: each micro-batch is pulled from ``iterator`` inside
    the loop, so the device holds one at a time. Elements are ``(x, y)``,
    ``(x, y, sample_weight)`` or ``(x, y, sample_weight, valid)`` with a static number
    of rows; ``valid`` (float, 1 for real rows, 0 for padding) defaults to all ones.

    Args:
        model: a Keras model compiled with a loss.
        iterator: e.g. ``iter(dataset.batch(64))``, created outside your ``tf.function``.
        steps: micro-batches in this large batch.
        batch_size: B, the rows of the large batch (the loss divides by the real rows
            counted from ``valid``; B only sets the scale inside the loop).
        update_metrics, loss_scale: as for :func:`accumulate_gradients`.

    Example:
        >>> iterator = iter(dataset.batch(64, drop_remainder=True))
        >>> @tf.function
        ... def train_step(iterator):
        ...     loss, grads = autosplit.accumulate_iterator(model, iterator, 16, batch_size=1024)
        ...     optimizer.apply_gradients(zip(grads, model.trainable_variables))
        ...     return loss
    """
    spec = iterator.element_spec
    if not isinstance(spec, tuple) or len(spec) not in (2, 3, 4):
        raise BatchSizeError(
            "Expected iterator elements (x, y[, sample_weight[, valid]]). Received: "
            f"element_spec={spec}.")
    rows = tf.nest.flatten(spec[0])[0].shape[0]
    if rows is None:
        raise BatchSizeError(
            "Expected micro-batches with a static number of rows. Received: "
            f"element_spec={spec}. Batch with `drop_remainder=True`, or pad and pass `valid`.")

    def take(_):
        element = iterator.get_next()
        x, y, *rest = element
        w = rest[0] if rest else ()
        valid = rest[1] if len(rest) > 1 else tf.ones([rows], tf.float32)
        return x, y, w, tf.cast(valid, tf.float32)

    w_spec = spec[2] if len(spec) > 2 else None
    plan = _prepare(model, (spec[0], spec[1], w_spec))
    scale = tf.constant(1.0) if loss_scale is None else tf.cast(loss_scale, tf.float32)
    totals = _sum_pieces(model, plan, take, steps, batch_size=batch_size, scale=scale,
                         update_metrics_too=update_metrics)
    return _finish(model, plan, totals, batch_size, scale)
