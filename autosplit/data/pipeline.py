"""The host pipeline: any input's rows -> micro-batches, never a large batch.

Every input adapter (``autosplit.data.inputs``) gives a host ``tf.data`` stream of rows in
batches of whatever size. This module cuts that stream with ``Dataset.rebatch`` into
the runs of :func:`autosplit.data.split.piece_pattern` (the balanced micro-batches of this
worker's share of each large batch, and the other workers' rows to drop), pads each
micro-batch to its static row count with copies of its own rows, and marks real rows
in ``valid``. Array rows are gathered here, after the cut, so no more than one
micro-batch of each input is ever copied. All of it is pinned to the host CPU; the
compiled step pulls one element per micro-step and only that element reaches the
accelerator.

An element is ``(x, y_or_(), sample_weight_or_(), valid)``: ``valid`` is float32 ``(rows,)``,
1.0 for real rows and 0.0 for padding. With several local replicas every part gains
a leading axis, one micro-batch per replica (missing ones are all padding). Every
element has a real row, so an element whose ``valid`` is all 0 can only be the end
marker that ``MicroBatches.dataset(marked=True)`` puts after each epoch.
"""

from __future__ import annotations

import functools
import math
import threading
from typing import Any

import tensorflow as tf

from autosplit.data.adapter import InputAdapter, varying_shapes
from autosplit.data.layout import ALONE, Layout
from autosplit.data.markers import end_marker, markable
from autosplit.data.sequences.by_length import cut_by_length, cut_rows_by_length, trim
from autosplit.data.sequences.cut import Cut
from autosplit.data.sequences.length_factor import Shortened
from autosplit.data.sequences.lengths import PaddedArrays
from autosplit.data.sequences.longest import pad_to_longest
from autosplit.data.sequences.shapes import Shapes
from autosplit.data.sharded import SHARE_ELEMENTS, cut_shares
from autosplit.data.split import Piece, piece_pattern
from autosplit.data.structure import none_to_empty
from autosplit.graph import HOST

__all__ = ["MicroBatches", "elements_per_batch", "host_autotune", "release"]

_IN_PARALLEL = {"num_parallel_calls": tf.data.AUTOTUNE, "deterministic": True}
_PREFETCH = 2  # micro-batches the host keeps ready: enough to hide the cut, constant in B


def host_autotune() -> bool:
    """Whether training's pipeline lets ``tf.data`` autotune: only when the step runs on
    a GPU.

    Autotuning grows buffers and in-flight elements as it goes. On a GPU they are host
    memory, outside the device memory the probe budgets. When the step runs on the
    CPU they are the same memory as the step's, and the probe's trials (which run with
    autotuning off, see ``autosplit.search.trials.trial_dataset``) cannot see them: under
    a CPU cap, steps then peak above what the trials measured, and epochs are no faster
    with it.
    """
    return bool(tf.config.list_logical_devices("GPU"))


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
def _shortened_element(piece: Any, length_factor: tf.Tensor, valid: tf.Tensor, *, materialize,
                     rows: int | None) -> tuple:
    """:func:`_element` of a piece cut by length (``by_length.cut_by_length``): its inputs
    as a :class:`Shortened` with their length factors (rows None: as the piece comes, its own
    ``valid``, which marks the rows XLA's shapes padded it with)."""
    (padded, length_factor, valid), padded_valid = _pad_rows((piece, length_factor, valid), rows)
    valid = valid if rows is None else valid * padded_valid
    x, y, w = materialize(padded)
    return Shortened(x, length_factor), none_to_empty(y), none_to_empty(w), valid


@tf.autograph.experimental.do_not_convert
def _shortened_rows(numbers: tf.Tensor, length: tf.Tensor, length_factor: tf.Tensor,
                    valid: tf.Tensor, *, materialize, rows: int | None,
                    padded: PaddedArrays) -> tuple:
    """:func:`_shortened_element` of a piece of row numbers (``by_length.cut_rows_by_length``):
    the rows gathered, then cut to the piece's length."""
    (numbers, length_factor, valid), padded_valid = _pad_rows((numbers, length_factor, valid), rows,
                                                        row_numbers=True)
    valid = valid if rows is None else valid * padded_valid
    x, y, w = trim(materialize(numbers), padded, length)
    return Shortened(x, length_factor), none_to_empty(y), none_to_empty(w), valid


def _pad_replicas_of(*element: Any, replicas: int) -> Any:
    return _pad_replicas(element, replicas)


def release(held: list[Any]) -> None:
    """Delete the iterators in ``held`` (their only references) on a thread of their own.

    With tf.data's autotuning on (the default), deleting an iterator waits for its
    optimisation thread, at times as long as an epoch of a small model. Training need
    not wait for that. The thread is no daemon: at exit the interpreter lets the deletion finish
    rather than tear TensorFlow down under it.
    """
    if any(it is not None for it in held):
        threading.Thread(target=held.clear, name="autosplit-release-iterator").start()


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


class MicroBatches:
    """One worker's micro-batches of one input, for one split.

    Args:
        adapter: the input.
        batch_size: B, the global large batch.
        rows: rows per micro-batch on this worker.
        where: the ``tf.distribute`` layout of this process (``autosplit.data.layout``).
        cut: how each large batch is cut (``autosplit.data.sequences.cut.Cut``). None or
            ``"rows"``/``"longest"``: as its rows come, each micro-batch padded to its
            large batch's longest row where rows vary in shape. ``"length"``: its rows
            sorted by length and each micro-batch padded to its own longest row in
            each of an example's lengths (under XLA, ``cut.buckets``, rounded up to its
            bucket), for a model that ignores padding; its inputs then come as
            ``length_factor.Shortened``. ``"tokens"``: the same in micro-batches of up to
            ``cut.tokens`` tokens and ``rows`` rows, as many as a large batch needs,
            then an element with no row that ends it (``markers.is_end_marker``): elements have
            no static row count, and none is padding but for XLA's, which pads each
            micro-batch's rows to what the budget holds at its lengths.
        shapes: where the shapes given are counted, under ``cut.buckets`` (None: a
            :class:`Shapes` of its own).
    """

    def __init__(self, adapter: InputAdapter, batch_size: int, rows: int,
                 where: Layout = ALONE, *, cut: Cut | None = None,
                 shapes: Shapes | None = None) -> None:
        self.adapter = adapter
        self.cut = Cut() if cut is None else cut
        # Under XLA's buckets, the shapes training gives its step (FitReport.programs)
        self.shapes = shapes if shapes is not None or not self.cut.buckets else Shapes()
        self.where = where
        self.batch_size = batch_size
        self.rows = rows
        self.local_replicas = local_replicas = where.local_replicas
        self.pattern = piece_pattern(batch_size, rows, workers=where.workers,
                                     worker=where.worker, local_replicas=local_replicas)
        self.tokens = self.cut.tokens if self.cut.by == "tokens" else None
        # With tokens, a large batch has at most a piece per kept row, then its end's
        # marker, which the loop must pull too.
        self.per_batch = (sum(p.rows for p in self.pattern if p.keep) + 1 if self.tokens
                          else SHARE_ELEMENTS if adapter.shares
                          else elements_per_batch(self.pattern, batch_size, local_replicas))
        # (None or (shuffle seed, repeat), autotune) -> the elements of an epoch
        self._cuts: dict = {}
        self._epochs: dict = {}  # (shuffle seed, repeat) -> the epoch the next iteration cuts
        self._datasets: dict = {}  # (repeat, seed, marked, autotune, counted) -> ready to iterate

    def all_real(self) -> bool:
        """Whether every element holds ``rows`` real rows, none of padding: the input
        tells its length, a whole number of large batches, each cut into pieces of
        ``rows`` rows, on one local replica. The train step then drops no padding
        before the metrics (``TrainStep.rebind``): no ``tf.cond`` per micro-batch."""
        if self.tokens:
            return self.local_replicas == 1 and not self.cut.buckets
        rows = None if self.adapter.shares else self.adapter.rows
        return (rows is not None and rows % self.batch_size == 0 and self.local_replicas == 1
                and all(p.rows == self.rows for p in self.pattern if p.keep))

    @property
    def batches_marked(self) -> bool:
        """Whether each large batch ends with an element of no row (:func:`end_marker`'s):
        in tokens, and the shares of a sharded input (``autosplit.data.sharded``)."""
        return bool(self.tokens) or self.adapter.shares

    @property
    def headers(self) -> bool:
        """Whether each large batch begins with a header (a share cut by length, whose
        length the workers agree on first: ``markers.is_header``)."""
        return self.adapter.shares and self.cut.sorted

    @property
    def element_rows(self) -> int | None:
        """Rows of every element: ``rows``, or None with tokens (each piece's own)."""
        return None if self.tokens else self.rows

    def steps(self) -> int | None:
        """Large batches in one epoch (None when the input does not say)."""
        rows = self.adapter.rows
        return None if rows is None else math.ceil(rows / self.batch_size)

    def elements(self, step: int) -> int:
        """Elements of large batch ``step`` (0-based) of an epoch; the last may be short."""
        rows = self.adapter.rows
        if rows is None or self.tokens:
            return self.per_batch
        return elements_per_batch(self.pattern, min(self.batch_size,
                                                    rows - step * self.batch_size),
                                  self.local_replicas)

    def dataset(self, *, repeat: bool = False, shuffle_seed: int | None = None,
                epoch: int = 0, marked: bool = False, autotune: bool | None = None,
                counted: bool = True) -> tf.data.Dataset:
        """The micro-batch elements of one epoch (or, with ``repeat``, of endless epochs).

        Repeating after the cut restarts the pattern with every epoch, so a short last
        batch never borrows rows from the next epoch. The cut is built once per seed and
        every variant wraps it: iterating again starts a new epoch, and asking for the
        repeated variant after the element spec traces none of its functions again.

        With ``shuffle_seed``, an input that shuffles (arrays) orders epoch ``epoch`` by
        ``(shuffle_seed, epoch)`` alone, and with ``repeat`` each epoch after it by the
        next number: a pipeline built later (at another micro-batch size, after an
        out-of-memory recovery) and started at epoch e gives e and every epoch after it
        the order this one would have. The number is a variable of the cut, which each
        iteration reads and advances: every call sets the epoch the next iterator made
        starts at. Other inputs keep their own order.

        With ``marked`` each epoch ends with :func:`end_marker`'s element (see
        :meth:`can_mark`), so one repeated iterator reads every epoch of an input whose
        length only its end tells: the step stops a large batch at the marker.

        ``autotune`` turns ``tf.data``'s autotuning on or off for the whole pipeline,
        the input's own stages included; None: :func:`host_autotune`. ``counted``: the
        shapes pulled count in :attr:`shapes` (a read on the host, ``sequences.stats``, does not).
        """
        autotune = host_autotune() if autotune is None else autotune
        if not self.adapter.shuffles:
            shuffle_seed = None
        counted = counted and self.shapes is not None
        key = (repeat, shuffle_seed, marked, autotune, counted)
        # The cut: one per seed and repeat (a repeated iterator's epochs must not move
        # with another's), its epoch a variable, so that rereading the data (each epoch
        # a new iterator, with steps_per_epoch) builds nothing new: a cut per epoch,
        # cached, grew by 47 MB over 300 epochs.
        cut = None if shuffle_seed is None else (shuffle_seed, repeat)
        if cut is not None:
            if cut not in self._epochs:
                with tf.device(HOST):
                    self._epochs[cut] = tf.Variable(0, dtype=tf.int64, trainable=False)
            self._epochs[cut].assign(epoch)
        if key not in self._datasets:
            if (cut, autotune) not in self._cuts:
                self._cuts[cut, autotune] = self._build(
                    shuffle_seed=shuffle_seed, epoch=0 if cut is None else self._epochs[cut],
                    parallel=autotune)
            ds = self._cuts[cut, autotune]
            with tf.device(HOST):
                if marked:
                    marker = end_marker(ds.element_spec)
                    if marker is None:
                        raise ValueError("These elements cannot be marked; see can_mark().")
                    ds = ds.concatenate(marker)
                if repeat:
                    ds = ds.repeat()
                options = tf.data.Options()
                options.deterministic = True
                options.autotune.enabled = autotune
                if not self.adapter.graph_rewrites:
                    options.experimental_optimization.apply_default_optimizations = False
                ds = ds.with_options(options).prefetch(_PREFETCH)
                if counted:
                    assert self.shapes is not None
                    ds = ds.map(self.shapes.record)
                self._datasets[key] = ds
        return self._datasets[key]

    def _build(self, *, shuffle_seed: int | None, epoch: int | tf.Variable,
               parallel: bool) -> tf.data.Dataset:
        """The cut, padded elements of one epoch, before any repeat or prefetch; ``parallel``
        maps in parallel, in order (arrays have tf.data's graph rewrites off, and a GPU
        host's gathers overlap), else one element at a time, as the probe measured."""
        with tf.device(HOST):
            ds = self.adapter.rows_dataset(shuffle_seed=shuffle_seed, epoch=epoch,
                                           batch_size=self.batch_size)
            # Functions that hold the adapter, not this object: a dataset kept in
            # self._cuts must not point back at self (a cycle would keep the input's
            # arrays alive until the next garbage collection).
            materialize, cut = self.adapter.materialize, self.cut
            if self.adapter.shares and cut.sorted:  # a header, its pieces, an end
                share = piece_pattern(self.batch_size // self.where.workers, self.rows)
                ds = cut_by_length(ds, share, cut, cap=self.rows, shares=True)
                return ds.map(functools.partial(_shortened_element, materialize=materialize,
                                                rows=self.element_rows))
            if self.adapter.shares:
                return cut_shares(
                    ds, rows=self.rows, local_replicas=self.local_replicas, marker=end_marker,
                    element=functools.partial(_element, materialize=materialize,
                                              rows=self.rows, row_numbers=False, all_real=False),
                    group=functools.partial(_pad_replicas_of, replicas=self.local_replicas))
            if not cut.sorted:
                ds = self._cut_as_it_comes(ds, cut)
                element = functools.partial(_element, materialize=materialize, rows=self.rows,
                                            row_numbers=self.adapter.row_numbers,
                                            all_real=self.all_real())
            elif cut.arrays is not None:  # this worker's pieces alone
                ds = cut_rows_by_length(ds, self.pattern, cut, cap=self.rows)
                element = functools.partial(_shortened_rows, materialize=materialize,
                                            rows=self.element_rows, padded=cut.arrays)
            else:
                ds = cut_by_length(ds, self.pattern, cut, cap=self.rows)
                element = functools.partial(_shortened_element, materialize=materialize,
                                            rows=self.element_rows)
            ds = ds.map(element, **(_IN_PARALLEL if parallel else {}))
            replicas = self.local_replicas
            if replicas > 1:
                ds = ds.batch(replicas).map(functools.partial(_pad_replicas_of,
                                                              replicas=replicas))
            steps = self.steps()
            if steps is not None and not self.tokens:
                # Every step and epoch boundary rests on this count (a batched input's
                # is datasets.counted_rows'): a pass that ends short stops with tf.data's
                # "expected to contain" error rather than take rows of the next epoch.
                ds = ds.apply(tf.data.experimental.assert_cardinality(
                    sum(self.elements(step) for step in range(steps))))
            return ds

    def _cut_as_it_comes(self, ds: tf.data.Dataset, cut: Cut) -> tf.data.Dataset:
        """The runs of :attr:`pattern`, rows in the order they come, this worker's kept."""
        sizes = [p.rows for p in self.pattern]
        if varying_shapes(ds.element_spec):
            ds = pad_to_longest(ds, sizes)
        else:
            ds = ds.rebatch(sizes if len(sizes) > 1 else sizes[0])
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

    def can_mark(self) -> bool:
        """Whether :meth:`dataset` can mark the end of each epoch (every part of an
        element a plain tensor)."""
        return markable(self.element_spec())

    def element_spec(self) -> Any:
        """The elements' spec: the same for every variant, so one already built gives it
        (building another would draw an op seed for its shuffle)."""
        for ds in self._datasets.values():
            return ds.element_spec
        return self.dataset().element_spec
