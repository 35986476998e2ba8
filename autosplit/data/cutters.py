"""The cutters: one small class per kind of cut (:func:`cutter_for`), each turning an
input's stream of rows into the elements of a pipeline (``autosplit.data.pipeline``)
with the same two methods: :meth:`Cutter.elements` (the stream of one epoch) and
:meth:`Cutter.per_batch` (the most elements a large batch takes), and one fact, how
each large batch ends (``Cutter.ends``, ``markers.Ends.batch``).

========================  ============================================================
cutter                    a large batch's elements
========================  ============================================================
:class:`AsItComes`        its rows in order: ``rebatch`` into the pattern's pieces, or
                          each padded to the large batch's longest row (``longest``)
:class:`ByLength`         its rows sorted by length, each piece padded to its own
                          longest row (``sequences.by_length.cut_by_length``)
:class:`ArraysByLength`   the same for arrays' row numbers, gathered after the cut
:class:`Shares`           a worker's share of each step, cut in order, then a marker
:class:`SharesByLength`   a header, the share cut by length, then (in rows) a marker
========================  ============================================================

An element is ``(x, y_or_(), sample_weight_or_(), valid)``; the functions that make one
hold the adapter's ``materialize``, never the pipeline (a dataset it caches must not
point back at it).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import tensorflow as tf

from autosplit.data.adapter import InputAdapter, varying_shapes
from autosplit.data.layout import Layout
from autosplit.data.markers import Batch, end_marker
from autosplit.data.sequences.by_length import cut_by_length, cut_rows_by_length, trim
from autosplit.data.sequences.cut import Cut
from autosplit.data.sequences.length_factor import Shortened
from autosplit.data.sequences.lengths import PaddedArrays
from autosplit.data.sequences.longest import pad_to_longest
from autosplit.data.sharded import SHARE_ELEMENTS, cut_shares, joined_shares
from autosplit.data.split import Piece, piece_pattern
from autosplit.data.structure import none_to_empty

__all__ = ["ArraysByLength", "AsItComes", "ByLength", "Cutter", "Shares", "SharesByLength",
           "cutter_for", "elements_per_batch"]

_IN_PARALLEL = {"num_parallel_calls": tf.data.AUTOTUNE, "deterministic": True}


def _pad_rows(piece: Any, rows: int | None, *, row_numbers: bool = False, all_real: bool = False
              ) -> tuple[Any, tf.Tensor]:
    """Pad every leaf of ``piece`` to ``rows`` rows with copies of its last row (None:
    as it is): data only when short, row numbers always (a ``tf.cond`` in a map costs
    every iterator); ``all_real``: nothing padded, nothing branches, ``valid`` all ones."""
    def fixed(t):  # the static row count (a gather or a cond keeps the other dimensions)
        return tf.ensure_shape(t, [rows, *t.shape[1:]])

    if rows is None:  # pieces of any row count (Cut.tokens), all real
        return piece, tf.ones(tf.shape(tf.nest.flatten(piece)[0])[:1], tf.float32)
    if all_real:
        return tf.nest.map_structure(fixed, piece), tf.ones([rows], tf.float32)
    n = tf.shape(tf.nest.flatten(piece)[0])[0]
    index = tf.minimum(tf.range(rows), n - 1)

    def pad(t):
        return fixed(tf.gather(t, index) if row_numbers else tf.cond(
            n < rows, lambda: tf.gather(t, index), lambda: t))

    return tf.nest.map_structure(pad, piece), tf.cast(tf.range(rows) < n, tf.float32)


def _pad_replicas(element: Any, replicas: int) -> Any:
    """(p, rows, ...) with p <= replicas pieces -> (replicas, rows, ...); extras weigh 0."""
    *parts, valid = element
    p = tf.shape(valid)[0]
    index = tf.minimum(tf.range(replicas), p - 1)

    def pad(t):
        return tf.ensure_shape(tf.gather(t, index), [replicas, *t.shape[1:]])

    parts = tf.nest.map_structure(pad, tuple(parts))
    present = tf.cast(tf.range(replicas) < p, tf.float32)[:, None]
    return (*parts, pad(valid) * present)


@tf.autograph.experimental.do_not_convert
def _element(*piece: Any, materialize, rows: int, row_numbers: bool, all_real: bool) -> tuple:
    """A cut piece of rows -> ``(x, y, sample_weight_or_(), valid)``, padded to ``rows``.

    Traced without autograph (``tf.data`` converts a map's function by default): its
    branches are ``tf.cond`` already, and building the pipeline skips the conversion.
    """
    piece = piece[0] if len(piece) == 1 else piece
    padded, valid = _pad_rows(piece, rows, row_numbers=row_numbers, all_real=all_real)
    x, y, w = materialize(padded)
    return x, none_to_empty(y), none_to_empty(w), valid


@tf.autograph.experimental.do_not_convert
def _shortened_element(piece: Any, length_factor: tf.Tensor, extent: Any, valid: tf.Tensor, *,
                       materialize, rows: int | None) -> tuple:
    """:func:`_element` of a piece cut by length (``by_length.cut_by_length``): its inputs
    as a :class:`Shortened` with their length factors and extent (rows None: as the piece
    comes, its own ``valid``, which marks the rows XLA's shapes padded it with)."""
    (padded, length_factor, extent, valid), padded_valid = _pad_rows(
        (piece, length_factor, extent, valid), rows)
    valid = valid if rows is None else valid * padded_valid
    x, y, w = materialize(padded)
    return Shortened(x, length_factor, extent), none_to_empty(y), none_to_empty(w), valid


@tf.autograph.experimental.do_not_convert
def _shortened_rows(numbers: tf.Tensor, length: tf.Tensor, length_factor: tf.Tensor,
                    extent: Any, valid: tf.Tensor, *, materialize, rows: int | None,
                    padded: PaddedArrays) -> tuple:
    """:func:`_shortened_element` of a piece of row numbers (``by_length.cut_rows_by_length``):
    the rows gathered, then cut to the piece's length."""
    (numbers, length_factor, extent, valid), padded_valid = _pad_rows(
        (numbers, length_factor, extent, valid), rows, row_numbers=True)
    valid = valid if rows is None else valid * padded_valid
    x, y, w = trim(materialize(numbers), padded, length)
    return Shortened(x, length_factor, extent), none_to_empty(y), none_to_empty(w), valid


def _pad_replicas_of(*element: Any, replicas: int) -> Any:
    return _pad_replicas(element, replicas)


def elements_per_batch(pattern: list[Piece], batch_rows: int, local_replicas: int) -> int:
    """Elements this worker's pipeline yields for a large batch of ``batch_rows`` rows.

    A short last batch (``batch_rows`` < B) ends inside the pattern: only the kept
    pieces it reaches count, the last one cut short.
    """
    kept, seen = 0, 0
    for piece in pattern:
        if seen >= batch_rows:
            break
        kept += piece.keep
        seen += piece.rows
    return math.ceil(kept / local_replicas)


class Cutter:
    """One kind of cut of one worker's rows into elements.

    Args:
        adapter: the input, whose ``materialize`` turns a piece into data.
        cut: how each large batch is cut (``sequences.cut.Cut``).
        pattern: this worker's pieces of a large batch (``split.piece_pattern``).
        rows: rows per micro-batch on this worker.
        where: the ``tf.distribute`` layout of this process.
        all_real: every element holds real rows only (``MicroBatches.all_real``).
    """

    ends: Batch = "counted"  # how its large batches end (markers.Ends.batch)

    def __init__(self, adapter: InputAdapter, cut: Cut, pattern: list[Piece], rows: int,
                 where: Layout, *, all_real: bool = False) -> None:
        self.materialize = adapter.materialize
        self.row_numbers = adapter.row_numbers
        self.cut, self.pattern, self.rows, self.where = cut, pattern, rows, where
        self.replicas = where.local_replicas
        self.all_real = all_real
        self.tokens = cut.tokens if cut.by == "tokens" else None

    def elements(self, rows: tf.data.Dataset, parallel: bool) -> tf.data.Dataset:
        """One epoch's elements from ``rows`` (the adapter's ``rows_dataset``);
        ``parallel``: map in parallel, in order."""
        ds = self.pieces(rows).map(self.element(), **(_IN_PARALLEL if parallel else {}))
        if self.replicas > 1:  # one piece per local replica, side by side
            ds = self.stacked(ds)
        return ds

    def stacked(self, ds: tf.data.Dataset) -> tf.data.Dataset:
        """Each run of one element per local replica, side by side: of one shape; a
        short last run padded with copies that weigh nothing."""
        return ds.batch(self.replicas).map(functools.partial(_pad_replicas_of,
                                                             replicas=self.replicas))

    def per_batch(self) -> int:
        """The most elements one large batch takes."""
        return elements_per_batch(self.pattern, sum(p.rows for p in self.pattern),
                                  self.replicas)

    def pieces(self, rows: tf.data.Dataset) -> tf.data.Dataset:
        """This worker's pieces of each large batch of ``rows``."""
        raise NotImplementedError

    def element(self) -> Any:
        """The map from a piece to an element."""
        raise NotImplementedError


class AsItComes(Cutter):
    """The rows in the order they come, in the pattern's pieces; rows that vary in
    shape padded to their large batch's longest row."""

    def pieces(self, rows: tf.data.Dataset) -> tf.data.Dataset:
        sizes = [p.rows for p in self.pattern]
        if varying_shapes(rows.element_spec):
            ds = pad_to_longest(rows, sizes)
        else:
            ds = rows.rebatch(sizes if len(sizes) > 1 else sizes[0])
        keep = [p.keep for p in self.pattern]
        if all(keep):
            return ds
        table = tf.constant(keep)
        period = len(keep)

        def ours(index, piece):
            return tf.gather(table, index % period)

        def drop_index(index, piece):
            return piece

        return ds.enumerate().filter(ours).map(drop_index)

    def element(self) -> Any:
        return functools.partial(_element, materialize=self.materialize, rows=self.rows,
                                 row_numbers=self.row_numbers, all_real=self.all_real)


class ByLength(Cutter):
    """Each large batch's rows sorted by what they cost, each piece padded to its own
    longest row in each length (in tokens: pieces of up to a budget, then a marker)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.tokens:
            self.ends = "marker"

    def per_batch(self) -> int:
        if self.tokens:  # at most a piece per kept row, then the large batch's marker
            return sum(p.rows for p in self.pattern if p.keep) + 1
        return super().per_batch()

    def pieces(self, rows: tf.data.Dataset) -> tf.data.Dataset:
        return cut_by_length(rows, self.pattern, self.cut, cap=self.rows)

    def stacked(self, ds: tf.data.Dataset) -> tf.data.Dataset:
        """Each micro-step's pieces, one per local replica and each of its own shape,
        padded at the end to the most rows and lengths of any: each replica's step cuts
        its own back out (``length_factor.own_shape``, by its ``extent``). Every run is
        whole: the cut fills a short one (``packing.in_groups``)."""
        return ds.padded_batch(self.replicas)

    def element(self) -> Any:
        return functools.partial(_shortened_element, materialize=self.materialize,
                                 rows=None if self.tokens else self.rows)


class ArraysByLength(ByLength):
    """:class:`ByLength` for arrays that hold padded sequences: their row numbers sorted
    and cut, each piece's rows gathered and cut to its longest row."""

    def pieces(self, rows: tf.data.Dataset) -> tf.data.Dataset:
        return cut_rows_by_length(rows, self.pattern, self.cut, cap=self.rows)

    def element(self) -> Any:
        return functools.partial(_shortened_rows, materialize=self.materialize,
                                 rows=None if self.tokens else self.rows,
                                 padded=self.cut.arrays)


class Shares(Cutter):
    """A worker's share of each step (``autosplit.data.sharded``), cut in order, then an
    element of no row: the step's loop stops there."""

    ends: Batch = "marker"

    def per_batch(self) -> int:
        return SHARE_ELEMENTS

    def elements(self, rows: tf.data.Dataset, parallel: bool) -> tf.data.Dataset:
        return cut_shares(
            rows, rows=self.rows, local_replicas=self.replicas, marker=end_marker,
            element=functools.partial(_element, materialize=self.materialize,
                                      rows=self.rows, row_numbers=False, all_real=False),
            group=functools.partial(_pad_replicas_of, replicas=self.replicas))


class SharesByLength(Shares):
    """A worker's share of sequences, sorted and cut by length after its header (the
    share's length, which the workers agree on), ended by a marker in rows. On several
    local replicas the share is their per-replica batches joined, cut as one device
    cuts it, and each micro-step's pieces stacked, one per replica (:class:`ByLength`)."""

    ends: Batch = "header"

    def elements(self, rows: tf.data.Dataset, parallel: bool) -> tf.data.Dataset:
        share = piece_pattern(sum(p.rows for p in self.pattern) // self.where.workers,
                              self.rows)
        if self.replicas > 1:
            rows = joined_shares(rows, self.replicas)
        ds = cut_by_length(rows, share, self.cut, cap=self.rows, shares=True).map(
            functools.partial(_shortened_element, materialize=self.materialize,
                              rows=None if self.tokens else self.rows))
        return ds.padded_batch(self.replicas) if self.replicas > 1 else ds


def cutter_for(adapter: InputAdapter, cut: Cut, pattern: list[Piece], rows: int,
               where: Layout, *, all_real: bool = False) -> Cutter:
    """The cutter of ``adapter``'s rows for ``cut``."""
    if adapter.shares:
        kind: type[Cutter] = SharesByLength if cut.sorted else Shares
    elif not cut.sorted:
        kind = AsItComes
    else:
        kind = ArraysByLength if cut.arrays is not None else ByLength
    return kind(adapter, cut, pattern, rows, where, all_real=all_real)
