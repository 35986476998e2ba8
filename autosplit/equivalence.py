"""Is accumulation exact for this model? One batch, split and whole, side by side.

``check`` runs the full-batch step (a ``GradientTape`` over ``model(x, training=True)``
and ``model.compute_loss``, as ``model.fit`` does) and the split step
(``accumulate_gradients``) on the same batch, compares the gradients variable by
variable, tests whether the compiled loss is a sum over examples, and names the layers
that make a split differ from the whole batch. Every model, metric and optimizer
variable is restored bitwise afterwards: BatchNormalization moving statistics, dropout
seed states and metric totals move during training-mode calls.

Random layers are compared as training runs them: both sides start from the same seed
state, but the split draws one mask per micro-batch and the full batch one mask for
all, so a model with active Dropout is reported not exact (its split is equal in
distribution, not bitwise). With one micro-batch (``micro_batch_size >= B``) the draws
coincide and the comparison is exact again. To check the rest of such a model, build it
with the rates at 0.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import keras
import numpy as np
import tensorflow as tf
from keras import tree

from autosplit.accumulate import accumulate_gradients, own_steps_accumulated
from autosplit.culprits import (
    ADDED,
    HINT,
    OWN_STEP,
    PER_BATCH,
    CheckReport,
    Culprit,
    VariableDifference,
    static_culprits,
    unreduced_culprits,
)
from autosplit.data.inputs import get_input
from autosplit.data.pipeline import MicroBatches
from autosplit.data.sequences.lengths import group_lengths, padded_lengths
from autosplit.data.split import Split, split_batch
from autosplit.data.structure import map_present
from autosplit.keras_hooks import internals as _keras
from autosplit.keras_hooks.custom_step import batch_data, overridden_steps
from autosplit.keras_hooks.interception import PLAIN, intercept
from autosplit.keras_hooks.traced import summed_in_float16
from autosplit.step.accumulation import split_loss
from autosplit.step.compiled import run_once
from autosplit.step.forward import align_targets
from autosplit.step.loss_plan import loss_plan, step_plan
from autosplit.step.mixing import loss_over_whole_batch
from autosplit.step.overflow import HALF_OVERFLOW
from autosplit.step.padding import check_padding
from autosplit.step.snapshot import Snapshot
from autosplit.training.arguments import check_compiled_loss

__all__ = ["CheckReport", "Culprit", "VariableDifference", "check"]

DEFAULT_TOLERANCE = 1e-4
_SCALE_FLOOR = 1e-3  # of the model's largest gradient entry; see _differences

@_keras.outside_strategy_scope()
def check(
    model: keras.Model,
    x: Any,
    y: Any,
    sample_weight: Any = None,
    *,
    micro_batch_size: int,
    tolerance: float = DEFAULT_TOLERANCE,
) -> CheckReport:
    """Compare the split step with the full-batch step on one batch; change nothing.

    Args:
        model: a Keras model compiled with a loss, or with its own ``train_step`` (or
            ``compute_loss``), checked as ``fit_large_batch`` runs it: once per
            micro-batch against once on the whole batch (an unbuilt model is built,
            as ``fit`` would; no optimizer step runs).
        x: one batch of inputs, as for ``model.fit``; leading dimension B.
        y: its targets; None for a model whose loss comes from ``add_loss``.
        sample_weight: its per-example weights, or None.
        micro_batch_size: rows per micro-batch, as you mean to train.
        tolerance: largest relative gradient difference still called exact; float32
            summation order alone gives ~1e-6.

    Returns:
        A ``CheckReport``: the largest relative gradient difference, both losses,
        whether the loss is a per-example sum, and the culprits.

    Example:
        >>> report = autosplit.check(model, x[:256], y[:256], micro_batch_size=64)  # doctest: +SKIP
        >>> report.exact, report.max_relative_difference, report.culprits  # doctest: +SKIP
        (True, 3.1e-07, ())
        >>> print(report.format())  # doctest: +SKIP
    """
    check_compiled_loss(model)
    x, y, sample_weight = tree.map_structure(
        lambda t: None if t is None else tf.convert_to_tensor(t), (x, y, sample_weight))
    batch = int(tree.flatten(x)[0].shape[0])
    split = split_batch(batch, micro_batch_size)
    own = bool(overridden_steps(model))
    _build(model, (x, y, sample_weight), split, own)

    culprits = static_culprits(model)
    explains = bool(culprits)
    unreduced = unreduced_culprits(model)
    if unreduced:
        return CheckReport(
            batch_size=split.batch_size, micro_batch_size=split.micro_batch_size,
            accumulation_steps=split.accumulation_steps, tolerance=float(tolerance),
            exact=False, max_relative_difference=None, loss_full=None, loss_split=None,
            decomposes=False, loss_decomposition_difference=None, per_variable=(),
            culprits=tuple(culprits + unreduced), hint=None)

    full, split_loss, split_grads = _both_ways(model, x, y, sample_weight, split, own)

    per_variable, worst = _differences(model.trainable_variables, full.gradients, split_grads)
    exact = worst <= tolerance
    if own:  # its loss is the step's own: only its gradients tell whether it splits
        decomposition, decomposes = None, exact
        culprits = [c for c in culprits if not (exact and c.reason.startswith(OWN_STEP))]
    else:
        decomposition, loss_culprits = _loss_culprits(model, full, tolerance)
        culprits += loss_culprits
        decomposes = all(full.per_example) and decomposition <= tolerance
    if exact:  # a per-batch mean over examples splits exactly: nothing to blame
        culprits = [c for c in culprits if c.reason != PER_BATCH]
    elif any(full.half) and worst <= FLOAT16_TOLERANCE:  # rounding, not a layer
        culprits.append(Culprit(model.name, "mixed_float16", FLOAT16))
        explains = True
    if not exact and not explains and not own and _adds_losses(
            model, x, y, sample_weight, split):
        culprits.append(Culprit(model.name, type(model).__name__, ADDED))
        explains = True
    explains = explains or not decomposes
    return CheckReport(
        batch_size=split.batch_size, micro_batch_size=split.micro_batch_size,
        accumulation_steps=split.accumulation_steps, tolerance=float(tolerance),
        exact=exact, max_relative_difference=worst,
        loss_full=None if full.loss is None else float(full.loss),
        loss_split=None if own else float(split_loss), decomposes=decomposes,
        loss_decomposition_difference=decomposition, per_variable=tuple(per_variable),
        culprits=tuple(culprits), hint=None if exact or explains else HINT,
        padding=_padding(model, x, y, sample_weight), float16=_near_overflow(model, full),
        step=_whole_batch(model, x, y, sample_weight, split))


def _whole_batch(model: keras.Model, x: Any, y: Any, sample_weight: Any, split: Split
                 ) -> str | None:
    """Where the loss is the whole batch's (``autosplit.step.mixing``), the step
    ``fit_large_batch`` trains it with, and why; None for a sum over the rows."""
    adapter = get_input(x, y, sample_weight, shuffle=False, model=model)
    spec = MicroBatches(adapter, split.batch_size, split.micro_batch_size).element_spec()
    why = loss_over_whole_batch(model, adapter, spec)
    return None if why is None else (
        f"outputs first, the loss over the whole batch, then the gradients: {why}")


FLOAT16 = ("float16 rounding: the full batch's gradient of a float16 layer is one float16 "
           "sum, rounded once; a split's micro-batches are rounded each (2**-11 of their "
           "value), then added in float32. Judge it at float16's tolerance (about 1e-3)")
# Past this, float16's rounding does not explain a difference: something else must.
FLOAT16_TOLERANCE = 1e-2


def _near_overflow(model: keras.Model, full: _Full) -> str | None:
    """Where the full batch's float16 gradients (``mixed_float16``) come within 2x of
    float16's overflow at the optimizer's loss scale on this batch: where a full batch
    and a split could decide an overflow apart (``autosplit.step.overflow``); else None."""
    scale = float(model.optimizer.scale_loss(tf.constant(1.0))) if model.optimizer else 1.0
    peaks = sorted(((float(tf.reduce_max(tf.abs(g))) * scale, v.path) for g, v, half in zip(
        full.gradients, model.trainable_variables, full.half, strict=False)
        if half and g is not None), reverse=True)
    if not peaks or peaks[0][0] < HALF_OVERFLOW / 2:
        return None
    peak, path = peaks[0]
    how = "past overflow" if peak >= HALF_OVERFLOW else "within 2x of overflow"
    return (f"{how}: {path}'s float16 gradient reaches {peak:,.0f} of "
            f"{HALF_OVERFLOW:,.0f} at the loss scale {scale:g} on this batch; "
            "fit_large_batch skips a large batch where the full batch's would overflow")


def _padding(model: keras.Model, x: Any, y: Any, sample_weight: Any) -> str | None:
    """For a batch of padded sequences (an input of rank 2 or more some of whose rows
    end in zeros along their second axis), what ``fit_large_batch``'s check of padding
    finds (``autosplit.step.padding``); None for other batches. The inputs as long as
    that one along their second axis count as its length."""
    data = (x, y, sample_weight)
    ranked = [t for t in tree.flatten(x) if t.shape.rank >= 2]
    if not ranked:
        return None
    width = int(ranked[0].shape[1])
    first = padded_lengths((tf.TensorSpec.from_tensor(ranked[0]),), width)
    if not any(int(n) < width for n in group_lengths([ranked[0]], first)[:, 0].numpy()):
        return None

    def spec_of(t: tf.Tensor) -> tf.TensorSpec:
        if t.shape.rank < 2:
            return tf.TensorSpec([None, *t.shape[1:]], t.dtype)
        return tf.TensorSpec([None, None if t.shape[1] == width else t.shape[1],
                              *t.shape[2:]], t.dtype)

    spec = tree.map_structure(lambda t: None if t is None else spec_of(t), data)
    sample = tree.map_structure(lambda t: None if t is None else t[:16], data)
    spec = tuple(() if s is None else s for s in spec)
    found = check_padding(model, sample, spec, padded_lengths(spec, width))
    if found.ignores_padding:
        return f"ignored: fit_large_batch cuts by length ({found.reason})"
    return f"read: fit_large_batch pads to each large batch's longest row ({found.reason})"


# ---------------------------------------------------------------- pieces


def _build(model: keras.Model, data: tuple[Any, Any, Any], split: Split, own: bool) -> None:
    """Build the model as ``fit_large_batch`` would. A step of its own is traced once,
    throwaway (a Keras VAE has no call()), which refuses what cannot be split (a GAN's
    two optimizers, a step that never applies, no optimizer) before anything runs."""
    if own:
        step_plan(model, map_present(
            lambda t: tf.TensorSpec([split.micro_batch_size, *t.shape[1:]], t.dtype), data))
    elif not model.built or not _keras.compile_loss_built(model):
        _keras.symbolic_build(model, tree.map_structure(
            lambda t: None if t is None else t[:1], data))


def _both_ways(model: keras.Model, x: Any, y: Any, sample_weight: Any, split: Split,
               own: bool) -> tuple[_Full, Any, Any]:
    """The full-batch step's result, then the split step's loss and gradients, both from
    the same seeds and moving statistics; every variable restored after."""
    snapshot = Snapshot(model)
    try:
        full = (_own_step(model, x, y, sample_weight) if own
                else _full_batch(model, x, y, sample_weight, split))
        snapshot.restore()
        split_loss, split_grads = run_once(
            lambda x, y, w: (own_steps_accumulated if own else accumulate_gradients)(
                model, x, y, w, micro_batch_size=split.micro_batch_size), x, y, sample_weight,
            autograph=not own)
    finally:
        snapshot.restore()
    return full, split_loss, split_grads


def _adds_losses(model: keras.Model, x: Any, y: Any, sample_weight: Any, split: Split) -> bool:
    """Whether the model adds losses in call() (traced on one micro-batch, nothing runs)."""
    specs = tree.map_structure(
        lambda t: None if t is None else tf.TensorSpec([split.micro_batch_size,
                                                        *t.shape[1:]], t.dtype),
        (x, y, sample_weight))
    return loss_plan(model, specs).forward_losses


def _loss_culprits(model: keras.Model, full: _Full, tolerance: float
                   ) -> tuple[float, list[Culprit]]:
    """The compiled losses that are not per-example sums, and the largest difference
    between a loss over micro-batches and over the batch, on the same predictions."""
    decomposition = 0.0
    found: list[Culprit] = []
    for flat, per_example, full_value, split_value in zip(
            _keras.flat_losses(model), full.per_example, full.loss_values, full.split_values,
            strict=True):
        if not per_example:
            found.append(Culprit(
                flat.loss.name, type(flat.loss).__name__, PER_BATCH))
            continue
        difference = _relative(float(split_value) - float(full_value), float(full_value))
        decomposition = max(decomposition, difference)
        if difference > tolerance:
            found.append(Culprit(
                flat.loss.name, type(flat.loss).__name__,
                "is not a sum over examples: on the same predictions, its value over "
                f"micro-batches differs from its value over the batch by {difference:.2g}"))
    return decomposition, found


class _Full(NamedTuple):
    loss: tf.Tensor | None
    gradients: list[tf.Tensor | None]
    per_example: tuple[bool, ...]  # per compiled loss: one value per example
    loss_values: list[tf.Tensor]  # per compiled loss, Keras's value on the whole batch
    split_values: list[tf.Tensor]  # per compiled loss, recombined from micro-batches
    half: tuple[bool, ...] = ()  # per variable: summed in float16 (mixed_float16)


def _own_step(model: keras.Model, x: Any, y: Any, sample_weight: Any) -> _Full:
    """The reference of a model with its own ``train_step`` (or ``compute_loss``): that
    step on the whole batch, its one ``apply_gradients`` caught, not applied; its loss
    the ``"loss"`` it logs (a tracker's result may average earlier batches: None then
    only where it logs none). ``check`` has planned the step (``step_plan``), which
    refuses a step that never applies or applies another optimizer."""
    logged: dict[str, bool] = {}

    def run(x: Any, y: Any, sample_weight: Any) -> tuple[Any, ...]:
        with intercept(model, None, 1, static_rows=None, inputs=(x, y, sample_weight),
                       plain=True) as seen:
            logs = model.train_step(batch_data(x, y, sample_weight))
        grads = [None if g is None else tf.cast(tf.convert_to_tensor(g), tf.float32)
                 for g in seen.gradients.get(PLAIN, [None] * len(model.trainable_variables))]
        loss = logs.get("loss") if isinstance(logs, dict) else None
        logged["loss"] = loss is not None
        return (tf.constant(0.0) if loss is None
                else tf.cast(tf.convert_to_tensor(loss), tf.float32)), grads

    loss, grads = run_once(run, x, y, sample_weight, autograph=False)
    return _Full(loss if logged["loss"] else None, grads, (), [], [])


def _full_batch(model: keras.Model, x: Any, y: Any, sample_weight: Any, split: Split) -> _Full:
    """The reference step, plus each compiled loss on the same predictions, split."""
    facts: dict[str, Any] = {}

    def run(x: Any, y: Any, sample_weight: Any) -> tuple[Any, ...]:
        with tf.GradientTape() as tape:
            training = _keras.call_has_training_arg(model)
            y_pred = model(x, training=True) if training else model(x)
            loss = model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight,
                                      training=True)
        grads = tape.gradient(loss, model.trainable_variables)
        facts["half"] = tuple(summed_in_float16(g) for g in grads)
        grads = [None if g is None else tf.cast(tf.convert_to_tensor(g), tf.float32)
                 for g in grads]
        y = align_targets(model, y, y_pred)
        per_example, whole, parts = [], [], []
        for flat in _keras.flat_losses(model):
            y_t = _keras.resolve_path(flat.path, y)
            y_p = _keras.resolve_path(flat.path, y_pred)
            s_w = sample_weight
            if sample_weight is not None and tree.is_nested(sample_weight):
                s_w = _keras.resolve_path(flat.path, sample_weight)
            dtype = flat.loss.dtype
            values = flat.loss.call(*tree.map_structure(
                lambda t, dtype=dtype: tf.cast(t, dtype), (y_t, y_p)))
            per_example.append(values.shape.rank >= 1 and values.shape[0] == split.batch_size)
            whole.append(tf.cast(flat.loss(y_t, y_p, s_w), tf.float32))
            parts.append(split_loss(flat.loss, y_t, y_p, s_w, split) if per_example[-1]
                         else tf.constant(0.0))
        facts["per_example"] = tuple(per_example)
        return tf.cast(loss, tf.float32), grads, whole, parts

    loss, grads, whole, parts = run_once(run, x, y, sample_weight)
    return _Full(loss, grads, facts["per_example"], whole, parts, facts["half"])


def _relative(difference: float, scale: float) -> float:
    difference, scale = abs(difference), abs(scale)
    if scale > 0:
        return difference / scale
    return 0.0 if difference == 0 else float("inf")


def _differences(variables: list[Any], full: list[Any], split: list[Any]
                 ) -> tuple[list[VariableDifference], float]:
    """Per-variable max|g_split - g_full| / max|g_full|, and the largest of them; the
    scale is at least ``_SCALE_FLOOR`` of the model's largest gradient entry, so that a
    gradient zero in exact arithmetic (float noise) does not read as a difference."""
    def dense(g: Any, v: Any) -> np.ndarray:
        return np.zeros(v.shape, np.float64) if g is None else np.asarray(g, np.float64)

    pairs = [(v, dense(f, v), dense(s, v)) for v, f, s in zip(variables, full, split,
                                                                 strict=True)]
    overall = max((float(np.max(np.abs(f))) for _, f, _ in pairs if f.size), default=0.0)
    result = []
    for v, f, s in pairs:
        if not f.size:
            continue
        scale = max(float(np.max(np.abs(f))), _SCALE_FLOOR * overall)
        result.append(VariableDifference(
            str(getattr(v, "path", v.name)), _relative(float(np.max(np.abs(s - f))), scale)))
    return result, max((r.relative_difference for r in result), default=0.0)
