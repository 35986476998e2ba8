"""Rows of varying shape cut as they come: every micro-batch of a large batch padded to
that large batch's longest row (:func:`pad_to_longest`), as ``padded_batch(B)`` pads it
for ``model.fit``: exact for every model, its padding included."""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from autosplit.data.example_lengths import Lengths
from autosplit.data.structure import unnumbered

__all__ = ["pad_to_longest"]


def pad_to_longest(ds: tf.data.Dataset, sizes: list[int], *, own_lengths: bool,
                   lengths: Lengths | None = None) -> tf.data.Dataset:
    """``ds.rebatch(sizes)`` for batches whose shapes differ beyond the row count: every
    piece of a large batch is padded to the longest row of that large batch, with zeros
    (``""`` for strings), as ``padded_batch(B)`` pads the large batch by default: each
    part to its own longest.

    Each micro-batch then holds its rows exactly as ``model.fit`` on the large batch
    sees them, so every denominator that counts padded cells (Keras's
    ``sum_over_batch_size`` over a per-token loss masked by ``sample_weight``, a custom
    step's ``tf.size``) and every model that reads its padding (a pooling without a
    mask) is the large batch's.

    ``rebatch`` copies slices of its input batches into each piece and stops with
    "source and dst shapes are not compatible" when a piece spans two ``padded_batch``
    batches padded to different lengths. Here the batches are unbatched, each row is
    numbered, and ``group_by_window`` gathers the rows of each large batch (the rows
    come in order); a first pass over them finds the longest row, a second pads each
    row to it and cuts the pieces. The host holds the large batch's rows, one by one
    (its longest row is known only after the last), and stacks no more than a piece.

    Without ``own_lengths`` (rows padded by the user's ``padded_batch``, whose batches
    may hold rows of the next large batch), the parts with a length in ``lengths`` count
    as long as their group is without trailing zeros
    (``example_lengths.group_lengths``), so a large batch is as long, in each of its
    lengths, as ``padded_batch(B)`` of the same rows makes it.
    """
    period = sum(sizes)
    trim = not own_lengths and lengths is not None and lengths.number > 0

    plain = tf.data.Options()  # a window has no graph to optimise (TensorFlow warns)
    plain.experimental_optimization.apply_default_optimizations = False

    def shape_of(row):
        leaves = tf.nest.flatten(row)
        shapes = [tf.shape(t, out_type=tf.int64) for t in leaves]
        if trim:  # each length as long as the row is without its trailing zeros
            assert lengths is not None
            real = _row_lengths(leaves, lengths)
            for index in range(len(leaves)):
                found = lengths.of(index)
                if found is not None:
                    shapes[index] = tf.tensor_scatter_nd_update(
                        shapes[index], [[found[0] - 1]], [real[found[1]]])
        return tf.nest.pack_sequence_as(row, shapes)

    def longest(rows: tf.data.Dataset) -> Any:
        start = tf.nest.map_structure(lambda spec: tf.zeros([spec.shape.rank], tf.int64),
                                      rows.element_spec)
        return rows.with_options(plain).reduce(start, lambda most, row: tf.nest.map_structure(
            tf.maximum, most, shape_of(row)))

    def pad(row, shape):
        known = row.shape  # the sizes the rows share (a feature axis) stay static
        if trim and row.shape.rank:
            row = tf.slice(row, tf.zeros_like(shape), tf.minimum(
                shape, tf.shape(row, out_type=tf.int64)))
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


def _row_lengths(leaves: list[tf.Tensor], lengths: Lengths) -> list[tf.Tensor]:
    """Per group, one row's length (its leaves without the row axis): one past its last
    non-zero entry in any leaf of the group."""
    found: list[list[tf.Tensor]] = [[] for _ in range(lengths.number)]
    for index, t in enumerate(leaves):
        found_in = lengths.of(index)
        if found_in is None:
            continue
        axis, group = found_in
        nonzero = tf.not_equal(t, tf.zeros([], t.dtype))
        others = [a for a in range(t.shape.rank) if a != axis - 1]
        if others:
            nonzero = tf.reduce_any(nonzero, axis=others)
        columns = tf.range(1, tf.size(nonzero, out_type=tf.int64) + 1)
        found[group].append(tf.reduce_max(tf.where(nonzero, columns, 0)))
    return [tf.reduce_max(tf.stack(group)) for group in found]
