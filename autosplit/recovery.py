"""Out-of-memory recovery: finish the same large batch with smaller micro-batches.

A ``ResourceExhaustedError`` in a micro-batch leaves the step's sums holding exactly
the micro-batches before it (``autosplit.step``). :class:`Recovery` then cuts every
remaining element, starting with the stashed one, into more pieces and runs the rest
of the large batch, so the batch is applied once, with nothing lost or counted twice.
The input pipeline keeps its element size until the next epoch, when
``fit_large_batch`` rebuilds it at the size that worked.

Across the workers of a ``MultiWorkerMirroredStrategy`` no worker may wait in a
collective for one that failed: each worker runs its local loop (no collectives),
then all of them agree (one small all-reduce of an ok flag) before any of them
applies; a worker that failed resumes its own remainder while the others, done
already, only join the next agreement. Each worker keeps its own micro-batch size.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from autosplit.errors import NothingFitsError, WorkerLostError
from autosplit.step import TrainStep

__all__ = ["Recovery", "shrink_micro_batch", "worker_lost"]


def shrink_micro_batch(failed: int, fits: Sequence[int] = ()) -> int:
    """The next micro-batch bound to try after ``failed`` rows ran out of memory.

    The largest size below ``failed`` already known to fit, if any; else half of it,
    rounded down to a multiple of 8 once it is at least 8; 0 when ``failed`` is 1.

    >>> shrink_micro_batch(512), shrink_micro_batch(100), shrink_micro_batch(5)
    (256, 48, 2)
    >>> shrink_micro_batch(512, fits=[96, 384, 640])
    384
    """
    below = [m for m in fits if m < failed]
    if below:
        return max(below)
    half = failed // 2
    if half >= 8:
        half -= half % 8
    return max(half, 1) if failed > 1 else 0


def worker_lost(error: Exception, strategy: Any, step_number: int) -> WorkerLostError:
    return WorkerLostError(
        f"A worker of the {type(strategy).__name__} run stopped answering during step "
        f"{step_number} ({type(error).__name__}); this worker stops too instead of waiting "
        "forever. Restart the job; keras.callbacks.BackupAndRestore resumes it from the last "
        "epoch. Collective timeouts are set with tf.distribute.experimental."
        "CommunicationOptions(timeout_seconds=...).")


class Recovery:
    """Runs large batches to completion on one worker, shrinking on out-of-memory.

    Args:
        step: the ``TrainStep``.
        on_oom: ``"recover"`` or ``"raise"``.
        known_fits: micro-batch sizes the probe saw fit (tried first when shrinking).
        multi_worker: agree with the other workers before every apply.
        fused: the input knows its length, so every large batch has elements: one call
            runs the loop and the apply. Otherwise the apply waits until the loop shows
            the batch is not empty.
        on_shrink: called with (step_number, failed_rows, new_rows) after each OOM.
        fault_hook: testing hook, called before the first attempt of each step.
    """

    def __init__(self, step: TrainStep, *, on_oom: str = "recover",
                 known_fits: Sequence[int] = (), multi_worker: bool = False,
                 fused: bool = True, on_shrink: Callable[[int, int, int], None] | None = None,
                 fault_hook: Callable[[int, int], None] | None = None) -> None:
        self.step = step
        self.on_oom = on_oom
        self.known_fits = list(known_fits)
        self.multi_worker = multi_worker
        self.fused = fused and not multi_worker
        self.on_shrink = on_shrink
        self.fault_hook = fault_hook
        self.pieces = 1
        self.records: list[dict] = []
        self._hooked = False  # the fault hook is running (it raised before any step ran)

    @property
    def rows(self) -> int:
        """Rows per micro-batch in use now."""
        return math.ceil(self.step.rows / self.pieces)

    def rebind(self, element_spec: Any) -> None:
        """A new epoch's pipeline at the size that worked: one piece per element again."""
        self.step.rebind(element_spec)
        self.pieces = 1

    def run(self, iterator, count: int, step_number: int) -> dict | None:
        """Train one large batch of ``count`` elements; None if the input had none left."""
        try:
            if self.multi_worker:
                return self._run_agreed(iterator, count, step_number)
            return self._run_alone(iterator, count, step_number)
        except (tf.errors.UnavailableError, tf.errors.DeadlineExceededError,
                tf.errors.CancelledError) as error:
            if self.step.replicas == 1:
                raise
            raise worker_lost(error, self.step.strategy, step_number) from error

    # ------------------------------------------------------------ one process

    def _run_alone(self, iterator, count: int, step_number: int) -> dict | None:
        resume, remaining = False, count
        while True:
            try:
                if not resume:
                    self._hook(step_number)
                if self.fused and not resume and self.pieces == 1:
                    return self.step.run(iterator, remaining)
                self.step.run_local(iterator, remaining, resume=resume, pieces=self.pieces)
                break
            except tf.errors.ResourceExhaustedError as error:
                remaining -= self._pulled()
                self._shrink(error, step_number)
                resume = True
        if self.step.local_rows() == 0:
            return None  # the input ended before this batch began
        return self.step.finish()

    # ------------------------------------------------------------ many workers

    def _run_agreed(self, iterator, count: int, step_number: int) -> dict | None:
        resume, remaining = False, count
        while True:
            ok = True
            try:
                if not resume:
                    self._hook(step_number)
                self.step.run_local(iterator, remaining, resume=resume, pieces=self.pieces)
                remaining = 0
            except tf.errors.ResourceExhaustedError as error:
                ok = False
                remaining -= self._pulled()
                self._shrink(error, step_number)
            # The only collectives of a step come after the local loop: first this
            # agreement, then (only if every worker succeeded) the apply.
            all_ok, rows = self.step.agree(ok, self.step.local_rows())
            if all_ok:
                break
            resume = not ok
        if rows == 0:
            return None
        return self.step.finish()

    # ------------------------------------------------------------ shrinking

    def _hook(self, step_number: int) -> None:
        if self.fault_hook is not None:
            self._hooked = True
            self.fault_hook(step_number, self.rows)
            self._hooked = False

    def _pulled(self) -> int:
        """Elements the failed attempt pulled from the iterator."""
        if self._hooked:  # the fault hook raised before anything ran
            self._hooked = False
            return 0
        pulled, _, _ = self.step.progress()
        return pulled

    def _shrink(self, error: Exception, step_number: int) -> None:
        failed = self.rows
        if self.on_oom == "raise":
            self.step.discard()
            raise error
        target = shrink_micro_batch(failed, self.known_fits)
        if target < 1:
            self.step.discard()
            raise NothingFitsError(
                "Out of memory during training with a micro-batch of 1 example: nothing "
                "smaller can be tried. Free memory or use a smaller model.") from error
        pieces = max(self.pieces + 1, math.ceil(self.step.rows / target))
        while math.ceil(self.step.rows / pieces) >= failed:
            pieces += 1
        self.pieces = pieces
        # A size the probe saw fit has just failed: memory is tighter than at probe
        # time, so its other measurements are not trusted either.
        self.known_fits = []
        warnings.warn(
            f"Out of memory in step {step_number} with micro-batches of {failed} rows; "
            f"finishing the same batch with micro-batches of {self.rows} rows.", stacklevel=4)
        self.records.append({"step": step_number, "failed": failed, "retry": self.rows})
        if self.on_shrink is not None:
            self.on_shrink(step_number, failed, self.rows)
