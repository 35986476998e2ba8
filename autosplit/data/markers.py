"""Elements with no real row, which a pipeline puts between its micro-batches: the end
of an epoch or of a large batch (:func:`end_marker`), and a share's header
(:func:`is_header`, ``autosplit.data.sequences.by_length.cut_by_length``)."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from autosplit.graph import HOST

__all__ = ["end_marker", "is_end_marker", "is_header", "markable", "skip_to_end_marker"]


def end_marker(element_spec: Any) -> tf.data.Dataset | None:
    """One element of ``element_spec`` with no real row (``valid`` all 0, the rest
    zeros; a dimension of unknown size is 0), or None when a part is not a plain
    tensor (ragged, sparse): then an epoch's end is the end of its iterator."""
    if not markable(element_spec):
        return None
    with tf.device(HOST):
        zeros = tf.nest.map_structure(
            lambda s: tf.zeros([0 if d is None else d for d in s.shape], s.dtype), element_spec)
        return tf.data.Dataset.from_tensors(zeros)


def is_end_marker(element: Any) -> tf.Tensor:
    """Whether ``element`` is :func:`end_marker`'s: no real row (in a graph or eagerly)."""
    return tf.logical_not(tf.reduce_any(element[-1] > 0))


def is_header(element: Any) -> tf.Tensor:
    """Whether ``element`` is a share's header (``by_length.cut_by_length``'s, ``valid`` -1):
    like an end marker, it holds no real row."""
    return tf.reduce_any(element[-1] < 0)


def skip_to_end_marker(iterator: Any, *, batches_marked: bool = False) -> int:
    """Read ``iterator`` (of ``MicroBatches.dataset(marked=True)``) up to and including
    its next end marker, or to its end; returns the real elements dropped on the way.
    An epoch that ran the large batches its first epoch counted ends there:
    ``model.fit`` trains on no more of a longer epoch. Eager, on the host: mostly one
    element.

    ``batches_marked``: every large batch ends with a marker too (``Cut.tokens``),
    read already for the last one run; the epoch's is the marker that follows a marker.
    """
    dropped, after_marker = 0, batches_marked
    for element in iterator:
        if bool(is_header(element)):
            continue
        if bool(is_end_marker(element)):
            if after_marker or not batches_marked:
                break
            after_marker = True
        else:
            dropped += 1
            after_marker = False
    return dropped


def markable(element_spec: Any) -> bool:
    """Whether elements of ``element_spec`` can be marked: every part a plain tensor."""
    return all(type(leaf) is tf.TensorSpec for leaf in tf.nest.flatten(element_spec))
