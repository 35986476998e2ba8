"""The split step: the one place where autosplit's compiled function is built.

Separation of concerns:
- ``split_batch`` is arithmetic: how B examples become k micro-batches of m.
- ``accumulate_gradients`` is graph code with no side effects on weights or optimizer:
  it runs the micro-batches in a ``tf.while_loop`` (the graph does not grow with k),
  sums float32 gradients of the per-output *numerators* and divides once by the
  whole large batch's denominators (``autosplit.reduction``). Custom training loops
  call it inside their own ``tf.function``.
- ``TrainStep`` owns the state changes of one large-batch update: it snapshots what a
  failed attempt could touch, runs the loop, then applies the optimizer exactly once,
  and caches the compiled ``tf.function`` (XLA when asked).

The large batch arrives with a static leading dimension B (the last, short batch of an
epoch is padded to B by the data pipeline, with ``n_valid`` saying how many rows are
real), so one trace serves a whole epoch. Rows past ``n_valid`` and the rows that pad
B up to k*m are copies of real rows with weight 0: finite, and invisible to the loss,
the gradients and the metrics. Micro-batches made only of padding are skipped.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import keras
import numpy as np
import tensorflow as tf
from keras.src import tree

from autosplit import _keras
from autosplit.errors import BatchSizeError, ModelNotReadyError, UnsupportedModelError, describe
from autosplit.reduction import COUNT, SUM, check_reduction, output_terms, row_weight

__all__ = [
    "Accumulated",
    "Snapshot",
    "Split",
    "TrainStep",
    "accumulate_gradients",
    "accumulate_streamed",
    "check_model",
    "check_size",
    "split_batch",
]


# ---------------------------------------------------------------- arithmetic


def check_size(name: str, value: Any) -> int:
    """Return ``value`` if it is a positive int, else raise ``BatchSizeError``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        if hasattr(value, "__index__") and not isinstance(value, bool):
            try:
                as_int = value.__index__()
            except TypeError:
                as_int = None
            if as_int is not None and as_int >= 1:
                return int(as_int)
        raise BatchSizeError(
            f"Expected `{name}` to be a positive integer. Received: {name}={describe(value)}. "
            f"Pass a whole number of examples such as {name}=256."
        )
    return value


class Split(NamedTuple):
    """How one large batch is cut: k micro-batches of m rows, padded to k*m rows."""

    batch_size: int  # B, examples per large batch
    micro_batch_size: int  # m = min(requested, B)
    accumulation_steps: int  # k = ceil(B / m)
    padded_rows: int  # k*m - B, zero-weight copies added to the last micro-batch


def split_batch(batch_size: int, micro_batch_size: int) -> Split:
    """Cut ``batch_size`` into micro-batches of at most ``micro_batch_size``.

    ``micro_batch_size >= batch_size`` means no split (k = 1), not an error.

    >>> split_batch(4096, 256)
    Split(batch_size=4096, micro_batch_size=256, accumulation_steps=16, padded_rows=0)
    >>> split_batch(10, 4)
    Split(batch_size=10, micro_batch_size=4, accumulation_steps=3, padded_rows=2)
    """
    batch_size = check_size("batch_size", batch_size)
    m = min(check_size("micro_batch_size", micro_batch_size), batch_size)
    k = math.ceil(batch_size / m)
    return Split(batch_size, m, k, k * m - batch_size)


# ---------------------------------------------------------------- model checks


def check_model(model: Any) -> None:
    """Raise a typed error, changing nothing, unless ``model`` can be trained split."""
    if not isinstance(model, keras.Model):
        raise ModelNotReadyError(
            f"Expected `model` to be a compiled keras.Model. Received: model={describe(model)}."
        )
    if not getattr(model, "compiled", False) or model.optimizer is None:
        raise ModelNotReadyError(
            "Expected a compiled model with an optimizer. Received: a model that "
            f"{'is not compiled' if not getattr(model, 'compiled', False) else 'has no optimizer'}"
            ". Call `model.compile(optimizer=..., loss=...)` first."
        )
    if getattr(model, "_compile_loss", None) is None:
        raise ModelNotReadyError(
            "Expected a model compiled with a loss. Received: model.compile(loss=None). "
            "Pass `loss=` to `model.compile` (autosplit splits the compiled loss)."
        )
    for method in ("train_step", "compute_loss"):
        override = getattr(type(model), method, None)
        if override is not None and override is not getattr(keras.Model, method):
            raise UnsupportedModelError(
                f"Expected a model that uses Keras's own `{method}`. Received: "
                f"{type(model).__name__} overrides `{method}`, which autosplit cannot split "
                "into micro-batches exactly. Use `autosplit.accumulate_gradients` inside "
                "your own training step instead."
            )
    if model.built and not model.trainable_variables:
        raise ModelNotReadyError(
            "Expected a model with trainable weights. Received: a model whose "
            "`trainable_variables` is empty (are all layers frozen?)."
        )


# ---------------------------------------------------------------- graph pieces


@dataclass(frozen=True)
class _LossPlan:
    """Static facts about a model's loss, learned from one throwaway trace."""

    folded: tuple[bool, ...]  # per compiled loss: denominator known before the loop
    per_row: tuple[int | None, ...]  # loss elements per example, for folded COUNT terms
    kinds: tuple[str, ...]
    forward_losses: bool  # losses added in call() (activity regularizers, add_loss)
    has_grad: tuple[bool, ...]  # per trainable variable


def _align_targets(model: keras.Model, y: Any, y_pred: Any) -> Any:
    """Give ``y`` the structure of ``y_pred``, as ``CompileLoss`` does."""
    if not tree.is_nested(y) and not tree.is_nested(y_pred):
        return y
    try:
        tree.assert_same_structure(y_pred, y)
        return y
    except (ValueError, TypeError):
        pass
    if isinstance(y_pred, (list, tuple)) and isinstance(y, dict):
        return type(y_pred)(y[name] for name in model.output_names)
    if not tree.is_nested(y) and isinstance(y_pred, (list, tuple)) and len(y_pred) == 1:
        return type(y_pred)([y])
    return tree.pack_sequence_as(y_pred, tree.flatten(y))


def _n_weight_regularizers(model: keras.Model) -> int:
    return sum(1 for v in model.trainable_variables if getattr(v, "regularizer", None))


def weight_regularization(model: keras.Model) -> tf.Tensor:
    """Sum of the weight regularizers: depends on the weights only, counted once."""
    losses = [
        tf.cast(v.regularizer(v), tf.float32)
        for v in model.trainable_variables
        if getattr(v, "regularizer", None) is not None
    ]
    return tf.add_n(losses) if losses else tf.constant(0.0, tf.float32)


def _forward(model, x, y, sample_weight, row_valid, *, training=True):
    """One micro-batch forward pass: predictions, per-output loss terms, forward losses."""
    if getattr(model, "_call_has_training_arg", True):
        y_pred = model(x, training=training)
    else:
        y_pred = model(x)
    y = _align_targets(model, y, y_pred)
    terms = []
    for flat in _keras.flat_losses(model):
        y_t = _keras.resolve_path(flat.path, y)
        y_p = _keras.resolve_path(flat.path, y_pred)
        if sample_weight is not None and tree.is_nested(sample_weight):
            s_w = _keras.resolve_path(flat.path, sample_weight)
        else:
            s_w = sample_weight
        terms.append(output_terms(flat.loss, y_t, y_p, s_w, row_valid))
    all_losses = list(model.losses)
    forward = all_losses[: len(all_losses) - _n_weight_regularizers(model)]
    forward = [tf.cast(loss, tf.float32) for loss in forward]
    return y, y_pred, terms, forward


_PLAN_CACHE_ATTR = "_autosplit_loss_plans"


@tf.autograph.experimental.do_not_convert
def _loss_plan(model: keras.Model, x, y, sample_weight) -> _LossPlan:
    """Trace one micro-batch (nothing runs) to learn the static structure of the loss."""
    specs = _map(lambda t: tf.TensorSpec(t.shape, t.dtype), (x, y, sample_weight))
    key = repr(specs)
    cache = model.__dict__.setdefault(_PLAN_CACHE_ATTR, {})
    if key in cache:
        return cache[key]
    facts: dict[str, Any] = {}

    def probe(x, y, sample_weight):
        rows = tf.shape(tree.flatten(x)[0])[0]
        row_valid = tf.ones([rows], tf.float32)
        with tf.GradientTape() as tape:
            _, _, terms, forward = _forward(model, x, y, sample_weight, row_valid)
            total = tf.add_n([t.numerator for t in terms] + forward)
        grads = tape.gradient(total, model.trainable_variables)
        facts["terms"] = terms
        facts["forward"] = bool(forward)
        facts["has_grad"] = tuple(g is not None for g in grads)
        facts["per_row"] = tuple(t.per_row for t in terms)
        return total

    tf.function(probe, autograph=False).get_concrete_function(*specs)
    terms = facts["terms"]
    folded = tuple(
        (t.kind == SUM) or (t.kind == COUNT and not t.masked and p is not None)
        for t, p in zip(terms, facts["per_row"], strict=True)
    )
    plan = _LossPlan(
        folded=folded,
        per_row=facts["per_row"],
        kinds=tuple(t.kind for t in terms),
        forward_losses=facts["forward"],
        has_grad=facts["has_grad"],
    )
    cache[key] = plan
    return plan


def _to_dense_f32(g) -> tf.Tensor:
    # An Embedding yields IndexedSlices with repeated indices; densifying sums the
    # duplicates, which is the true gradient of the summed loss.
    return tf.cast(tf.convert_to_tensor(g), tf.float32)


def _update_metrics(model, y, y_pred, sample_weight, row_valid) -> None:
    """Update the compiled metrics from one micro-batch, padding rows weighted 0."""
    unweighted, weighted, flatten = _keras.metric_lists(model)
    if not unweighted and not weighted:
        return
    y_flat, p_flat = flatten(y), flatten(y_pred)
    for mls, y_t, y_p in zip(unweighted, y_flat, p_flat, strict=False):
        if mls:
            # Rank of a per-sample value (y_pred less its last axis), so that Keras
            # broadcasts it against a (m, T) mask instead of refusing (m,) * (m, T).
            rank = max(1, y_p.shape.rank - 1)
            mls.update_state(y_t, y_p, sample_weight=tf.reshape(row_valid, [-1] + [1] * (rank - 1)))
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
                s_w = tf.reshape(row_valid, [-1] + [1] * (rank - 1))
            else:
                s_w = tf.cast(s_w, tf.float32) * row_weight(row_valid, tf.cast(s_w, tf.float32))
            mls.update_state(y_t, y_p, sample_weight=s_w)


def _reshape_rows(t: tf.Tensor, split: Split) -> tf.Tensor:
    """(B, ...) -> (k, m, ...), padding with copies of the first rows (weight 0)."""
    if split.padded_rows:
        t = tf.concat([t, t[: split.padded_rows]], axis=0)
    return tf.reshape(t, [split.accumulation_steps, split.micro_batch_size, *t.shape[1:]])


def _map(fn, structure):
    """``tree.map_structure`` that leaves ``None`` (no sample weight) alone."""
    return tree.map_structure(lambda t: None if t is None else fn(t), structure)


class Accumulated(NamedTuple):
    """What ``accumulate_gradients`` returns."""

    loss: tf.Tensor  # shape=(), float32: the full-batch loss Keras would report
    gradients: list  # one per model.trainable_variables entry (None where unconnected)


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
    """Exact gradients and loss of one large batch, computed in micro-batches.

    Equivalent to ``tape.gradient(model.compute_loss(...), model.trainable_variables)``
    on the whole batch, but peak memory is that of one micro-batch. Use it inside your
    own ``tf.function`` and apply the result with any optimizer, once.

    Args:
        model: a Keras model compiled with a loss (the optimizer is not used here).
        x, y, sample_weight: the large batch; tensors, tuples or dicts whose leading
            dimension B is static.
        micro_batch_size: rows per micro-batch; ``>= B`` means no split.
        n_valid: how many leading rows are real (the rest weigh 0); default B.
        update_metrics: also update the compiled metrics from every micro-batch.
        loss_scale: multiply every micro-batch's loss by this before differentiating
            (mixed precision's loss scale, one value for the whole large batch); the
            gradients come back scaled, the loss does not.

    Returns:
        ``Accumulated(loss, gradients)``; gradients align with
        ``model.trainable_variables`` and are float32 for float32 variables.

    Example:
        >>> @tf.function
        ... def train_step(x, y):
        ...     loss, grads = autosplit.accumulate_gradients(model, x, y, micro_batch_size=64)
        ...     optimizer.apply_gradients(zip(grads, model.trainable_variables))
        ...     return loss
    """
    first = tree.flatten(x)[0]
    batch = first.shape[0]
    if batch is None:
        raise BatchSizeError(
            "Expected the large batch to have a static leading dimension. Received: x with "
            f"shape {first.shape}. Batch with `drop_remainder=True`, pad the last batch and "
            "pass `n_valid=`, or use `autosplit.fit_large_batch`, which does both."
        )
    split = split_batch(batch, micro_batch_size)
    xs, ys, sws = _map(lambda t: _reshape_rows(tf.convert_to_tensor(t), split),
                       (x, y, sample_weight))

    def take(i):
        return _map(lambda t: tf.gather(t, i), (xs, ys, sws))

    sample = _map(lambda t: t[0], (xs, ys, sws))
    return _accumulate(model, take, sample, split, n_valid, update_metrics=update_metrics,
                       loss_scale=loss_scale)


def accumulate_streamed(
    model: keras.Model,
    source: tuple,
    index: tf.Tensor,
    *,
    micro_batch_size: int,
    n_valid: tf.Tensor | int | None = None,
    update_metrics: bool = False,
    loss_scale: tf.Tensor | float | None = None,
) -> Accumulated:
    """``accumulate_gradients`` for a large batch given by its row numbers.

    The large batch is never materialised: each micro-batch's rows are gathered from
    ``source`` (the whole data set, ``(x, y, sample_weight_or_None)`` with one row per
    example) inside the loop. Use it when a large batch's inputs alone would crowd the
    accelerator: only ``index`` (B integers) and one micro-batch are in flight.

    Args:
        source: the examples, as tensors (keep them in host memory on a GPU machine).
        index: int tensor (B,): the rows of ``source`` in this large batch.
        micro_batch_size, n_valid, update_metrics, loss_scale: as for
            ``accumulate_gradients``.
    """
    batch = index.shape[0]
    if batch is None:
        raise BatchSizeError(
            f"Expected `index` to have a static length. Received: shape {index.shape}.")
    source = (*tuple(source), None, None)[:3]
    split = split_batch(batch, micro_batch_size)
    rows = _reshape_rows(tf.convert_to_tensor(index), split)

    def take(i):
        picked = tf.gather(rows, i)
        return _map(lambda t: tf.gather(t, picked), tuple(source))

    sample = _map(lambda t: tf.TensorSpec([split.micro_batch_size, *t.shape[1:]], t.dtype),
                  tuple(source))
    return _accumulate(model, take, sample, split, n_valid, update_metrics=update_metrics,
                       loss_scale=loss_scale)


def _accumulate(model, take, sample, split: Split, n_valid, *, update_metrics: bool,
                loss_scale) -> Accumulated:
    """The micro-batch loop: ``take(i)`` gives micro-batch i as ``(x, y, sample_weight)``."""
    k, m = split.accumulation_steps, split.micro_batch_size
    batch = split.batch_size
    n_valid = tf.constant(batch, tf.int32) if n_valid is None else tf.cast(n_valid, tf.int32)
    scale = tf.constant(1.0, tf.float32) if loss_scale is None else tf.cast(loss_scale, tf.float32)
    rows = tf.range(k * m, dtype=tf.int32)
    row_valid_all = tf.reshape(tf.cast(rows < n_valid, tf.float32), [k, m])
    # Under a tf.distribute strategy each replica splits its own share; denominators
    # are those of the GLOBAL batch (one scalar all-reduce before the loop, one after),
    # and the optimizer all-reduces the gradients once, after the loop.
    context = tf.distribute.get_replica_context()
    replicas = context.num_replicas_in_sync if context is not None else 1
    n_real = tf.cast(n_valid, tf.float32)
    if replicas > 1:
        n_real = context.all_reduce(tf.distribute.ReduceOp.SUM, n_real)
    steps = (n_valid + m - 1) // m  # micro-batches holding at least one real row

    sample_x, sample_y, sample_w = sample
    compile_loss = getattr(model, "_compile_loss", None)
    if compile_loss is not None and not compile_loss.built:
        _keras.build_model(model, (sample_x, sample_y, sample_w))
    plan = _loss_plan(model, sample_x, sample_y, sample_w)
    variables = model.trainable_variables
    deferred = [j for j, f in enumerate(plan.folded) if not f]
    flat = _keras.flat_losses(model)
    weights = [1.0 if f.weight is None else float(f.weight) for f in flat]
    n_groups = 1 + len(deferred)  # group 0: everything whose scale is known in the loop

    def zeros():
        return [tf.zeros(v.shape, tf.float32) if has else tf.zeros([], tf.float32)
                for v, has in zip(variables, plan.has_grad, strict=True)]

    def body(i, accs, numerators, denominators, forward_total):
        xi, yi, swi = take(i)
        row_valid = tf.gather(row_valid_all, i)
        share = tf.reduce_sum(row_valid) / n_real
        with tf.GradientTape(persistent=n_groups > 1) as tape:
            y_aligned, y_pred, terms, forward = _forward(model, xi, yi, swi, row_valid)
            direct = []
            for j, term in enumerate(terms):
                if plan.folded[j]:
                    factor = weights[j]
                    if plan.kinds[j] == COUNT:
                        factor = weights[j] / (n_real * plan.per_row[j])
                    direct.append(term.numerator * factor)
            forward_sum = tf.add_n(forward) if forward else tf.constant(0.0)
            if forward:
                direct.append(forward_sum * share)
            objectives = [tf.add_n(direct) * scale if direct else None]
            objectives += [terms[j].numerator * weights[j] * scale for j in deferred]
        new_accs = []
        for group, objective in enumerate(objectives):
            if objective is None:
                new_accs.append(accs[group])
                continue
            grads = tape.gradient(objective, variables)
            new_accs.append([
                acc + _to_dense_f32(g) if g is not None else acc
                for acc, g in zip(accs[group], grads, strict=True)
            ])
        del tape
        if update_metrics:
            _update_metrics(model, y_aligned, y_pred, swi, row_valid)
        numerators = [a + t.numerator for a, t in zip(numerators, terms, strict=True)]
        denominators = [a + t.denominator for a, t in zip(denominators, terms, strict=True)]
        return i + 1, new_accs, numerators, denominators, forward_total + forward_sum * share

    n_terms = len(plan.kinds)
    init = (
        tf.constant(0, tf.int32),
        [zeros() for _ in range(n_groups)],
        [tf.constant(0.0)] * n_terms,
        [tf.constant(0.0)] * n_terms,
        tf.constant(0.0),
    )
    # parallel_iterations=1: micro-batches run one after another, so the peak memory
    # is one micro-batch's, not several in flight.
    _, accs, numerators, denominators, forward_total = tf.while_loop(
        lambda i, *_: i < steps, body, init, parallel_iterations=1,
        maximum_iterations=k,
    )

    if replicas > 1:
        numerators, denominators, forward_total = context.all_reduce(
            tf.distribute.ReduceOp.SUM, (numerators, denominators, forward_total))
    with tf.GradientTape() as tape:
        # Counted once per large batch: each replica adds its 1/replicas share.
        regularization = weight_regularization(model) / replicas
        scaled_regularization = regularization * scale
    reg_grads = tape.gradient(scaled_regularization, variables) if plan.has_grad else []

    loss = regularization * replicas + forward_total
    for j, kind in enumerate(plan.kinds):
        if kind == SUM:
            loss += weights[j] * numerators[j]
        else:
            loss += weights[j] * tf.math.divide_no_nan(numerators[j], denominators[j])
    gradients = []
    for idx, variable in enumerate(variables):
        reg = reg_grads[idx] if reg_grads else None
        if not plan.has_grad[idx] and reg is None:
            gradients.append(None)
            continue
        total = accs[0][idx] if plan.has_grad[idx] else tf.zeros(variable.shape, tf.float32)
        for group, j in enumerate(deferred, start=1):
            if plan.has_grad[idx]:
                total += tf.math.divide_no_nan(accs[group][idx], denominators[j])
        if reg is not None:
            total += _to_dense_f32(reg)
        gradients.append(tf.cast(total, variable.dtype))
    return Accumulated(loss, gradients)


# ---------------------------------------------------------------- the train step


class Snapshot:
    """Bitwise copy of every model, metric and optimizer variable, to put back later.

    The probe and ``check`` run real training steps on the user's model and must leave
    it exactly as they found it (BatchNorm statistics, seed states, slots, metrics).
    """

    def __init__(self, model: keras.Model) -> None:
        optimizer = getattr(model, "optimizer", None)
        seen: set[int] = set()
        self.variables = []
        for v in (list(model.variables) + list(model.metrics_variables)
                  + (list(optimizer.variables) if optimizer is not None else [])):
            if id(v) not in seen:
                seen.add(id(v))
                self.variables.append(v)
        self.values = [np.array(v.numpy(), copy=True) for v in self.variables]

    def restore(self) -> None:
        for v, value in zip(self.variables, self.values, strict=True):
            v.assign(value)


class _StateGuard:
    """Backups of what a failed attempt could change before the optimizer runs.

    The loop updates metric variables and non-trainable model state (BatchNorm
    moving statistics, dropout seed generators) as it goes; the weights and the
    optimizer are only touched after the loop succeeds. Restoring these backups
    after a failure leaves the model as if the attempt never happened.
    """

    def __init__(self, model: keras.Model) -> None:
        seen: set[int] = set()
        self.variables: list = []
        for v in list(model.non_trainable_variables) + list(model.metrics_variables):
            if id(v) not in seen:
                seen.add(id(v))
                self.variables.append(v)
        self.backups = [
            tf.Variable(tf.convert_to_tensor(v), trainable=False, name="autosplit_backup")
            for v in self.variables
        ]
        # Counts the saves that ran, so a failure before this step's save (nothing
        # changed yet) does not roll back the previous step.
        self.generation = tf.Variable(0, dtype=tf.int64, trainable=False)
        self._completed = 0

    def save(self) -> tf.Operation:
        saves = [b.assign(tf.convert_to_tensor(v)) for b, v in
                 zip(self.backups, self.variables, strict=True)]
        with tf.control_dependencies(saves):
            return self.generation.assign_add(1)

    def succeeded(self) -> None:
        self._completed += 1

    def restore(self) -> None:
        generation = int(self.generation.numpy())
        if generation > self._completed:
            for b, v in zip(self.backups, self.variables, strict=True):
                v.assign(b)
        self._completed = generation


def has_batch_norm(model: keras.Model) -> bool:
    return any(isinstance(layer, keras.layers.BatchNormalization)
               for layer in model._flatten_layers())


class TrainStep:
    """One exact large-batch update of a compiled Keras model, compiled once.

    Args:
        model: a compiled Keras model (TensorFlow backend).
        split: how each large batch is cut (``split_batch(B, m)``). Under a
            ``tf.distribute`` strategy B is the global batch: each of the R replicas
            takes B/R rows and splits them into micro-batches of m.
        jit_compile: XLA on/off; default: what ``model.compile`` resolved.
        run_eagerly: run the step eagerly (debugging); default ``model.run_eagerly``.

    Calling it with the global ``(x, y, sample_weight, n_valid)`` applies the optimizer
    once and returns the logs (``loss`` and the compiled metrics), like
    ``model.train_step``. With ``source`` (the whole data set as ``(x, y[, w])``
    tensors) the step streams: call it with ``(index, None, None, n_valid)``, the row
    numbers of the large batch, and each micro-batch is gathered inside the loop.
    """

    def __init__(self, model: keras.Model, split: Split, *, jit_compile: bool | None = None,
                 run_eagerly: bool | None = None, source: tuple | None = None) -> None:
        self.model = model
        self.source = source
        self.strategy = model.distribute_strategy
        self.replicas = self.strategy.num_replicas_in_sync
        if source is not None and self.replicas > 1:
            raise UnsupportedModelError(
                "Expected streaming=False under a tf.distribute strategy. Received: "
                f"streaming with {type(self.strategy).__name__}. Each replica already holds "
                "only its share of the batch; pass streaming=False.")
        if split.batch_size % self.replicas:
            raise BatchSizeError(
                f"Expected `batch_size` to divide evenly across the {self.replicas} replicas "
                f"of {type(self.strategy).__name__}. Received: batch_size={split.batch_size}. "
                f"Use a multiple of {self.replicas}, e.g. "
                f"{split.batch_size - split.batch_size % self.replicas or self.replicas}."
            )
        local = split_batch(split.batch_size // self.replicas, split.micro_batch_size)
        self.local_split = local
        self.split = Split(split.batch_size, local.micro_batch_size,
                           local.accumulation_steps, local.padded_rows * self.replicas)
        self.jit_compile = bool(model.jit_compile if jit_compile is None else jit_compile)
        self.run_eagerly = bool(model.run_eagerly if run_eagerly is None else run_eagerly)
        for flat in _keras.flat_losses(model):
            check_reduction(flat.loss)
        # Under a strategy the metric variables are per-replica sums; only the weights
        # and the optimizer (touched after the loop) are guarded there.
        self.guard = _StateGuard(model) if self.replicas == 1 else None
        self._function = None
        if local.accumulation_steps > 1 and has_batch_norm(model):
            warnings.warn(
                "This model has BatchNormalization layers: in training mode they normalise "
                f"each micro-batch of {local.micro_batch_size} with its own statistics "
                "(ghost batch norm), not the whole batch of "
                f"{split.batch_size}. Gradients are exact for that computation.",
                stacklevel=3,
            )

    def _replica_step(self, x, y, sample_weight, n_valid):
        model = self.model
        if self.guard is not None:
            with tf.control_dependencies([self.guard.save()]):
                n_valid = tf.identity(n_valid)
        # One loss scale for the whole large batch (mixed_float16 wraps the optimizer in
        # a LossScaleOptimizer; for others scale_loss is the identity). Its apply then
        # unscales, checks the accumulated gradients once, and skips the whole large
        # step and lowers the scale once if any micro-batch overflowed.
        scale = tf.cast(model.optimizer.scale_loss(tf.constant(1.0, tf.float32)), tf.float32)
        if self.source is None:
            result = accumulate_gradients(
                model, x, y, sample_weight, micro_batch_size=self.local_split.micro_batch_size,
                n_valid=n_valid, update_metrics=True, loss_scale=scale,
            )
        else:  # streaming: x holds the row numbers of the large batch
            result = accumulate_streamed(
                model, self.source, x, micro_batch_size=self.local_split.micro_batch_size,
                n_valid=n_valid, update_metrics=True, loss_scale=scale,
            )
        pairs = [(g, v) for g, v in zip(result.gradients, model.trainable_variables,
                                        strict=True) if g is not None]
        # The optimizer (and its `iterations`) must not move before every
        # micro-batch has succeeded: make the apply wait for the loop's results.
        # Under a strategy, Keras's optimizer all-reduces these gradients: once.
        with tf.control_dependencies([result.loss] + [g for g, _ in pairs]):
            model.optimizer.apply_gradients(pairs)
        tracker = _keras.loss_tracker(model)
        if tracker is not None:
            tracker.update_state(result.loss, sample_weight=tf.cast(n_valid, tf.float32))
        return result.loss

    def _step(self, x, y, sample_weight, n_valid):
        if self.replicas == 1:
            self._replica_step(x, y, sample_weight, n_valid)
        else:
            self.strategy.run(self._replica_step, args=(x, y, sample_weight, n_valid))
        return self.model.get_metrics_result()

    @property
    def function(self):
        """The compiled ``tf.function`` (built on first use, then cached)."""
        if self._function is None:
            if self.run_eagerly:
                self._function = self._step
            else:
                self._function = tf.function(
                    self._step, jit_compile=self.jit_compile, reduce_retracing=True
                )
        return self._function

    def distribute(self, x, y, sample_weight, n_valid):
        """The global batch cut into per-replica shares (identity on one device)."""
        if self.replicas == 1:
            return x, y, sample_weight, n_valid
        local = self.local_split.batch_size

        def share(context):
            r = context.replica_id_in_sync_group
            rows = _map(lambda t: t[r * local:(r + 1) * local], (x, y, sample_weight))
            n = tf.clip_by_value(tf.cast(n_valid, tf.int32) - r * local, 0, local)
            return (*rows, n)

        return self.strategy.experimental_distribute_values_from_function(share)

    def __call__(self, x, y, sample_weight, n_valid) -> dict:
        if self.replicas == 1:
            logs = self.function(x, y, sample_weight, n_valid)
        else:
            per_replica = self.distribute(x, y, sample_weight, n_valid)
            logs = self.function(*self._unpack(per_replica))
        if self.guard is not None:
            self.guard.succeeded()
        return logs

    def _unpack(self, per_replica):
        values = self.strategy.experimental_local_results(per_replica)
        parts = [[v[i] for v in values] for i in range(4)]
        return tuple(
            None if part[0] is None else tf.nest.map_structure(
                lambda *leaves: self._per_replica(leaves), *part)
            for part in parts
        )

    def _per_replica(self, leaves):
        from tensorflow.python.distribute import values as distribute_values

        return distribute_values.PerReplica(tuple(leaves))

    def restore(self) -> None:
        """Undo the metric and non-trainable updates of a step that raised."""
        if self.guard is not None:
            self.guard.restore()

    def tracing_count(self) -> int:
        fn = self._function
        return fn.experimental_get_tracing_count() if hasattr(
            fn, "experimental_get_tracing_count") else 0


def trainable_signature(variables: Sequence) -> list[tuple]:
    """(path, shape, dtype) of each variable; used for fingerprints and tests."""
    return [(getattr(v, "path", v.name), tuple(v.shape), str(v.dtype)) for v in variables]
