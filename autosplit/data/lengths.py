"""Cutting a large batch of sequences by length: its rows sorted, each micro-batch padded
to its own longest row.

Rows of varying length come padded (``padded_batch``, a ragged input autosplit pads). A
large batch cut as it comes pads every micro-batch to the large batch's longest row
(:func:`pad_to_longest`): exact for every model, and mostly padding on a heavy-tailed
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
covers. Arrays of one shape that hold padded sequences (``keras.utils.pad_sequences``,
at the front by default or at the end) are cut alike (:func:`cut_rows_by_length`): their
row numbers sorted by each row's length, each micro-batch gathered and cut to its
longest row (:func:`trim`); their large batch is as long as the arrays.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import tensorflow as tf

from autosplit.data.packing import Packing, token_pieces
from autosplit.data.split import Piece

__all__ = ["LENGTH_MULTIPLE", "LengthCut", "Padded", "Trimmed", "cut_by_length",
           "cut_rows_by_length", "inputs_of", "longest_row", "pad_to_longest", "padded_sequences",
           "real_lengths", "row_length", "sorts_by_length", "trim"]

LENGTH_MULTIPLE = 8  # under XLA, padded lengths are multiples of this: few programs


class LengthCut(NamedTuple):
    """How a pipeline cuts by length: each micro-batch's length rounded up to a
    ``multiple``; for arrays of one shape, how they hold their sequences; with
    ``tokens``, micro-batches of up to that many tokens (rows x padded length) each, not
    of a fixed row count, cut for the least work (``"least_work"``) or each filled to the
    budget (``"fullest"``: the probe's trials, which must meet the budget's peak)."""

    multiple: int = 1
    padded: Padded | None = None
    tokens: int | None = None
    packing: Packing = "least_work"


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


def longest_row(sample: tuple, padded: Padded | None, multiple: int = 1) -> int:
    """The longest row of ``sample`` (``(x, y, sample_weight)`` padded to its longest, as
    ``InputAdapter.sample`` gives it) by its inputs' :func:`real_lengths`, rounded up to
    ``multiple``; for arrays that hold ``padded`` sequences, the longest in them."""
    if padded is not None:
        longest = int(padded.lengths.max())
    else:
        leaves = [t for t in tf.nest.flatten(sample[0]) if t is not None and t.shape.rank >= 2]
        longest = int(tf.reduce_max(real_lengths(leaves))) if leaves else 1
    return int(_round_up(max(longest, 1), multiple))


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


def pad_to_longest(ds: tf.data.Dataset, sizes: list[int], *, own_lengths: bool
                   ) -> tf.data.Dataset:
    """``ds.rebatch(sizes)`` for batches whose shapes differ beyond the row count: every
    piece of a large batch is padded to the longest row of that large batch, with zeros
    (``""`` for strings), as ``padded_batch(B)`` pads the large batch by default.

    Each micro-batch then holds its rows exactly as ``model.fit`` on the large batch
    sees them, so every denominator that counts padded cells (Keras's
    ``sum_over_batch_size`` over a per-token loss masked by ``sample_weight``, a custom
    step's ``tf.size``) and every model that reads its padding (a pooling without a
    mask) is the large batch's. Padding a piece only to its own longest row would change
    those.

    ``rebatch`` copies slices of its input batches into each piece and stops with
    "source and dst shapes are not compatible" when a piece spans two ``padded_batch``
    batches padded to different lengths. Here the batches are unbatched, each row is
    numbered, and ``group_by_window`` gathers the rows of each large batch (the rows
    come in order); a first pass over them finds the longest row, a second pads each
    row to it and cuts the pieces. The host holds the large batch's rows, one by one
    (its longest row is known only after the last), and stacks no more than a piece.

    Without ``own_lengths`` (rows padded by the user's ``padded_batch``, whose batches
    may hold rows of the next large batch), rows that vary along one length count as
    long as they are without trailing zeros (:func:`row_length`), so a large batch
    is as long as ``padded_batch(B)`` of the same rows makes it.
    """
    period = sum(sizes)
    row_spec = ds.element_spec
    trim = not own_lengths and sorts_by_length(row_spec)
    varying = [s.shape.rank >= 2 and s.shape[1] is None for s in tf.nest.flatten(row_spec)]

    def strip(_, *row):
        return row[0] if len(row) == 1 else row

    plain = tf.data.Options()  # a window has no graph to optimise (TensorFlow warns)
    plain.experimental_optimization.apply_default_optimizations = False

    def shape_of(row):
        shapes = [tf.shape(t, out_type=tf.int64) for t in tf.nest.flatten(row)]
        if trim:  # the length axis as long as the row is without its trailing zeros
            length = row_length(row, varying)
            shapes = [tf.tensor_scatter_nd_update(s, [[0]], [length]) if v else s
                      for s, v in zip(shapes, varying, strict=True)]
        return tf.nest.pack_sequence_as(row, shapes)

    def longest(rows: tf.data.Dataset) -> Any:
        start = tf.nest.map_structure(lambda spec: tf.zeros([spec.shape.rank], tf.int64),
                                      rows.element_spec)
        return rows.with_options(plain).reduce(start, lambda most, row: tf.nest.map_structure(
            tf.maximum, most, shape_of(row)))

    def pad(row, shape):
        known = row.shape  # the sizes the rows share (a feature axis) stay static
        if trim and row.shape.rank:
            row = row[:shape[0]]
        gap = shape - tf.shape(row, out_type=tf.int64)
        return tf.ensure_shape(tf.pad(row, tf.stack([tf.zeros_like(gap), gap], axis=1),
                                      constant_values=tf.zeros([], row.dtype)), known)

    def large_batch(_, window):
        rows = window.map(strip)
        shapes = longest(rows)
        padded = rows.map(lambda *row: tf.nest.map_structure(
            pad, row[0] if len(row) == 1 else row, shapes))
        return padded.batch(1).rebatch(sizes if len(sizes) > 1 else sizes[0])

    return ds.unbatch().enumerate().group_by_window(lambda index, *_: index // period,
                                                    large_batch, window_size=period)


def cut_by_length(ds: tf.data.Dataset, pattern: list[Piece], cut: LengthCut, *,
                  own_lengths: bool, cap: int | None = None) -> tf.data.Dataset:
    """The kept pieces of ``pattern`` from every large batch of ``ds`` (batches of rows,
    of any size), each large batch's kept rows sorted by length first; each piece
    ``(rows, stretch)``, its varying inputs padded with zeros to its longest row
    rounded up to ``cut.multiple`` (at most the large batch's longest), ``stretch`` the
    large batch's length over that.

    The large batch's length is its longest row's: as the row comes with
    ``own_lengths`` (``InputAdapter.own_lengths``), else as long as it is without the
    padding of the user's batch (which may hold rows of the next large batch).

    A short last large batch gives the pieces ``rebatch`` would: those that start
    before its last row. The host holds one large batch's rows, unpadded (a ragged
    batch), and stacks no more than a piece. With ``cut.tokens``, the pieces are
    :func:`token_pieces` of at most ``cap`` rows, each large batch's last an empty one.
    """
    period = sum(p.rows for p in pattern)
    bounds = _kept_bounds(pattern)

    def strip(_, *row):
        return row[0] if len(row) == 1 else row

    def pieces(*large):
        large = large[0] if len(large) == 1 else large
        leaves = tf.nest.flatten(large, expand_composites=False)
        ragged = [t for t in leaves if isinstance(t, tf.RaggedTensor)]
        given = ragged[0].row_lengths()
        checks = [tf.debugging.assert_equal(
            t.row_lengths(), given, message="autosplit: the inputs that vary in length "
            "must have one length per example to be cut by length") for t in ragged[1:]]
        with tf.control_dependencies(checks):
            real = tf.reduce_max(tf.stack([_ragged_lengths(t) for t in ragged]), axis=0)
        longest = tf.reduce_max(given if own_lengths else real)

        def piece(index, length, stretch):
            def take(t):
                if isinstance(t, tf.RaggedTensor):
                    kept = tf.gather(t, index)
                    shape = tf.concat([tf.stack([tf.size(index, out_type=tf.int64), length]),
                                       tf.constant(t.shape[2:].as_list(), tf.int64)], 0)
                    return tf.ensure_shape(kept.to_tensor(shape=shape), [None, *t.shape[1:]])
                return tf.gather(t, index)

            return tf.nest.pack_sequence_as(large, [take(t) for t in leaves],
                                            expand_composites=False), stretch

        return _sorted_pieces(real, ragged[0].nrows(), longest, bounds, cut, cap).map(piece)

    @tf.autograph.experimental.do_not_convert
    def large_batch(_, window):
        return window.map(strip).ragged_batch(period).flat_map(pieces)

    return ds.unbatch().enumerate().group_by_window(lambda index, *_: index // period,
                                                    large_batch, window_size=period)


class Padded(NamedTuple):
    """Arrays of one shape that hold sequences padded with zeros to one length
    (``keras.utils.pad_sequences``)."""

    length: int  # the arrays' length L: what model.fit pads every batch to
    pre: bool  # padded at the front (pad_sequences' default), not at the end
    lengths: np.ndarray  # int64 (rows,): each row's length without its padding


def padded_sequences(arrays: tuple, takes_any_length: bool) -> Padded | None:
    """How ``arrays`` = ``(x, y, sample_weight)`` hold padded sequences, or None.

    Sequences are integer inputs of rank 2 or more (token ids) whose second axis some
    rows end (or start) with zeros along, fed to a model that ``takes_any_length``
    (its inputs' second axis is unknown). Every array as long along its second axis
    counts as padded with them: targets and a ``sample_weight`` mask per token.
    """
    leaves = tf.nest.flatten(arrays)
    tokens = [t for t in tf.nest.flatten(arrays[0]) if t is not None and t.shape.rank >= 2
              and t.dtype.is_integer]
    if not takes_any_length or not tokens:
        return None
    length = int(tokens[0].shape[1])
    varying = tuple(t is not None and t.shape.rank >= 2 and int(t.shape[1]) == length
                    for t in leaves)
    nonzero = np.zeros((int(tokens[0].shape[0]), length), bool)
    for t, v in zip(leaves, varying, strict=True):
        if v:
            held = np.asarray(t) != 0
            nonzero |= held.any(axis=tuple(range(2, held.ndim))) if held.ndim > 2 else held
    columns = np.arange(1, length + 1)
    post = np.where(nonzero, columns, 0).max(axis=1)
    pre = np.where(nonzero, length + 1 - columns, 0).max(axis=1)
    if min(post.sum(), pre.sum()) >= length * len(post):
        return None  # no row is padded
    front = bool(pre.sum() < post.sum())
    return Padded(length, front, (pre if front else post).astype(np.int64))


def trim(rows: Any, padded: Padded, length: tf.Tensor) -> Any:
    """``rows`` (a gathered micro-batch of ``(x, y, sample_weight)``) with every input
    as long as the arrays along its second axis cut to ``length``, on the side without
    data."""
    def cut(t):
        if t is None or t.shape.rank < 2 or t.shape[1] != padded.length:
            return t
        return t[:, padded.length - length:] if padded.pre else t[:, :length]

    return tf.nest.map_structure(cut, rows)


def cut_rows_by_length(ds: tf.data.Dataset, pattern: list[Piece], cut: LengthCut, *,
                       cap: int | None = None) -> tf.data.Dataset:
    """:func:`cut_by_length` for batches of row numbers (arrays, gathered later): each
    kept piece ``(row numbers, length, stretch)``, the rows of each large batch sorted
    by their length in ``cut.padded``, its length the longest rounded up to
    ``cut.multiple`` (at most the arrays'), ``stretch`` the arrays' length over it."""
    padded = cut.padded
    assert padded is not None
    period = sum(p.rows for p in pattern)
    bounds = _kept_bounds(pattern)
    table = tf.constant(padded.lengths)
    full = tf.constant(padded.length, tf.int64)

    def pieces(numbers):
        n = tf.size(numbers, out_type=tf.int64)
        return _sorted_pieces(tf.gather(table, numbers), n, full, bounds, cut, cap).map(
            lambda index, length, stretch: (tf.gather(numbers, index), length, stretch))

    return ds.unbatch().batch(period).flat_map(pieces)


def _kept_bounds(pattern: list[Piece]) -> tuple[tf.Tensor, tf.Tensor, int, int]:
    """The kept pieces' (starts, ends) in a large batch, and the first and last row kept."""
    bounds, start = [], 0
    for p in pattern:
        if p.keep:
            bounds.append((start, start + p.rows))
        start += p.rows
    return (tf.constant([b[0] for b in bounds], tf.int64),
            tf.constant([b[1] for b in bounds], tf.int64), bounds[0][0], bounds[-1][1])


def _sorted_pieces(lengths: tf.Tensor, n: tf.Tensor, longest: tf.Tensor,
                   bounds: tuple[tf.Tensor, tf.Tensor, int, int], cut: LengthCut,
                   cap: int | None = None) -> tf.data.Dataset:
    """The kept pieces of a large batch of ``n`` rows whose lengths are ``lengths``: its
    kept rows sorted by length, each piece ``(positions, length, stretch)`` for those
    that start before row ``n``; its length the longest of its rows rounded up to
    ``cut.multiple``, at most ``longest`` (the large batch's), ``stretch`` ``longest``
    over it. With ``cut.tokens``, the pieces are :func:`token_pieces`' (of at most
    ``cap`` rows) instead of ``bounds``'."""
    starts, ends, first, last = bounds
    end = tf.minimum(tf.constant(last, tf.int64), n)
    order = first + tf.cast(tf.argsort(lengths[first:end], stable=True), tf.int64)

    def length_of(most):
        return tf.minimum(_round_up(tf.maximum(most, 1), cut.multiple), longest)

    def piece(a, b):
        index = order[a - first:tf.minimum(b, n) - first]
        length = length_of(tf.reduce_max(tf.gather(lengths, index)))
        return index, length, tf.fill(tf.shape(index), tf.cast(longest, tf.float32)
                                      / tf.cast(length, tf.float32))

    if cut.tokens is not None:
        sorted_lengths = length_of(tf.gather(lengths, order))
        starts, ends = token_pieces(sorted_lengths, cut.tokens, cap, cut.packing)
        return tf.data.Dataset.from_tensor_slices((first + starts, first + ends)).map(piece)
    return tf.data.Dataset.from_tensor_slices((starts, ends)).filter(lambda a, b: a < n).map(piece)
