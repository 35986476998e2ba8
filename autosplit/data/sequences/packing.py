"""How a large batch's rows, sorted by what they cost, are cut into micro-batches under a
token budget: for the least work, or each filled to the budget (the probe's trials).

A row has one length per group of its parts (``autosplit.data.sequences.lengths``): a
translation pair its source's and its target's. A micro-batch pads each group to its own
longest row, so it costs its rows times the sum of its longest lengths, and that must fit
the budget. With one length the rows' order makes the last row the longest; with several,
each group's longest is found over the piece."""

from __future__ import annotations

from typing import Literal

import tensorflow as tf

__all__ = ["STEP_COST", "Packing", "in_groups", "padded_row_count", "rows_within",
           "token_pieces"]

Packing = Literal["least_work", "fullest"]
# A micro-step's own cost (the loop's turn, the pull, adding its gradients), in the
# budget's cells: a micro-batch is cut in two only where that saves more padding.
STEP_COST = 1 / 8
# Past this many rows the least-work cut chooses among boundaries every few rows (as
# many as the budget holds at the longest length, at most).
_BLOCKS = 1024


def token_pieces(lengths: tf.Tensor, tokens: int, cap: int | None,
                 packing: Packing = "least_work", *, padded_rows: bool = False,
                 replicas: int = 1) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """The (starts, ends) of pieces of rows sorted by what they cost, whose padded
    ``lengths`` are (rows, lengths per example), each of at most ``cap`` rows and of up
    to ``tokens`` tokens (or one row): :func:`_least_work` or :func:`_fullest`.

    With ``replicas`` = R local replicas, each run of R pieces, from the longest down,
    is one micro-step's (:func:`in_groups`: a short last run takes fillers, which weigh
    nothing), and the order below is the runs'. The longest piece (run) comes first,
    then the shortest, then the rest from short to long: the first two a trial step
    pulls (``autosplit.search.trials``) are the two ends, where the memory per token is
    highest (under attention, and with costs per row). Last come R empty pieces,
    ``(n, n)``: the large batch's end, whose element has no row
    (``autosplit.data.markers.is_end_marker``). Returns ``(starts, ends, weights)``,
    ``weights`` 0.0 for a filler. Lengths of rank 1 are one length.

    ``padded_rows``: each piece is padded to the rows the budget holds at its lengths,
    or half that (:func:`padded_row_count`: XLA's shapes,
    ``autosplit.data.sequences.pieces``), so it costs those rows, not its own, for the
    least work."""
    if lengths.shape.rank == 1:
        lengths = lengths[:, None]
    n = tf.shape(lengths, out_type=tf.int64)[0]
    pieces = (_fullest(lengths, n, tokens, cap) if packing == "fullest"
              else _least_work(lengths, n, tokens, cap, padded_rows))
    starts, ends, weights = in_groups(pieces[:, 0], pieces[:, 1], replicas)
    runs = tf.shape(starts)[0] // replicas
    order = tf.concat([tf.range(tf.minimum(runs, 1)), tf.range(tf.maximum(runs - 1, 0), 0, -1)], 0)
    order = tf.reshape(order[:, None] * replicas + tf.range(replicas)[None, :], [-1])
    end = tf.fill([replicas], n)
    return (tf.concat([tf.gather(starts, order), end], 0),
            tf.concat([tf.gather(ends, order), end], 0),
            tf.concat([tf.gather(weights, order), tf.ones([replicas])], 0))


def in_groups(starts: tf.Tensor, ends: tf.Tensor, replicas: int
              ) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """Pieces ``(starts, ends)`` in runs of ``replicas``, one per local replica of a
    micro-step, with their weights (1.0): a short last run is filled with pieces of one
    row, the first (the cheapest of the sorted rows), that weigh nothing (0.0), so that
    every replica runs every micro-step. No piece, no run.

    >>> [t.numpy().tolist() for t in in_groups(tf.constant([0, 3, 5]), tf.constant([3, 5, 8]), 2)]
    [[0, 3, 5, 0], [3, 5, 8, 1], [1.0, 1.0, 1.0, 0.0]]
    """
    count = tf.shape(starts)[0]
    extra = -count % replicas
    return (tf.concat([starts, tf.zeros([extra], starts.dtype)], 0),
            tf.concat([ends, tf.ones([extra], ends.dtype)], 0),
            tf.concat([tf.ones([count]), tf.zeros([extra])], 0))


def rows_within(tokens: int, cost: tf.Tensor, cap: int | None) -> tf.Tensor:
    """The most rows of ``cost`` each a piece holds: ``tokens // cost``, in [1, cap]."""
    rows = tf.maximum(tokens // cost, 1)
    return rows if cap is None else tf.minimum(rows, cap)


def padded_row_count(real: tf.Tensor, most: tf.Tensor) -> tf.Tensor:
    """Under XLA, the rows a piece of ``real`` rows is padded to, where the budget holds
    ``most`` at its lengths: ``most``, or half of it (rounded up) for a piece that fits
    there; 0 for none. Two shapes per length: a bounded set of programs, and no piece
    pads more than half the rows the budget holds there.

    >>> [int(padded_row_count(tf.constant(n, tf.int64), tf.constant(9, tf.int64)))
    ...  for n in (0, 1, 5, 6, 9)]
    [0, 5, 5, 9, 9]
    """
    half = (most + 1) // 2
    return tf.where(real > half, most, tf.where(real > 0, half, tf.zeros_like(real)))


def _table(lengths: tf.Tensor) -> tf.Tensor | None:
    """A sparse table of ``lengths`` (rows, lengths per example) for the longest of any
    run of rows in two lookups: level j holds, per row, the most of it and the 2**j - 1
    rows after it, per length. None for one length: a run's longest is its last row."""
    if lengths.shape[1] == 1:
        return None
    count = tf.shape(lengths, out_type=tf.int64)[0]

    def body(span, level, table):
        later = tf.concat([level[span:], tf.zeros_like(level[:tf.minimum(span, count)])], 0)
        level = tf.maximum(level, later)
        return span * 2, level, table.write(table.size(), level)

    table = tf.TensorArray(lengths.dtype, size=0, dynamic_size=True,
                           element_shape=lengths.shape).write(0, lengths)
    _, _, table = tf.while_loop(lambda span, *_: span < count, body,
                                [tf.constant(1, tf.int64), lengths, table])
    return table.stack()


def _costs(lengths: tf.Tensor, table: tf.Tensor | None, end: tf.Tensor, at: tf.Tensor,
           padded: tuple[int, int | None] | None = None) -> tf.Tensor:
    """What each piece ``[at[i], end)`` costs: its rows times the sum of its longest
    lengths (:func:`_table`'s two lookups per piece); with ``padded`` = (tokens, cap),
    the rows the budget holds at those lengths instead of its own."""
    def cells(width):
        if padded is None:
            return (end - at) * width
        return padded_row_count(end - at, rows_within(padded[0], width, padded[1])) * width

    if table is None:  # one length: a piece's longest row is its last
        return cells(tf.broadcast_to(lengths[end - 1, 0], tf.shape(at)))
    level = tf.cast(tf.math.floor(tf.math.log(tf.cast(end - at, tf.float64) + 0.5)
                                  / tf.math.log(tf.constant(2.0, tf.float64))), tf.int64)
    width = tf.bitwise.left_shift(tf.ones_like(level), level)
    longest = tf.maximum(tf.gather_nd(table, tf.stack([level, at], 1)),
                         tf.gather_nd(table, tf.stack([level, end - width], 1)))
    return cells(tf.reduce_sum(longest, axis=1))


def _fullest(lengths: tf.Tensor, n: tf.Tensor, tokens: int, cap: int | None) -> tf.Tensor:
    """Pieces (start, end), longest first: from the costliest row down, each holds as
    many rows as the budget allows at its padded lengths."""
    table = _table(lengths)

    def body(end, found):
        most = tf.minimum(rows_within(tokens, tf.reduce_sum(lengths[end - 1]), cap), end)
        at = tf.range(end - most, end)
        fits = _costs(lengths, table, end, at) <= tokens  # every start after one fits
        rows = tf.maximum(tf.reduce_sum(tf.cast(fits, tf.int64)), 1)
        return end - rows, found.write(found.size(), tf.stack([end - rows, end]))

    _, found = tf.while_loop(lambda end, _: end > 0, body,
                             [n, tf.TensorArray(tf.int64, size=0, dynamic_size=True,
                                                element_shape=[2])])
    return tf.reshape(found.stack(), [-1, 2])


def _least_work(lengths: tf.Tensor, n: tf.Tensor, tokens: int, cap: int | None,
                padded_rows: bool = False) -> tf.Tensor:
    """Pieces (start, end), longest first, that feed the fewest cells plus ``STEP_COST``
    budgets per piece, each within the budget (a shortest path over the boundaries).

    Boundaries fall every ``block`` rows counted from the costliest: one row where the
    large batch has at most ``_BLOCKS`` rows, else as few as make ``_BLOCKS``, but never
    more than the budget's rows at the longest lengths (so that any block fits): then
    there are more than ``_BLOCKS`` boundaries, each weighing the pieces the budget
    allows to end there."""
    longest = tf.reduce_sum(tf.reduce_max(tf.concat(
        [lengths, tf.ones([1, tf.shape(lengths)[1]], lengths.dtype)], 0), axis=0))
    block = tf.clip_by_value((n + _BLOCKS - 1) // _BLOCKS, 1,
                             rows_within(tokens, longest, cap))
    blocks = (n + block - 1) // block
    at = tf.maximum(n - (blocks - tf.range(blocks + 1, dtype=tf.int64)) * block, 0)
    step = tf.constant(int(tokens * STEP_COST), tf.int64)
    never = tf.constant(2**62, tf.int64)
    longest_of = _table(lengths)

    def body(t, cost, back):
        end = at[t]
        first = end - rows_within(tokens, tf.reduce_sum(lengths[end - 1]), cap)
        start = tf.minimum(tf.searchsorted(at, tf.reshape(first, [1]), side="left",
                                           out_type=tf.int64)[0], t - 1)
        starts = tf.range(start, t)
        cells = _costs(lengths, longest_of, end, tf.gather(at, starts))
        # One block always fits; more must fit the budget (with one length they do).
        fits = (cells <= tokens) | (starts == t - 1)
        if padded_rows:
            cells = _costs(lengths, longest_of, end, tf.gather(at, starts), (tokens, cap))
        cells = tf.where(fits, cells, never)
        options = cost.gather(tf.cast(starts, tf.int32)) + cells + step
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
