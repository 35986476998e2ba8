"""The probe: ``probe`` and ``search_micro_batch``, which drive the pure search
(``autosplit.search.policy``) with real trial steps (``autosplit.search.trials``), in a
child process where a kernel may crash (``autosplit.search.isolation``).

Phases: validate and read the device and the budget (``autosplit.memory.device``,
``autosplit.memory.peak_meter``), look up the cache (``autosplit.search.cache``), search,
build the immutable :class:`~autosplit.search.result.ProbeResult` from the trials.
Out-of-memory is detected by type (``tf.errors.ResourceExhaustedError``).
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import time
from collections.abc import Callable
from typing import Any, Literal

import keras
import tensorflow as tf

from autosplit.data.adapter import InputAdapter
from autosplit.data.arrays import ArrayInput
from autosplit.data.hub import preprocessed, takes_raw_data
from autosplit.data.inputs import get_input
from autosplit.data.layout import Layout, layout
from autosplit.data.pipeline import MicroBatches
from autosplit.data.sequences.cut import Cut
from autosplit.data.sequences.lengths import costliest_row, padded_lengths, padded_sequences
from autosplit.data.split import check_size
from autosplit.errors import ArgumentError, MemoryLimitError, check_choice, describe
from autosplit.keras_hooks import internals as _keras
from autosplit.keras_hooks.checks import check_model
from autosplit.memory.device import budget_bytes, check_headroom, read_device
from autosplit.memory.device_info import DeviceInfo
from autosplit.memory.peak_meter import PeakMeter
from autosplit.search import cache as _cache
from autosplit.search.isolation import IsolatedTrials, IsolationError, kernels_may_crash
from autosplit.search.policy import OBJECTIVES, Trial, run_search
from autosplit.search.result import ProbeResult, invalidate_cache, result_of
from autosplit.search.speed import run_speed
from autosplit.search.trials import TRIAL_SHUFFLE_SEED, TrialRunner
from autosplit.step.compiled import Compilation
from autosplit.step.cut_choice import choose_cut
from autosplit.step.model_state import model_state
from autosplit.step.snapshot import Snapshot
from autosplit.step.train_step import build_for, step_for
from autosplit.units import format_bytes, parse_memory
from autosplit.warn import warn_user

__all__ = ["ProbeResult", "Trial", "invalidate_cache", "probe", "search_micro_batch"]


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
    micro_batch_tokens: Literal["auto"] | None = "auto",
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
        cache: reuse/store the result under ``autosplit.search.cache.cache_dir()``.
        jit_compile: as for ``fit_large_batch``.
        verbose: 1 prints one line per trial as it finishes, then the choice.
        on_trial: called with ``(trial, budget_bytes)`` after every trial.
        objective: ``"memory"`` (default): the largest size that fits. ``"speed"``: also
            time up to two more balanced sizes between half of it and it, and keep the
            one with the most samples per second when it is more than 5% faster than
            the largest (one process only).
        isolate: run the trials in a child process (``autosplit.search.isolation``), where a
            kernel that crashes on an allocation failure costs one trial, not this
            process. ``None`` (default): where that can happen, on the CPU under
            TensorFlow's cap. Not under a ``tf.distribute`` strategy.
        micro_batch_tokens: ``"auto"`` (default): where ``fit_large_batch`` would cut
            the rows by length and size micro-batches in tokens (its
            ``micro_batch_tokens``), the trials run that cut and the result's ``tokens``
            is the budget found. None: rows, always.

    Returns:
        A ``ProbeResult`` with the chosen ``micro_batch_size`` (with ``tokens``, rows of
        the longest length sampled) and every trial.

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
        check_choice("micro_batch_tokens", micro_batch_tokens, ("auto", None))
        cut = None
        if micro_batch_tokens == "auto":
            cut = choose_cut(model, adapter, batch_size, layout(model.distribute_strategy),
                             by_length=None, jit=Compilation.of(model, jit_compile).jit_compile,
                             tokens="auto")
        return search_micro_batch(model, adapter, batch_size, memory_limit=memory_limit,
                                  headroom=headroom, cache=cache, jit_compile=jit_compile,
                                  verbose=verbose, on_trial=on_trial, objective=objective,
                                  isolate=isolate, cut=cut)


def search_micro_batch(model: keras.Model, adapter: InputAdapter, batch_size: int, *,
                       memory_limit: int | str | None = None, headroom: float = 0.1,
                       cache: bool = True, jit_compile: bool | None = None, verbose: int = 0,
                       on_trial: Callable[[Trial, int], None] | None = None,
                       objective: str = "memory", isolate: bool | None = None,
                       cut: Cut | None = None) -> ProbeResult:
    """``probe`` for an input adapter (what ``fit_large_batch(micro_batch_size="auto")`` calls).

    ``cut``: the run's cut (``autosplit.step.cut_choice``); in tokens without a budget
    (``Cut.tokens`` None), search one for it: m rows of what the sample's costliest row
    costs, its rows' lengths rounded up as the cut rounds them."""
    started = time.perf_counter()
    where = layout(model.distribute_strategy)
    limit = _checked(objective, isolate, memory_limit, headroom, where)
    local_batch = batch_size // where.replicas
    sample = functools.cache(lambda: adapter.sample(local_batch))  # taken once, if needed
    trial_input = adapter if adapter.reiterable else ArrayInput(*sample(), shuffle=False)
    by_length = _in_tokens(cut, adapter.reiterable, sample)
    pipeline = MicroBatches(trial_input, batch_size, min(local_batch, 8), where)
    spec = pipeline.dataset(shuffle_seed=TRIAL_SHUFFLE_SEED).element_spec
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
        replicas=where.replicas, objective=objective,
        **({"tokens": True} if by_length is not None else {}))
    cached = _from_cache(model, key, cache, where, pipeline, jit)
    if cached is not None:
        return cached
    say = _reporter(verbose, on_trial, budget)
    length = 1 if by_length is None else costliest_row(
        sample(), by_length.lengths, by_length.arrays, by_length.buckets, tokens=True)
    isolated = _isolated(model, sample, local_batch, budget, meter, jit, where, isolate,
                         None if by_length is None else (by_length.buckets, length,
                                                         by_length.outputs),
                         several=by_length is not None and by_length.arrays is None and
                         by_length.lengths is not None and by_length.lengths.number > 1)
    if isolated is not None:
        with isolated:
            chosen, trials, speed_reason = _searched(
                _reporting(isolated.trial, say), budget, local_batch, objective)
    else:
        runner = TrialRunner(step_for(model, pipeline, jit_compile=jit), Snapshot(model),
                             meter, budget, trial_input, batch_size, where, say,
                             by_length=by_length, length=length)
        chosen, trials, speed_reason = _in_process(runner, local_batch, objective)
    result = result_of(trials, chosen, local_batch, device, budget, limit, headroom, meter,
                       key, time.perf_counter() - started)
    result = dataclasses.replace(result, worker=where.worker, workers=where.workers,
                                 objective=objective, speed_reason=speed_reason)
    if by_length is not None:
        result = dataclasses.replace(result, tokens=result.micro_batch_size * length,
                                     reference_length=length)
    if verbose:
        print(f"  chose micro_batch_size={result.micro_batch_size} "
              f"(k={result.accumulation_steps}): {result.reason()}", flush=True)
    if cache:
        _cache.store(key, result.to_dict())
    return result


def _in_tokens(cut: Cut | None, reiterable: bool, sample: Callable[[], tuple[Any, ...]]
               ) -> Cut | None:
    """The cut whose token budget the trials search (``cut`` in tokens, without one), or
    None: rows. An input read once is tried on its sample, as arrays that hold padded
    sequences (one length: the first sequence's)."""
    if cut is None or cut.by != "tokens" or cut.tokens is not None:
        return None
    if reiterable:
        return cut
    padded = padded_sequences(sample(), takes_any_length=True)
    if padded is None:
        return None
    spec = tf.nest.map_structure(tf.TensorSpec.from_tensor,
                                 tuple(() if part is None else part for part in sample()))
    return cut.of_arrays(padded, padded_lengths(spec, padded))


def _checked(objective: str, isolate: bool | None, memory_limit: int | str | None,
             headroom: float, where: Layout) -> int | None:
    """The search's arguments checked, before anything runs; the limit in bytes."""
    check_choice("objective", objective, OBJECTIVES)
    if isolate not in (None, True, False):
        raise ArgumentError(f"Expected `isolate` to be None, True or False. Received: "
                            f"isolate={describe(isolate)}.")
    limit = parse_memory(memory_limit)
    check_headroom(headroom)
    if objective == "speed" and where.multi_worker:
        raise ArgumentError(
            "Expected objective='memory' in a multi-worker job (each worker's speed is its "
            "own; the workers' search runs in lockstep). Received: objective='speed'.")
    return limit


def _in_process(runner: TrialRunner, local_batch: int, objective: str
                ) -> tuple[int | None, list[Trial], str | None]:
    """The search with trials in this process; the model, the optimizer and the metrics
    put back after, and the trials' pipelines freed before training builds its own."""
    try:
        return _searched(runner.trial, runner.budget, local_batch, objective,
                         lockstep=runner.lockstep if runner.where.multi_worker else None)
    finally:
        runner.step.discard()
        runner.snapshot.restore()
        runner.collector.close()
        del runner
        gc.collect()


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


def _isolated(model: keras.Model, sample: Callable[[], tuple[Any, ...]], local_batch: int,
              budget: int, meter: PeakMeter, jit: bool, where: Layout, isolate: bool | None,
              tokens: tuple[bool, int, tuple[int | None, ...]] | None = None,
              several: bool = False) -> IsolatedTrials | None:
    """The child process the trials run in (``autosplit.search.isolation``) on ``sample()``
    (the input's first rows), or None: in this process. ``isolate=None`` isolates where
    an allocation failure may crash a kernel. ``tokens``: the trials search in tokens
    (``IsolatedTrials``), where the child cuts arrays of one length by length: examples
    of ``several`` lengths are tried in this process."""
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
    if tokens is not None and (padded_sequences(sample(), takes_any_length=True) is None
                               or several):
        what = ("examples of several lengths, and these have " if several else
                "sequences of integer token ids, and these are not")
        warn_user(f"The probe's trials in tokens run in this process: a child process cuts "
                  f"by length arrays of one length, of {what}. Under TensorFlow's CPU cap a "
                  "kernel that runs out of memory may end the process instead of raising.")
        return None
    try:
        return IsolatedTrials(model, sample(), local_batch, budget,
                              meter.baseline_bytes, jit, step_held=bool(model_state(model).steps),
                              tokens=tokens)
    except IsolationError as error:
        warn_user(
            f"The probe's trials run in this process: {error}. Under TensorFlow's CPU cap "
            "a kernel that runs out of memory (oneDNN's convolution or batch "
            "normalization, or a new step's constant folding) may end the process "
            "instead of raising. Make the model "
            "loadable by keras.saving.load_model (register its custom objects with "
            "keras.saving.register_keras_serializable, in a module both processes "
            "import), or set TF_ENABLE_ONEDNN_OPTS=0 before TensorFlow starts.")
        return None


def _reporter(verbose: int, on_trial: Callable[[Trial, int], None] | None, budget: int
              ) -> Callable[[Trial], None]:
    def say(trial: Trial) -> None:
        if on_trial is not None:
            on_trial(trial, budget)
        if verbose:
            print(format_trial(trial, budget), flush=True)
    return say


