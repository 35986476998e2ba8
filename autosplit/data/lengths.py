"""Cutting a large batch of sequences by length: its rows sorted, each micro-batch padded
to its own longest row.

Rows of varying length come padded (``padded_batch``, a ragged input autosplit pads). A
large batch cut as it comes pads every micro-batch to the large batch's longest row
(``pipeline._padded_cut``): exact for every model, and mostly padding on a heavy-tailed
corpus. Sorted by length first, the short rows share micro-batches and the long ones
theirs, each padded only to its own longest row. Under XLA, which compiles a program
per shape, that length is rounded up to a multiple of :data:`LENGTH_MULTIPLE`: a
bounded number of programs. A step that is not XLA's takes any length without tracing
again, and pads no further.

That is exact only for a model whose losses and gradients ignore padding
(``autosplit.step.padding`` checks it), and only if every denominator that counts padded
cells counts the large batch's: each micro-batch's inputs come as :class:`Trimmed`, whose
``stretch`` is the large batch's padded length over the micro-batch's.

A row's length is one past its last non-zero entry in any input that varies (padding is
zeros), so rows that arrive padded (a ``padded_batch`` of the user's own) are sorted by
what they hold. Trimming a row's trailing zeros is padding it less, which the check
covers.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import tensorflow as tf

from autosplit.data.split import Piece

__all__ = ["LENGTH_MULTIPLE", "Trimmed", "cut_by_length", "inputs_of", "real_lengths",
           "row_length", "sorts_by_length"]

LENGTH_MULTIPLE = 8  # under XLA, padded lengths are multiples of this: few programs


class Trimmed(NamedTuple):
    """A micro-batch's inputs padded to its own longest row, not its large batch's."""

    inputs: Any  # x, as the model takes it
    stretch: tf.Tensor  # float32 (rows,): the large batch's padded length over this one's


def inputs_of(x: Any) -> Any:
    """The model's inputs, from ``x`` or from a :class:`Trimmed`."""
    return x.inputs if isinstance(x, Trimmed) else x


def _varying(spec: Any) -> bool:
    return spec.shape.rank is not None and None in spec.shape.as_list()[1:]


def sorts_by_length(element_spec: Any) -> bool:
    """Whether batches of ``element_spec`` can be cut by length: plain tensors, some of
    which vary in length, each only along its first axis after the rows."""
    leaves = tf.nest.flatten(element_spec)
    if not all(type(leaf) is tf.TensorSpec for leaf in leaves):
        return False
    varying = [leaf for leaf in leaves if _varying(leaf)]
    return bool(varying) and all(
        leaf.shape.rank >= 2 and leaf.shape[1] is None and None not in leaf.shape.as_list()[2:]
        for leaf in varying)


def row_length(row: Any, varying: list[bool]) -> tf.Tensor:
    """:func:`real_lengths` of one row (its leaves without the row axis), over the
    leaves marked ``varying``."""
    leaves = [t[None] for t, v in zip(tf.nest.flatten(row), varying, strict=True) if v]
    return real_lengths(leaves)[0]


def real_lengths(batch: Any) -> tf.Tensor:
    """Per row of a batch (dense tensors padded with zeros): one past its last non-zero
    entry in any varying input, int64 (rows,)."""
    lengths = []
    for t in tf.nest.flatten(batch):
        if t.shape.rank is None or t.shape.rank < 2:
            continue
        nonzero = tf.not_equal(t, tf.zeros([], t.dtype))
        if t.shape.rank > 2:
            nonzero = tf.reduce_any(nonzero, axis=list(range(2, t.shape.rank)))
        columns = tf.range(1, tf.shape(t, out_type=tf.int64)[1] + 1)
        lengths.append(tf.reduce_max(tf.where(nonzero, columns[None, :], 0), axis=1))
    return tf.reduce_max(tf.stack(lengths), axis=0)


def _ragged_lengths(rt: tf.RaggedTensor) -> tf.Tensor:
    """:func:`real_lengths` of one ragged input (rows, (length), ...)."""
    values = rt.values
    nonzero = tf.not_equal(values, tf.zeros([], values.dtype))
    if values.shape.rank > 1:
        nonzero = tf.reduce_any(nonzero, axis=list(range(1, values.shape.rank)))
    rows = rt.value_rowids()
    column = tf.range(1, tf.size(rows, out_type=tf.int64) + 1) - tf.gather(rt.row_starts(), rows)
    return tf.math.unsorted_segment_max(tf.where(nonzero, column, 0), rows, rt.nrows())


def _round_up(n: tf.Tensor, multiple: int) -> tf.Tensor:
    return (n + multiple - 1) // multiple * multiple


def cut_by_length(ds: tf.data.Dataset, pattern: list[Piece], *, own_lengths: bool,
                  multiple: int = 1) -> tf.data.Dataset:
    """The kept pieces of ``pattern`` from every large batch of ``ds`` (batches of rows,
    of any size), each large batch's kept rows sorted by length first; each piece
    ``(rows, stretch)``, its varying inputs padded with zeros to its longest row
    rounded up to ``multiple`` (at most the large batch's longest), ``stretch`` the large
    batch's length over that.

    The large batch's length is its longest row's: as the row comes with
    ``own_lengths`` (``InputAdapter.own_lengths``), else as long as it is without the
    padding of the user's batch (which may hold rows of the next large batch).

    A short last large batch gives the pieces ``rebatch`` would: those that start
    before its last row. The host holds one large batch's rows, unpadded (a ragged
    batch), and stacks no more than a piece.
    """
    period = sum(p.rows for p in pattern)
    bounds, start = [], 0
    for p in pattern:
        if p.keep:
            bounds.append((start, start + p.rows))
        start += p.rows
    first, last = bounds[0][0], bounds[-1][1]
    starts = tf.constant([b[0] for b in bounds], tf.int64)
    ends = tf.constant([b[1] for b in bounds], tf.int64)

    def strip(_, *row):
        return row[0] if len(row) == 1 else row

    def pieces(*large):
        large = large[0] if len(large) == 1 else large
        leaves = tf.nest.flatten(large, expand_composites=False)
        ragged = [t for t in leaves if isinstance(t, tf.RaggedTensor)]
        n = ragged[0].nrows()
        given = ragged[0].row_lengths()
        checks = [tf.debugging.assert_equal(
            t.row_lengths(), given, message="autosplit: the inputs that vary in length "
            "must have one length per example to be cut by length") for t in ragged[1:]]
        with tf.control_dependencies(checks):
            real = tf.reduce_max(tf.stack([_ragged_lengths(t) for t in ragged]), axis=0)
        longest = tf.reduce_max(given if own_lengths else real)
        end = tf.minimum(tf.constant(last, tf.int64), n)
        order = first + tf.cast(tf.argsort(real[first:end], stable=True), tf.int64)

        def piece(a, b):
            index = order[a - first:tf.minimum(b, n) - first]
            most = tf.maximum(tf.reduce_max(tf.gather(real, index)), 1)
            length = tf.minimum(_round_up(most, multiple), longest)

            def take(t):
                if isinstance(t, tf.RaggedTensor):
                    kept = tf.gather(t, index)
                    shape = tf.concat([tf.stack([tf.size(index, out_type=tf.int64), length]),
                                       tf.constant(t.shape[2:].as_list(), tf.int64)], 0)
                    return kept.to_tensor(shape=shape)
                return tf.gather(t, index)

            rows = tf.nest.pack_sequence_as(large, [take(t) for t in leaves],
                                            expand_composites=False)
            stretch = tf.fill(tf.shape(index), tf.cast(longest, tf.float32)
                              / tf.cast(length, tf.float32))
            return rows, stretch

        return (tf.data.Dataset.from_tensor_slices((starts, ends))
                .filter(lambda a, b: a < n).map(piece))

    @tf.autograph.experimental.do_not_convert
    def large_batch(_, window):
        return window.map(strip).ragged_batch(period).flat_map(pieces)

    return ds.unbatch().enumerate().group_by_window(lambda index, *_: index // period,
                                                    large_batch, window_size=period)
