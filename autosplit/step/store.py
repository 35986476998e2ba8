"""The store of one large batch's elements on the host (:class:`Store`): what the
whole-batch step (``autosplit.step.whole_batch``) pulls before any pass runs, so that an
out-of-memory error in either pass redoes the large batch from it, losing nothing, and
reading nothing twice from the input."""

from __future__ import annotations

import math
from typing import Any

import tensorflow as tf

from autosplit.data.markers import is_end_marker
from autosplit.graph import HOST, after

__all__ = ["Store", "parts_of"]


class Store:
    """One large batch's elements, stacked per leaf (``[elements, ...]``), in variables
    on the host, with how many it holds, how many the last pull took, whether the input
    ended and its real rows."""

    def __init__(self, element_spec: Any) -> None:
        self.spec = element_spec
        with tf.device(HOST):
            self.values = [tf.Variable(tf.zeros([0, *[d or 1 for d in s.shape]], s.dtype),
                                       trainable=False, shape=tf.TensorShape(None))
                           for s in tf.nest.flatten(element_spec)]
            self.count = tf.Variable(0, dtype=tf.int32, trainable=False)
            self.pulled = tf.Variable(0, dtype=tf.int32, trainable=False)
            self.exhausted = tf.Variable(False, trainable=False)
            self.real = tf.Variable(0.0, trainable=False)  # rows whose valid is not 0

    def fits(self, element_spec: Any) -> bool:
        """Whether elements of ``element_spec`` can be stored here (same leaves)."""
        flat = tf.nest.flatten(element_spec)
        return len(flat) == len(self.values) and all(
            v.dtype == s.dtype for v, s in zip(self.values, flat, strict=True))

    def pull(self, iterator: Any, count: tf.Tensor, *, until: str, append: bool = False
             ) -> tf.Tensor:
        """Graph code: pull up to ``count`` elements (until the input ends, or, with
        ``until="marker"``, an element of no row), after the stored ones with
        ``append``; the number pulled."""
        flat_spec = tf.nest.flatten(iterator.element_spec)
        with tf.device(HOST):
            arrays = [tf.TensorArray(s.dtype, size=0, dynamic_size=True,
                                     element_shape=s.shape) for s in flat_spec]

            def body(i, stop, *arrays):
                optional = iterator.get_next_as_optional()
                has = optional.has_value()
                if until == "marker":
                    has = tf.cond(has, lambda: tf.logical_not(is_end_marker(
                        optional.get_value())), lambda: tf.constant(False))

                def one():
                    leaves = tf.nest.flatten(optional.get_value())
                    return (i + 1, tf.constant(False),
                            *[a.write(i, t) for a, t in zip(arrays, leaves, strict=True)])

                return tf.cond(has, one, lambda: (i, tf.constant(True), *arrays))

            n, stopped, *arrays = tf.while_loop(
                lambda i, stop, *_: tf.logical_and(i < count, tf.logical_not(stop)), body,
                (tf.constant(0), tf.constant(False), *arrays), parallel_iterations=1)

            def stored():
                new = [a.stack() for a in arrays]
                if append:
                    new = [tf.concat([v.read_value()[:self.count.read_value()], t], 0)
                           for v, t in zip(self.values, new, strict=True)]
                real = tf.reduce_sum(tf.cast(new[-1] > 0, tf.float32))
                return after([v.assign(t) for v, t in zip(self.values, new, strict=True)]
                             + [self.real.assign(real)])

            done = tf.cond(n > 0, stored, lambda: tf.constant(True))
            with tf.control_dependencies([done]):
                marks = [self.count.assign(self.count + n if append else n),
                         self.pulled.assign(n), self.exhausted.assign(stopped)]
            with tf.control_dependencies(marks):
                return tf.identity(n)

    def read(self) -> tuple[tf.Tensor, list]:
        """Graph code: the elements stored, and the stacked leaves."""
        with tf.device(HOST):
            return self.count.read_value(), [
                tf.ensure_shape(v.read_value(), [None, *s.shape])
                for v, s in zip(self.values, tf.nest.flatten(self.spec), strict=True)]

    def forget(self) -> tf.Tensor:
        """Start the next large batch (graph code, or eagerly)."""
        return after([self.count.assign(0), self.real.assign(0.0)])


def parts_of(stored: list, n: tf.Tensor, slices: int, rows: int
             ) -> tuple[list, tf.Tensor, int]:
    """Graph code: the ``n`` stored elements (leaves ``[n, rows, ...]``, ``valid`` last)
    cut into ``slices`` parts each, ``[n * slices, size, ...]`` per leaf, their
    ``valid`` (a part's last rows are copies of its element's last, which weigh
    nothing), and the parts' ``size``."""
    if slices == 1:
        return stored[:-1], stored[-1], rows
    size = math.ceil(rows / slices)
    index = tf.range(slices * size)
    clipped = tf.minimum(index, rows - 1)
    with tf.device(HOST):
        parts = [tf.reshape(tf.gather(t, clipped, axis=1),
                            tf.concat([[n * slices, size], tf.shape(t)[2:]], 0))
                 for t in stored]
        inside = tf.tile(tf.cast(index < rows, tf.float32)[None, :], [n, 1])
        valid = parts[-1] * tf.reshape(inside, [n * slices, size])
    return parts[:-1], valid, size
