"""Test utilities: deterministic fault injection, and one large batch through the real path.

A real out-of-memory error needs a real cap and costs seconds (the allocator retries
before it gives up); ``inject_oom`` raises the same exception type,
``tf.errors.ResourceExhaustedError``, at chosen training steps, in milliseconds.
``train_on_large_batch`` runs one batch of arrays through the host pipeline and the
compiled step exactly as ``fit_large_batch`` does, for tests that compare one step
with ``model.train_on_batch``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import keras
import tensorflow as tf

from autosplit import fit as _fit
from autosplit.inputs import ArrayInput
from autosplit.pipeline import MicroBatches
from autosplit.split import split_batch
from autosplit.step import TrainStep, build_for, train_step

__all__ = ["inject_oom", "train_on_large_batch"]


@contextlib.contextmanager
def inject_oom(at_steps: Iterable[int], *, above: int = 0) -> Iterator[list]:
    """Raise ``ResourceExhaustedError`` before the first attempt of each step in ``at_steps``.

    Args:
        at_steps: global step numbers (0-based, counting large batches) that fail once.
        above: only fail while the micro-batch is larger than this.

    Yields:
        The list of ``(step, micro_batch_size)`` faults raised, for assertions.
    """
    pending, raised = set(at_steps), []

    def hook(step: int, micro_batch_size: int) -> None:
        if step in pending and micro_batch_size > above:
            pending.discard(step)
            raised.append((step, micro_batch_size))
            raise tf.errors.ResourceExhaustedError(None, None, f"injected OOM at step {step}")

    previous, _fit._FAULT_HOOK = _fit._FAULT_HOOK, hook
    try:
        yield raised
    finally:
        _fit._FAULT_HOOK = previous


def train_on_large_batch(model: keras.Model, x: Any, y: Any, sample_weight: Any = None, *,
                         micro_batch_size: int, batch_size: int | None = None,
                         jit_compile: bool | None = None, run_eagerly: bool | None = None
                         ) -> tuple[dict, TrainStep]:
    """One exact large-batch update from arrays (all rows, in order); returns (logs, step).

    ``batch_size`` defaults to the number of rows; pass a larger one to train a short
    last batch of an epoch (the loss divides by the real rows).
    """
    data = ArrayInput(x, y, sample_weight, shuffle=False)
    batch = batch_size or data.rows
    rows = split_batch(batch, micro_batch_size).micro_batch_size
    pipeline = MicroBatches(data, batch, rows)
    spec = pipeline.element_spec()
    build_for(model, spec)
    step = train_step(model, batch, spec, jit_compile=jit_compile, run_eagerly=run_eagerly)
    logs = step.run(iter(pipeline.dataset()), pipeline.elements(0))
    return {name: float(value) for name, value in logs.items()}, step
