"""How a large batch's elements end, and an epoch's (:class:`Ends`), and the elements
with no real row that a pipeline puts between its micro-batches to say so: the end of an
epoch or of a large batch (:func:`end_marker`), and a share's header (:func:`is_header`,
``autosplit.data.sequences.by_length.cut_by_length``)."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import tensorflow as tf

from autosplit.graph import HOST

__all__ = ["Batch", "Ends", "end_marker", "is_end_marker", "is_header", "markable",
           "skip_to_end_marker"]


Batch = Literal["counted", "input", "marker", "header"]  # Ends.batch


@dataclasses.dataclass(frozen=True)
class Ends:
    """Where each large batch's elements end, and each epoch's: decided once per call
    (``MicroBatches.ends``) and read by the epochs, the out-of-memory recovery and the
    step's loop (``autosplit.step.loop.Pull``).

    ``batch``: ``"counted"``, the iterator holds a known count of elements for each
    large batch (an input that knows its length); ``"input"``, the last large batch ends
    where the input does; ``"marker"``, every large batch ends with an element of no row
    (micro-batches in tokens, a worker's share in rows); ``"header"``, every large batch
    (a worker's share cut by length) begins with a header, which the workers agree on,
    and ends with a marker.

    ``epoch``: ``"iterator"``, an epoch ends with its iterator, or after the large
    batches its first epoch counted; ``"marker"``, one iterator repeated over the epochs
    of an input whose length only its end tells, each epoch ended by a marker.
    """

    batch: Batch = "counted"
    epoch: Literal["iterator", "marker"] = "iterator"

    @property
    def stop(self) -> Literal["counted", "input", "marker"]:
        """How the step's loop stops (``Pull.ends``): at a marker, where any ends so."""
        if self.epoch == "marker" or self.marks_batches:
            return "marker"
        return "counted" if self.batch == "counted" else "input"

    @property
    def marks_batches(self) -> bool:
        """Whether every large batch ends with a marker (then an epoch's marker follows
        a large batch's)."""
        return self.batch in ("marker", "header")

    @property
    def headers(self) -> bool:
        """Whether every large batch begins with a share's header (:func:`is_header`)."""
        return self.batch == "header"


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


def skip_to_end_marker(iterator: Any, ends: Ends) -> int:
    """Read ``iterator`` (of ``MicroBatches.dataset(ends=...)``, its epochs ended by a
    marker) up to and including its next epoch's marker, or to its end; returns the real
    elements dropped on the way. An epoch that ran the large batches its first epoch
    counted ends there: ``model.fit`` trains on no more of a longer epoch. Eager, on the
    host: mostly one element.

    Where every large batch ends with a marker too (``Ends.marks_batches``), the last
    one run has read its own already; the epoch's is the marker that follows a marker.
    """
    dropped, after_marker = 0, ends.marks_batches
    for element in iterator:
        if bool(is_header(element)):
            continue
        if bool(is_end_marker(element)):
            if after_marker or not ends.marks_batches:
                break
            after_marker = True
        else:
            dropped += 1
            after_marker = False
    return dropped


def markable(element_spec: Any) -> bool:
    """Whether elements of ``element_spec`` can be marked: every part a plain tensor."""
    return all(type(leaf) is tf.TensorSpec for leaf in tf.nest.flatten(element_spec))
