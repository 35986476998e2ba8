"""The shapes of micro-batch a run gives its compiled step: under XLA, its programs.

XLA compiles a program per distinct shape of its inputs. Cut by length under XLA, a
micro-batch's lengths (and, in tokens, its rows) are rounded up to buckets
(``autosplit.data.sequences.lengths``), so a run compiles a bounded set of programs
(``Cut.programs``); :class:`Shapes` counts the ones it really gave the step, for
``FitReport.programs``.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from autosplit.data.sequences.length_factor import own_size
from autosplit.graph import HOST

__all__ = ["Shapes"]


class Shapes:
    """The distinct shapes of the micro-batches pipelines have given, counted as the step
    pulls them (after the prefetch, markers left out): under XLA, the programs the step
    compiles for them, one per shape, which ``FitReport.programs`` reports. One is
    shared by every pipeline of a run (an out-of-memory recovery's too); the smaller
    pieces an out-of-memory redo cuts inside the step are not counted."""

    def __init__(self) -> None:
        with tf.device(HOST):
            self._seen = tf.lookup.experimental.MutableHashTable(tf.string, tf.int64, 0)

    @tf.autograph.experimental.do_not_convert
    def record(self, *element: Any) -> Any:
        """``element`` as it is, once its shape is counted (a map's function)."""
        extent = getattr(element[0], "extent", ())
        if isinstance(extent, tuple):
            shapes = tf.concat([tf.shape(t, out_type=tf.int64)
                                for t in tf.nest.flatten(element) if isinstance(t, tf.Tensor)], 0)
            keys = tf.strings.reduce_join(tf.strings.as_string(shapes), separator=",")[None]
        else:  # local replicas' micro-batches side by side: each replica's own shape
            keys = _own_shapes(extent, element[-1])

        def insert():
            with tf.control_dependencies([self._seen.insert(keys, tf.ones_like(keys, tf.int64))]):
                return tf.constant(True)

        # An element with no real row is an end marker (``markers.end_marker``; a header, too).
        done = tf.cond(tf.reduce_any(element[-1] > 0), insert, lambda: tf.constant(False))
        with tf.control_dependencies([done]):
            return tf.nest.map_structure(tf.identity, element)

    def count(self) -> int:
        """Distinct shapes given so far."""
        return int(self._seen.size())


def _own_shapes(extent: tf.Tensor, valid: tf.Tensor) -> tf.Tensor:
    """Per local replica, a key of the shape its micro-batch is computed at
    (``length_factor.own_size``): its rows and its lengths."""
    rows, lengths = own_size(extent, tf.shape(extent)[1] if valid.shape[1] is not None
                             else None)
    shape = tf.concat([rows[:, None], lengths], 1)
    return tf.strings.reduce_join(tf.strings.as_string(shape), axis=1, separator=",")
