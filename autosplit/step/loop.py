"""The train step's loops: elements pulled from the host iterator, each cut into slices.

:func:`pull` pulls up to ``count`` elements of the host pipeline (``autosplit.data.pipeline``)
inside a ``tf.while_loop`` and commits each, micro-step by micro-step
(``autosplit.step.update``). It copies every element to the host-side stash as it pulls it;
the micro-steps record how many of its rows are in the sums. After an out-of-memory
error, ``pull(..., Pull(resume=True, slices=q))`` first redoes the stashed element's rows not
yet committed, then the rest of the large batch, with each element cut into q smaller
slices: nothing is lost or counted twice (``autosplit.training.recovery`` drives that).

Nothing with B rows ever enters these loops: their inputs are the iterator and an
element count, the iterator and the stash are pinned to the host CPU, and the
accelerator sees one micro-batch at a time.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

import tensorflow as tf

from autosplit.data.markers import is_end_marker
from autosplit.graph import HOST, after
from autosplit.step.update import LargeBatchUpdate

__all__ = ["Pull", "pull", "run_element"]


class Pull(NamedTuple):
    """How a compiled loop pulls, chosen once per function (part of its cache key).

    ``ends``: ``"counted"``, the iterator holds ``count`` more elements (an input that
    knows its length, as every call of its large batches counts them): a plain
    ``get_next``, without the optional and the ``tf.cond`` that let an input end
    anywhere (a smaller graph to trace and optimise, in every call and probe trial);
    ``"input"``, the input may end anywhere; ``"marker"``, the iterator runs on past
    each epoch (or, in tokens, each large batch), whose end is an element with no real
    row (``markers.Ends``): the loop stops there, as at the end
    of an iterator, and the marker is neither stashed nor counted.

    ``all_real``: the elements hold real rows only (:func:`run_element`).
    ``resume``: first redo the stashed element's rows not yet committed; ``slices``:
    each element cut in that many (after an out-of-memory error)."""

    ends: Literal["counted", "input", "marker"] = "input"
    all_real: bool = False
    resume: bool = False
    slices: int = 1


def run_element(update: LargeBatchUpdate, element: Any, slices: int, first_row=None, *,
                all_real: bool = False) -> tf.Tensor:
    """All of one element (the rows from ``first_row`` on), in ``slices`` parts.

    ``all_real``: the element holds real rows only (``TrainStep.rebind``), and goes
    to the micro-step without a check for padding. Its rest after ``first_row`` or its
    parts may hold padding, and keep the check."""
    x, y, w, valid = element
    axis = 1 if update.replicas.local > 1 else 0
    rows = update.rows if update.rows is not None else tf.shape(valid)[axis]
    if first_row is not None:
        keep = tf.cast(tf.range(rows) >= first_row, tf.float32)
        valid = valid * (keep[None, :] if axis else keep)
    if slices == 1:
        return update.micro_step(x, y, w, valid, tf.convert_to_tensor(rows), rows,
                                 all_real=all_real and first_row is None)
    size = -(-rows // slices)

    def body(p):
        with tf.device(HOST):
            index = p * size + tf.range(size)
            clipped = tf.minimum(index, rows - 1)
            part = tf.nest.map_structure(lambda t: tf.gather(t, clipped, axis=axis),
                                         (x, y, w, valid))
            inside = tf.cast(index < rows, tf.float32)
            part_valid = part[3] * (inside[None, :] if axis else inside)
        end_row = tf.minimum((p + 1) * size, rows)

        def step():
            return after([update.micro_step(part[0], part[1], part[2], part_valid, end_row,
                                           rows)])

        def record_only():
            return after([update.stash.record(end_row, rows)])

        if update.replicas.count == 1:
            # A slice of padding alone (a short element cut after an out-of-memory error)
            # is recorded, not run: a custom train_step on 0 rows logged NaN for the epoch.
            done = tf.cond(tf.reduce_any(part_valid > 0), step, record_only)
        else:
            done = step()  # every replica runs its slices: they meet in collectives
        with tf.control_dependencies([done]):
            return p + 1

    start = tf.constant(0) if first_row is None else first_row // size
    loop = tf.while_loop(lambda p: p < slices, body, [start], parallel_iterations=1)
    return after([loop])


def pull(update: LargeBatchUpdate, iterator, count, how: Pull) -> tf.Tensor:
    """Pull up to ``count`` elements and commit them, as ``how`` says; no collective
    communication. Returns the number pulled."""
    stash = update.stash
    ops = [stash.pulled.assign(0), stash.exhausted.assign(False)]
    # A custom step's trackers as the last committed micro-batch left them: kept as a call
    # begins, put back before a redo (its failed slice may have counted already).
    ops.append(update.restore_metrics() if how.resume else update.keep_metrics())
    if how.resume:
        with tf.control_dependencies(ops):
            stashed = stash.get(update.element_spec)
            ops = [tf.cond(stash.pending.read_value(),
                           lambda: run_element(update, stashed, how.slices,
                                               stash.done_rows.read_value()),
                           lambda: tf.constant(True))]

    def take(element):
        """Stash the element, then commit it."""
        with tf.device(HOST):
            marks = stash.put(element)
        with tf.control_dependencies([after(marks)]):
            element = tf.nest.map_structure(tf.identity, element)
        return run_element(update, element, how.slices, all_real=how.all_real)

    def counted_body(i):
        with tf.device(HOST):
            element = iterator.get_next()
        with tf.control_dependencies([take(element)]):
            return [i + 1]

    def cond(i, stop):
        return tf.logical_and(i < count, tf.logical_not(stop))

    def body(i, stop):
        with tf.device(HOST):
            optional = iterator.get_next_as_optional()
            has = optional.has_value()
            if how.ends == "marker":
                # A small branch of its own reads the marker: the micro-step stays in one
                # tf.cond, as unmarked (inside a second one it would cost more to trace
                # and optimise).
                has = tf.cond(has, lambda: tf.logical_not(is_end_marker(optional.get_value())),
                              lambda: tf.constant(False))

        def one():
            with tf.device(HOST):
                element = optional.get_value()
            with tf.control_dependencies([take(element)]):
                return i + 1, tf.constant(False)

        def end():
            with tf.control_dependencies([stash.exhausted.assign(True)]):
                return i, tf.constant(True)

        return tf.cond(has, one, end)

    with tf.control_dependencies(ops):
        start = tf.constant(0, count.dtype if hasattr(count, "dtype") else tf.int32)
    if how.ends == "counted":
        loop = tf.while_loop(lambda i: i < count, counted_body, [start],
                             parallel_iterations=1)
    else:
        loop = tf.while_loop(cond, body, [start, tf.constant(False)], parallel_iterations=1)
    with tf.control_dependencies(tf.nest.flatten(loop)):
        return stash.pulled.read_value()
