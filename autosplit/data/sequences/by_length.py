"""The cut by length: each large batch's rows sorted by what they cost, then cut into
micro-batches each padded only to its own longest row (:func:`cut_by_length`; arrays'
row numbers, :func:`cut_rows_by_length`), as a :class:`~.cut.Cut` says.

Rows of varying length come padded (``padded_batch``, a ragged input autosplit pads). A
large batch cut as it comes pads every micro-batch to the large batch's longest row
(``autosplit.data.sequences.longest``): exact for every model, and mostly padding on a
heavy-tailed corpus. Sorted by length first (:func:`cut_by_length`), the short rows
share micro-batches and the long ones theirs, and every part of a micro-batch is padded
only to its own longest row in its own length (``autosplit.data.sequences.lengths``): a
source to the micro-batch's longest source, its target to its longest target. Under XLA
each length is rounded up to a bucket (``autosplit.data.sequences.buckets``), and in
tokens each micro-batch's rows to what the budget holds there or half, with copies of a
row that weigh nothing: a bounded set of programs (:meth:`Cut.programs`). Without XLA
any length runs as is.

That is exact only for a model whose losses and gradients ignore padding
(``autosplit.step.padding`` checks it), and only if every denominator that counts padded
cells counts the large batch's: each micro-batch's inputs come as
``length_factor.Shortened``, whose ``length_factor`` holds, per model output, the large
batch's padded length over the micro-batch's in the length that output follows.

Arrays of one shape that hold padded sequences (``keras.utils.pad_sequences``, at the
front by default or at the end) are cut alike (:func:`cut_rows_by_length`): their row
numbers sorted by each row's length, each micro-batch gathered and cut to its longest row
(:func:`trim`); their large batch is as long as the arrays.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from autosplit.data.sequences.cut import Cut
from autosplit.data.sequences.lengths import Lengths, PaddedArrays, real_lengths
from autosplit.data.sequences.pieces import kept_bounds, sorted_pieces
from autosplit.data.split import Piece
from autosplit.data.structure import unnumbered

__all__ = ["cut_by_length", "cut_rows_by_length", "extent_of", "trim"]


def _front(t: tf.Tensor, axis: int) -> tf.Tensor:
    """One row's ``t`` with its ``axis`` (counted with the rows) first."""
    order = [axis - 1] + [a for a in range(t.shape.rank) if a != axis - 1]
    return t if axis == 1 else tf.transpose(t, order)


def _back(t: tf.Tensor, axis: int) -> tf.Tensor:
    """:func:`_front` undone on a batch of rows."""
    rank = t.shape.rank
    order = [0, *range(2, axis + 1), 1, *range(axis + 1, rank)]
    return t if axis == 1 else tf.transpose(t, order)


def cut_by_length(ds: tf.data.Dataset, pattern: list[Piece], cut: Cut, *,
                  cap: int | None = None, shares: bool = False) -> tf.data.Dataset:
    """The kept pieces of ``pattern`` from every large batch of ``ds`` (batches of rows,
    of any size), each large batch's kept rows sorted by what they cost
    (``lengths.row_costs``) first; each piece ``(rows, length_factor, valid)``, each of
    its parts padded with zeros to the piece's longest row in the part's length (at most
    the large batch's longest; under XLA its bucket, see ``pieces.sorted_pieces``),
    ``length_factor`` per model output the large batch's length over that
    (``length_factor.Shortened``), ``valid`` 1.0 per real row.

    The large batch's length, in each of an example's lengths, is what its denominators
    that count padded cells count (``length_factor``): its longest row's as the input gives
    it, an example as long as it is, a row of a user's ``padded_batch`` as long as its
    batch, a row a map pads to a fixed length that long (as ``padded_batch(B)`` of the
    same examples pads it where the input's batches tile the large batches). A batch
    of the input that spans two large batches, and a share (padded by TensorFlow's
    rebatch of each worker's batches), says nothing of which rows its length is
    for: their rows count as long as they are without trailing zeros. The pieces are
    cut short of it, to their rows' lengths without trailing zeros, which the check of
    padding (``autosplit.step.padding``) has shown the model ignores.

    A short last large batch gives the pieces ``rebatch`` would: those that start
    before its last row. The host holds one large batch's rows, unpadded (a ragged
    batch; a part whose length is not on its first axis after the rows has that axis
    moved there, and back in the piece), and stacks no more than a piece. With
    ``cut.tokens``, the pieces are :func:`token_pieces` of at most ``cap`` rows, each
    large batch's last an empty one.

    ``shares``: each element of ``ds`` is a large batch of its own (a worker's share of
    a step, ``autosplit.data.sharded``), padded: its pieces come after a header, a row
    of zeros whose ``valid`` is -1 and whose ``length_factor`` holds, per model output, the
    share's length (0 for a share of no row), for the workers to agree on the large
    batch's; in rows, they end with a row of zeros whose ``valid`` is 0 (a marker).
    """
    lengths = cut.lengths
    assert lengths is not None
    bounds = kept_bounds(pattern)
    structure = ds.element_spec  # of a row, once unbatched

    def pieces(leaves, n, row_lengths, longest, ceiling):
        def piece(index, length, length_factor, valid):
            def take(i, t):
                found = lengths.of(i)
                if found is None:
                    return tf.gather(t, index)
                kept = tf.gather(t, index)
                shape = tf.concat([tf.stack([tf.size(index, out_type=tf.int64),
                                             length[found[1]]]),
                                   tf.constant(t.shape[2:].as_list(), tf.int64)], 0)
                dense = tf.ensure_shape(kept.to_tensor(shape=shape), [None, *t.shape[1:]])
                return _back(dense, found[0])

            return tf.nest.pack_sequence_as(structure, [take(i, t) for i, t in enumerate(
                leaves)]), length_factor, extent_of(length, index, cut), valid

        cut_up = sorted_pieces(row_lengths, n, longest, bounds, cut, cap,
                               ceiling=ceiling).map(piece)
        return _with_header(cut_up, leaves, n, longest, structure, cut) if shares else cut_up

    def running(most, batch):
        most = tf.maximum(most, batch[3])
        return most, (*batch, most)

    batches = _measured_batches(ds, lengths, sum(p.rows for p in pattern), shares)
    if cut.buckets:  # XLA's buckets reach no further than the longest row met so far
        batches = batches.scan(tf.zeros([lengths.number], tf.int64), running)
    else:
        batches = batches.map(lambda *batch: (*batch, batch[3]))
    return batches.flat_map(pieces)


def extent_of(length: tf.Tensor, index: tf.Tensor, cut: Cut) -> Any:
    """A piece's :attr:`~.length_factor.Shortened.extent` on several local replicas: per
    row, the piece's ``length`` in each of an example's lengths; () on one."""
    if cut.replicas == 1:
        return ()
    return tf.tile(tf.cast(length, tf.int32)[None, :], tf.stack([tf.size(index), 1]))


def _measured_batches(ds: tf.data.Dataset, lengths: Lengths, period: int,
                      shares: bool) -> tf.data.Dataset:
    """The large batches of ``ds`` (``period`` rows each; or each element a share), as
    ``(leaves, rows, row_lengths, longest)``: the leaves a ragged batch of their rows,
    each length moved to the first axis after the rows; per row and length, its length
    without trailing zeros; per length, the large batch's length (:func:`cut_by_length`)."""
    def row(whole, *element):
        leaves = tf.nest.flatten(element[0] if len(element) == 1 else element)
        moved = []
        for i, t in enumerate(leaves):
            found = lengths.of(i)
            moved.append(t if found is None else _front(t, found[0]))
        return (whole, *moved)

    def measured(whole, *leaves):
        given, real = [], []
        for group in range(lengths.number):
            members = [leaves[i] for i in lengths.members(group)]
            given.append(tf.reduce_max(tf.stack([t.row_lengths() for t in members]), axis=0))
            real.append(tf.reduce_max(tf.stack([real_lengths(t) for t in members]), axis=0))
        row_lengths = tf.stack(real, axis=1)
        # A row as long as the input gives it where its batch lies in this large batch
        # (its longest row is then here, as long as it is); a row of a batch that spans
        # two large batches, or of a share, without its trailing zeros.
        own = tf.where(whole[:, None], tf.stack(given, axis=1), row_lengths)
        return leaves, _rows_of(leaves[0]), row_lengths, tf.reduce_max(own, axis=0)

    @tf.autograph.experimental.do_not_convert
    def large_batch(_, window):
        return window.map(unnumbered).ragged_batch(period)

    def within(start, *batch):  # per row: its batch lies in one large batch
        n = tf.shape(tf.nest.flatten(batch)[0], out_type=tf.int64)[0]
        whole = start // period == (start + n - 1) // period
        return start + n, (tf.fill([n], whole), *batch)

    if shares:
        return ds.map(lambda *parts: _ragged_share(parts, lengths)).map(
            lambda *leaves: measured(tf.zeros([_rows_of(leaves[0])], tf.bool), *leaves))
    return ds.scan(tf.constant(0, tf.int64), within).unbatch().map(row).enumerate(
    ).group_by_window(lambda index, *_: index // period, large_batch,
                      window_size=period).map(measured)


def _rows_of(t: Any) -> tf.Tensor:
    """A dense or ragged batch's row count, int64."""
    return t.nrows() if isinstance(t, tf.RaggedTensor) else tf.shape(t, out_type=tf.int64)[0]


def _ragged_share(parts: tuple, lengths: Lengths) -> tuple:
    """A padded batch (a share) as :func:`cut_by_length`'s ragged batch of its rows: its
    leaves, each with a length moved to the first axis after the rows."""
    leaves = tf.nest.flatten(parts[0] if len(parts) == 1 else parts)
    moved = []
    for i, t in enumerate(leaves):
        found = lengths.of(i)
        if found is not None:
            axis = found[0]
            t = tf.RaggedTensor.from_tensor(tf.transpose(t, [0, axis, *(
                a for a in range(1, t.shape.rank) if a != axis)]) if axis > 1 else t)
        moved.append(t)
    return tuple(moved)


def _with_header(pieces: tf.data.Dataset, leaves: tuple, n: tf.Tensor, longest: tf.Tensor,
                 structure: Any, cut: Cut) -> tf.data.Dataset:
    """A share's ``pieces`` after its header and, in rows, before its end
    (:func:`cut_by_length` with ``shares``)."""
    lengths = cut.lengths
    assert lengths is not None
    longest = tf.where(n > 0, tf.maximum(longest, 1), 0)

    def zeros(i, t):  # a row of zeros at the share's lengths
        found = lengths.of(i)
        if found is None:
            return tf.zeros(tf.concat([[1], tf.shape(t, out_type=tf.int64)[1:]], 0), t.dtype)
        shape = tf.concat([[1, longest[found[1]]], tf.constant(t.shape[2:].as_list(),
                                                               tf.int64)], 0)
        return _back(tf.zeros(shape, t.dtype), found[0])

    row = tf.nest.pack_sequence_as(structure, [zeros(i, t) for i, t in enumerate(leaves)])
    ratio = tf.cast(longest, tf.float32)
    header = tf.stack([tf.constant(1.0) if g is None or g >= lengths.number else ratio[g]
                       for g in cut.outputs]) if cut.outputs else tf.zeros([0])
    extent = extent_of(tf.maximum(longest, 1), tf.zeros([1]), cut)
    # One per local replica, as every micro-step's pieces (a run of R, packing.in_groups)
    share = tf.data.Dataset.from_tensors((row, header[None, :], extent, -tf.ones([1]))
                                         ).repeat(cut.replicas).concatenate(pieces)
    if cut.tokens is not None:  # token_pieces end each share with R empty pieces
        return share
    end = (row, tf.ones_like(header)[None, :], extent, tf.zeros([1]))
    return share.concatenate(tf.data.Dataset.from_tensors(end).repeat(cut.replicas))


def trim(rows: Any, padded: PaddedArrays, length: tf.Tensor) -> Any:
    """``rows`` (a gathered micro-batch of ``(x, y, sample_weight)``) with every input
    as long as the arrays along its second axis cut to ``length``, on the side without
    data."""
    def cut(t):
        if t is None or t.shape.rank < 2 or t.shape[1] != padded.length:
            return t
        return t[:, padded.length - length:] if padded.pre else t[:, :length]

    return tf.nest.map_structure(cut, rows)


def cut_rows_by_length(ds: tf.data.Dataset, pattern: list[Piece], cut: Cut, *,
                       cap: int | None = None) -> tf.data.Dataset:
    """:func:`cut_by_length` for batches of row numbers (arrays, gathered later): each
    kept piece ``(row numbers, length, length_factor, valid)``, the rows of each large batch
    sorted by their length in ``cut.arrays``, its length the longest (under XLA its
    bucket), at most the arrays', ``length_factor`` the arrays' length over it."""
    padded = cut.arrays
    assert padded is not None
    period = sum(p.rows for p in pattern)
    bounds = kept_bounds(pattern)
    table = tf.constant(padded.lengths)
    full = tf.constant([padded.length], tf.int64)

    def pieces(numbers):
        n = tf.size(numbers, out_type=tf.int64)
        return sorted_pieces(tf.gather(table, numbers)[:, None], n, full, bounds, cut, cap,
                              static_longest=True).map(lambda index, length, length_factor, valid: (
                                  tf.gather(numbers, index), length[0], length_factor,
                                  extent_of(length, index, cut), valid))

    return ds.unbatch().batch(period).flat_map(pieces)


