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
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, NamedTuple

import keras
import numpy as np
import tensorflow as tf

from autosplit.data.lengths import LENGTH_MULTIPLE, Trimmed, real_lengths
from autosplit.data.structure import empty_to_none
from autosplit.keras_hooks import internals as _keras
from autosplit.keras_hooks.custom_step import has_custom_step
from autosplit.step.loss_plan import step_plan
from autosplit.step.piece import compute_piece, update_metrics
from autosplit.step.snapshot import Snapshot

__all__ = ["PaddingCheck", "check_padding"]

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
        piece = compute_piece(model, plan, x, y, w, valid, batch_size=rows,
                              scale=tf.constant(1.0))
        update_metrics(model, piece.y, piece.y_pred, w, valid, piece.masks, full=True,
                       stretch=piece.stretch)
        return ([g for group in piece.gradients for g in group if g is not None],
                piece.numerators, piece.denominators, piece.forward,
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
