"""A custom step's ``tape.gradient`` calls, answered per group of terms, and the
gradients that reach its ``apply_gradients`` traced back to them.

While a model's own ``train_step`` runs on one micro-batch (:func:`split_gradients`),
every ``tape.gradient`` of a trainable variable reads its target
(``autosplit.keras_hooks.target``) and returns, per group of terms, the gradient that
adds up over the micro-batches: ``"count"`` (means over the rows) weighed by the
micro-batch's share of the rows, ``"sum"`` unweighed, ``("deferred", r)`` (a ratio)
weighed by its own divisor, which the large batch's sum divides once. The step gets the
sum of its groups back; what it passes to ``apply_gradients`` must be those tensors as
they are (or cast, times a constant, added up): a transform in between (``clip_by_global_norm``)
would act on each micro-batch's part, so it is refused with the optimizer's own
``clipnorm`` / ``global_clipnorm`` / ``clipvalue`` as the fix, which act once.

The groups found by the step's throwaway trace are replayed, term by term, by every later
trace: the sums are sized for them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import keras
import tensorflow as tf

from autosplit.errors import UnsupportedModelError
from autosplit.keras_hooks.patches import class_patches
from autosplit.keras_hooks.target import COUNT, FIXED, RATIO, SUM, Term, Unreadable, read
from autosplit.keras_hooks.traced import evaluate

__all__ = ["PLAIN", "Reading", "Split", "layer_outputs", "split_gradients"]

PLAIN = "plain"  # the one group of a step's own gradients, unweighed

_TRANSFORM_FIX = (
    "autosplit adds up the micro-batches' gradients and applies them once, so a transform "
    "written between tape.gradient and apply_gradients would act on each micro-batch's part "
    "of the gradient instead of the large batch's. Clip with the optimizer instead "
    "(`clipnorm=`, `global_clipnorm=` or `clipvalue=` in its constructor: applied once, to "
    "the large batch's gradient), or train with model.fit.")


@dataclass(frozen=True)
class Reading:
    """What the throwaway trace read: the groups, in order, and per ``tape.gradient``
    call, per flat target, the group of each of its terms."""

    groups: tuple = ()
    calls: tuple = ()

    @property
    def ratios(self) -> int:
        return sum(1 for g in self.groups if isinstance(g, tuple))


@dataclass
class Split:
    """One step's gradient calls: per group, the gradients the sums take."""

    model: Any
    rows: Any  # the micro-batch's real rows (a tensor), or None in the throwaway trace
    batch_size: Any
    static_rows: int | None
    replay: Reading | None
    stop: set = field(default_factory=set)
    groups: list = field(default_factory=list)
    calls: list = field(default_factory=list)
    parts: dict = field(default_factory=dict)  # key of a returned gradient -> {group: part}
    denominators: dict = field(default_factory=dict)  # ratio index -> its divisor
    half: bool = False  # the model computes in float16: ratios differentiated as means

    def reading(self) -> Reading:
        return Reading(tuple(self.groups), tuple(self.calls))

    def resolve(self, gradient: Any) -> dict:
        """Per group, the part of ``gradient`` (what the step passed to
        ``apply_gradients``) that the sums take: a gradient ``tape.gradient`` returned,
        cast, times a constant, or a sum or difference of such."""
        if gradient is None:
            return {}
        if _key(gradient) in self.parts:
            return dict(self.parts[_key(gradient)])
        op = getattr(gradient, "op", None)
        if op is None or isinstance(gradient, tf.IndexedSlices):
            raise self._transform(None)
        if op.type in ("Identity", "Cast"):
            return self.resolve(op.inputs[0])
        if op.type in ("AddV2", "Add", "AddN", "Sub"):
            parts = [self.resolve(t) for t in op.inputs]
            if op.type == "Sub":
                parts[1] = {g: -p for g, p in parts[1].items()}
            summed: dict = {}
            for part in parts:
                for g, p in part.items():
                    summed[g] = p if g not in summed else summed[g] + p
            return summed
        constant = [evaluate(t) for t in op.inputs] if op.type == "Mul" else []
        scalars = [i for i, c in enumerate(constant) if c is not None and not c.ndim]
        if len(scalars) == 1:
            factor = float(constant[scalars[0]])  # type: ignore[arg-type]  # scalars: not None
            return {g: p * factor for g, p in self.resolve(op.inputs[1 - scalars[0]]).items()}
        raise self._transform(op)

    def _transform(self, op) -> UnsupportedModelError:
        where = "" if op is None else f" (op {op.type!r}, {op.name!r})"
        return UnsupportedModelError(
            f"Expected `{type(self.model).__name__}.train_step` to pass the gradients "
            "tape.gradient returned to apply_gradients as they are. Received: gradients "
            f"transformed in between{where}, as tf.clip_by_global_norm, clip_by_norm or "
            f"clip_by_value do. {_TRANSFORM_FIX}")

    def weight(self, group: Any) -> Any:
        """What a micro-batch's gradient of ``group`` is weighed by."""
        if isinstance(group, tuple):
            return self.denominators[group[1]]
        if group == COUNT and self.rows is not None:
            return tf.cast(self.rows, tf.float32) / tf.cast(self.batch_size, tf.float32)
        return tf.constant(1.0)


def _key(tensor: Any) -> Any:
    return tensor.name if isinstance(tensor, tf.Tensor) and hasattr(tensor, "op") else id(tensor)


def _groups_of(terms: list[Term], split: Split) -> tuple:
    """Each term's group, new ratio groups numbered after the ones already seen; a term
    that reads no batch joins the first mean or ratio beside it (counted once)."""
    ratios: dict[int, Any] = {}
    groups: list = []
    for term in terms:
        if term.kind == RATIO:
            if id(term.denominator) not in ratios:
                ratios[id(term.denominator)] = ("deferred",
                                                sum(isinstance(g, tuple) for g in split.groups)
                                                + len(ratios))
            groups.append(ratios[id(term.denominator)])
        else:
            groups.append({SUM: SUM, COUNT: COUNT}.get(term.kind))
    anchor = next((g for g in groups if g not in (SUM, None)), COUNT)
    return tuple(anchor if g is None else g for g in groups)


def _refusal(model: keras.Model, error: Unreadable) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"Expected the loss `{type(model).__name__}.train_step` differentiates to be made "
        "of sums and means over the batch's rows (or ratios of sums, as a masked mean), "
        "which add up exactly over micro-batches. Received: "
        f"{error}. That part of the loss depends on the whole large batch at once, so no "
        "split into micro-batches computes it: write the loss as a mean or sum over rows "
        "(or a sum over a count of tokens); for a loss over the whole batch (in-batch "
        "negatives), compute it in compute_loss and leave train_step to Keras, or compile "
        "it (model.compile(loss=...)): fit_large_batch computes those over the whole "
        "batch, outputs first. Or train the model with model.fit.")


def _read_call(split: Split, targets: list) -> list[tuple[list[Term], tuple]]:
    """Per flat target: its terms and their groups (read now, or replayed)."""
    index = len(split.calls)
    replay = split.replay.calls[index] if split.replay and index < len(split.replay.calls) \
        else None
    read_now = []
    for position, target in enumerate(targets):
        try:
            terms = read(target, split.static_rows, split.stop)
        except Unreadable as error:
            raise _refusal(split.model, error) from None
        groups = _groups_of(terms, split) if replay is None else replay[position]
        if len(groups) != len(terms):
            raise UnsupportedModelError(
                f"Expected `{type(split.model).__name__}.train_step`'s loss to read the same "
                "at every micro-batch size. Received: a loss whose terms change with the "
                f"micro-batch's shape ({len(terms)} terms here, {len(groups)} when traced "
                "first); train it with model.fit.")
        for term, group in zip(terms, groups, strict=True):
            if isinstance(group, tuple) and term.denominator is not None:
                split.denominators[group[1]] = term.denominator
            if group not in split.groups:
                split.groups.append(group)
        read_now.append((terms, groups))
    split.calls.append(tuple(groups for _, groups in read_now))
    return read_now


def _answer(split: Split, tape, original, target, sources, kwargs) -> Any:
    targets = [tf.convert_to_tensor(t) for t in tf.nest.flatten(target)]
    by_group: dict = {}
    for t, (terms, groups) in zip(targets, _read_call(split, targets), strict=True):
        if len(set(groups)) == 1:
            weight = split.weight(groups[0])
            by_group.setdefault(groups[0], []).append(
                (t, tf.ones_like(t) * tf.cast(weight, t.dtype)))
            continue
        for term, group in zip(terms, groups, strict=True):
            if split.replay is None and term.kind != FIXED and _reads_weights(
                    tape, original, term.coefficient, sources):
                raise _refusal(split.model, Unreadable(
                    term.tensor.op, "a term of a mixed loss multiplied by a trainable value"))
            value = tf.cast(term.coefficient, tf.float32) * tf.cast(split.weight(group),
                                                                    tf.float32)
            by_group.setdefault(group, []).append(
                (term.tensor, tf.cast(value, term.tensor.dtype)))
    flat_sources = tf.nest.flatten(sources)
    per_group = {group: _weighed(split, group, original, tape, pairs, flat_sources, kwargs)
                 for group, pairs in by_group.items()}
    answered: list = []
    for index in range(len(flat_sources)):
        parts = {g: grads[index] for g, grads in per_group.items() if grads[index] is not None}
        if not parts:
            answered.append(None)
            continue
        total = next(iter(parts.values())) if len(parts) == 1 else tf.add_n(
            [tf.convert_to_tensor(p) for p in parts.values()])
        split.parts[_key(total)] = parts
        answered.append(total)
    return tf.nest.pack_sequence_as(sources, answered)


def _weighed(split: Split, group: Any, original, tape, pairs: list, sources: list,
             kwargs: dict) -> list:
    """The gradients of ``pairs`` (tensors, each with its weight) of ``group``. Under
    ``mixed_float16`` a ratio's are differentiated without its divisor (the micro-batch's
    own mean, as large in float16 as the full batch's: its numerator's would overflow
    where the full batch does not), then multiplied by it in float32."""
    divisor = split.weight(group) if split.half and isinstance(group, tuple) else None
    weights = [w if divisor is None else tf.math.divide_no_nan(w, tf.cast(divisor, w.dtype))
               for _, w in pairs]
    grads = original(tape, [t for t, _ in pairs], sources, output_gradients=weights, **kwargs)
    if divisor is None:
        return grads
    return [None if g is None else _times(g, divisor) for g in grads]


def _times(gradient: Any, factor: Any) -> Any:
    """``gradient`` (dense or sparse) times a scalar ``factor``, in its dtype."""
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(gradient.values * tf.cast(factor, gradient.values.dtype),
                                gradient.indices, gradient.dense_shape)
    return gradient * tf.cast(factor, gradient.dtype)


def _reads_weights(tape, original, coefficient, sources) -> bool:
    if not isinstance(coefficient, tf.Tensor):
        return False
    return any(g is not None for g in original(tape, coefficient, tf.nest.flatten(sources),
                                               unconnected_gradients="none"))


@contextlib.contextmanager
def split_gradients(model: keras.Model, rows: Any, batch_size: Any, static_rows: int | None,
                    replay: Reading | None, inputs: Any, plain: bool = False
                    ) -> Iterator[Split]:
    """While the model's ``train_step`` runs on ``inputs`` (the data it is given): its
    tapes are persistent (a loss of several groups takes one gradient per group) and their
    gradients of trainable variables are answered per group (:class:`Split`). ``rows``
    None: the throwaway trace. ``plain``: answered as they are, in one group ``PLAIN``."""
    split = Split(model, rows, batch_size, static_rows, replay,
                  half=getattr(model, "compute_dtype", "float32") == "float16")
    split.stop.update(t.op for t in tf.nest.flatten(inputs) if hasattr(t, "op"))
    original_init, original = tf.GradientTape.__init__, tf.GradientTape.gradient

    def init(tape, persistent=False, watch_accessed_variables=True):
        original_init(tape, persistent=True,
                      watch_accessed_variables=watch_accessed_variables)

    def gradient(tape, target, sources, output_gradients=None, **kwargs):
        trainable = {id(v) for v in model.trainable_variables}  # a step may build them
        if output_gradients is not None or not any(
                id(v) in trainable for v in tf.nest.flatten(sources)):
            return original(tape, target, sources, output_gradients, **kwargs)
        if not plain:
            return _answer(split, tape, original, target, sources, kwargs)
        answered = original(tape, target, sources, output_gradients, **kwargs)
        for g in tf.nest.flatten(answered):
            if g is not None:
                split.parts[_key(g)] = {PLAIN: g}
        return answered

    with class_patches([(tf.GradientTape, "__init__", init),
                        (tf.GradientTape, "gradient", gradient)]), layer_outputs(split.stop):
        yield split


@contextlib.contextmanager
def layer_outputs(stop: set) -> Iterator[set]:
    """Collect into ``stop`` the ops of the outputs of the layers (the model, its
    sub-models) a step calls itself: the per-row values its loss starts from."""
    depth = [0]
    original = keras.layers.Layer.__call__

    def call(layer, *args, **kwargs):
        depth[0] += 1
        try:
            outputs = original(layer, *args, **kwargs)
        finally:
            depth[0] -= 1
        if not depth[0]:
            stop.update(t.op for t in tf.nest.flatten(outputs) if hasattr(t, "op"))
        return outputs

    with class_patches([(keras.layers.Layer, "__call__", call)]):
        yield stop
