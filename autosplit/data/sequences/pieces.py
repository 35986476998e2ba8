"""The pieces of one large batch of sequences sorted by what they cost
(:func:`sorted_pieces`): which rows each micro-batch takes, how long it is padded, and
its length ratio (``autosplit.data.sequences.length_ratio``), for the cut by length of a
dataset's rows and of arrays' row numbers alike (``autosplit.data.sequences.by_length``)."""

from __future__ import annotations

import tensorflow as tf

from autosplit.data.sequences.buckets import bucket_up
from autosplit.data.sequences.cut import Cut
from autosplit.data.sequences.lengths import row_costs
from autosplit.data.sequences.packing import padded_row_count, rows_within, token_pieces
from autosplit.data.split import Piece

__all__ = ["kept_bounds", "sorted_pieces"]


def kept_bounds(pattern: list[Piece], replicas: int = 1
                 ) -> tuple[tf.Tensor, tf.Tensor, int, int]:
    """The kept pieces' (starts, ends) in ranks of ``replicas`` rows counted from the
    first row kept (each run of ``replicas`` kept pieces one piece of ranks: the
    pattern's pieces of a run are equal, so it divides), and the first and last row kept."""
    bounds, start = [], 0
    for p in pattern:
        if p.keep:
            bounds.append((start, start + p.rows))
        start += p.rows
    first = bounds[0][0]
    runs = [(bounds[i][0], bounds[min(i + replicas, len(bounds)) - 1][1])
            for i in range(0, len(bounds), replicas)]
    assert all((a - first) % replicas == 0 and (b - first) % replicas == 0
               for a, b in runs[:-1]), runs
    return (tf.constant([(a - first) // replicas for a, _ in runs], tf.int64),
            tf.constant([-(-(b - first) // replicas) for _, b in runs], tf.int64),
            first, bounds[-1][1])


def sorted_pieces(row_lengths: tf.Tensor, n: tf.Tensor, longest: tf.Tensor,
                   bounds: tuple[tf.Tensor, tf.Tensor, int, int], cut: Cut,
                   cap: int | None = None, *, static_longest: bool = False,
                   ceiling: tf.Tensor | None = None) -> tf.data.Dataset:
    """The kept pieces of a large batch of ``n`` rows whose lengths are ``row_lengths``
    (rows, groups): its kept rows sorted by cost, each piece ``(positions, lengths,
    length_factor, valid)`` for those that start before row ``n``; its lengths its rows'
    longest in each group, at most ``longest`` (the large batch's), ``length_factor`` per
    model output ``longest`` over it in the output's group, ``valid`` 1.0 per real row.

    With ``cut.replicas`` = R local replicas, the sorted rows are taken in ranks of R
    and a piece is a run of ranks: replica r's micro-batch holds row r of each (a copy
    of the rank's first, ``valid`` 0.0, where the last rank is short), all R padded to
    the run's longest lengths, so they stack into one element and every replica gets
    rows of about the same lengths. In tokens a rank costs, per length, what its
    longest row there does.

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
    replicas = cut.replicas
    ranks = (count + replicas - 1) // replicas
    if replicas == 1:
        rank_lengths = tf.gather(row_lengths, order)
    else:
        at = tf.reshape(tf.range(ranks * replicas), [-1, replicas])
        rank_lengths = tf.reduce_max(tf.gather(row_lengths, tf.gather(
            order, tf.minimum(at, count - 1))), axis=1)

    def length_of(most):
        most = tf.maximum(most, 1)
        if not cut.buckets:
            return tf.minimum(most, longest)
        rounded = bucket_up(most, cut.tokens is not None)
        if static_longest:
            return tf.minimum(rounded, longest)
        return rounded if ceiling is None else tf.minimum(rounded, ceiling)

    def piece(a, b, replica):
        b = tf.minimum(b, ranks)
        at = tf.range(a, b) * replicas + replica
        real_row = at < count
        index = tf.gather(order, tf.where(real_row, at, at - replica))
        valid = tf.cast(real_row, tf.float32)
        length = length_of(tf.reduce_max(rank_lengths[a:b], axis=0))
        real = b - a
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
        starts, ends = token_pieces(length_of(rank_lengths), cut.tokens, cap, cut.packing,
                                    padded_rows=padded_rows)
    else:
        reached = starts < ranks
        starts, ends = tf.boolean_mask(starts, reached), tf.boolean_mask(ends, reached)
    if replicas == 1:
        return tf.data.Dataset.from_tensor_slices((starts, ends)).map(
            lambda a, b: piece(a, b, tf.constant(0, tf.int64)))
    # Each piece of ranks once per replica, in turn: the pipeline stacks each R.
    return tf.data.Dataset.from_tensor_slices((
        tf.repeat(starts, replicas), tf.repeat(ends, replicas),
        tf.tile(tf.range(replicas, dtype=tf.int64), tf.shape(starts)))).map(piece)
