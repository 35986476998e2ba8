"""Out-of-memory recovery: finish the same large batch with smaller micro-batches.

A ``ResourceExhaustedError`` in a micro-batch leaves the step's sums holding exactly
the micro-batches before it (``autosplit.step.update``). :class:`Recovery` then cuts every
remaining element, starting with the stashed one, into more slices and runs the rest
of the large batch, so the batch is applied once, with nothing lost or counted twice.
The input pipeline keeps its element size until the next epoch, when
``fit_large_batch`` rebuilds it at the size that worked.

Across the workers of a ``MultiWorkerMirroredStrategy`` no worker may wait in a
collective for one that failed: each worker runs its local loop (no collectives),
then all of them agree (one small all-reduce of an ok flag) before any of them
applies; a worker that failed resumes its own remainder while the others, done
already, only join the next agreement. Each worker keeps its own micro-batch size. A
worker that gives up (``on_oom="raise"``, or one row did not fit) still joins that
agreement, so that the others stop with it instead of waiting for it.

:class:`Recovery` is control flow only: it drives any :class:`RecoverableStep`, the
few operations of ``autosplit.step.train_step.TrainStep`` it needs, and is tested with a
pure-Python fake of them (``tests/training/test_recovery_logic.py``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import tensorflow as tf

from autosplit.data.markers import Ends
from autosplit.errors import BatchSizeError, NothingFitsError, WorkerLostError
from autosplit.search.policy import shrink_micro_batch
from autosplit.warn import warn_user

__all__ = ["OomRecovery", "RecoverableStep", "Recovery", "worker_lost"]

# The rows a worker that gives up reports to the agreement: every other worker's total
# comes out negative (-inf plus any real rows), which no real count can be.
_GAVE_UP = -math.inf
_COUNTED, _INPUT = Ends("counted"), Ends("input")


class RecoverableStep(Protocol):
    """The train step as :class:`Recovery` sees it (``autosplit.step.train_step.TrainStep`` is one).

    A step pulls elements of ``rows`` rows from an iterator and commits them micro-batch
    by micro-batch to sums; it keeps the element in flight in a stash, with the rows of
    it already committed, so that an out-of-memory error costs only the micro-batch
    that raised it.
    """

    @property
    def rows(self) -> int:
        """Rows per element of the pipeline: one micro-batch when an element is one slice."""

    replicas: int
    """Replicas in sync, over every worker."""
    strategy: Any
    """The model's ``tf.distribute`` strategy (named in a ``WorkerLostError``)."""

    def rebind(self, element_spec: Any, *, all_real: bool = False, rows: int | None = None
               ) -> None:
        """Use elements of another size (a new epoch's pipeline) from now on (``all_real``:
        they hold no padding rows; ``rows``: the most they hold, where that varies)."""

    def run(self, iterator: Any, count: int) -> dict[str, Any]:
        """``run_local(iterator, count)`` then ``finish()``, in one call, for an input that
        knows its length: the iterator holds ``count`` more elements."""

    def run_if_any(self, iterator: Any, count: int, *, ends: Ends = _INPUT
                   ) -> dict[str, Any] | None:
        """:meth:`run` (one replica), except that it applies nothing and returns None
        when no row came: the input had ended (or a marker came, as ``ends`` says)
        before the large batch began."""

    def run_local(self, iterator: Any, count: int, *, resume: bool = False,
                  slices: int = 1, ends: Ends = _INPUT) -> int:
        """Commit up to ``count`` more elements, each cut into ``slices``, stopping at
        the input's end (or at a marker, as ``ends`` says); first, with ``resume``,
        the stashed element's rows not yet committed. Returns the elements pulled; runs
        no collective."""

    def finish(self) -> dict[str, Any]:
        """Apply the committed sums once and zero them; returns the logs."""

    def agree(self, ok: bool, rows: float) -> tuple[bool, float]:
        """Collective: whether every worker is ok, and the sum of their ``rows``."""

    def agree_lengths(self, iterator: Any) -> bool:
        """Collective: pull a share's header, agree on the large batch's lengths;
        whether every worker read its own."""

    def local_rows(self) -> float:
        """Real rows committed on this worker since the last ``finish``."""

    def progress(self) -> tuple[int, bool, bool]:
        """After the last ``run``/``run_local``, failed or not: (elements it pulled, the
        stash holds an element not fully committed, the input ended)."""

    def discard(self) -> None:
        """Forget a partial large batch: zero the sums and the stash."""


@dataclasses.dataclass(frozen=True)
class OomRecovery:
    """One out-of-memory error that training survived (``FitReport.oom_recoveries``)."""

    step: int
    """The large batch it happened in: 0-based, counted from the start of the call."""
    failed: int
    """Rows per micro-batch that ran out of memory."""
    retry: int
    """Rows per micro-batch the same large batch was then finished with."""

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


def worker_lost(error: Exception, strategy: Any, step_number: int) -> WorkerLostError:
    return WorkerLostError(
        f"A worker of the {type(strategy).__name__} run stopped answering during step "
        f"{step_number} ({type(error).__name__}); this worker stops too instead of waiting "
        "forever. Restart the job; keras.callbacks.BackupAndRestore resumes it from the last "
        "epoch. Collective timeouts are set with tf.distribute.experimental."
        "CommunicationOptions(timeout_seconds=...).")


def _another_gave_up(strategy: Any, step_number: int) -> WorkerLostError:
    return WorkerLostError(
        f"Another worker of the {type(strategy).__name__} run stopped in step {step_number}: "
        "it ran out of memory and could not go on (on_oom='raise', or not even a "
        "micro-batch of 1 example fit), or its input failed (a bad record in its shard); "
        "its error says which. This worker stops too instead of waiting for it.")


class Recovery:
    """Runs large batches to completion on one worker, shrinking on out-of-memory.

    Args:
        step: the ``TrainStep``, or any :class:`RecoverableStep`.
        on_oom: ``"recover"`` or ``"raise"``.
        known_fits: micro-batch sizes the probe saw fit (one is tried when shrinking
            if it is above half the failed size).
        multi_worker: agree with the other workers before every apply.
        ends: where each large batch's elements end (``markers.Ends``). Counted (an
            input that knows its length, every large batch has elements), one call
            runs the loop and the apply. Otherwise, on one replica, one call runs the
            loop and applies only if a row came (``run_if_any``); on several, the apply
            waits until the loop shows the batch is not empty. The loops stop where
            ``ends`` says (an input's end, a marker); a share's header comes first
            where ``ends.headers``.
        on_shrink: called with (step_number, failed_rows, new_rows) after each OOM.
        most_rows: the most rows a large batch may hold, checked before each apply
            (a ``tf.distribute`` input's large batch is what its pipelines yield).
    """

    def __init__(self, step: RecoverableStep, *, on_oom: str = "recover",
                 known_fits: Sequence[int] = (), multi_worker: bool = False,
                 ends: Ends = _COUNTED,
                 on_shrink: Callable[[int, int, int], None] | None = None,
                 most_rows: int | None = None) -> None:
        self.step = step
        self.ends = ends
        self.on_oom = on_oom
        self.known_fits = list(known_fits)
        self.multi_worker = multi_worker
        self.fused = ends.stop == "counted" and not multi_worker
        self.on_shrink = on_shrink
        self.most_rows = most_rows
        self.slices = 1  # each element of the pipeline is cut into this many micro-batches
        self.records: list[OomRecovery] = []

    @property
    def rows(self) -> int:
        """Rows per micro-batch in use now."""
        return math.ceil(self.step.rows / self.slices)

    def rebind(self, element_spec: Any, *, all_real: bool = False, rows: int | None = None
               ) -> None:
        """A new epoch's pipeline at the size that worked: one slice per element again
        (``all_real`` and ``rows`` as ``TrainStep.rebind`` takes them)."""
        self.step.rebind(element_spec, all_real=all_real, rows=rows)
        self.slices = 1

    def run(self, iterator: Any, count: int, step_number: int) -> dict[str, Any] | None:
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

    def _run_alone(self, iterator: Any, count: int, step_number: int) -> dict[str, Any] | None:
        resume, remaining = False, count
        while True:
            try:
                if not resume and self.slices == 1:
                    if self.fused:
                        return self.step.run(iterator, remaining)
                    if self.step.replicas == 1 and self.most_rows is None:
                        return self.step.run_if_any(iterator, remaining, ends=self.ends)
                self.step.run_local(iterator, remaining, resume=resume, slices=self.slices,
                                    ends=self.ends)
                break
            except tf.errors.ResourceExhaustedError as error:
                remaining -= self._pulled()
                self._shrink(error, step_number)
                resume = True
        rows = self.step.local_rows()
        if rows == 0:
            return None  # the input ended before this batch began
        self._check_rows(rows, step_number)
        return self.step.finish()

    # ------------------------------------------------------------ many workers

    def _run_agreed(self, iterator: Any, count: int, step_number: int) -> dict[str, Any] | None:
        resume, remaining = False, count
        # The large batch's length, before its first micro-step: a collective every
        # worker joins, one whose input failed too (then raising its own error).
        if self.ends.headers and not self.step.agree_lengths(iterator):
            self.step.discard()
            raise _another_gave_up(self.step.strategy, step_number)
        while True:
            failure = None
            try:
                self.step.run_local(iterator, remaining, resume=resume, slices=self.slices,
                                    ends=self.ends)
                remaining = 0
            except tf.errors.ResourceExhaustedError as error:
                failure = error
                remaining -= self._pulled()
            except tf.errors.OpError:
                # This worker's own error (a bad record of its shard): the others would
                # wait in the agreement for it; it gives up there, so all of them stop.
                self.step.agree(False, _GAVE_UP)
                self.step.discard()
                raise
            gives_up = failure is not None and self._next_rows() < 1
            # After the local loop, the step's collectives (before it, only a sharded
            # share's lengths): first this agreement, then (only if every worker
            # succeeded) the apply.
            all_ok, rows = self.step.agree(
                failure is None, _GAVE_UP if gives_up else self.step.local_rows())
            if rows < 0 and not gives_up:
                self.step.discard()
                raise _another_gave_up(self.step.strategy, step_number) from failure
            if failure is not None:
                self._shrink(failure, step_number)  # raises when this worker gives up
            if all_ok:
                break
            resume = failure is not None
        if rows == 0:
            return None
        self._check_rows(rows, step_number)
        return self.step.finish()

    def _check_rows(self, rows: float, step_number: int) -> None:
        """Refuse, before its apply, a large batch of more rows than the call's B."""
        if self.most_rows is None or rows <= self.most_rows:
            return
        self.step.discard()
        raise BatchSizeError(
            f"Expected each large batch of the tf.distribute input to hold at most "
            f"batch_size={self.most_rows} rows across replicas. Received: {int(rows)} rows in "
            f"large batch {step_number} (nothing of it applied). Batch each replica's "
            f"pipeline by context.get_per_replica_batch_size({self.most_rows}), or pass the "
            "batch_size the pipelines make.")

    # ------------------------------------------------------------ shrinking

    def _pulled(self) -> int:
        """Elements the failed attempt pulled from the iterator."""
        pulled, _, _ = self.step.progress()
        return pulled

    def _next_rows(self) -> int:
        """The micro-batch bound to try next: 0 to give up (re-raise or nothing fits)."""
        if self.on_oom == "raise":
            return 0
        return shrink_micro_batch(self.rows, self.known_fits)

    def _shrink(self, error: Exception, step_number: int) -> None:
        """Cut every element into more slices after ``error``, or give up: discard the
        partial batch and raise."""
        failed, target = self.rows, self._next_rows()
        if target < 1:
            self.step.discard()
            if self.on_oom == "raise":
                raise error
            raise NothingFitsError(
                "Out of memory during training with a micro-batch of 1 example: nothing "
                "smaller can be tried. Free memory or use a smaller model.") from error
        slices = max(self.slices + 1, math.ceil(self.step.rows / target))
        while math.ceil(self.step.rows / slices) >= failed:
            slices += 1
        self.slices = slices
        # A size the probe saw fit has just failed: memory is tighter than at probe
        # time, so its other measurements are not trusted either.
        self.known_fits = []
        warn_user(
            f"Out of memory in step {step_number} with micro-batches of {failed} rows; "
            f"finishing the same batch with micro-batches of {self.rows} rows.")
        self.records.append(OomRecovery(step_number, failed, self.rows))
        if self.on_shrink is not None:
            self.on_shrink(step_number, failed, self.rows)
