"""Rows of varying shape cut as they come: every micro-batch of a large batch padded to
that large batch's longest row (:func:`pad_to_longest`), as ``padded_batch(B)`` pads it
for ``model.fit``: exact for every model, its padding included."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from autosplit.data.structure import unnumbered

__all__ = ["pad_to_longest"]


def pad_to_longest(ds: tf.data.Dataset, sizes: list[int]) -> tf.data.Dataset:
    """``ds.rebatch(sizes)`` for batches whose shapes differ beyond the row count: every
    piece of a large batch is padded to the longest row of that large batch, with zeros
    (``""`` for strings), as ``padded_batch(B)`` pads the large batch by default: each
    part to its own longest.

    Each micro-batch then holds its rows exactly as ``model.fit`` on the large batch
    sees them, so every denominator that counts padded cells (Keras's
    ``sum_over_batch_size`` over a per-token loss masked by ``sample_weight``, a custom
    step's ``tf.size``) and every model that reads its padding (a pooling without a
    mask) is the large batch's.

    A row is as long as the input gives it: an example as long as it is, a row of a
    user's ``padded_batch`` as long as its batch. Nothing is trimmed: trailing zeros are
    data to a model that reads its padding, and a row a map pads to a fixed length
    (``tf.pad(x, ...)[:n]``, whose length TensorFlow's shapes leave unknown) stays that
    long. Where the input's batches tile the large batches (``padded_batch(b)`` with b
    dividing B, or examples), that is ``padded_batch(B)`` of the same examples.

    ``rebatch`` copies slices of its input batches into each piece and stops with
    "source and dst shapes are not compatible" when a piece spans two ``padded_batch``
    batches padded to different lengths. Here the batches are unbatched, each row is
    numbered, and ``group_by_window`` gathers the rows of each large batch (the rows
    come in order); a first pass over them finds the longest row, a second pads each
    row to it and cuts the pieces. The host holds the large batch's rows, one by one
    (its longest row is known only after the last), and stacks no more than a piece.
    """
    period = sum(sizes)

    plain = tf.data.Options()  # a window has no graph to optimise (TensorFlow warns)
    plain.experimental_optimization.apply_default_optimizations = False

    def shape_of(row):
        return tf.nest.map_structure(lambda t: tf.shape(t, out_type=tf.int64), row)

    def longest(rows: tf.data.Dataset) -> Any:
        start = tf.nest.map_structure(lambda spec: tf.zeros([spec.shape.rank], tf.int64),
                                      rows.element_spec)
        return rows.with_options(plain).reduce(start, lambda most, row: tf.nest.map_structure(
            tf.maximum, most, shape_of(row)))

    def pad(row, shape):
        known = row.shape  # the sizes the rows share (a feature axis) stay static
        gap = shape - tf.shape(row, out_type=tf.int64)
        return tf.ensure_shape(tf.pad(row, tf.stack([tf.zeros_like(gap), gap], axis=1),
                                      constant_values=tf.zeros([], row.dtype)), known)

    def large_batch(_, window):
        rows = window.map(unnumbered)
        shapes = longest(rows)
        padded = rows.map(lambda *row: tf.nest.map_structure(
            pad, row[0] if len(row) == 1 else row, shapes))
        return padded.batch(1).rebatch(sizes if len(sizes) > 1 else sizes[0])

    return ds.unbatch().enumerate().group_by_window(lambda index, *_: index // period,
                                                    large_batch, window_size=period)
