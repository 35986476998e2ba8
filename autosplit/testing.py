"""Deterministic fault injection for tests of autosplit's OOM recovery.

A real out-of-memory error needs a real cap and costs seconds (the allocator retries
before it gives up); ``inject_oom`` raises the same exception type,
``tf.errors.ResourceExhaustedError``, at chosen training steps, in milliseconds.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import tensorflow as tf

from autosplit import fit as _fit

__all__ = ["inject_oom"]


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
