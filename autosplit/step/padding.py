"""Whether a model ignores padding: what lets a large batch of sequences be cut by length.

A micro-batch cut by length (``autosplit.data.lengths``) is padded less than its large
batch. That changes nothing only where the model's losses, gradients and metrics do
not see the padding: a mask (``Embedding(mask_zero=True)``, a ``padding_mask``), a
``sample_weight`` that weighs it 0, a causal model whose real tokens never attend to
later ones. :func:`check_padding` finds it out on a few real rows rather than assume it:
one micro-step on them padded to their longest row, and one padded 8 columns further,
must give the same loss numerators, gradients, in-call losses and metric totals, and
denominators that differ only as ``Trimmed.stretch`` says. Random layers (dropout,
noise) are still for the two steps; the model is left as it was found.
:func:`length_cut` decides, from the check, how an input is cut.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, NamedTuple

import keras
import numpy as np
import tensorflow as tf

from autosplit.data.adapter import InputAdapter, varying_shapes
from autosplit.data.layout import Layout
from autosplit.data.lengths import (
    LENGTH_MULTIPLE,
    LengthCut,
    Padded,
    Trimmed,
    real_lengths,
    sorts_by_length,
)
from autosplit.data.pipeline import MicroBatches
from autosplit.data.structure import empty_to_none
from autosplit.errors import DatasetError, UnsupportedModelError
from autosplit.keras_hooks import internals as _keras
from autosplit.keras_hooks.custom_step import has_custom_step
from autosplit.step.contribution import compute_contribution, update_metrics
from autosplit.step.loss_plan import step_plan
from autosplit.step.snapshot import Snapshot
from autosplit.step.train_step import build_for

__all__ = ["PaddingCheck", "check_padding", "length_cut"]

_GRADIENT_TOLERANCE = 1e-4  # of a tensor's largest entry: summation order moves ~1e-7
_VALUE_TOLERANCE = 1e-5


class PaddingCheck(NamedTuple):
    """What :func:`check_padding` found."""

    ignores_padding: bool
    reason: str  # what was compared, or what changed with the padding


@contextlib.contextmanager
def _still(model: keras.Model) -> Iterator[None]:
    """Dropout rates and noise levels at 0 (what a trace bakes in), then as they were:
    the rate of a dropout or noise layer, a recurrent cell's dropouts."""
    noisy = (keras.layers.Dropout, keras.layers.GaussianDropout, keras.layers.GaussianNoise,
             keras.layers.AlphaDropout)
    changed = []
    for layer in _keras.flatten_layers(model):
        names = ("rate", "stddev") if isinstance(layer, noisy) else ("dropout",
                                                                      "recurrent_dropout")
        for name in names:
            if isinstance(vars(layer).get(name), (int, float)):
                changed.append((layer, name, vars(layer)[name]))
                setattr(layer, name, 0.0)
    try:
        yield
    finally:
        for layer, name, value in changed:
            setattr(layer, name, value)


def _resize(t: tf.Tensor, length: int, pre: bool) -> tf.Tensor:
    """``t`` (rows, length', ...) cut or zero-padded to ``length`` columns, at its end
    (at its front where ``pre``)."""
    t = t[:, -length:] if pre else t[:, :length]
    gap = length - int(t.shape[1])
    if gap <= 0:
        return t
    pads = [[0, 0], [gap, 0] if pre else [0, gap]] + [[0, 0]] * (t.shape.rank - 2)
    return tf.pad(t, pads)


def _varying_spec(spec: tf.TensorSpec) -> bool:
    return spec.shape.rank is not None and spec.shape.rank >= 2 and spec.shape[1] is None


def check_padding(model: keras.Model, sample: tuple, spec: tuple, *, pre: bool = False
                  ) -> PaddingCheck:
    """Whether ``model`` trains the same on ``sample``'s rows however far they are
    padded (see the module's docstring).

    Args:
        model: a compiled model, built.
        sample: ``(x, y, sample_weight)`` tensors, a few rows padded to their longest.
        spec: the specs of ``(x, y, sample_weight_or_())`` in a micro-batch: the
            inputs that vary in length have an unknown second dimension.
        pre: the rows are padded at their front (``keras.utils.pad_sequences``'
            default), not at their end.
    """
    if has_custom_step(model):
        return PaddingCheck(False, "the model has its own train_step")
    sample = tuple(() if part is None else part for part in sample)
    varying = [_varying_spec(s) for s in tf.nest.flatten(spec)]
    leaves = tf.nest.flatten(sample)
    ends = [t[:, ::-1] if pre else t for t, v in zip(leaves, varying, strict=True) if v]
    short = int(tf.reduce_max(real_lengths(ends)))
    lengths = (max(short, 1), max(short, 1) + LENGTH_MULTIPLE)
    rows = int(leaves[0].shape[0])
    signature = (Trimmed(spec[0], tf.TensorSpec([None], tf.float32)),
                 *spec[1:], tf.TensorSpec([None], tf.float32))
    signature = tf.nest.map_structure(
        lambda s: tf.TensorSpec([None, *s.shape[1:]], s.dtype), signature)
    plan = step_plan(model, (spec[0], empty_to_none(spec[1]), empty_to_none(spec[2])))
    if plan.custom is not None:
        return PaddingCheck(False, "the model has its own train_step")

    def step(x, y, w, valid):
        y, w = empty_to_none(y), empty_to_none(w)
        c = compute_contribution(model, plan, x, y, w, valid, batch_size=rows,
                                 scale=tf.constant(1.0))
        update_metrics(model, c.y, c.y_pred, w, valid, c.masks, all_real=True,
                       stretch=c.stretch)
        return ([g for group in c.gradients for g in group if g is not None],
                c.numerators, c.denominators, c.forward,
                [v.value for m in _keras.all_metrics(model) for v in m.variables])

    snapshot = Snapshot(model)
    results = []
    try:
        with _still(model):
            traced = tf.function(step, input_signature=signature, reduce_retracing=False)
            for length in lengths:
                resized = tf.nest.pack_sequence_as(sample, [
                    _resize(t, length, pre) if v else t
                    for t, v in zip(leaves, varying, strict=True)])
                stretch = tf.fill([rows], lengths[1] / length)
                for metric in _keras.all_metrics(model):
                    metric.reset_state()
                out = traced(Trimmed(resized[0], stretch), *resized[1:],
                             tf.ones([rows], tf.float32))
                results.append(tf.nest.map_structure(lambda t: np.asarray(t), out))
                snapshot.restore()
    except Exception as error:  # any failure: not shown to ignore padding, so exact path
        snapshot.restore()
        lines = [line for line in str(error).splitlines() if line.strip() and not line.startswith(
            ("  File", "Graph execution", "Detected at", "\t"))]
        return PaddingCheck(False, f"the check could not run ({type(error).__name__}: "
                            f"{lines[0] if lines else ''})")
    return _compare(model, results[0], results[1], lengths)


def _compare(model: keras.Model, short: Any, long: Any, lengths: tuple[int, int]) -> PaddingCheck:
    gradients, numerators, denominators, forward, metrics = zip(short, long, strict=True)
    names = [v.path for v in model.trainable_variables]
    scale = max((float(np.max(np.abs(g))) for g in gradients[0] if g.size), default=0.0)
    worst, where = 0.0, ""
    for index, (a, b) in enumerate(zip(*gradients, strict=True)):
        size = max(float(np.max(np.abs(a))) if a.size else 0.0, 1e-3 * scale, 1e-30)
        error = float(np.max(np.abs(a - b))) / size if a.size else 0.0
        if error > worst:
            worst, where = error, names[index] if index < len(names) else f"gradient {index}"
    if worst > _GRADIENT_TOLERANCE:
        return PaddingCheck(False, f"its gradients change when its rows are padded further "
                            f"({where} by {worst:.1e} of its largest entry)")
    for what, (a, b) in (("loss", (numerators[0], numerators[1])),
                         ("loss denominators", (denominators[0], denominators[1])),
                         ("losses added in call()", (forward[0], forward[1])),
                         ("metrics", (metrics[0], metrics[1]))):
        for u, v in zip(a, b, strict=True):
            if not np.allclose(u, v, rtol=_VALUE_TOLERANCE, atol=1e-6):
                return PaddingCheck(False, f"its {what} change when its rows are padded "
                                    "further")
    return PaddingCheck(True, f"the same loss, gradients and metrics at lengths "
                        f"{lengths[0]} and {lengths[1]}")


def length_cut(model: keras.Model, adapter: InputAdapter, batch_size: int, where: Layout, *,
               by_length: bool | None, jit: bool, verbose: int = 0
               ) -> tuple[LengthCut | None, str | None]:
    """The cut by length where the rows of ``adapter`` vary in length and the model
    ignores padding (:func:`check_padding`), with ``FitReport.padding``'s account:
    lengths rounded up to a multiple of 8 under XLA (``jit``), unrounded otherwise.
    ``by_length``: True asks for it (raising where it cannot be), False refuses it, None
    (``"auto"``) lets the check decide; ``verbose`` says so when it does not."""
    padded = adapter.padded_sequences(_takes_any_length(model))
    # Row numbers (arrays) vary in nothing; their sequences are `padded`.
    if padded is None and (adapter.row_numbers
                           or not _rows_vary(adapter.rows_dataset().element_spec)):
        if by_length:
            raise DatasetError(
                "Expected rows that vary in length with by_length=True. Received: an input "
                f"whose rows all have one shape ({adapter.kind}) and hold no "
                "padded sequences for a model that takes any length. Pass them as a "
                "padded_batch, a ragged tensor, variable-length examples or arrays padded "
                "with zeros (pad_sequences) to a model whose inputs take any length "
                "(keras.Input((None,))), or leave by_length='auto'.")
        return None, None
    if by_length is False:
        why = "by_length=False"
    elif where.local_replicas > 1:
        why = f"{where.local_replicas} replicas on this worker"
    elif padded is None and not sorts_by_length(adapter.rows_dataset().element_spec):
        why = "its inputs vary in more than one length"
    else:
        spec = MicroBatches(adapter, batch_size, min(batch_size // where.replicas, 8),
                            where).element_spec()
        build_for(model, spec)  # the compiled loss and metrics, as the step builds them
        found = check_padding(model, adapter.sample(min(batch_size, 16)),
                              _length_spec(spec[:3], padded),
                              pre=padded is not None and padded.pre)
        if found.ignores_padding:
            rounded = f" (lengths rounded up to a multiple of {LENGTH_MULTIPLE} for XLA)"
            return (LengthCut(LENGTH_MULTIPLE if jit else 1, padded),
                    f"by length{rounded if jit else ''}: the model ignores padding "
                    f"({found.reason})")
        why = f"the model does not ignore padding: {found.reason}"
    if by_length:
        raise UnsupportedModelError(
            f"Expected a model and input that can be cut by length with by_length=True. "
            f"Received: {why}. Pass by_length='auto' to pad every micro-batch to its "
            "large batch's longest row instead, exactly as model.fit sees it.")
    if verbose and by_length is None:
        print(f"autosplit: micro-batches padded to their large batch's longest row: {why}.",
              flush=True)
    return None, f"to the large batch's longest row: {why}"


def _rows_vary(row_spec: Any) -> bool:
    """Whether an input's rows (``InputAdapter.rows_dataset``'s spec) may differ in shape
    beyond their count: ragged, or of a dimension of unknown size."""
    return varying_shapes(row_spec) or any(
        isinstance(leaf, tf.RaggedTensorSpec) for leaf in tf.nest.flatten(row_spec))


def _takes_any_length(model: keras.Model) -> bool:
    """Whether the model's declared inputs (a functional or Sequential model's) of rank 2
    or more take any length along their second axis."""
    try:
        inputs = model.inputs
    except (AttributeError, ValueError):
        return False
    ranked = [t for t in tf.nest.flatten(inputs or []) if len(t.shape) >= 2]
    return bool(ranked) and all(t.shape[1] is None for t in ranked)


def _length_spec(spec: tuple, padded: Padded | None) -> tuple:
    """``spec`` with the length axis unknown on the arrays as long as ``padded``'s."""
    if padded is None:
        return spec
    return tf.nest.map_structure(
        lambda s: tf.TensorSpec([s.shape[0], None, *s.shape[2:]], s.dtype)
        if s.shape.rank >= 2 and s.shape[1] == padded.length else s, spec)
