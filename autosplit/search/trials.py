"""Real trial steps of the compiled step at one size after another (:class:`TrialRunner`),
in this process or in the child process of ``autosplit.search.isolation``
(:func:`child_trials`).

A trial at micro-batch size m builds the input pipeline training will use at m
(``autosplit.data.pipeline``) and runs the training step (``autosplit.step``) on it:
one warm-up step of one micro-batch and the apply, then two measured ones, each of two
micro-batches and the apply. The loop runs its micro-batches one after another, so two
reach the step's peak and a trial's time does not grow with B/m. The model, the
optimizer and the metrics are restored bitwise after each trial.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any, overload

import keras
import tensorflow as tf

from autosplit.data.adapter import InputAdapter
from autosplit.data.arrays import ArrayInput
from autosplit.data.layout import Layout, layout
from autosplit.data.markers import is_end_marker
from autosplit.data.pipeline import MicroBatches
from autosplit.data.sequences.cut import Cut
from autosplit.data.sequences.lengths import padded_lengths, padded_sequences
from autosplit.data.split import split_batch
from autosplit.errors import NothingFitsError
from autosplit.memory.peak_meter import PeakMeter
from autosplit.search.policy import Trial, search
from autosplit.step.snapshot import Snapshot
from autosplit.step.train_step import Step, build_for, step_for
from autosplit.step.whole_batch import WholeBatchStep

__all__ = ["TRIAL_SHUFFLE_SEED", "TrialRunner", "child_trials", "trial_dataset"]

_TRIAL_STEPS = 2  # measured steps per trial, after one warm-up step
_TRIAL_MICRO_BATCHES = 2  # per measured step: enough to reach the loop's steady peak
# The warm-up step traces the step and makes its one-time allocations: one micro-batch
# and the apply run every op the measured steps run, at a fraction of their cost.
_WARM_UP_MICRO_BATCHES = 1
# Trial pipelines shuffle (the same memory as training's) by a seed of their own: an
# unseeded shuffle would take one of the op seeds `keras.utils.set_random_seed` fixes,
# and the training shuffle's order would depend on how many trials the search ran.
TRIAL_SHUFFLE_SEED = 0


def trial_dataset(cut: MicroBatches) -> tf.data.Dataset:
    """The endless micro-batches a trial pulls from: training's pipeline at the trial's
    size, with ``tf.data``'s autotuning off.

    A trial lasts a few seconds, too short for autotuning to tune anything: its
    optimisation thread only takes CPU from the step, deleting a trial's iterator waits
    for it, and the buffers it grows make the peaks noisy. Training on the CPU runs with
    autotuning off too, so the trials measure the pipeline it runs; on a GPU training
    autotunes, in host memory the trials do not budget
    (:func:`autosplit.data.pipeline.host_autotune`). Every size is timed the same way,
    so ``objective="speed"`` compares like with like.
    """
    ds = cut.dataset(repeat=True, shuffle_seed=TRIAL_SHUFFLE_SEED, autotune=False)
    if cut.ends().marks_batches:  # each large batch's end marker holds no row to step on
        ds = ds.filter(lambda *element: tf.logical_not(is_end_marker(element)))
    return ds


class _Collector:
    """A full garbage collection after each trial (a dead pipeline's cycles hold buffers
    the next peak would count), scanning only what that trial made: survivors are
    frozen (``gc.freeze``) until :meth:`close`, unless the process froze objects itself."""

    def __init__(self) -> None:
        self.freezing = gc.get_freeze_count() == 0

    def collect(self) -> None:
        gc.collect()
        if self.freezing:
            gc.freeze()

    def close(self) -> None:
        if self.freezing:
            gc.unfreeze()
            self.freezing = False


class TrialRunner:
    """Trial steps at one size after another, and the lockstep form across workers."""

    def __init__(self, step: Step, snapshot: Snapshot, meter: PeakMeter, budget: int,
                 data: InputAdapter, batch_size: int, where: Layout,
                 say: Callable[[Trial], None], by_length: Cut | None = None,
                 length: int = 1) -> None:
        self.step, self.snapshot, self.meter = step, snapshot, meter
        self.budget, self.data, self.batch_size, self.where = budget, data, batch_size, where
        self.say = say
        # With by_length, a trial at m runs the cut by length with a budget of m rows of
        # what its costliest row costs (Cut.tokens): the search runs in tokens.
        self.by_length, self.length = by_length, length
        self.collector = _Collector()
        self.ballast: Any = None  # child_trials: what the parent holds, held here

    @overload
    def trial(self, m: int) -> Trial: ...
    @overload
    def trial(self, m: None) -> None: ...
    def trial(self, m: int | None) -> Trial | None:
        """One warm-up step (one micro-batch), then the peak of two more; None when ``m``
        is None (a worker whose search is over still takes part in every collective of
        the round).

        In one process a trial whose first measured step already peaked over the budget
        stops there: the peak is a maximum, so the second step could not bring it back
        under, and it costs as much as a step near the cap. Workers of a multi-worker
        job run every step: the steps agree in collectives."""
        t0 = time.perf_counter()
        held_before = self.meter.current_bytes()
        iterator, failed, peak, speed, rows = None, m is None, None, None, 0
        try:
            count = 0
            if m is not None:
                local = self.batch_size // self.where.replicas
                rows = split_batch(local, m).micro_batch_size
                # In tokens, micro-batches filled to the budget: training's peak.
                cut = (MicroBatches(self.data, self.batch_size, rows, self.where)
                       if self.by_length is None else
                       MicroBatches(self.data, self.batch_size, local, self.where,
                                    cut=self.by_length.with_budget(
                                        rows * self.length, packing="fullest")))
                data = trial_dataset(cut)
                # As training at this size will run: whole elements where none is padded.
                self.step.rebind(data.element_spec, all_real=cut.all_real(), rows=cut.rows)
                iterator = iter(data)
                # The whole-batch step's peak is a whole large batch's: its outputs kept
                # for every row and the loss over all of them.
                count = (cut.per_batch if isinstance(self.step, WholeBatchStep)
                         else min(_TRIAL_MICRO_BATCHES, cut.per_batch))
            # The first step traces and makes one-time allocations (kernel caches,
            # scratch buffers) that stay; the steady-state peak is what training sees.
            steps = 0  # measured
            for index in range(1 + _TRIAL_STEPS):
                pulled = min(_WARM_UP_MICRO_BATCHES, count) if index == 0 else count
                failed = not self._step(iterator, pulled, active=not failed) or failed
                if index == 0:
                    self.meter.reset()
                    measured = time.perf_counter()
                    continue
                steps += 1
                if (not failed and not self.where.multi_worker
                        and self.meter.peak_bytes() > self.budget):
                    break
            peak = None if failed else self.meter.peak_bytes()
            # Rows of the measured steps over their time: the warm-up (tracing) excluded.
            speed = None if failed or not count else (
                steps * count * rows / (time.perf_counter() - measured))
        finally:
            self.step.discard()
            self.snapshot.restore()
            del iterator
            self.collector.collect()  # a dead trial's buffers must not count in the next
        if m is None:
            return None
        result = Trial(m, peak is not None and peak <= self.budget, peak is None,
                       None if peak is None else int(peak), time.perf_counter() - t0,
                       None if speed is None else round(speed, 1),
                       held_before=held_before, held_after=self.meter.current_bytes())
        self.say(result)
        return result

    def _step(self, iterator: Any, count: int, *, active: bool) -> bool:
        """One trial step; False if it ran out of memory on this worker."""
        if not self.where.multi_worker:
            if not active:
                return False
            try:
                self.step.run(iterator, count)
            except tf.errors.ResourceExhaustedError:
                return False
            return True
        ok = True
        if active:
            try:
                self.step.run_local(iterator, count)
            except tf.errors.ResourceExhaustedError:
                ok = False
        # The loop above runs no collective; the agreement and the apply do, and
        # every worker reaches them the same number of times, whatever it tried.
        all_ok, _ = self.step.agree(ok, 0.0)
        if all_ok:
            self.step.finish()
        else:
            self.step.discard()
        return ok and active

    def lockstep(self, batch_size: int) -> tuple[int | None, list[Trial]]:
        """Each worker runs its own search (its own sizes, its own budget), one trial per
        round for all; the rounds go on until every worker's search is over."""
        trials: list[Trial] = []
        generator = search(batch_size, self.budget)
        request: tuple[int, bool] | None = next(generator)
        chosen = None
        while True:
            result = self.trial(None if request is None else request[0])
            if result is not None:  # a request was made
                trials.append(result)
                try:
                    request = generator.send(result)
                except StopIteration as stop:
                    chosen, request = stop.value, None
            everyone_done, _ = self.step.agree(request is None, 0.0)
            if everyone_done:
                break
        # A worker with nothing that fits stops them all, not only itself.
        all_found, _ = self.step.agree(chosen is not None, 0.0)
        if not all_found and chosen is not None:
            raise NothingFitsError(
                "Another worker of the MultiWorkerMirroredStrategy run found that not even "
                "one example fits its memory budget; see that worker's error.")
        return chosen, trials


def child_trials(model: keras.Model, sample: tuple[Any, Any, Any], batch_size: int,
                 budget: int, jit_compile: bool, *, held_bytes: int, step_held: bool,
                 tokens: tuple[bool, int, tuple[int | None, ...]] | None = None) -> TrialRunner:
    """The trials of ``search_micro_batch``, in the child process of
    ``autosplit.search.isolation``: on ``sample``, holding what the parent holds.

    ``held_bytes`` is what the parent's allocator holds; ``step_held``, whether that
    includes a compiled step's float32 sums and stash (a step cached from an earlier
    call), which this process makes too. The difference is allocated and kept (a ballast
    tensor), so that a trial meets the cap where the parent's training would.

    ``tokens``: ``(buckets, length, outputs)``, trials in tokens (``IsolatedTrials``) on
    the sample's padded sequences, which the parent found there (``padded_sequences``).
    """
    where = layout(model.distribute_strategy)
    data = ArrayInput(*sample, shuffle=False)
    pipeline = MicroBatches(data, batch_size, min(batch_size, 8), where)
    build_for(model, pipeline.dataset(shuffle_seed=TRIAL_SHUFFLE_SEED).element_spec)
    meter = PeakMeter("CPU:0")
    model_bytes = meter.current_bytes()  # the model, its optimizer, the data sample
    step = step_for(model, pipeline, jit_compile=jit_compile)
    with_step = meter.current_bytes()
    missing = held_bytes - (with_step if step_held else model_bytes)
    ballast = (tf.raw_ops.Empty(shape=[missing // 4], dtype=tf.float32, init=False)
               if missing >= 4 else None)
    meter.reset()
    by_length, length = None, 1
    if tokens is not None:
        arrays = tf.nest.map_structure(lambda t: t if t is None else tf.constant(t), sample)
        padded = padded_sequences(arrays, takes_any_length=True)
        assert padded is not None
        by_length = Cut("tokens", lengths=padded_lengths(pipeline.element_spec()[:3], padded),
                        buckets=bool(tokens[0]), arrays=padded, outputs=tuple(tokens[2]))
        length = tokens[1]
    runner = TrialRunner(step, Snapshot(model), meter, budget, data, batch_size, where,
                         lambda trial: None, by_length=by_length, length=length)
    runner.ballast = ballast
    return runner
