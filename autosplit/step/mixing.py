"""Whether a model's loss must be computed over the whole batch (:func:`whole_batch_reason`):
a loss for a row that depends on the batch's other rows, which no sum of micro-batches
gives.

Found before the first update, on evidence, never on a guess:

- a compiled ``keras.losses.Loss`` that computes its value in a ``__call__`` of its own
  (keras-io's ``SupervisedContrastiveLoss``): its value is its own, not one its
  per-example values add up to;
- a compiled loss that returns one value per batch which the trace does not read as a
  plain mean over the rows (``LossPlan.per_batch_ratios``: a chi-square between
  histograms of the batch, a ratio);
- a compiled loss whose per-example values move with the other rows of the batch, on
  the sample's real rows: each half's values computed alone, and the rows' values in
  reverse order, differ from the whole batch's (in-batch negatives: each row's softmax
  over every row of the batch).

Keras's own per-example losses (``"mse"``, ``SparseCategoricalCrossentropy()``, ... on
their last axis: :data:`KERAS_PER_ROW`) read their row alone by definition, so a model
compiled with those alone is told without a sample: a sample is an iterator more over
the input, which moves a seeded ``shuffle`` on (the first epoch would not be
``model.fit``'s), runs a generator once more and reads a worker's files twice.
``tests/step/test_mixing.py`` checks every one of them on real rows.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from autosplit.data.adapter import InputAdapter
from autosplit.data.sequences.length_factor import inputs_of
from autosplit.data.structure import empty_to_none
from autosplit.errors import UnsupportedModelError
from autosplit.keras_hooks import internals as _keras
from autosplit.keras_hooks.custom_step import overridden_steps
from autosplit.step.forward import align_targets
from autosplit.step.loss_plan import LossPlan, step_plan
from autosplit.step.model_state import model_state
from autosplit.step.reduction import own_call

__all__ = [
    "KERAS_PER_ROW", "loss_over_whole_batch", "refuse_what_is_not_exact", "whole_batch_reason",
]

_ROWS = 32  # the sample's rows the per-example values are compared on
_TOLERANCE = 1e-4  # of the largest value: a row's own value moves ~1e-7 with the batch

#: Keras's loss functions whose value for a row is computed from that row alone (on
#: their last axis); not ``dice``/``tversky`` (one value per batch by default) nor
#: ``circle`` (each row against the batch's others).
KERAS_PER_ROW = frozenset(getattr(keras.losses, name) for name in (
    "binary_crossentropy", "binary_focal_crossentropy", "categorical_crossentropy",
    "categorical_focal_crossentropy", "categorical_generalized_cross_entropy",
    "categorical_hinge", "cosine_similarity", "ctc", "hinge", "huber", "kl_divergence",
    "log_cosh", "mean_absolute_error", "mean_absolute_percentage_error",
    "mean_squared_error", "mean_squared_logarithmic_error", "poisson",
    "sparse_categorical_crossentropy", "squared_hinge") if hasattr(keras.losses, name))


def loss_over_whole_batch(model: keras.Model, adapter: InputAdapter, element_spec: Any,
                          sample: Callable[[], tuple] | None = None) -> str | None:
    """:func:`whole_batch_reason` for the micro-batches of ``element_spec`` (a
    pipeline's ``(x, y, w_or_(), valid)``; with several local replicas, a replica's),
    read on a sample of ``adapter``'s rows once per compile state: ``sample``'s, where
    the caller reads one of its own (each read is an iterator more over the input), or
    one of 32 rows read here."""
    steps = overridden_steps(model)
    if "train_step" in steps:  # its own step reads its own loss (keras_hooks.custom_step)
        return None
    x, y, w = (empty_to_none(part) for part in element_spec[:3])
    x = inputs_of(x)  # a micro-batch cut by length: its inputs
    rows = tf.nest.flatten(x)[0].shape[0] or _ROWS  # the plan the step reads, if static
    specs = tuple(None if part is None else tf.nest.map_structure(
        lambda s: tf.TensorSpec([rows, *s.shape[1:]], s.dtype), part) for part in (x, y, w))
    key = ("whole batch", repr(specs))
    cache = model_state(model).plans
    if key not in cache:
        if steps:  # compute_loss: read term by term, or, where that refuses, the batch's
            try:
                step_plan(model, specs)
                cache[key] = None
            except UnsupportedModelError as error:
                cache[key] = f"its compute_loss is not a sum over the rows ({_first(error)})"
        else:
            cache[key] = whole_batch_reason(model, step_plan(model, specs),
                                            sample or (lambda: adapter.sample(_ROWS)))
    return cache[key]


def _first(error: Exception) -> str:
    """The first sentence of what ``error`` received: the op the reading stopped at."""
    text = str(error)
    found = text.split("Received: ", 1)[-1]
    return found.split(". ", 1)[0]


def whole_batch_reason(model: keras.Model, plan: LossPlan, sample: Callable[[], tuple]
                       ) -> str | None:
    """Why ``model``'s loss is computed over the whole batch, or None: a sum over its
    rows, which micro-batches add up exactly (see the module's docstring).

    Args:
        model: a compiled model, built.
        plan: its loss plan (``loss_plan.step_plan``).
        sample: returns ``(x, y, sample_weight)`` of a few real rows
            (``InputAdapter.sample``); called only where a loss is not Keras's own
            per-example one.
    """
    if plan.custom is not None:
        return None
    flat = _keras.flat_losses(model)
    for loss in flat:
        if own_call(loss.loss):
            return (f"its loss {_named(loss)} overrides __call__: its value is its own, "
                    "not a sum over examples")
    if plan.per_batch_ratios:
        return ("a loss of it returns one value per batch that is not a mean over the "
                "batch's rows")
    if not flat or all(_keras_per_row(loss.loss) for loss in flat):
        return None
    x, y, _ = sample()
    if y is None:
        return None
    rows = int(tf.shape(tf.nest.flatten(x)[0])[0])
    if rows < 2:
        return None
    n = min(rows, _ROWS)
    x, y = tf.nest.map_structure(lambda t: t[:n], (x, y))
    y_pred = model(x, training=False) if _keras.call_has_training_arg(model) else model(x)
    y = align_targets(model, y, y_pred)
    for loss in flat:
        moved = _moved(loss.loss, _keras.resolve_path(loss.path, y),
                       _keras.resolve_path(loss.path, y_pred), n)
        if moved is not None:
            by = ("it fails on a part of them" if math.isinf(moved)
                  else f"by {moved:.1e} of the largest")
            return (f"the per-example values of its loss {_named(loss)} move with the "
                    f"batch's other rows ({by}, on {n} rows of the data): each row's loss "
                    "depends on other rows of the batch")
    return None


def _keras_per_row(loss: Any) -> bool:
    """Whether ``loss`` is Keras's own wrapper of a :data:`KERAS_PER_ROW` function on
    its last axis (a subclass of the user's may compute anything)."""
    found = _keras.keras_loss_function(loss)
    return found is not None and found[0] in KERAS_PER_ROW and found[1].get("axis", -1) == -1


def _named(flat: Any) -> str:
    name = getattr(flat.loss, "name", None) or type(flat.loss).__name__
    return f"`{name}`"


def _values(loss: keras.losses.Loss, y_true: Any, y_pred: Any) -> np.ndarray | None:
    """Per row, the loss's per-example values (summed over any axes after the rows), or
    None for a value per batch (the plan reads those)."""
    dtype = loss.dtype
    y_true, y_pred = (keras.tree.map_structure(
        lambda t: keras.ops.convert_to_tensor(t, dtype=dtype), part) for part in (y_true, y_pred))
    values = keras.ops.convert_to_tensor(loss.call(y_true, y_pred), dtype=dtype)
    if values.shape.rank == 0:
        return None
    per_row = tf.reduce_sum(tf.reshape(values, [tf.shape(values)[0], -1]), axis=1)
    return np.asarray(per_row, np.float64)


def _moved(loss: keras.losses.Loss, y_true: Any, y_pred: Any, n: int) -> float | None:
    """How far the per-example values of ``loss`` move when the rows come in two parts
    (cut at an odd row: pairs of rows part), in reverse order or rolled by a row, over
    the largest value; None where they do not."""
    def rows(index):
        return tuple(tf.nest.map_structure(lambda t: tf.gather(t, index), part)
                     for part in (y_true, y_pred))

    whole = _values(loss, y_true, y_pred)
    if whole is None:
        return None
    cut = n // 2 if (n // 2) % 2 else max(n // 2 - 1, 1)
    orders = [np.arange(cut), np.arange(cut, n), np.arange(n)[::-1], np.roll(np.arange(n), 1)]
    found = []
    for index in orders:
        try:
            values = _values(loss, *rows(tf.constant(index)))
        except (ValueError, TypeError, tf.errors.OpError):
            return math.inf  # it cannot be computed on a part of the batch at all
        found.append(np.zeros(len(index)) if values is None else values)
    seen = [np.concatenate([found[0], found[1]]), found[2][::-1], np.roll(found[3], -1)]
    scale = max(float(np.max(np.abs(whole))), 1e-12)
    moved = max(float(np.max(np.abs(values - whole))) for values in seen)
    return moved / scale if moved > _TOLERANCE * scale + 1e-7 else None


def refuse_what_is_not_exact(plan: Any, why: str, own_loss: bool, replicas: int) -> None:
    """Refuse what the whole-batch step cannot make exact: BatchNormalization in training
    mode (each micro-batch would normalise with its own statistics, not the batch's, and
    a loss that compares rows learns from that leak: SimCLR's global BatchNormalization
    is there for it); a ``compute_loss`` of the model's own that would read the losses
    a micro-batch added in call(), or that runs on several replicas."""
    if own_loss and (plan.forward_losses or replicas > 1):
        what = ("adds losses in call(), which its compute_loss would read of one "
                "micro-batch" if plan.forward_losses else f"runs on {replicas} replicas")
        raise UnsupportedModelError(
            f"Expected a model whose compute_loss computes its loss over the whole batch "
            f"({why}) on one replica, from the batch alone. Received: a model that {what}. "
            "Compile the loss (model.compile(loss=...)), which the whole-batch step "
            "computes on every replica's rows, or train with model.fit.")
    layers = [layer.name for layer, calls in plan.batch_norm_calls if calls]
    if layers:
        raise UnsupportedModelError(
            "Expected a model whose forward pass treats each row on its own, for a loss "
            f"computed over the whole batch ({why}). Received: BatchNormalization in "
            f"training mode ({', '.join(layers)}), which normalises each micro-batch with "
            "its own statistics where model.fit uses the batch's, and a loss that "
            "compares the rows learns from that difference. Freeze those layers "
            "(layer.trainable = False), use LayerNormalization, or train with model.fit.")
