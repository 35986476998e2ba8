"""Exact gradients of a large batch from its micro-batches, for custom training loops.

:func:`accumulate_gradients` (a batch in hand) and :func:`accumulate_iterator` (an
iterator of micro-batches) check their arguments and sum the micro-batches in a
``tf.while_loop`` (``autosplit.step.accumulation``: one micro-batch's activations at a
time), returning ``Accumulated(loss, gradients)`` to apply once.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import keras
import tensorflow as tf

from autosplit.data.split import split_batch
from autosplit.data.structure import map_present, none_to_empty
from autosplit.errors import BatchSizeError, DatasetError
from autosplit.keras_hooks import internals as _keras
from autosplit.step.accumulation import (
    as_scale,
    finish,
    piece_rows,
    prepare,
    replicas_here,
    sum_pieces,
)

__all__ = ["Accumulated", "accumulate_gradients", "accumulate_iterator", "own_steps_accumulated"]


class _Fields(NamedTuple):
    loss: tf.Tensor  # shape=(), float32: the full-batch loss Keras would report
    gradients: list[tf.Tensor | None]  # per model.trainable_variables entry; None: unconnected


class Accumulated(_Fields):
    """What ``accumulate_gradients`` returns: ``(loss, gradients)``, and the large batch's
    gradient noise estimate as the attribute ``noise``.

    ``noise`` is an ``autosplit.step.noise_scale.GradientNoise`` of tensors (this
    replica's, under a strategy): ``noise`` (``tr(Sigma)``), ``signal`` (``|G|^2``),
    ``batch`` (the large batch's examples) and ``counted`` (1.0 where the estimate
    exists; 0.0 and zeros with one micro-batch, or where the gradients overflow). Sum
    ``noise`` and ``signal`` over many large batches and divide, for McCandlish et al.'s
    ``B_simple`` (a ratio of means: one large batch's ratio is mostly noise). None
    unless asked for (``noise_scale=True``), and for a model whose own ``train_step``
    runs. An attribute, not a field: ``loss, gradients =
    ...`` unpacks as ever, and a ``tf.function`` that returns the whole result returns
    the two fields alone.
    """

    noise: Any = None


@_keras.outside_strategy_scope()
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
    noise_scale: bool = False,
) -> Accumulated:
    """Exact gradients and loss of one large batch you hold, computed in micro-batches.

    Equivalent to ``tape.gradient(model.compute_loss(...), model.trainable_variables)``
    on the whole batch; the peak holds one micro-batch's activations (the batch itself
    is yours). Use it inside your own ``tf.function`` and apply the result once. When
    the batch should never sit whole on the device, use :func:`accumulate_iterator`.

    Args:
        model: a Keras model compiled with a loss (the optimizer is not used here).
        x: the large batch's inputs; leading dimension B static.
        y: its targets.
        sample_weight: its per-example weights, or None.
        micro_batch_size: upper bound on rows per micro-batch; ``>= B`` means no split.
        n_valid: how many leading rows are real (the rest weigh 0); default B.
        update_metrics: also update the compiled metrics from every micro-batch.
        loss_scale: multiply every micro-batch's loss by this before differentiating
            (mixed precision); the gradients come back scaled, the loss does not.
        noise_scale: also estimate the gradient noise scale (``Accumulated.noise``:
            k squared norms more per large batch).

    Returns:
        ``Accumulated(loss, gradients)`` aligned with ``model.trainable_variables``;
        under ``mixed_float16`` the gradients are ``inf`` where the whole batch's
        float16 ones would overflow (``autosplit.step.overflow``), so that a
        ``LossScaleOptimizer`` skips the step as it would the whole batch's.

    Example:
        >>> @tf.function
        ... def train_step(x, y):
        ...     loss, grads = autosplit.accumulate_gradients(model, x, y, micro_batch_size=64)
        ...     optimizer.apply_gradients(zip(grads, model.trainable_variables))
        ...     return loss
    """
    return _accumulate(model, x, y, sample_weight, micro_batch_size=micro_batch_size,
                       n_valid=n_valid, update_metrics=update_metrics, loss_scale=loss_scale,
                       noise_scale=noise_scale)


@_keras.outside_strategy_scope()
def own_steps_accumulated(model: keras.Model, x: Any, y: Any, sample_weight: Any, *,
                          micro_batch_size: int) -> Accumulated:
    """:func:`accumulate_gradients` of the model's own ``train_step`` (or
    ``compute_loss``) where it has one, run once per micro-batch as ``fit_large_batch``
    runs it (its ``apply_gradients`` caught); the loss is not combined (0). For
    ``check``."""
    return _accumulate(model, x, y, sample_weight, micro_batch_size=micro_batch_size,
                       own_step=True)


def _accumulate(model: keras.Model, x: Any, y: Any, sample_weight: Any, *,
                micro_batch_size: int, n_valid: tf.Tensor | int | None = None,
                update_metrics: bool = False, loss_scale: tf.Tensor | float | None = None,
                own_step: bool = False, noise_scale: bool = False) -> Accumulated:
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
    x, y, sample_weight = map_present(tf.convert_to_tensor, (x, y, sample_weight))

    def take(i: tf.Tensor) -> tuple[Any, ...]:
        rows = tf.gather(index, i)
        part = map_present(lambda t: tf.gather(t, rows), (x, y, sample_weight))
        return (*part[:2], none_to_empty(part[2]), tf.gather(valid, i))

    specs = map_present(lambda t: tf.TensorSpec([split.micro_batch_size, *t.shape[1:]], t.dtype),
                 (x, y, sample_weight))
    plan = prepare(model, specs, own_step=own_step)
    scale = as_scale(loss_scale)
    # Under a strategy B is this replica's batch; the loss divides by the global one.
    global_batch = batch * replicas_here()[1]
    totals = sum_pieces(model, plan, take, split.accumulation_steps, batch_size=global_batch,
                        scale=scale, update_metrics_too=update_metrics, noise=noise_scale)
    return _result(*finish(model, plan, totals, global_batch, scale))


def _result(loss: tf.Tensor, gradients: list[tf.Tensor | None], noise: Any) -> Accumulated:
    result = Accumulated(loss, gradients)
    result.noise = noise
    return result


@_keras.outside_strategy_scope()
def accumulate_iterator(
    model: keras.Model,
    iterator: Any,
    steps: int | tf.Tensor,
    *,
    batch_size: int,
    update_metrics: bool = False,
    loss_scale: tf.Tensor | float | None = None,
    noise_scale: bool = False,
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
        update_metrics: as for ``accumulate_gradients``.
        loss_scale: as for ``accumulate_gradients``.
        noise_scale: as for ``accumulate_gradients``.

    Example:
        >>> iterator = iter(dataset.batch(64, drop_remainder=True))  # doctest: +SKIP
        >>> @tf.function  # doctest: +SKIP
        ... def train_step(iterator):
        ...     loss, grads = autosplit.accumulate_iterator(model, iterator, 16, batch_size=1024)
        ...     optimizer.apply_gradients(zip(grads, model.trainable_variables))
        ...     return loss
    """
    spec = iterator.element_spec
    if not isinstance(spec, tuple) or len(spec) not in (2, 3, 4):
        raise DatasetError(
            "Expected iterator elements (x, y[, sample_weight[, valid]]). Received: "
            f"element_spec={spec}. Map the dataset to such tuples before iter().")
    rows = tf.nest.flatten(spec[0])[0].shape[0]
    if rows is None:
        raise DatasetError(
            "Expected micro-batches with a static number of rows. Received: "
            f"element_spec={spec}. Batch with `drop_remainder=True`, or pad and pass `valid`.")

    def take(_: tf.Tensor) -> tuple[Any, ...]:
        element = iterator.get_next()
        x, y, *rest = element
        w = rest[0] if rest else ()
        valid = rest[1] if len(rest) > 1 else tf.ones([rows], tf.float32)
        return x, y, w, tf.cast(valid, tf.float32)

    w_spec = spec[2] if len(spec) > 2 else None
    plan = prepare(model, (spec[0], spec[1], w_spec))
    scale = as_scale(loss_scale)
    totals = sum_pieces(model, plan, take, steps, batch_size=batch_size, scale=scale,
                        update_metrics_too=update_metrics, noise=noise_scale)
    return _result(*finish(model, plan, totals, batch_size, scale))
