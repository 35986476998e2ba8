"""The pieces of one large batch of sequences sorted by what they cost
(:func:`sorted_pieces`): which rows each micro-batch takes, how long it is padded, and
its length ratio (``autosplit.data.sequences.length_ratio``), for the cut by length of a
dataset's rows and of arrays' row numbers alike (``autosplit.data.sequences.by_length``)."""

from __future__ import annotations

import tensorflow as tf

from autosplit.data.sequences.buckets import bucket_up
from autosplit.data.sequences.cut import Cut
from autosplit.data.sequences.lengths import row_costs
from autosplit.data.sequences.packing import in_groups, padded_row_count, rows_within, token_pieces
from autosplit.data.split import Piece

__all__ = ["kept_bounds", "sorted_pieces"]


def kept_bounds(pattern: list[Piece]) -> tuple[tf.Tensor, tf.Tensor, int, int]:
    """The kept pieces' (starts, ends) in rows counted from the first row kept, and the
    first and last row kept."""
    bounds, start = [], 0
    for p in pattern:
        if p.keep:
            bounds.append((start, start + p.rows))
        start += p.rows
    first = bounds[0][0]
    return (tf.constant([a - first for a, _ in bounds], tf.int64),
            tf.constant([b - first for _, b in bounds], tf.int64), first, bounds[-1][1])


def sorted_pieces(row_lengths: tf.Tensor, n: tf.Tensor, longest: tf.Tensor,
                   bounds: tuple[tf.Tensor, tf.Tensor, int, int], cut: Cut,
                   cap: int | None = None, *, static_longest: bool = False,
                   ceiling: tf.Tensor | None = None) -> tf.data.Dataset:
    """The kept pieces of a large batch of ``n`` rows whose lengths are ``row_lengths``
    (rows, groups): its kept rows sorted by cost, each piece ``(positions, lengths,
    length_factor, valid)`` for those that start before row ``n``; its lengths its rows'
    longest in each group, at most ``longest`` (the large batch's), ``length_factor`` per
    model output ``longest`` over it in the output's group, ``valid`` 1.0 per real row.

    With ``cut.replicas`` = R local replicas, the pieces are one device's, and each run
    of R of them is one micro-step's, a piece per replica (``packing.in_groups``): each
    replica's micro-batch holds consecutive sorted rows, padded to its own longest, and
    the R of a micro-step are neighbours in the order, so they cost about the same. A
    short run is filled with one row of the cheapest (``valid`` 0.0).

    With ``cut.buckets`` (XLA) each length is rounded up to its bucket, capped at a
    ``static_longest`` ``longest`` (the arrays'), else at the ``ceiling``, the longest
    row met so far per length (not a program per large batch's longest, nor past what
    the model may take: a table of 512 positions). In tokens each piece is then padded
    to the rows the budget holds at its lengths with copies of its last (``valid`` 0).
    With ``cut.tokens``, the pieces are :func:`token_pieces`' (of at most ``cap`` rows)
    instead of ``bounds``'."""
    starts, ends, first, last = bounds
    count = tf.maximum(tf.minimum(tf.constant(last, tf.int64), n) - first, 0)
    longest = tf.maximum(longest, 1)  # a length whose every part is zeros: one column
    order = first + tf.cast(tf.argsort(row_costs(row_lengths[first:first + count]), stable=True),
                            tf.int64)
    groups = int(row_lengths.shape[1])
    padded_rows = cut.buckets and cut.tokens is not None
    sorted_lengths = tf.gather(row_lengths, order)

    def length_of(most):
        most = tf.maximum(most, 1)
        if not cut.buckets:
            return tf.minimum(most, longest)
        rounded = bucket_up(most, cut.tokens is not None)
        if static_longest:
            return tf.minimum(rounded, longest)
        return rounded if ceiling is None else tf.minimum(rounded, ceiling)

    def piece(a, b, weight):
        index = tf.gather(order, tf.range(a, tf.minimum(b, count)))
        real = tf.size(index, out_type=tf.int64)
        valid = tf.fill([real], weight)
        length = length_of(tf.reduce_max(sorted_lengths[a:b], axis=0))
        if padded_rows:
            assert cut.tokens is not None
            rows = padded_row_count(real, rows_within(cut.tokens, tf.reduce_sum(length), cap))
            copies = tf.minimum(tf.range(rows), real - 1)
            index, valid = tf.gather(index, copies), tf.gather(valid, copies) * tf.cast(
                tf.range(rows) < real, tf.float32)
        longer = tf.cast(longest, tf.float32) / tf.cast(length, tf.float32)
        length_factor = tf.stack([tf.constant(1.0) if g is None or g >= groups else longer[g]
                            for g in cut.outputs]) if cut.outputs else tf.zeros([0])
        return index, length, tf.tile(length_factor[None, :], tf.stack([tf.size(index), 1])), valid

    if cut.tokens is not None:
        starts, ends, weights = token_pieces(length_of(sorted_lengths), cut.tokens, cap,
                                             cut.packing, padded_rows=padded_rows,
                                             replicas=cut.replicas)
    else:
        reached = starts < count
        starts, ends, weights = in_groups(tf.boolean_mask(starts, reached),
                                          tf.boolean_mask(ends, reached), cut.replicas)
    return tf.data.Dataset.from_tensor_slices((starts, ends, weights)).map(piece)
