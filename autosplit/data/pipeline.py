"""The host pipeline: any input's rows -> micro-batches, never a large batch.

Every input adapter (``autosplit.data.inputs``) gives a host ``tf.data`` stream of rows in
batches of whatever size. A cutter (``autosplit.data.cutters``) cuts that stream into
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
element has a real row, so an element whose ``valid`` is all 0 can only be a marker
(``autosplit.data.markers``): an epoch's end, a large batch's, or a share's header.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import tensorflow as tf

from autosplit.data.adapter import InputAdapter
from autosplit.data.cutters import cutter_for, elements_per_batch
from autosplit.data.layout import ALONE, Layout
from autosplit.data.markers import Ends, end_marker, markable
from autosplit.data.sequences.cut import Cut
from autosplit.data.sequences.shapes import Shapes
from autosplit.data.split import piece_pattern
from autosplit.graph import HOST

__all__ = ["MicroBatches", "host_autotune", "release"]

_COUNTED = Ends()
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


def release(held: list[Any]) -> None:
    """Delete the iterators in ``held`` (their only references) on a thread of their own.

    With tf.data's autotuning on (the default), deleting an iterator waits for its
    optimisation thread, at times as long as an epoch of a small model. Training need
    not wait for that. The thread is no daemon: at exit the interpreter lets the deletion finish
    rather than tear TensorFlow down under it.
    """
    if any(it is not None for it in held):
        threading.Thread(target=held.clear, name="autosplit-release-iterator").start()


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
            ``length_factor.Shortened``. ``"tokens"``: the same in micro-batches of up
            to ``cut.tokens`` tokens and ``rows`` rows, as many as a large batch needs,
            then an element with no row that ends it (``markers.is_end_marker``):
            elements have no static row count, and none is padding but for XLA's, which
            pads each micro-batch's rows to what the budget holds at its lengths.
        shapes: where the shapes given are counted, under ``cut.buckets`` (None: a
            :class:`Shapes` of its own).

    The kind of cut is a cutter's (``autosplit.data.cutters``); this class owns the
    epochs: the seeded order of each, the variants an iteration asks for (repeated,
    ended by a marker), each built once.
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
        self.local_replicas = where.local_replicas
        self.pattern = piece_pattern(batch_size, rows, workers=where.workers,
                                     worker=where.worker, local_replicas=self.local_replicas)
        self.tokens = self.cut.tokens if self.cut.by == "tokens" else None
        self.cutter = cutter_for(adapter, self.cut, self.pattern, rows, where,
                                 all_real=self.all_real())
        self.per_batch = self.cutter.per_batch()
        # (shuffle seed, repeat): the order of a seeded input's epochs, which a repeated
        # iterator's must not share with another's; None for an input of its own order
        self._elements: dict = {}  # (order, autotune) -> one epoch's elements, cut
        self._epoch_numbers: dict = {}  # order -> the epoch the next iteration cuts
        self._datasets: dict = {}  # (repeat, seed, ends, autotune, counted) -> to iterate

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

    def ends(self, *, one_iterator: bool = False, steps_given: bool = False) -> Ends:
        """Where each large batch's elements end, and each epoch's (``markers.Ends``),
        read as an iteration reads them: ``one_iterator``, one iterator repeated over
        every epoch; ``steps_given``, ``steps_per_epoch`` given, so that the data may end
        inside an epoch and a large batch's elements are not counted in advance."""
        batch = self.cutter.ends
        if batch == "counted" and (self.adapter.rows is None or steps_given):
            batch = "input"
        marked = one_iterator and self.adapter.rows is None and self.can_mark()
        return Ends(batch, "marker" if marked else "iterator")

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
                epoch: int = 0, ends: Ends = _COUNTED, autotune: bool | None = None,
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

        Where ``ends.epoch`` is ``"marker"`` each epoch ends with :func:`end_marker`'s
        element (see :meth:`can_mark`), so one repeated iterator reads every epoch of an
        input whose length only its end tells: the step stops a large batch at the marker.

        ``autotune`` turns ``tf.data``'s autotuning on or off for the whole pipeline,
        the input's own stages included; None: :func:`host_autotune`. ``counted``: the
        shapes pulled count in :attr:`shapes` (a read on the host, ``sequences.stats``,
        does not).
        """
        autotune = host_autotune() if autotune is None else autotune
        if not self.adapter.shuffles:
            shuffle_seed = None
        counted = counted and self.shapes is not None
        marked = ends.epoch == "marker"
        key = (repeat, shuffle_seed, marked, autotune, counted)
        # One epoch's elements per order, its epoch a variable, so that rereading the
        # data (each epoch a new iterator, with steps_per_epoch) builds nothing new: an
        # epoch's elements cut anew each epoch, cached, grew by 47 MB over 300 epochs.
        order = None if shuffle_seed is None else (shuffle_seed, repeat)
        if order is not None:
            if order not in self._epoch_numbers:
                with tf.device(HOST):
                    self._epoch_numbers[order] = tf.Variable(0, dtype=tf.int64,
                                                             trainable=False)
            self._epoch_numbers[order].assign(epoch)
        if key not in self._datasets:
            if (order, autotune) not in self._elements:
                self._elements[order, autotune] = self._build(
                    shuffle_seed=shuffle_seed,
                    epoch=0 if order is None else self._epoch_numbers[order],
                    parallel=autotune)
            ds = self._elements[order, autotune]
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
            rows = self.adapter.rows_dataset(shuffle_seed=shuffle_seed, epoch=epoch,
                                             batch_size=self.batch_size)
            ds = self.cutter.elements(rows, parallel)
            steps = self.steps()
            if steps is not None and not self.tokens:
                # Every step and epoch boundary rests on this count (a batched input's
                # is datasets.counted_rows'): a pass that ends short stops with tf.data's
                # "expected to contain" error rather than take rows of the next epoch.
                ds = ds.apply(tf.data.experimental.assert_cardinality(
                    sum(self.elements(step) for step in range(steps))))
            return ds

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
