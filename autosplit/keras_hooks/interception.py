"""What a model's own ``train_step`` does, caught while it runs: its ``apply_gradients``
recorded instead of applied (:func:`intercept`), its gradients answered per group of loss
terms (``autosplit.keras_hooks.gradients``), the variables it assigns
(:func:`watch_writes`), and its scalar trackers weighed as their values add up
(:func:`weighed_trackers`). Each patch lasts for one call or one trace and is undone
after it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import keras
import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops  # tf.Variable's classes

from autosplit.errors import UnsupportedModelError
from autosplit.keras_hooks import internals as _keras
from autosplit.keras_hooks.gradients import PLAIN, Reading, Split, split_gradients
from autosplit.keras_hooks.patches import class_patches, object_patches
from autosplit.keras_hooks.target import COUNT, FIXED, RATIO, SUM, log_parts, replayed
from autosplit.keras_hooks.traced import counts_rows, evaluate

__all__ = [
    "PLAIN",
    "Intercepted",
    "check_writes",
    "intercept",
    "watch_writes",
    "weighed_trackers",
]


class Intercepted:
    """What one call of ``train_step`` tried to apply: per group of loss terms
    (``Split``), per model trainable variable, the gradient the sums take."""

    def __init__(self, model: keras.Model, split: Split) -> None:
        self.model = model
        self.split = split
        self.calls = 0
        self.gradients: dict = {}  # group -> per trainable variable (None: none)
        # per scalar tracker update, in call order: how its parts combine (a throwaway
        # trace's reading, of static rows, which later traces replay) and the index of
        # its metric in internals.all_metrics(model)
        self.tracker_kinds: list[tuple[tuple[str, ...], int]] = []
        self.applied: list[tuple[Any, int]] = []  # (gradient as applied, variable index)
        self.deferred: list = []  # tracker updates the update makes (weighed_trackers)

    def record(self, grads, variables) -> None:
        self.calls += 1
        if self.calls > 1:
            raise UnsupportedModelError(
                f"Expected `{type(self.model).__name__}.train_step` to apply gradients once "
                "per batch. Received: a step that calls `optimizer.apply_gradients` more "
                "than once. Its updates depend on each other within the batch, so they have "
                "no exact split into micro-batches in one pass: train it with model.fit.")
        index = {id(v): i for i, v in enumerate(self.model.trainable_variables)}
        for g, v in zip(grads, variables, strict=True):
            i = index.get(id(v))
            if i is None:
                raise UnsupportedModelError(
                    f"Expected `{type(self.model).__name__}.train_step` to apply gradients "
                    "to the model's trainable variables. Received: a gradient for "
                    f"{getattr(v, 'path', v.name)}, which is not one of them (frozen, or "
                    "not tracked by the model).")
            if g is not None:
                self.applied.append((g, i))
            for group, part in self.split.resolve(g).items():
                self.gradients.setdefault(group, [None] * len(index))[i] = part

    def has_grad(self) -> tuple[bool, ...]:
        n = len(self.model.trainable_variables)
        return tuple(any(grads[i] is not None for grads in self.gradients.values())
                     for i in range(n))


@contextlib.contextmanager
def intercept(model: keras.Model, rows: tf.Tensor | None, batch_size: int, *,
              static_rows: int | None, inputs: Any, replay: Reading | None = None,
              trackers: tuple = (),
              warn: Callable[[str], None] | None = None, plain: bool = False
              ) -> Iterator[Intercepted]:
    """While ``train_step`` runs on ``inputs``, a micro-batch of ``rows`` real rows (None:
    a throwaway trace): its gradients are answered per group (``replay``: the groups the throwaway
    trace read), its one ``apply_gradients`` is recorded, not applied, and scalar tracker
    updates are weighed (:func:`weighed_trackers`; ``trackers``: how the throwaway trace
    read each, ``Intercepted.tracker_kinds``). After that apply the step reads the
    optimizer's step count (and a learning rate schedule of it) one step on, as after
    the one real apply of the large batch. ``plain``: the gradients are
    the step's own, unweighed, in the one group ``PLAIN`` (a full batch's reference;
    nothing weighed). Python-side patches, active while the
    step is traced (or run eagerly)."""
    optimizer = model.optimizer

    def foreign(self, *args, **kwargs):
        raise UnsupportedModelError(
            f"Expected `{type(model).__name__}.train_step` to apply gradients through "
            "`self.optimizer` only. Received: a step that applies another optimizer "
            f"({type(self).__name__}), as a GAN applies two. Each update depends on the "
            "other within the batch: there is no exact split in one pass; train it with "
            "model.fit.")

    # Any other optimizer's apply_gradients or apply raises; model.optimizer's own
    # attributes shadow these class attributes.
    base = keras.optimizers.Optimizer
    count = vars(optimizer).get("_iterations")  # what Optimizer.iterations returns
    with split_gradients(model, rows, batch_size, static_rows, replay,
                         inputs, plain) as split, _restored(optimizer, "_iterations"):
        seen = Intercepted(model, split)

        def applied():
            if count is not None and vars(optimizer).get("_iterations") is count:
                object.__setattr__(optimizer, "_iterations", tf.convert_to_tensor(count) + 1)

        def apply_gradients(grads_and_vars):
            pairs = list(grads_and_vars)
            seen.record([g for g, _ in pairs], [v for _, v in pairs])
            applied()
            return optimizer.iterations

        def apply(grads, trainable_variables=None):
            seen.record(list(grads), list(trainable_variables or model.trainable_variables))
            applied()

        with (object_patches([(optimizer, "apply_gradients", apply_gradients),
                              (optimizer, "apply", apply)]),
              weighed_trackers(model, None if plain else rows, batch_size, static_rows,
                               split.stop, warn, None if plain else seen.tracker_kinds,
                               trackers, None if plain else seen.deferred),
              class_patches([(base, "apply_gradients", foreign), (base, "apply", foreign)])):
            yield seen


def _is(value: Any, number: int) -> bool:
    return value is not None and value.ndim == 0 and float(value) == number


@contextlib.contextmanager
def _restored(obj: Any, name: str) -> Iterator[None]:
    """Put ``obj``'s own attribute ``name`` back as it was after the block."""
    saved = vars(obj).get(name)
    try:
        yield
    finally:
        if saved is not None:
            object.__setattr__(obj, name, saved)


@contextlib.contextmanager
def weighed_trackers(model: keras.Model, rows: tf.Tensor | None, batch_size: int | tf.Tensor,
                     static_rows: int | None = None, stop: Any = (),
                     warn: Callable[[str], None] | None = None,
                     record: list | None = None, replay: tuple = (),
                     deferred: list | None = None) -> Iterator[None]:
    """While a step runs on a micro-batch of ``rows`` rows: a metric of the model updated
    with one scalar (``self.loss_tracker.update_state(loss)``), without a sample weight or
    with the batch's row count as one (Keras's own train_step), is weighed so that a large
    batch's micro-batches add up to one update of the whole batch's value:

    - a mean over the rows (or a value that reads no batch) with the weight
      ``rows / batch_size`` (the count as it is, where it was given one);
    - a sum over the rows (``autosplit.keras_hooks.target``), or a count of the rows
      computed from the batch's shape alone (:func:`counts_rows`), so that the parts add
      up to the whole: a ``Sum`` metric adds it as it is;
    - a sum of such terms (a mean plus a penalty, a mean plus a sum), each part as
      itself;
    - a value with a ratio, a maximum or a minimum among its parts (a masked mean) is
      not updated here: its parts go to ``deferred`` as ``([(value, weight)], count)``
      (the weight in a part's running mean; the row count it was given, or None), and
      the update puts the metric back as the large batch found it and updates it once
      with the value combined so far (``LargeBatchUpdate._combine_trackers``);
    - anything else weighed by rows, and ``warn`` is told.

    Updates per example, or with weights of their own, pass as they are. ``rows`` None:
    no weighing (a throwaway trace): each update's ``(kinds, metric index)`` is appended
    to ``record``. ``replay``: those, by call order, read where the rows were static: a
    mean over the rows reads as a ratio of their dynamic count in a later trace, and is
    a mean."""
    calls = [0]
    metrics = _keras.all_metrics(model)

    def weighted(metric):
        original = metric.update_state

        def update_state(*args, **kwargs):
            if rows is None and record is None:  # a full batch's reference: read nothing
                return original(*args, **kwargs)
            values = args[0] if args else kwargs.get("values")
            weight = args[1] if len(args) > 1 else kwargs.get("sample_weight")
            counted = weight is not None and (
                counts_rows(tf.convert_to_tensor(weight))  # the row count, from a shape
                or (static_rows is not None and _is(evaluate(tf.convert_to_tensor(weight)),
                                                     static_rows)))
            if (len(args) > 2 or not kwargs.keys() <= {"values", "sample_weight"}
                    or values is None or tf.convert_to_tensor(values).shape.rank != 0
                    or (weight is not None and not counted)):
                return original(*args, **kwargs)
            values = tf.convert_to_tensor(values)
            parts = ([] if counts_rows(values) else log_parts(values, static_rows, stop))
            call, calls[0] = calls[0], calls[0] + 1
            if rows is None and record is not None:  # a throwaway trace: read, not weighed
                record.append((tuple(p.kind for p in parts),
                               next(i for i, m in enumerate(metrics) if m is metric)))
                return original(*args, **kwargs)
            share = tf.cast(rows, tf.float32) / tf.cast(batch_size, tf.float32)
            if call < len(replay):
                if deferred is not None and defers(replay[call][0]):
                    return _defer(deferred, replayed(parts, replay[call][0]), rows,
                                  weight if counted else None, metric)
                parts = replayed(parts, replay[call][0]) or parts
            kinds = {p.kind for p in parts}
            if not kinds <= {SUM, COUNT, FIXED, "last"}:
                if warn is not None:
                    warn(f"{metric.name} ({', '.join(sorted(kinds))})")
                return original(values, sample_weight=weight if counted else share)
            if kinds <= {SUM} and isinstance(metric, keras.metrics.Sum):
                return original(values)  # a sum adds up as it is
            # A sum (or a count) adds up over the micro-batches, a mean weighs by rows:
            # each micro-batch adds its share of the whole batch's value.
            summed = [tf.cast(p.value, tf.float32) for p in parts if p.kind == SUM]
            if not parts:
                summed = [tf.cast(values, tf.float32)]
            rest = [tf.cast(p.value, tf.float32) for p in parts if p.kind != SUM]
            return original(tf.add_n([s / share for s in summed] + rest),
                            sample_weight=weight if counted else share)

        return update_state

    with object_patches([(m, "update_state", weighted(m)) for m in _keras.all_metrics(model)
                         if isinstance(m, keras.metrics.Metric)]):
        yield


def defers(kinds: tuple[str, ...]) -> bool:
    """Whether a tracker update of parts ``kinds`` waits for the large batch's value
    (:func:`weighed_trackers`): a ratio, a maximum or a minimum, beside parts that
    combine."""
    return bool(set(kinds) & {RATIO, "max", "min"}) and set(kinds) <= {
        SUM, COUNT, FIXED, RATIO, "max", "min", "last"}


def _defer(deferred: list, parts: list | None, rows: Any, count: Any, metric: Any) -> None:
    if parts is None:
        raise UnsupportedModelError(
            f"Expected the value the train_step gives the tracker {metric.name} to read "
            "the same in every trace. Received: another reading on a micro-batch of any "
            "rows than on one of static rows. Return the value from the step instead.")
    deferred.append(([(tf.cast(p.value, tf.float32), p.weight(rows)) for p in parts],
                     None if count is None else tf.cast(count, tf.float32)))


@contextlib.contextmanager
def watch_writes() -> Iterator[list]:
    """The Keras variables a ``train_step`` assigns outside any layer's call and any seed
    generator's draw, while it is traced: state the step keeps itself (an exponential
    moving average of the weights, a queue, a counter). Layers' own state (BatchNorm's
    statistics) is written in their call, a random op's seed by its generator, and
    metrics' totals by their ``update_state``: the caller allows those by identity."""
    written: list = []
    depth = [0]

    def inside(original):
        def method(self, *args, **kwargs):
            depth[0] += 1
            try:
                return original(self, *args, **kwargs)
            finally:
                depth[0] -= 1
        return method

    def watched(original):
        def method(self, *args, **kwargs):
            if not depth[0]:
                written.append(self)
            # What it assigns in turn (a Keras variable's TensorFlow variable, a
            # subclass's super() call) is this one write.
            return inside(original)(self, *args, **kwargs)
        return method

    wraps = [(keras.layers.Layer, "__call__", inside),
             (keras.random.SeedGenerator, "next", inside)]
    # Keras variables, and TensorFlow's own (a tf.Variable the step holds, or a Keras
    # variable's `.value`): a review found both written unseen, 0.3-0.4 off model.fit.
    for cls in (keras.Variable, resource_variable_ops.BaseResourceVariable,
                resource_variable_ops.ResourceVariable):
        wraps += [(cls, name, watched) for name in ("assign", "assign_add", "assign_sub")]
    with class_patches([(cls, name, wrap(getattr(cls, name))) for cls, name, wrap in wraps]):
        yield written


def check_writes(model: keras.Model, written: list) -> None:
    metrics = _keras.all_metrics(model)
    metric_variables = {id(v) for m in metrics for v in m.variables}
    metric_variables |= {id(getattr(v, "value", None)) for m in metrics for v in m.variables}
    own = [v for v in written if id(v) not in metric_variables]
    if own:
        names = sorted({getattr(v, "path", v.name) for v in own})
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        raise UnsupportedModelError(
            f"Expected `{type(model).__name__}.train_step` to change variables only through "
            "`self.optimizer`, the model's layers and its metrics. Received: a step that "
            f"assigns {shown} itself (a moving average of the weights, a queue, a counter, "
            "or a metric not listed in the model's `metrics`). "
            "autosplit runs the step once per micro-batch, so that update would run once "
            "per micro-batch, before the large batch's gradients are applied. Make it in "
            "a callback's on_train_batch_end (once per large batch, after the update), or "
            "train with model.fit.")
