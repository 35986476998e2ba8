"""Test utilities: deterministic fault injection, and one large batch through the real path.

A real out-of-memory error needs a real cap and costs seconds (the allocator retries
before it gives up); ``inject_oom`` raises the same exception type,
``tf.errors.ResourceExhaustedError``, at chosen training steps, in milliseconds. It
does so from outside the library: :class:`FaultyStep` wraps the real ``TrainStep``
and fails on cue, and ``inject_oom`` hands it to ``fit_large_batch``'s out-of-memory
recovery for the length of a ``with`` block. ``train_on_large_batch`` runs one batch
of arrays through the host pipeline and the compiled step exactly as
``fit_large_batch`` does, for tests that compare one step with
``model.train_on_batch``; ``traced_graph`` is the graph that step runs, for tests that
walk it.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator
from typing import Any
from unittest import mock

import keras
import tensorflow as tf

from autosplit.data.arrays import ArrayInput
from autosplit.data.markers import Ends
from autosplit.data.pipeline import MicroBatches
from autosplit.data.split import split_batch
from autosplit.step.train_step import Step, TrainStep, step_for
from autosplit.training import fit as _fit
from autosplit.training.recovery import RecoverableStep, Recovery

__all__ = ["FaultyStep", "inject_oom", "traced_graph", "train_on_large_batch"]

_INPUT = Ends("input")


class FaultyStep:
    """A train step that runs out of memory before the first attempt of chosen steps.

    Wraps a real step (a ``TrainStep``, or any ``autosplit.training.recovery.RecoverableStep``)
    and delegates everything to it, except that the first ``run``, ``run_if_any`` or
    ``run_local`` of a large batch numbered in ``at_steps`` raises a real
    ``tf.errors.ResourceExhaustedError`` before it pulls anything, as a step whose
    first micro-batch did not fit: ``progress()`` then says it pulled nothing. Each
    step fails once. Large batches are numbered from 0 by the applies (``run``,
    ``run_if_any`` or ``finish``) that went through this wrapper.

    Args:
        step: the step to wrap.
        at_steps: the numbers of the large batches that fail once.
        above: only fail while the micro-batch has more rows than this.

    Attributes:
        raised: ``(step, micro_batch_rows)`` of every fault raised, in order.

    Example:
        >>> step = FaultyStep(real_step, at_steps={0})  # doctest: +SKIP
        >>> Recovery(step).run(iterator, count, 0)  # doctest: +SKIP
    """

    def __init__(self, step: RecoverableStep, at_steps: Iterable[int], *,
                 above: int = 0) -> None:
        self.step = step
        self.pending = set(at_steps)
        self.above = above
        self.raised: list[tuple[int, int]] = []
        self.applied = 0  # large batches applied through this wrapper
        self._faulted = False  # the last call failed here, before the real step ran

    def __getattr__(self, name: str) -> Any:
        if name == "step":  # not set yet (copy, pickle): no endless recursion
            raise AttributeError(name)
        return getattr(self.step, name)

    def _maybe_fail(self, slices: int) -> None:
        rows = math.ceil(self.step.rows / slices)
        self._faulted = self.applied in self.pending and rows > self.above
        if self._faulted:
            self.pending.discard(self.applied)
            self.raised.append((self.applied, rows))
            raise tf.errors.ResourceExhaustedError(
                None, None, f"injected OOM at step {self.applied}")

    def run(self, iterator: Any, count: int) -> dict:
        self._maybe_fail(1)
        logs = self.step.run(iterator, count)
        self.applied += 1
        return logs

    def run_if_any(self, iterator: Any, count: int, *, ends: Ends = _INPUT) -> dict | None:
        self._maybe_fail(1)
        logs = self.step.run_if_any(iterator, count, ends=ends)
        self.applied += logs is not None
        return logs

    def run_local(self, iterator: Any, count: int, *, resume: bool = False,
                  slices: int = 1, ends: Ends = _INPUT) -> int:
        if not resume:
            self._maybe_fail(slices)
        else:
            self._faulted = False
        return self.step.run_local(iterator, count, resume=resume, slices=slices,
                                   ends=ends)

    def finish(self) -> dict:
        logs = self.step.finish()
        self.applied += 1
        return logs

    def progress(self) -> tuple[int, bool, bool]:
        pulled, pending, exhausted = self.step.progress()
        return (0 if self._faulted else pulled), pending, exhausted


@contextlib.contextmanager
def inject_oom(at_steps: Iterable[int], *, above: int = 0) -> Iterator[list]:
    """Raise ``ResourceExhaustedError`` before the first attempt of each step in ``at_steps``.

    Inside the block, every ``fit_large_batch`` call trains through a
    :class:`FaultyStep`: each call counts its steps from 0, and each step number in
    ``at_steps`` fails once in the whole block.

    Args:
        at_steps: global step numbers (0-based, counting large batches) that fail once.
        above: only fail while the micro-batch is larger than this.

    Yields:
        The list of ``(step, micro_batch_size)`` faults raised, for assertions.

    Example:
        >>> with inject_oom(at_steps={2}) as raised:  # doctest: +SKIP
        ...     history = autosplit.fit_large_batch(model, x, y, batch_size=64,
        ...                                         micro_batch_size=32)
        >>> raised, history.autosplit.oom_recoveries[0].retry  # doctest: +SKIP
        ([(2, 32)], 16)
    """
    pending = set(at_steps)
    raised: list[tuple[int, int]] = []

    def faulty_recovery(step: Step, **kwargs: Any) -> Recovery:
        faulty = FaultyStep(step, (), above=above)
        # One record for every call in the block: a step that failed once does not fail
        # again in a later call.
        faulty.pending, faulty.raised = pending, raised
        return Recovery(faulty, **kwargs)

    with mock.patch.object(_fit, "Recovery", faulty_recovery):
        yield raised


def train_on_large_batch(model: keras.Model, x: Any, y: Any, sample_weight: Any = None, *,
                         micro_batch_size: int, batch_size: int | None = None,
                         jit_compile: bool | None = None, run_eagerly: bool | None = None
                         ) -> tuple[dict, Step]:
    """One exact large-batch update from arrays (all rows, in order); returns (logs, step).

    ``batch_size`` defaults to the number of rows; pass a larger one to train a short
    last batch of an epoch (the loss divides by the real rows).
    """
    data = ArrayInput(x, y, sample_weight, shuffle=False)
    batch = batch_size or data.rows
    rows = split_batch(batch, micro_batch_size).micro_batch_size
    pipeline = MicroBatches(data, batch, rows)
    step = step_for(model, pipeline, jit_compile=jit_compile, run_eagerly=run_eagerly)
    logs = step.run(iter(pipeline.dataset()), pipeline.elements(0))
    return {name: float(value) for name, value in logs.items()}, step


def traced_graph(step: TrainStep, iterator: Any, *, known_length: bool = True) -> tf.Graph:
    """The traced graph of ``step.run`` on ``iterator`` (for tests that walk it:
    placement, shapes, collectives); with ``known_length=False``, of
    ``step.run_if_any``, which pulls as an input of unknown length needs."""
    function = step.train_function if known_length else step.function_if_any()
    return function.get_concrete_function(iterator, tf.constant(1, tf.int32)).graph
