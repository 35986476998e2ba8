"""What a model's own ``train_step`` does, caught while it runs: its ``apply_gradients``
recorded instead of applied (:func:`intercept`), the targets it differentiates
(:func:`watch_targets`), the variables it assigns (:func:`watch_writes`), and its scalar
trackers weighed by rows (:func:`weighed_trackers`). Each patch lasts for one call or one
trace and is undone after it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import keras
import tensorflow as tf
from tensorflow.python.ops import resource_variable_ops  # tf.Variable's classes

from autosplit.errors import UnsupportedModelError
from autosplit.keras_hooks import internals as _keras
from autosplit.keras_hooks.traced import counts_rows, row_reduction

__all__ = [
    "Intercepted",
    "Targets",
    "check_writes",
    "intercept",
    "watch_targets",
    "watch_writes",
    "weighed_trackers",
]


class Intercepted:
    """What one call of ``train_step`` tried to apply, per model trainable variable."""

    def __init__(self, model: keras.Model) -> None:
        self.model = model
        self.calls = 0
        # Sized when the step applies: a subclassed model the step's trace builds has
        # no variables before its first call.
        self.gradients: list = []

    def record(self, grads, variables) -> None:
        self.calls += 1
        if self.calls > 1:
            raise UnsupportedModelError(
                f"Expected `{type(self.model).__name__}.train_step` to apply gradients once "
                "per batch. Received: a step that calls `optimizer.apply_gradients` more "
                "than once. Its updates depend on each other within the batch, so they have "
                "no exact split into micro-batches in one pass: train it with model.fit.")
        index = {id(v): i for i, v in enumerate(self.model.trainable_variables)}
        self.gradients = [None] * len(index)
        for g, v in zip(grads, variables, strict=True):
            i = index.get(id(v))
            if i is None:
                raise UnsupportedModelError(
                    f"Expected `{type(self.model).__name__}.train_step` to apply gradients "
                    "to the model's trainable variables. Received: a gradient for "
                    f"{getattr(v, 'path', v.name)}, which is not one of them (frozen, or "
                    "not tracked by the model).")
            self.gradients[i] = g


@contextlib.contextmanager
def intercept(model: keras.Model, rows: tf.Tensor | None, batch_size: int
              ) -> Iterator[Intercepted]:
    """While ``train_step`` runs: its one ``apply_gradients`` is recorded, not applied,
    and scalar tracker updates weigh ``rows / batch_size``. Python-side patches, active
    while the step is traced (or run eagerly)."""
    seen = Intercepted(model)
    optimizer = model.optimizer

    def apply_gradients(grads_and_vars):
        pairs = list(grads_and_vars)
        seen.record([g for g, _ in pairs], [v for _, v in pairs])
        return optimizer.iterations

    def apply(grads, trainable_variables=None):
        seen.record(list(grads), list(trainable_variables or model.trainable_variables))

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
    with (_object_patches([(optimizer, "apply_gradients", apply_gradients),
                           (optimizer, "apply", apply)]),
          weighed_trackers(model, rows, batch_size),
          _class_patches([(base, "apply_gradients", foreign), (base, "apply", foreign)])):
        yield seen


@contextlib.contextmanager
def weighed_trackers(model: keras.Model, rows: tf.Tensor | None, batch_size: int | tf.Tensor
                     ) -> Iterator[None]:
    """While a step runs on a micro-batch of ``rows`` rows: a metric of the model updated
    with one scalar and no sample weight (``self.loss_tracker.update_state(loss)``) is
    given the weight ``rows / batch_size``, so that a large batch's micro-batches add up
    to one update of the whole batch's mean. A scalar computed from the batch's shape
    alone (its row count: ``images_seen.update_state(ops.shape(x)[0])``,
    :func:`counts_rows`) adds up over the micro-batches instead, to the large batch's
    count. Updates per example, or with weights of their own, pass as they are.
    ``rows`` None: no weighing (a throwaway trace)."""
    def weighted(metric):
        original = metric.update_state

        def update_state(*args, **kwargs):
            values = args[0] if args else kwargs.get("values")
            if (rows is not None and len(args) <= 1 and kwargs.keys() <= {"values"}
                    and values is not None and tf.convert_to_tensor(values).shape.rank == 0):
                share = tf.cast(rows, tf.float32) / tf.cast(batch_size, tf.float32)
                values = tf.convert_to_tensor(values)
                if not counts_rows(values):
                    return original(values, sample_weight=share)
                # A count of the rows adds up over the micro-batches: a Sum adds it as
                # it is; a Mean adds it with the weight n / B of one step's share.
                if isinstance(metric, keras.metrics.Sum):
                    return original(values)
                return original(tf.cast(values, tf.float32) / share, sample_weight=share)
            return original(*args, **kwargs)

        return update_state

    with _object_patches([(m, "update_state", weighted(m)) for m in _keras.all_metrics(model)
                          if isinstance(m, keras.metrics.Metric)]):
        yield


@contextlib.contextmanager
def _object_patches(patches: list[tuple[Any, str, Any]]) -> Iterator[None]:
    """Set each ``(object, name, value)`` on the instance for the block (shadowing its
    class's attribute), then remove it."""
    for obj, name, value in patches:
        object.__setattr__(obj, name, value)
    try:
        yield
    finally:
        for obj, name, _ in patches:
            with contextlib.suppress(AttributeError):
                object.__delattr__(obj, name)


@contextlib.contextmanager
def _class_patches(patches: list[tuple[type, str, Any]]) -> Iterator[None]:
    """Set each ``(class, name, value)`` for the block, then put back what the class
    itself had, or remove the attribute where it only inherited one."""
    saved = [(cls, name, vars(cls).get(name)) for cls, name, _ in patches]
    for cls, name, value in patches:
        setattr(cls, name, value)
    try:
        yield
    finally:
        for cls, name, original in saved:
            if original is None:
                delattr(cls, name)
            else:
                setattr(cls, name, original)


class Targets:
    """What :func:`watch_targets` saw: per model trainable variable (by id), whether its
    gradient is of a sum over the rows; whether a target is a ratio over the batch."""

    def __init__(self) -> None:
        self.summed: dict[int, bool] = {}
        self.ratio = False


@contextlib.contextmanager
def watch_targets(model: keras.Model, rows: int | None) -> Iterator[Targets]:
    """While a ``train_step`` is traced on a batch of ``rows`` rows (None: unknown): per
    model trainable variable (by id) that a ``tf.GradientTape.gradient`` call differentiates,
    whether that call's target is a sum over the rows. ``tape.gradient`` sums a
    non-scalar target, so a target with a row per example (rank 1 or more, its first
    dimension the batch's or unknown) is one, as is a scalar ``Sum`` of per-row values
    (``compute_loss`` returning ``ops.sum(loss)``,
    :func:`autosplit.keras_hooks.traced.row_reduction`): their micro-batches' gradients
    add up unweighed. Another scalar is taken for a mean; one that divides by a value of
    the batch (a mean over unmasked tokens) is noted as a ratio, which no weighing of the
    micro-batches reproduces.

    Raises:
        UnsupportedModelError: a variable differentiated both ways (no one weight fits).
    """
    targets = Targets()
    trainable = {id(v) for v in model.trainable_variables}
    original = tf.GradientTape.gradient

    def summed(target) -> bool:
        target = tf.convert_to_tensor(target)
        shape = target.shape
        if shape.rank == 0:
            kind = row_reduction(target, rows=rows)
            targets.ratio |= kind == "ratio"
            return kind == "sum"
        return shape.rank is not None and shape[0] in (None, rows)

    def gradient(tape, target, sources, *args, **kwargs):
        if any(id(v) in trainable for v in tf.nest.flatten(sources)):
            flags = {summed(t) for t in tf.nest.flatten(target)}
        for v in tf.nest.flatten(sources):
            if id(v) in trainable:
                seen = targets.summed
                flags_of_v = flags | ({seen[id(v)]} if id(v) in seen else set())
                if len(flags_of_v) > 1:
                    raise UnsupportedModelError(
                        f"Expected `{type(model).__name__}.train_step` to take the gradient "
                        "of each variable from either a mean over the batch (a scalar) or "
                        "a sum over it (a loss per example, which tape.gradient sums). "
                        f"Received: both, for {getattr(v, 'path', v.name)}; no one weight "
                        "per micro-batch splits that exactly. Reduce the per-example "
                        "losses to their mean (or sum) before tape.gradient, or train it "
                        "with model.fit.")
                seen[id(v)] = flags_of_v.pop()
        return original(tape, target, sources, *args, **kwargs)

    with _class_patches([(tf.GradientTape, "gradient", gradient)]):
        yield targets


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
    with _class_patches([(cls, name, wrap(getattr(cls, name))) for cls, name, wrap in wraps]):
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
