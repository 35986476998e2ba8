"""How a large batch's rows, sorted by length, are cut into micro-batches under a token
budget: for the least work, or each filled to the budget (the probe's trials)."""

from __future__ import annotations

from typing import Literal

import tensorflow as tf

__all__ = ["STEP_COST", "Packing", "token_pieces"]

Packing = Literal["least_work", "fullest"]
# A micro-step's own cost (the loop's turn, the pull, adding its gradients), in the
# budget's cells: a micro-batch is cut in two only where that saves more padding.
STEP_COST = 1 / 8
# Past this many rows the least-work cut chooses among boundaries every few rows (as
# many as the budget holds at the longest length, at most).
_BLOCKS = 1024


def token_pieces(lengths: tf.Tensor, tokens: int, cap: int | None,
                 packing: Packing = "least_work") -> tuple[tf.Tensor, tf.Tensor]:
    """The (starts, ends) of pieces of rows sorted by their padded ``lengths``
    (ascending), each of at most ``cap`` rows and of up to ``tokens`` tokens (or one
    row): :func:`_least_work` or :func:`_fullest`.

    The longest piece comes first, then the shortest, then the rest from short to long:
    the first two a trial step pulls (``autosplit.search.trials``) are the two ends,
    where the memory per token is highest (under attention, and with costs per row).
    Last comes an empty piece, ``(n, n)``: the large batch's end, whose element has no
    row (``autosplit.data.pipeline.is_end_marker``)."""
    n = tf.size(lengths, out_type=tf.int64)
    pieces = (_fullest if packing == "fullest" else _least_work)(lengths, n, tokens, cap)
    count = tf.shape(pieces)[0]
    order = tf.concat([tf.range(tf.minimum(count, 1)),
                       tf.range(tf.maximum(count - 1, 0), 0, -1)], 0)
    pieces = tf.concat([tf.gather(pieces, order), tf.stack([[n, n]])], 0)
    return pieces[:, 0], pieces[:, 1]


def _rows_within(tokens: int, length: tf.Tensor, cap: int | None) -> tf.Tensor:
    """The most rows of ``length`` a piece holds: ``tokens // length``, in [1, cap]."""
    rows = tf.maximum(tokens // length, 1)
    return rows if cap is None else tf.minimum(rows, cap)


def _fullest(lengths: tf.Tensor, n: tf.Tensor, tokens: int, cap: int | None) -> tf.Tensor:
    """Pieces (start, end), longest first: from the longest row down, each holds as many
    rows as the budget allows at its longest."""
    def body(end, found):
        rows = tf.minimum(_rows_within(tokens, lengths[end - 1], cap), end)
        return end - rows, found.write(found.size(), tf.stack([end - rows, end]))

    _, found = tf.while_loop(lambda end, _: end > 0, body,
                             [n, tf.TensorArray(tf.int64, size=0, dynamic_size=True,
                                                element_shape=[2])])
    return tf.reshape(found.stack(), [-1, 2])


def _least_work(lengths: tf.Tensor, n: tf.Tensor, tokens: int, cap: int | None
                ) -> tf.Tensor:
    """Pieces (start, end), longest first, that feed the fewest cells plus ``STEP_COST``
    budgets per piece, each within the budget (a shortest path over the boundaries).

    Boundaries fall every ``block`` rows counted from the longest: one row where the
    large batch has at most ``_BLOCKS`` rows, else as few as make ``_BLOCKS``, but never
    more than the budget's rows at the longest length (so that any block fits): then
    there are more than ``_BLOCKS`` boundaries, each weighing the pieces the budget
    allows to end there."""
    longest = tf.maximum(tf.reduce_max(tf.concat([lengths, [1]], 0)), 1)
    block = tf.clip_by_value((n + _BLOCKS - 1) // _BLOCKS, 1,
                             _rows_within(tokens, longest, cap))
    blocks = (n + block - 1) // block
    at = tf.maximum(n - (blocks - tf.range(blocks + 1, dtype=tf.int64)) * block, 0)
    step = tf.constant(int(tokens * STEP_COST), tf.int64)

    def body(t, cost, back):
        end = at[t]
        length = lengths[end - 1]
        first = end - _rows_within(tokens, length, cap)  # at[t - 1] is never before it
        start = tf.minimum(tf.searchsorted(at, tf.reshape(first, [1]), side="left",
                                           out_type=tf.int64)[0], t - 1)
        starts = tf.range(start, t)
        options = (cost.gather(tf.cast(starts, tf.int32)) + (end - tf.gather(at, starts))
                   * length + step)
        best = tf.argmin(options, output_type=tf.int64)
        return t + 1, cost.write(tf.cast(t, tf.int32), options[best]), back.write(
            tf.cast(t, tf.int32), start + best)

    def table():  # one entry per boundary, read back in any order
        return tf.TensorArray(tf.int64, size=tf.cast(blocks + 1, tf.int32),
                              clear_after_read=False, element_shape=[]).write(0, 0)

    _, _, back = tf.while_loop(lambda t, *_: t <= blocks, body,
                               [tf.constant(1, tf.int64), table(), table()])
    back = back.stack()

    def trace_back(t, found):
        return back[t], found.write(found.size(), tf.stack([at[back[t]], at[t]]))

    _, found = tf.while_loop(lambda t, _: t > 0, trace_back,
                             [blocks, tf.TensorArray(tf.int64, size=0, dynamic_size=True,
                                                     element_shape=[2])])
    return tf.reshape(found.stack(), [-1, 2])
