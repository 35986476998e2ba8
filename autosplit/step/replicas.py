"""Per-replica graph code under a ``tf.distribute`` strategy, and the vote of the workers.

The train step's graph code is written for one replica. With one replica in sync it is
called as it is; with several it runs through ``strategy.run``, once per local replica,
and what each returned is read back with ``experimental_local_results``. A strategy
runs replica functions in threads of their own, where the caller's control
dependencies do not reach: order between replica functions travels as data, in tokens
(:meth:`Replicas.done`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from autosplit.data.layout import layout
from autosplit.graph import HOST, after
from autosplit.keras_hooks import internals as _keras

__all__ = ["Replicas", "row_count", "without_replica_axis"]


def without_replica_axis(specs: Any) -> Any:
    """Per-replica specs of elements that carry a leading local-replica axis."""
    return tf.nest.map_structure(lambda s: tf.TensorSpec(s.shape[1:], s.dtype), specs)


def _summed(*values: tf.Tensor) -> tf.Tensor:
    context = tf.distribute.get_replica_context()
    return context.all_reduce(tf.distribute.ReduceOp.SUM, tf.stack(values))


def _bounds(values: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    gathered = tf.distribute.get_replica_context().all_gather(values[None, :], axis=0)
    return tf.reduce_max(gathered, axis=0), tf.reduce_min(gathered, axis=0)


def row_count(total: float) -> float:
    """The agreement's sum as a count of rows: each local replica adds rows / replicas,
    which float32 rounds (6 x float32(500 / 3) = 1000.0001); -inf (a worker gave up) as
    it is."""
    return float(round(total) if math.isfinite(total) else total)


class Replicas:
    """The replicas of a model's strategy, as its graph code runs on them.

    Args:
        strategy: the model's ``tf.distribute`` strategy (the default one without).
    """

    def __init__(self, strategy: tf.distribute.Strategy) -> None:
        where = layout(strategy)
        self.strategy = strategy
        self.count = where.replicas  # in sync, over every worker
        self.local = where.local_replicas  # in this process

    def each(self, fn: Callable, *args: Any) -> Any:
        """``fn(*args)`` per replica: called as it is with one replica in sync, through
        ``strategy.run`` with several."""
        return fn(*args) if self.count == 1 else self.run(fn, *args)

    def run(self, fn: Callable, *args: Any) -> Any:
        """``fn(*args)`` on every local replica (``strategy.run``)."""
        return self.strategy.run(fn, args=args)

    def results(self, values: Any) -> tuple:
        """What each local replica returned."""
        return self.strategy.experimental_local_results(values)

    def done(self, values: Any) -> tf.Tensor:
        """A token that exists once every local replica's ``values`` do."""
        return after([t for out in self.results(values) for t in tf.nest.flatten(out)])

    def split(self, element: Any, axis: int = 0, own: Callable | None = None) -> Any:
        """One value per local replica from an element with a local-replica axis at
        ``axis`` (an element without one, with a single local replica, as it is), each
        replica's part taken on the host, then passed through ``own`` (a micro-batch
        cut back to its own shape, ``length_factor.own_shape``), so that only the part
        a replica computes on reaches its device. ``tf.distribute`` takes a value of
        another shape per replica, in graph mode and under XLA alike (each replica's
        program is compiled for its own shapes)."""
        if self.local == 1:
            return element
        with tf.device(HOST):
            parts = [tf.nest.map_structure(lambda t, i=i: tf.gather(t, i, axis=axis), element)
                     for i in range(self.local)]
            if own is not None:
                parts = [own(part) for part in parts]
        return tf.nest.map_structure(lambda *values: _keras.per_replica(list(values)), *parts)

    def vote(self, failed: tf.Tensor, rows: tf.Tensor) -> tf.Tensor:
        """Collective: ``[failed, rows]`` summed over every worker (one all-reduce of two
        floats); ``rows`` is this worker's, shared out between its local replicas."""
        return self.results(self.run(_summed, failed, rows / self.local))[0]

    def bounds(self, values: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        """Collective: ``values`` (a vector) at their most and their least over every
        replica (one all-gather: a collective all-reduce takes sums and means only)."""
        return self.results(self.run(_bounds, values))[0]

    def in_batch_order(self, gathered: tf.Tensor, per_element: int) -> tf.Tensor:
        """Every replica's rows (an ``all_gather``'s: replica after replica, each its
        elements of ``per_element`` rows in turn) in the large batch's order: worker after
        worker, each worker's elements in turn, each element's replicas side by side."""
        workers, local = self.count // self.local, self.local
        rest = tf.shape(gathered)[1:]
        shaped = tf.reshape(gathered, tf.concat([[workers, local, -1, per_element], rest], 0))
        order = [0, 2, 1, 3, *range(4, gathered.shape.rank + 3)]
        return tf.reshape(tf.transpose(shaped, order), tf.concat([[-1], rest], 0))

    def rows_of_this(self, whole: tf.Tensor, context: Any, per_element: int) -> tf.Tensor:
        """This replica's rows (``context``'s) of a tensor in the large batch's order
        (undoes :meth:`in_batch_order`)."""
        workers, local = self.count // self.local, self.local
        rest = tf.shape(whole)[1:]
        shaped = tf.reshape(whole, tf.concat([[workers, -1, local, per_element], rest], 0))
        order = [0, 2, 1, 3, *range(4, whole.shape.rank + 3)]
        mine = tf.reshape(tf.transpose(shaped, order), tf.concat(
            [[workers * local, -1], rest], 0))[context.replica_id_in_sync_group]
        return tf.reshape(mine, tf.concat([[-1], rest], 0))
