"""BatchNormalization's moving statistics, committed once per large batch, pooled exactly.

Under a split, each micro-batch's forward pass would move ``moving_mean`` and
``moving_variance`` once with that micro-batch's own statistics: k updates of momentum
``m`` per large batch (the old value weighted ``m**k``, not ``m``), and the spread between
the micro-batches' means lost from the variance. With ``batch_norm="pooled"`` (the
default) autosplit instead records, for every BatchNormalization layer in training mode,
the count ``n_j``, mean ``mu_j`` and biased variance ``v_j`` its ``_moments`` computes on
each micro-batch (of real rows only: padding never reaches it), pools them exactly
(Chan et al.'s parallel update, in float32)::

    N = sum n_j,   mu = sum n_j mu_j / N,
    v = sum (n_j / N) v_j + sum (n_j / N) (mu_j - mu)**2

and applies Keras's own update once per large batch:
``moving = momentum * moving + (1 - momentum) * pooled``. A layer called c times per
forward pass (one encoder over two views) is updated c times by Keras, once with each
call's statistics: each call is pooled on its own and the c updates applied in order
(the loss plan's trace counts the calls, ``LossPlan.batch_norm_calls``). The forward
normalisation still uses each micro-batch's statistics (that cannot change in one
pass); the moving statistics, which inference uses, are those of the whole batch.

While a micro-batch's forward pass is traced, the layer's own assignments to its moving
statistics are turned into no-ops (nothing reads them in training mode), so nothing but
the one update per large batch moves them: a micro-batch that runs out of memory, even
in mid-forward, leaves no trace, and a redone one is committed once. Counts are
per channel (a mask counts its unmasked positions); ``synchronized=True`` layers already
all-reduce their moments, and their counts are all-reduced alike. ``renorm=True`` layers
are left to Keras (their renorm statistics follow other rules): they update per
micro-batch, as with ``batch_norm="micro"``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import keras
import tensorflow as tf

from autosplit.keras_hooks import internals as _keras

__all__ = ["MODES", "Moments", "Pool", "calls_of", "counted_all", "pooled_layers", "recording"]

MODES = ("pooled", "micro")


class Moments(NamedTuple):
    """One layer's statistics over some rows, per channel (float32)."""

    count: tf.Tensor  # shape=(C,), rows x positions counted (unmasked ones)
    mean: tf.Tensor  # shape=(C,)
    m2: tf.Tensor  # shape=(C,), sum of squared deviations from ``mean``

    def merged(self, other: Moments) -> Moments:
        """Chan et al.'s pairwise update: the moments of both sets of rows."""
        count = self.count + other.count
        share = tf.math.divide_no_nan(other.count, count)
        delta = other.mean - self.mean
        return Moments(count, self.mean + delta * share,
                       self.m2 + other.m2 + delta * delta * self.count * share)


def pooled_layers(model: keras.Model) -> list:
    """The BatchNormalization layers whose moving statistics autosplit pools: built
    ones (a layer the model holds but never calls has no statistics; it stopped the
    step's set-up with an AttributeError)."""
    return [layer for layer in _keras.flatten_layers(model)
            if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable
            and not getattr(layer, "renorm", False)
            and getattr(layer, "moving_mean", None) is not None]


def _counts(layer, inputs, mask) -> tf.Tensor:
    """Per channel: how many values ``layer._moments`` averaged."""
    axes = list(layer._reduction_axes)
    channels = layer.moving_mean.shape[0]
    if mask is None:
        shape = tf.shape(inputs)
        n = tf.cast(tf.reduce_prod(tf.gather(shape, axes)), tf.float32)
        counts = tf.fill([channels], n)
    else:
        weights = tf.broadcast_to(tf.cast(mask, tf.float32)[..., None], tf.shape(inputs))
        counts = tf.reshape(tf.reduce_sum(weights, axis=axes), [channels])
    if (layer.synchronized and tf.distribute.has_strategy()
            and not tf.distribute.in_cross_replica_context()):
        # The layer all-reduced its moments: the count is the global one too.
        counts = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM,
                                                                 counts)
    return counts


class _Patches:
    """The patched ``_moments`` and moving-variable ``assign`` of each layer, installed
    while any thread records it. A strategy traces its replicas in threads of their own,
    each with its own records: the patches look them up per thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.users: dict[int, int] = {}  # id(layer) -> threads recording it
        self.local = threading.local()  # .records: id(layer) -> list of Moments

    def records(self) -> dict:
        if not hasattr(self.local, "records"):
            self.local.records = {}
        return self.local.records

    def install(self, layer) -> None:
        with self.lock:
            key = id(layer)
            self.users[key] = self.users.get(key, 0) + 1
            if self.users[key] > 1:
                return
            original = layer._moments
            records = self.records

            def moments(inputs, mask):
                mean, variance = original(inputs, mask)
                calls = records().get(key)
                if calls is not None:
                    counts = _counts(layer, inputs, mask)
                    shape = [layer.moving_mean.shape[0]]
                    var32 = tf.reshape(tf.cast(variance, tf.float32), shape)
                    calls.append(Moments(counts, tf.reshape(tf.cast(mean, tf.float32), shape),
                                         var32 * counts))
                return mean, variance

            object.__setattr__(layer, "_moments", moments)
            for variable in (layer.moving_mean, layer.moving_variance):
                object.__setattr__(variable, "assign", self._guarded(variable, key))

    def _guarded(self, variable, key):
        original = variable.assign

        def assign(value, *args, **kwargs):
            if key in self.records():  # recording: one update per large batch, later
                return value
            return original(value, *args, **kwargs)

        return assign

    def uninstall(self, layer) -> None:
        with self.lock:
            key = id(layer)
            self.users[key] -= 1
            if self.users[key]:
                return
            del self.users[key]
            for obj in (layer, layer.moving_mean, layer.moving_variance):
                name = "_moments" if obj is layer else "assign"
                with contextlib.suppress(AttributeError):
                    object.__delattr__(obj, name)


_PATCHES = _Patches()


@contextlib.contextmanager
def recording(layers: Sequence[Any]) -> Iterator[list[list[Moments]]]:
    """While a forward pass runs: every ``_moments`` call of ``layers`` is recorded.

    Yields one list per layer, filled with the :class:`Moments` of each call (a layer
    shared by two branches is called twice); the layers' own updates of their moving
    statistics do nothing meanwhile. Python-side patches of each layer's ``_moments``
    and of its moving variables' ``assign``, active while the forward pass is traced (or
    run eagerly), per thread.
    """
    records: list[list[Moments]] = [[] for _ in layers]
    mine = _PATCHES.records()
    for layer, calls in zip(layers, records, strict=True):
        _PATCHES.install(layer)
        mine[id(layer)] = calls
    try:
        yield records
    finally:
        for layer in layers:
            mine.pop(id(layer), None)
            _PATCHES.uninstall(layer)


def calls_of(layers: Sequence[Any], records: list[list[Moments]]) -> tuple[tuple[Any, int], ...]:
    """(layer, calls recorded) per layer, from :func:`recording`'s records."""
    return tuple((layer, len(calls)) for layer, calls in zip(layers, records, strict=True))


def counted_all(model: keras.Model, calls: Sequence[tuple[Any, int]]) -> bool:
    """Whether ``calls`` covers every layer :func:`pooled_layers` finds now (a first
    trace of an unbuilt model builds its layers as it goes, too late to record them)."""
    return [layer for layer, _ in calls] == pooled_layers(model)


class Pool:
    """Per replica: the pooled moments of the micro-batches committed in this large
    batch, per layer and per call of the layer in a forward pass. Variables, created
    once by ``autosplit.step.sums.Sums``; only the step's compiled functions change them.

    A layer called twice per forward pass (one encoder over two views, as SimSiam's)
    has its moving statistics updated twice per step by ``model.fit``, first with the
    first view's statistics, then with the second's; so here each call is pooled over
    the micro-batches on its own and the updates are applied in call order.
    """

    def __init__(self, layers: list, calls: Sequence[int], var) -> None:
        self.layers = layers
        self.calls = tuple(calls)
        self.count = [[var(layer.moving_mean.shape, "bn_count") for _ in range(n)]
                      for layer, n in zip(layers, calls, strict=True)]
        self.mean = [[var(layer.moving_mean.shape, "bn_mean") for _ in range(n)]
                     for layer, n in zip(layers, calls, strict=True)]
        self.m2 = [[var(layer.moving_mean.shape, "bn_m2") for _ in range(n)]
                   for layer, n in zip(layers, calls, strict=True)]

    def add(self, moments: list[list[Moments]]) -> list:
        """Commit one micro-batch's moments (per layer, per call)."""
        ops = []
        for layer, n, calls, counts, means, m2s in zip(
                self.layers, self.calls, moments, self.count, self.mean, self.m2, strict=True):
            if len(calls) != n:
                raise RuntimeError(
                    f"Expected {n} calls of {layer.name} in training mode per micro-batch, as "
                    f"the loss plan's trace saw. Received: {len(calls)}.")
            for count, mean, m2, new in zip(counts, means, m2s, calls, strict=True):
                merged = Moments(count.read_value(), mean.read_value(),
                                 m2.read_value()).merged(new)
                ops += [count.assign(merged.count), mean.assign(merged.mean),
                        m2.assign(merged.m2)]
        return ops

    def apply(self) -> list:
        """Keras's update, once per call of each layer, in call order, with that call's
        pooled statistics (where it saw rows)."""
        ops = []
        for layer, counts, means, m2s in zip(self.layers, self.count, self.mean, self.m2,
                                             strict=True):
            if not counts:
                continue
            momentum = float(layer.momentum)
            moving_mean = tf.cast(layer.moving_mean.value, tf.float32)
            moving_var = tf.cast(layer.moving_variance.value, tf.float32)
            for count, mean, m2 in zip(counts, means, m2s, strict=True):
                n = count.read_value()
                seen = n > 0
                pooled_var = tf.math.divide_no_nan(m2.read_value(), n)
                moving_mean = tf.where(
                    seen, moving_mean * momentum + mean.read_value() * (1 - momentum),
                    moving_mean)
                moving_var = tf.where(seen, moving_var * momentum + pooled_var * (1 - momentum),
                                      moving_var)
            ops += [layer.moving_mean.assign(tf.cast(moving_mean, layer.moving_mean.dtype)),
                    layer.moving_variance.assign(tf.cast(moving_var,
                                                         layer.moving_variance.dtype))]
        return ops

    def zero(self) -> None:
        """Start the next large batch (after :meth:`apply`, or to forget one)."""
        for v in [v for per_layer in (*self.count, *self.mean, *self.m2) for v in per_layer]:
            v.assign(tf.zeros(v.shape, tf.float32))
