"""The probe: real trial steps of the real compiled step, driven by ``autosplit.search``.

A trial at micro-batch size m builds the input pipeline training will use at m
(``autosplit.pipeline``) and runs the training step (``autosplit.step``) on it: one
warm-up step of one micro-batch and the apply, then two measured ones, each of two
micro-batches and the apply. The loop runs its micro-batches one after another, so two
reach the step's peak and a trial's time does not grow with B/m. Nothing of B rows is
ever held, so the memory model's fixed part is the weights, the optimizer slots, the
float32 sums and the pipeline's few buffered micro-batches, whatever the input kind.

Phases: validate and read the device and the budget (``autosplit.device``,
``autosplit.peak_meter``), look up the cache (``autosplit.cache``), search
(``autosplit.search``), build the immutable :class:`ProbeResult` from the trials. The
model, the optimizer and the metrics are restored bitwise after the trials.
Out-of-memory is detected by type (``tf.errors.ResourceExhaustedError``).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import time
from collections.abc import Callable
from typing import Any, overload

import keras
import tensorflow as tf

from autosplit import _keras
from autosplit import cache as _cache
from autosplit.compiled import Compilation
from autosplit.device import budget_bytes, check_headroom, read_device
from autosplit.device_info import DeviceInfo
from autosplit.distribute import Layout, layout
from autosplit.errors import ArgumentError, MemoryLimitError, NothingFitsError, describe
from autosplit.hub import preprocessed, takes_raw_data
from autosplit.inputs import ArrayInput, InputAdapter, get_input
from autosplit.isolation import IsolatedTrials, IsolationError, kernels_may_crash
from autosplit.peak_meter import PeakMeter
from autosplit.pipeline import MicroBatches
from autosplit.search import (
    OBJECTIVES,
    Trial,
    fit_line,
    reliable_fits,
    run_search,
    run_speed,
    search,
)
from autosplit.split import split_batch
from autosplit.state import Snapshot
from autosplit.step import TrainStep, build_for, step_for
from autosplit.units import format_bytes, parse_memory
from autosplit.validation import check_choice, check_model, check_size
from autosplit.warn import warn_user

__all__ = ["ProbeResult", "Trial", "invalidate_cache", "probe", "search_micro_batch"]

_TRIAL_STEPS = 2  # measured steps per trial, after one warm-up step
_TRIAL_MICRO_BATCHES = 2  # per measured step: enough to reach the loop's steady peak
# The warm-up step traces the step and makes its one-time allocations: one micro-batch
# and the apply run every op the measured steps run (~0.1-0.2 s a trial on the CLI's CNN).
_WARM_UP_MICRO_BATCHES = 1
# Trial pipelines shuffle (the same memory as training's) by a seed of their own: an
# unseeded shuffle would take one of the op seeds `keras.utils.set_random_seed` fixes,
# and the training shuffle's order would depend on how many trials the search ran.
_TRIAL_SHUFFLE_SEED = 0


def trial_dataset(cut: MicroBatches) -> tf.data.Dataset:
    """The endless micro-batches a trial pulls from: training's pipeline at the trial's
    size, with ``tf.data``'s autotuning off.

    A trial lasts one to three seconds, too short for autotuning to tune anything, and
    its optimisation thread only took CPU from the step and made the trial's readings
    noisy. Measured on the CLI's CNN at B = 4096 on 2 cores, four processes each way:

    - deleting a trial's iterator waited for that thread, 1.2 s in a third of the
      trials (0.001 s with autotuning off);
    - the measured steps ran 5-15% faster;
    - the peak at 64 rows read 71-97 MiB (72-76 off) and at 256 rows 164-191 MiB
      (159-171 off).

    Training on the CPU runs with autotuning off too, so the trials measure the
    pipeline it runs; on a GPU training autotunes, in host memory the trials do not
    budget (:func:`autosplit.pipeline.host_autotune`). Every size is timed the same
    way, so ``objective="speed"`` compares like with like.
    """
    return cut.dataset(repeat=True, shuffle_seed=_TRIAL_SHUFFLE_SEED, autotune=False)


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    """What the search found; immutable and JSON-serialisable (``to_dict``/``from_dict``)."""

    batch_size: int
    micro_batch_size: int  # rows per micro-batch (balanced), per replica
    accumulation_steps: int
    trials: tuple[Trial, ...]
    device: dict[str, Any]  # DeviceInfo.to_dict()
    budget_bytes: int
    memory_limit_bytes: int | None
    headroom: float
    fixed_bytes: int | None  # memory model: peak = fixed + per_example * m
    per_example_bytes: float | None
    predicted_peak_bytes: int | None  # model's prediction at the chosen size
    measured_peak_bytes: int | None  # trial peak at the chosen size
    peak_source: str  # "tf-allocator" or "rss-hwm"
    ooms: int
    seconds: float
    cache_key: str
    from_cache: bool = False
    worker: int = 0  # this worker's index: each worker of a multi-worker run searches
    workers: int = 1  # for itself, in lockstep, and may use its own size
    objective: str = "memory"  # "memory": the largest that fits; "speed": the fastest
    speed_reason: str | None = None  # objective="speed": why this size

    def fitting_sizes(self) -> list[int]:
        """Sizes that fit in every trial they had, largest first (a size that failed once,
        when tried again, is not one an out-of-memory recovery should step down to)."""
        return reliable_fits(self.trials)

    def predict_peak(self, micro_batch_size: int) -> int | None:
        """The memory model's peak at ``micro_batch_size`` (None without a model)."""
        if self.fixed_bytes is None or self.per_example_bytes is None:
            return None
        return int(self.fixed_bytes + self.per_example_bytes * micro_batch_size)

    def reason(self) -> str:
        """Why this size, in one line (for ``history.autosplit`` and the CLI)."""
        where = f"worker {self.worker} of {self.workers}: " if self.workers > 1 else ""
        if self.from_cache:
            return f"{where}cached probe result ({self.cache_key[:8]})"
        if self.speed_reason is not None:
            return (f"{where}objective='speed': {self.speed_reason}; {len(self.trials)} trials, "
                    f"{self.ooms} out of memory")
        peak, budget = format_bytes(self.measured_peak_bytes or 0), format_bytes(self.budget_bytes)
        if self.micro_batch_size >= self.batch_size:
            return f"{where}the whole batch fits: peak {peak} within the budget of {budget}"
        smallest_failure = min((t.micro_batch_size for t in self.trials if not t.fits),
                               default=None)
        if smallest_failure is None:
            # The search stopped without a larger trial: the peak was within a few percent
            # of the budget, or the line put the next size a split can run over it.
            larger = math.ceil(self.batch_size / (self.accumulation_steps - 1))
            predicted = self.predict_peak(larger)
            why = ("" if predicted is None
                   else f" (the memory model predicts {format_bytes(predicted)})")
            return (f"{where}largest size tried, with peak {peak} of the budget of {budget}; "
                    f"the next size a split can run, {larger}, was not tried{why}; "
                    f"{len(self.trials)} trials, {self.ooms} out of memory")
        return (f"{where}largest size that fit the budget of {budget} (peak {peak}); "
                f"{smallest_failure} did not; {len(self.trials)} trials, {self.ooms} out of memory")

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["trials"] = [dataclasses.asdict(t) for t in self.trials]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ProbeResult:
        data = dict(data)
        data["trials"] = tuple(Trial(**t) for t in data["trials"])
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


def invalidate_cache(result: ProbeResult) -> None:
    """Forget a cached result (an OOM during training proved it wrong)."""
    _cache.invalidate(result.cache_key)


def format_trial(trial: Trial, budget: int) -> str:
    """One line per finished trial, for progress output."""
    outcome = ("crashed" if trial.crashed else "OOM" if trial.oom
               else "fits" if trial.fits else "over budget")
    peak = "-" if trial.peak_bytes is None else format_bytes(trial.peak_bytes)
    speed = ("" if trial.samples_per_second is None
             else f"  {trial.samples_per_second:9.1f} samples/s")
    return (f"  trial micro_batch_size={trial.micro_batch_size:<6} {outcome:<11} peak {peak:>11}"
            f" of {format_bytes(budget)}  {trial.seconds:5.1f} s{speed}")


def probe(
    model: keras.Model,
    x: Any = None,
    y: Any = None,
    *,
    batch_size: int,
    sample_weight: Any = None,
    memory_limit: int | str | None = None,
    headroom: float = 0.1,
    cache: bool = True,
    jit_compile: bool | None = None,
    verbose: int = 0,
    on_trial: Callable[[Trial, int], None] | None = None,
    objective: str = "memory",
    isolate: bool | None = None,
) -> ProbeResult:
    """Find the largest micro-batch of ``model`` that fits, by real trial steps.

    Args:
        model: a compiled Keras model.
        x: the training data, in any form ``fit_large_batch`` takes; a few
            micro-batches of it feed the trials.
        y: the targets when ``x`` is arrays; else None.
        sample_weight: per-example weights when ``x`` is arrays; else None.
        batch_size: the effective batch B; the micro-batch is capped at B (k = 1).
        memory_limit: a budget smaller than the device ("6GiB", "512MB" or bytes).
        headroom: the fraction of the budget left free (default 10%).
        cache: reuse/store the result under ``autosplit.cache.cache_dir()``.
        jit_compile: as for ``fit_large_batch``.
        verbose: 1 prints one line per trial as it finishes, then the choice.
        on_trial: called with ``(trial, budget_bytes)`` after every trial.
        objective: ``"memory"`` (default): the largest size that fits. ``"speed"``: also
            time up to two more balanced sizes between half of it and it, and keep the
            one with the most samples per second when it is more than 5% faster than
            the largest (one process only).
        isolate: run the trials in a child process (``autosplit.isolation``), where a
            kernel that crashes on an allocation failure costs one trial, not this
            process. ``None`` (default): where that can happen, on the CPU under
            TensorFlow's cap with oneDNN on. Not under a ``tf.distribute`` strategy.

    Returns:
        A ``ProbeResult`` with the chosen ``micro_batch_size`` and every trial.

    Raises:
        NothingFitsError: not even one example fits; says what one example needs.

    Example:
        >>> result = autosplit.probe(  # doctest: +SKIP
        ...     model, x, y, batch_size=4096, memory_limit="2GiB")
        >>> result.micro_batch_size, result.accumulation_steps  # doctest: +SKIP
        (512, 8)
    """
    batch_size = check_size("batch_size", batch_size)
    check_model(model)
    # Called inside `with strategy.scope():`, it runs as outside (as fit_large_batch).
    with _keras.outside_strategy_scope():
        if takes_raw_data(model):
            x, y, sample_weight = preprocessed(model, x, y, sample_weight, batch_size)
        adapter = get_input(x, y, sample_weight, shuffle=False, model=model)
        return search_micro_batch(model, adapter, batch_size, memory_limit=memory_limit,
                                  headroom=headroom, cache=cache, jit_compile=jit_compile,
                                  verbose=verbose, on_trial=on_trial, objective=objective,
                                  isolate=isolate)


def search_micro_batch(model: keras.Model, adapter: InputAdapter, batch_size: int, *,
                       memory_limit: int | str | None = None, headroom: float = 0.1,
                       cache: bool = True, jit_compile: bool | None = None, verbose: int = 0,
                       on_trial: Callable[[Trial, int], None] | None = None,
                       objective: str = "memory", isolate: bool | None = None
                       ) -> ProbeResult:
    """``probe`` for an input adapter (what ``fit_large_batch(micro_batch_size="auto")`` calls)."""
    started = time.perf_counter()
    check_choice("objective", objective, OBJECTIVES)
    if isolate not in (None, True, False):
        raise ArgumentError(f"Expected `isolate` to be None, True or False. Received: "
                            f"isolate={describe(isolate)}.")
    limit = parse_memory(memory_limit)
    check_headroom(headroom)
    where = layout(model.distribute_strategy)
    if objective == "speed" and where.multi_worker:
        raise ArgumentError(
            "Expected objective='memory' in a multi-worker job (each worker's speed is its "
            "own; the workers' search runs in lockstep). Received: objective='speed'.")
    local_batch = batch_size // where.replicas
    trial_input = adapter if adapter.reiterable else ArrayInput(
        *adapter.sample(local_batch), shuffle=False)
    pipeline = MicroBatches(trial_input, batch_size, min(local_batch, 8), where)
    spec = pipeline.dataset(shuffle_seed=_TRIAL_SHUFFLE_SEED).element_spec
    # Built before the meter's baseline, which then holds the weights and the optimizer
    # state (step_for, below, finds the model built).
    build_for(model, spec, where.local_replicas)
    meter, device, budget = _measuring(limit, headroom)
    jit = Compilation.of(model, jit_compile).jit_compile
    # The live budget moves with whatever else holds memory right now; the key uses
    # what defines it: the device's total, the user's limit and the headroom.
    key = _cache.fingerprint(
        model, spec[:3], device=[device.kind, device.identity, device.total_bytes],
        jit_compile=jit, memory_limit=limit, batch_size=batch_size, headroom=headroom,
        replicas=where.replicas, objective=objective)
    cached = _from_cache(model, key, cache, where, pipeline, jit)
    if cached is not None:
        return cached
    say = _reporter(verbose, on_trial, budget)
    isolated = _isolated(model, trial_input, local_batch, budget, meter, jit, where, isolate)
    if isolated is not None:
        with isolated:
            chosen, trials, speed_reason = _searched(
                _reporting(isolated.trial, say), budget, local_batch, objective)
    else:
        step = step_for(model, pipeline, jit_compile=jit)
        trials_runner = _Trials(step, Snapshot(model), meter, budget, trial_input, batch_size,
                                where, say)
        try:
            chosen, trials, speed_reason = _searched(
                trials_runner.trial, budget, local_batch, objective,
                lockstep=trials_runner.lockstep if where.multi_worker else None)
        finally:
            step.discard()
            trials_runner.snapshot.restore()
            trials_runner.collector.close()
            del trials_runner
            gc.collect()  # the trials' pipelines, before training builds its own
    result = _result(trials, chosen, local_batch, device, budget, limit, headroom, meter,
                     key, time.perf_counter() - started)
    result = dataclasses.replace(result, worker=where.worker, workers=where.workers,
                                 objective=objective, speed_reason=speed_reason)
    if verbose:
        print(f"  chose micro_batch_size={result.micro_batch_size} "
              f"(k={result.accumulation_steps}): {result.reason()}", flush=True)
    if cache:
        _cache.store(key, result.to_dict())
    return result


def _measuring(limit: int | None, headroom: float) -> tuple[PeakMeter, DeviceInfo, int]:
    """The peak meter (reset), the device it reads and the budget of the search."""
    meter_device = "GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0"
    meter = PeakMeter(meter_device)
    meter.reset()
    baseline = meter.baseline_bytes
    device = read_device(meter_device)
    # What this process may hold in all, in the meter's units: NVML's figure already
    # counts our own allocations; the CPU readings are what is still free.
    ceiling = device.available_bytes if device.kind == "GPU" else baseline + device.available_bytes
    if limit is not None and limit <= baseline:
        raise MemoryLimitError(
            f"Expected `memory_limit` above what the process already holds "
            f"({format_bytes(baseline)}: weights, optimizer state"
            f"{', runtime' if meter.source == 'rss-hwm' else ''}). Received: "
            f"memory_limit={format_bytes(limit)}. Raise the limit or use a smaller model.")
    budget = budget_bytes(dataclasses.replace(device, available_bytes=ceiling), limit, headroom)
    return meter, device, budget


def _from_cache(model: keras.Model, key: str, cache: bool, where: Layout,
                pipeline: MicroBatches, jit: bool) -> ProbeResult | None:
    """The stored result for ``key``, if any (in a multi-worker job: only if every worker
    has one, agreed in one collective)."""
    stored = _cache.load(key) if cache else None
    if where.multi_worker:
        # Every worker searches, or none: one that skipped the search on a cache hit
        # would leave the others waiting in the trials' collectives.
        agreement = step_for(model, pipeline, jit_compile=jit)
        hit, _ = agreement.agree(stored is not None, 0.0)
        stored = stored if hit else None
    if stored is None:
        return None
    try:
        return dataclasses.replace(ProbeResult.from_dict(stored), from_cache=True)
    except (TypeError, KeyError):
        return None


def _searched(trial: Callable[[int], Trial], budget: int, local_batch: int, objective: str,
              lockstep: Callable[[int], tuple[int | None, list[Trial]]] | None = None
              ) -> tuple[int | None, list[Trial], str | None]:
    """Run the search (``lockstep`` across workers); with ``objective="speed"`` time the
    sizes between half the largest and it. Returns (chosen, trials, why for speed)."""
    if lockstep is not None:
        chosen, trials = lockstep(local_batch)
        return chosen, trials, None
    chosen, trials = run_search(local_batch, budget, trial)
    if objective != "speed" or chosen is None:
        return chosen, trials, None
    chosen, why = run_speed(local_batch, chosen, trials, trial)
    return chosen, trials, why


def _reporting(trial: Callable[[int], Trial], say: Callable[[Trial], None]
               ) -> Callable[[int], Trial]:
    def reported(m: int) -> Trial:
        result = trial(m)
        say(result)
        return result
    return reported


def _isolated(model: keras.Model, data: InputAdapter, local_batch: int, budget: int,
              meter: PeakMeter, jit: bool, where: Layout, isolate: bool | None
              ) -> IsolatedTrials | None:
    """The child process the trials run in (``autosplit.isolation``), or None: in this
    process. ``isolate=None`` isolates where an allocation failure may crash a kernel."""
    if where.replicas > 1:
        if isolate:
            raise ArgumentError(
                "Expected isolate=None or False under a tf.distribute strategy with "
                f"{where.replicas} replicas (trials in a child process run on one device). "
                "Received: isolate=True.")
        return None
    if isolate is None:
        isolate = kernels_may_crash()
    if not isolate:
        return None
    try:
        return IsolatedTrials(model, data.sample(local_batch), local_batch, budget,
                              meter.baseline_bytes, jit)
    except IsolationError as error:
        warn_user(
            f"The probe's trials run in this process: {error}. Under TensorFlow's CPU cap "
            "with oneDNN on, a convolution, pooling or batch normalization kernel that "
            "runs out of memory ends the process instead of raising. Make the model "
            "loadable by keras.saving.load_model (register its custom objects with "
            "keras.saving.register_keras_serializable, in a module both processes "
            "import), or set TF_ENABLE_ONEDNN_OPTS=0 before TensorFlow starts.")
        return None


def child_trials(model: keras.Model, sample: tuple[Any, Any, Any], batch_size: int,
                 budget: int, jit_compile: bool, *, held_bytes: int) -> _Trials:
    """The trials of ``search_micro_batch``, in the child process of
    ``autosplit.isolation``: on ``sample``, holding ``held_bytes`` as the parent does."""
    where = layout(model.distribute_strategy)
    data = ArrayInput(*sample, shuffle=False)
    pipeline = MicroBatches(data, batch_size, min(batch_size, 8), where)
    build_for(model, pipeline.dataset(shuffle_seed=_TRIAL_SHUFFLE_SEED).element_spec)
    meter = PeakMeter("CPU:0")
    meter.reset()
    missing = held_bytes - meter.baseline_bytes
    # Kept alive by the runner: the parent's data and other state, as bytes here.
    ballast = (tf.raw_ops.Empty(shape=[missing // 4], dtype=tf.float32, init=False)
               if missing >= 4 else None)
    meter.reset()
    step = step_for(model, pipeline, jit_compile=jit_compile)
    runner = _Trials(step, Snapshot(model), meter, budget, data, batch_size, where,
                     lambda trial: None)
    runner.ballast = ballast
    return runner


class _Collector:
    """A full garbage collection after each trial, over what that trial left alone.

    A trial's dead pipeline and iterator may sit in reference cycles and hold buffers
    the next trial's peak would count, so every trial ends with ``gc.collect()``. In a
    process that has traced a few models that scans a million objects: 0.1 to 0.4 s a
    trial, measured on the CNN. What survives one collection is frozen
    (``gc.freeze``), so the next scans only the objects made since; :meth:`close` puts
    them back in the collector's care. A process that froze objects of its own keeps
    its freeze untouched and pays the full scan.
    """

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


class _Trials:
    """Trial steps at one size after another, and the lockstep form across workers."""

    def __init__(self, step: TrainStep, snapshot: Snapshot, meter: PeakMeter, budget: int,
                 data: InputAdapter, batch_size: int, where: Layout,
                 say: Callable[[Trial], None]) -> None:
        self.step, self.snapshot, self.meter = step, snapshot, meter
        self.budget, self.data, self.batch_size, self.where = budget, data, batch_size, where
        self.say = say
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
        under, and it costs as much as a step near the cap (~0.5 s of a 2 s trial on the
        CLI's CNN). Workers of a multi-worker job run every step: the steps agree in
        collectives."""
        t0 = time.perf_counter()
        held_before = self.meter.current_bytes()
        iterator, failed, peak, speed, rows = None, m is None, None, None, 0
        try:
            count = 0
            if m is not None:
                rows = split_batch(self.batch_size // self.where.replicas, m).micro_batch_size
                cut = MicroBatches(self.data, self.batch_size, rows, self.where)
                data = trial_dataset(cut)
                # As training at this size will run: whole elements where none is padded.
                self.step.rebind(data.element_spec, full=cut.always_full())
                iterator = iter(data)
                count = min(_TRIAL_MICRO_BATCHES, cut.per_batch)
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


def _reporter(verbose: int, on_trial: Callable[[Trial, int], None] | None, budget: int
              ) -> Callable[[Trial], None]:
    def say(trial: Trial) -> None:
        if on_trial is not None:
            on_trial(trial, budget)
        if verbose:
            print(format_trial(trial, budget), flush=True)
    return say


def _result(trials: list[Trial], chosen: int | None, batch_size: int, device: DeviceInfo,
            budget: int, limit: int | None, headroom: float, meter: PeakMeter, key: str,
            seconds: float) -> ProbeResult:
    line = fit_line([(t.micro_batch_size, t.peak_bytes) for t in trials
                     if t.peak_bytes is not None])
    if chosen is None:
        per_example = line[1] if line else None
        smallest = min((t.peak_bytes for t in trials if t.peak_bytes), default=None)
        need = (f"about {format_bytes(int(line[1]))} per example on top of "
                f"{format_bytes(int(line[0]))} fixed" if line else
                f"more than the budget at m=1 (peak {format_bytes(smallest)})"
                if smallest else "more than the budget even at m=1 (OOM)")
        raise NothingFitsError(
            f"Not even a micro-batch of 1 example fits: one example needs {need}, and the "
            f"budget is {format_bytes(budget)} ({int(headroom * 100)}% headroom kept). "
            "Raise `memory_limit`, lower `headroom`, or use a smaller model or inputs.",
            bytes_per_example=int(per_example) if per_example else None,
            budget_bytes=budget)
    chosen_trial = [t for t in trials if t.fits and t.micro_batch_size == chosen][-1]
    split = split_batch(batch_size, chosen)
    return ProbeResult(
        batch_size=batch_size,
        micro_batch_size=split.micro_batch_size,
        accumulation_steps=split.accumulation_steps,
        trials=tuple(trials),
        device=device.to_dict(),
        budget_bytes=int(budget),
        memory_limit_bytes=limit,
        headroom=float(headroom),
        fixed_bytes=int(line[0]) if line else None,
        per_example_bytes=line[1] if line else None,
        predicted_peak_bytes=int(line[0] + line[1] * chosen) if line else None,
        measured_peak_bytes=chosen_trial.peak_bytes,
        peak_source=meter.source,
        ooms=sum(t.oom for t in trials),
        seconds=seconds,
        cache_key=key,
    )
