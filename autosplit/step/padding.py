"""Whether a model ignores padding: what lets a large batch of sequences be cut by length.

A micro-batch cut by length (``autosplit.data.sequences.by_length``) is padded less than
its large batch, in each of an example's lengths. That changes nothing only where the
model's losses, gradients and metrics do not see the padding: a mask
(``Embedding(mask_zero=True)``, a ``padding_mask``), a ``sample_weight`` that weighs it
0, a causal model whose real tokens never attend to later ones. :func:`check_padding`
finds it out on a few real rows rather than assume it, through the step the model trains
with (Keras's, or its own ``train_step``): one micro-step on them padded to their
longest row in every length, and one padded 8 columns further in one length at a time,
must give the same loss numerators, gradients, in-call losses, metric totals and logs,
and denominators that differ only as ``Shortened.length_factor`` says. Which length each
output follows is read off the model the same way: the outputs whose second axis grows
with a length. Random layers (dropout, noise) are still for the steps; the model is left
as it was found.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, NamedTuple

import keras
import numpy as np
import tensorflow as tf

from autosplit.data.sequences.length_factor import Shortened
from autosplit.data.sequences.lengths import Lengths, group_lengths, row_costs
from autosplit.data.structure import empty_to_none
from autosplit.errors import said
from autosplit.keras_hooks import internals as _keras
from autosplit.step.contribution import compute_contribution
from autosplit.step.loss_plan import step_plan
from autosplit.step.metrics import update_metrics
from autosplit.step.snapshot import Snapshot

__all__ = ["PaddingCheck", "check_padding"]

_GRADIENT_TOLERANCE = 1e-4  # of a tensor's largest entry: summation order moves ~1e-7
_VALUE_TOLERANCE = 1e-5
_ROWS = 16  # the shortest of the sample's rows the check runs on
_MORE = 8  # the check compares each length with itself padded by this many columns


class PaddingCheck(NamedTuple):
    """What :func:`check_padding` found."""

    ignores_padding: bool
    reason: str  # what was compared, or what changed with the padding
    # per model output (keras.tree.flatten's order): the length its second axis follows
    outputs: tuple[int | None, ...] = ()


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


def _resize(t: tf.Tensor, axis: int, length: int, pre: bool) -> tf.Tensor:
    """``t`` cut or zero-padded to ``length`` along ``axis``, at its end (at its front
    where ``pre``)."""
    size = int(t.shape[axis])
    keep = [slice(None)] * t.shape.rank
    keep[axis] = slice(max(size - length, 0), None) if pre else slice(0, length)
    t = t[tuple(keep)]
    gap = length - int(t.shape[axis])
    if gap <= 0:
        return t
    pads = [[0, 0]] * t.shape.rank
    pads[axis] = [gap, 0] if pre else [0, gap]
    return tf.pad(t, pads)


def _shortest(sample: tuple, lengths: Lengths, pre: bool) -> tuple:
    """The :data:`_ROWS` rows of ``sample`` that cost least: a model with a longest
    position (an embedding of positions) takes them 8 columns further."""
    leaves = tf.nest.flatten(sample)
    costs = row_costs(group_lengths(leaves, lengths, pre=pre))
    index = tf.sort(tf.argsort(costs, stable=True)[:_ROWS])
    return tf.nest.map_structure(lambda t: tf.gather(t, index), sample)


def check_padding(model: keras.Model, sample: tuple, spec: tuple, lengths: Lengths, *,
                  pre: bool = False) -> PaddingCheck:
    """Whether ``model`` trains the same on ``sample``'s rows however far they are
    padded, in each of ``lengths`` (see the module's docstring).

    Args:
        model: a compiled model, built.
        sample: ``(x, y, sample_weight)`` tensors, rows padded to their longest.
        spec: the specs of ``(x, y, sample_weight_or_())`` in a micro-batch: the
            inputs that vary in length have an unknown size along their length's axis.
        lengths: the lengths of an example (``autosplit.data.sequences.lengths``).
        pre: the rows are padded at their front (``keras.utils.pad_sequences``'
            default), not at their end.
    """
    sample = _shortest(tuple(() if part is None else part for part in sample), lengths, pre)
    leaves = tf.nest.flatten(sample)
    shortest = [max(int(n), 1) for n in tf.reduce_max(group_lengths(leaves, lengths, pre=pre),
                                                      axis=0)]

    def resized(leaf: int, t: tf.Tensor, extra: int, group: int | None) -> tf.Tensor:
        found = lengths.of(leaf)
        if found is None:
            return t
        axis, own = found
        return _resize(t, axis, shortest[own] + (extra if own == group else 0), pre)

    def padded(extra: int = 0, group: int | None = None) -> tuple:
        return tf.nest.pack_sequence_as(sample, [resized(i, t, extra, group)
                                                 for i, t in enumerate(leaves)])

    # What the step is made of (a refusal of the model's own step stands: training
    # would meet it too).
    plan = step_plan(model, (spec[0], empty_to_none(spec[1]), empty_to_none(spec[2])))
    snapshot = Snapshot(model)
    try:
        with _still(model):
            outputs = () if plan.custom is not None else _outputs(
                model, padded(), [padded(_MORE, g) for g in range(lengths.number)])
            if isinstance(outputs, str):
                return PaddingCheck(False, outputs)
            step = _step(model, plan, spec, len(outputs), int(leaves[0].shape[0]))
            found = []
            for group in range(lengths.number):
                longer = shortest[group] + _MORE
                length_factor = [longer / shortest[group] if g == group else 1.0 for g in outputs]
                found.append((_run(model, snapshot, step, padded(), length_factor),
                              _run(model, snapshot, step, padded(_MORE, group),
                                   [1.0] * len(outputs))))
    except Exception as error:  # any failure: not shown to ignore padding, so exact path
        snapshot.restore()
        return PaddingCheck(False, f"the check could not run ({said(error)})")
    for group, (short, long) in enumerate(found):
        differs = _compare(model, short, long)
        if differs is not None:
            what = f" in {lengths.described(group)}" if lengths.number > 1 else ""
            return PaddingCheck(False, f"{differs} when its rows are padded further{what}",
                                outputs)
    checked = "with " + ", and ".join(
        f"{lengths.described(g)} padded to {n} and {n + _MORE}"
        for g, n in enumerate(shortest)) if lengths.number > 1 else (
        f"at lengths {shortest[0]} and {shortest[0] + _MORE}")
    if plan.custom is not None:
        return PaddingCheck(True, f"its own train_step gives the same gradients, logs and "
                            f"metrics {checked}", outputs)
    return PaddingCheck(True, f"the same loss, gradients and metrics {checked}", outputs)


def _outputs(model: keras.Model, base: tuple, longer: list[tuple]) -> tuple[int | None, ...] | str:
    """Per model output, the group whose padding its second axis grows with (one model
    call per padding); a reason where one grows with two."""
    def lengths_of(x: Any) -> list[int | None]:
        found = keras.tree.flatten(model(x, training=False))
        return [int(t.shape[1]) if len(t.shape) >= 2 else None for t in found]

    base_lengths = lengths_of(base[0])
    follows: list[list[int]] = [[] for _ in base_lengths]
    for group, x in enumerate(longer):
        for k, (a, b) in enumerate(zip(base_lengths, lengths_of(x[0]), strict=True)):
            if a != b:
                follows[k].append(group)
    for k, groups in enumerate(follows):
        if len(groups) > 1:
            return (f"the length of its output {k} grows with {len(groups)} of an example's "
                    "lengths")
    return tuple(groups[0] if groups else None for groups in follows)


def _step(model: keras.Model, plan: Any, spec: tuple, outputs: int, rows: int) -> Any:
    """One traced micro-step on ``rows`` rows that returns what the check compares, by
    kind."""
    rows_spec = tf.nest.map_structure(lambda s: tf.TensorSpec([None, *s.shape[1:]], s.dtype),
                                      spec)
    signature = (Shortened(rows_spec[0], tf.TensorSpec([None, outputs], tf.float32)),
                 *rows_spec[1:], tf.TensorSpec([None], tf.float32))

    def step(x, y, w, valid):
        y, w = empty_to_none(y), empty_to_none(w)
        c = compute_contribution(model, plan, x, y, w, valid, batch_size=rows,
                                 scale=tf.constant(1.0))
        compared = {"gradients": [g for group in c.gradients for g in group if g is not None],
                    "loss denominators": c.denominators}
        if plan.custom is None:
            update_metrics(model, c.y, c.y_pred, w, valid, c.masks, all_real=True,
                           length_factor=c.length_factor)
            compared.update({"loss": c.numerators, "losses added in call()": c.forward})
        else:
            compared.update({"logs": [v for v in tf.nest.flatten(c.log_parts) if v is not None],
                             "tracker updates": [v for v in tf.nest.flatten(c.tracker_parts)
                                                 if v is not None]})
        compared["metrics"] = [v.value for m in _keras.all_metrics(model) for v in m.variables]
        return compared

    return tf.function(step, input_signature=signature, reduce_retracing=False)


def _run(model: keras.Model, snapshot: Snapshot, step: Any, data: tuple,
         length_factor: list[float]) -> dict:
    """One micro-step on ``data`` with every metric reset first, the model restored after."""
    rows = int(tf.nest.flatten(data)[0].shape[0])
    for metric in _keras.all_metrics(model):
        metric.reset_state()
    try:
        out = step(Shortened(data[0], tf.constant([length_factor] * rows, tf.float32,
                                                shape=[rows, len(length_factor)])),
                   *data[1:], tf.ones([rows], tf.float32))
        return tf.nest.map_structure(lambda t: np.asarray(t), out)
    finally:
        snapshot.restore()


def _compare(model: keras.Model, short: dict, long: dict) -> str | None:
    """What changed between two runs of :func:`_step`, or None."""
    names = [v.path for v in model.trainable_variables]
    gradients = list(zip(short.pop("gradients"), long.pop("gradients"), strict=True))
    scale = max((float(np.max(np.abs(a))) for a, _ in gradients if a.size), default=0.0)
    worst, where = 0.0, ""
    for index, (a, b) in enumerate(gradients):
        size = max(float(np.max(np.abs(a))) if a.size else 0.0, 1e-3 * scale, 1e-30)
        error = float(np.max(np.abs(a - b))) / size if a.size else 0.0
        if error > worst:
            worst, where = error, names[index] if index < len(names) else f"gradient {index}"
    if worst > _GRADIENT_TOLERANCE:
        return f"its gradients change ({where} by {worst:.1e} of its largest entry)"
    for what in short:
        for u, v in zip(short[what], long[what], strict=True):
            if not np.allclose(u, v, rtol=_VALUE_TOLERANCE, atol=1e-6):
                return f"its {what} change"
    return None
