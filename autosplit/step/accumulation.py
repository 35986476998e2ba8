"""A large batch summed from its micro-batches in one ``tf.while_loop``, outside the
train step: for ``accumulate_gradients``, ``accumulate_iterator`` and ``check``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from keras import tree

from autosplit.data.split import Split, balanced_sizes
from autosplit.data.structure import empty_to_none
from autosplit.graph import after
from autosplit.keras_hooks import internals as _keras
from autosplit.step.contribution import combine, compute_contribution
from autosplit.step.forward import forward_totals
from autosplit.step.loss_plan import LossPlan, loss_plan, step_plan
from autosplit.step.metrics import update_metrics, without_padding
from autosplit.step.noise_scale import GradientNoise, estimate, noise_slots
from autosplit.step.reduction import combined_loss, output_terms
from autosplit.step.totals import Totals, added, sum_loop, zero_totals

__all__ = ["as_scale", "finish", "piece_rows", "prepare", "replicas_here", "split_loss",
           "sum_pieces"]


def piece_rows(split: Split) -> tuple[np.ndarray, np.ndarray]:
    """Row numbers (k, r) of each balanced micro-batch of a B-row batch, and validity.

    Padding rows repeat the micro-batch's last real row and weigh 0.

    >>> from autosplit.data.split import split_batch
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


def sum_pieces(model: keras.Model, plan: LossPlan, take: Callable[[tf.Tensor], tuple[Any, ...]],
                count: int | tf.Tensor, *, batch_size: int, scale: tf.Tensor,
                update_metrics_too: bool, noise: bool = False) -> Totals:
    """Sum ``count`` micro-batches in a while loop; ``take(i) -> (x, y, w, valid)``; with
    ``noise``, the gradient noise scale's numbers too where the plan sums a compiled
    loss's gradients (:func:`finish` reads them)."""
    variables = model.trainable_variables
    noise = noise and plan.custom is None and bool(plan.groups)

    def step(i: tf.Tensor, totals: Totals) -> tuple[Totals, tf.Tensor]:
        x, y, w, valid = take(i)
        x, y, w, valid = without_padding(plan.real_rows_only, x, y, empty_to_none(w), valid)
        contribution = compute_contribution(model, plan, x, y, w, valid, batch_size=batch_size,
                                            scale=scale, noise=noise)
        totals = added(totals, contribution)
        if update_metrics_too:
            with tf.control_dependencies([after(tf.nest.flatten(totals.gradients))]):
                update_metrics(model, contribution.y, contribution.y_pred, w, valid)
        return totals, tf.constant(False)

    # A while loop carries no None: a variable without a gradient sums a scalar zero.
    zeros = [[tf.zeros(v.shape if has else [], tf.float32)
              for v, has in zip(variables, plan.has_grad, strict=True)] for _ in plan.groups]
    totals, _ = sum_loop(step, count, zero_totals(len(plan.kinds), zeros,
                                                  noise_slots(plan) if noise else 0))
    return totals._replace(gradients=[
        [g if has else None for g, has in zip(sums, plan.has_grad, strict=True)]
        for sums in totals.gradients])


def replicas_here() -> tuple[Any, int]:
    context = tf.distribute.get_replica_context()
    return context, (context.num_replicas_in_sync if context is not None else 1)


def finish(model: keras.Model, plan: LossPlan, totals: Totals, batch_size: int,
           scale: tf.Tensor) -> tuple[tf.Tensor, list[tf.Tensor | None], GradientNoise | None]:
    """The large batch's (loss, gradients, gradient noise estimate or None): the scalar
    sums all-reduced across replicas (one call), then combined."""
    context, replicas = replicas_here()
    local = totals
    if replicas > 1:
        totals = totals.summed_over_replicas(context)
    combined = combine(model, plan, totals, batch_size=batch_size, scale=scale,
                       replicas=replicas)
    noise = None if not local.noise.shape[0] else estimate(
        plan, local, totals, combined.gradients, combined.regularization,
        combined.correction, scale=scale, replicas=replicas)
    return combined.loss, combined.gradients, noise


def as_scale(loss_scale: tf.Tensor | float | None) -> tf.Tensor:
    return tf.constant(1.0) if loss_scale is None else tf.cast(loss_scale, tf.float32)


def prepare(model: keras.Model, specs: tuple[Any, ...], *, own_step: bool = False
             ) -> LossPlan:
    """The plan of the compiled loss; with ``own_step``, of the model's own
    ``train_step`` where it has one, as ``fit_large_batch`` runs it (``check``), which
    builds the model by tracing the step (a Keras VAE has no call() to build it by)."""
    if not own_step and not _keras.compile_loss_built(model):
        _keras.symbolic_build(model, specs)
    return step_plan(model, specs) if own_step else loss_plan(model, specs)


def split_loss(loss: keras.losses.Loss, y_true: Any, y_pred: Any, sample_weight: Any,
                split: Split) -> tf.Tensor:
    """``loss`` recombined from micro-batches of the given predictions, as autosplit does."""
    mask = _keras.get_keras_mask(y_pred) if not tree.is_nested(y_pred) else None
    index, valid = piece_rows(split)
    ys, ps, ws, ms = tree.map_structure(
        lambda t: None if t is None else tf.gather(tf.convert_to_tensor(t), index),
        (y_true, y_pred, sample_weight, mask))
    row_valid = tf.constant(valid)
    kind: dict[str, str] = {}

    def step(i: tf.Tensor, totals: Totals) -> tuple[Totals, tf.Tensor]:
        y_i, p_i, w_i = tree.map_structure(
            lambda t: None if t is None else tf.gather(t, i), (ys, ps, ws))
        if ms is not None:
            _keras.set_keras_mask(p_i, tf.gather(ms, i))
        terms = output_terms(loss, y_i, p_i, w_i, tf.gather(row_valid, i))
        kind["kind"] = terms.kind
        part = Totals([], [terms.numerator], [terms.denominator], forward_totals(), 0.0)
        return added(totals, part), tf.constant(False)

    totals, _ = sum_loop(step, split.accumulation_steps, zero_totals(1))
    _, (value,) = combined_loss(totals.numerators, totals.denominators, totals.forward,
                                totals.rows, kinds=(kind["kind"],), weights=(1.0,))
    return value
