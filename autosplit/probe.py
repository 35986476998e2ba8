"""The micro-batch search: real trial steps, a memory model, and an on-disk cache.

Not a blind halving (accelerate's ``find_executable_batch_size`` lesson, PR #3684:
"stop halving my batch"): measure the real peak of the real compiled step at two
small sizes, fit ``peak = fixed + per_example * m`` (the fixed part holds the
weights, the optimizer slots, the accumulator and the large batch's own inputs, which
stay in memory while it is split), predict the largest ``m`` under the budget, verify
it with a trial, and bisect between the largest size that fit and the smallest that
did not. Out-of-memory is detected by type (``tf.errors.ResourceExhaustedError``).
Each OOM is slow (the allocator retries before giving up), so the search is built to
provoke few of them, and counts them.

The model, the optimizer and the metrics are restored bitwise after the trials.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import json
import math
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from autosplit import _keras
from autosplit.data import LargeBatches
from autosplit.errors import MemoryLimitError, NothingFitsError
from autosplit.memory import (
    DeviceInfo,
    PeakMeter,
    budget_bytes,
    format_bytes,
    parse_memory,
    read_device,
)
from autosplit.step import Snapshot, TrainStep, check_model, check_size, split_batch

__all__ = [
    "ProbeResult",
    "Trial",
    "cache_dir",
    "invalidate_cache",
    "probe",
    "should_stream",
    "stream_by_default",
]

_TRIAL_STEPS = 2  # measured steps per trial, after one warm-up step
_TOLERANCE = 0.05  # stop bisecting when the gap is within 5% of the best fit
# Stream micro-batches from the arrays when one large batch of inputs alone would take
# this share of the budget: materialising it would leave too little for activations.
_STREAM_SHARE = 0.25


@dataclasses.dataclass(frozen=True)
class Trial:
    """One trial step at one micro-batch size."""

    micro_batch_size: int
    fits: bool  # ran without OOM and peaked under the budget
    oom: bool  # raised ResourceExhaustedError
    peak_bytes: int | None  # measured peak (None after an OOM)
    seconds: float


@dataclasses.dataclass(frozen=True)
class ProbeResult:
    """What the search found; immutable and JSON-serialisable (``to_dict``/``from_dict``)."""

    batch_size: int
    micro_batch_size: int
    accumulation_steps: int
    trials: tuple[Trial, ...]
    device: dict
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
    streaming: bool = False  # micro-batches gathered inside the loop (fit_large_batch)
    from_cache: bool = False

    def fitting_sizes(self) -> list[int]:
        """Sizes a trial showed to fit, largest first."""
        return sorted({t.micro_batch_size for t in self.trials if t.fits}, reverse=True)

    def predict_peak(self, micro_batch_size: int) -> int | None:
        """The memory model's peak at ``micro_batch_size`` (None without a model)."""
        if self.fixed_bytes is None or self.per_example_bytes is None:
            return None
        return int(self.fixed_bytes + self.per_example_bytes * micro_batch_size)

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


# ---------------------------------------------------------------- cache


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/autosplit``, else ``~/.cache/autosplit``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "autosplit"


def _fingerprint(model: keras.Model, sample: tuple, batch_size: int, limit: int | None,
                 device: DeviceInfo, headroom: float, jit_compile: bool,
                 streaming: bool) -> str:
    spec = tf.nest.map_structure(
        lambda t: None if t is None else (tuple(t.shape[1:]), str(t.dtype)), list(sample))
    try:
        architecture = model.to_json()
    except Exception:  # subclassed models without get_config
        architecture = repr([(v.path, tuple(v.shape), str(v.dtype)) for v in model.variables])
    optimizer = model.optimizer
    parts = {
        "device": [device.kind, device.identity, device.total_bytes],
        "versions": [tf.__version__, keras.__version__],
        "architecture": architecture,
        "dtype_policy": str(keras.mixed_precision.global_policy().name),
        "inputs": repr(spec),
        "optimizer": [type(optimizer).__name__,
                      json.dumps(optimizer.get_config(), sort_keys=True, default=str)],
        "jit_compile": jit_compile,
        "streaming": streaming,
        "memory_limit": limit,
        "batch_size": batch_size,
        "headroom": headroom,
    }
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


def _cache_path(key: str) -> Path:
    return cache_dir() / f"probe-{key}.json"


def invalidate_cache(result: ProbeResult) -> None:
    """Forget a cached result (an OOM during training proved it wrong)."""
    with contextlib.suppress(FileNotFoundError):
        _cache_path(result.cache_key).unlink()


def stream_by_default(batches: LargeBatches, model: keras.Model) -> bool:
    """``streaming="auto"``: stream whenever the examples are arrays in memory.

    Streaming never costs memory (the arrays are held anyway, and only row numbers
    travel) and keeps the step's peak flat in the target batch: measured +1% from
    B=512 to B=16384, against +50% (2.6 copies of a large batch in the input pipeline)
    when the batch is materialised (benchmarks/memory_scaling.py). Datasets, and
    models under a multi-replica strategy, are batched as usual.
    """
    return batches.streamable and model.distribute_strategy.num_replicas_in_sync == 1


def should_stream(batches: LargeBatches, *, memory_limit: int | str | None = None,
                  headroom: float = 0.1) -> bool:
    """Whether one large batch of inputs would take a quarter of the budget or more.

    A diagnostic for the README's advice; ``streaming="auto"`` streams all arrays.
    """
    if not batches.streamable:
        return False
    gpu = bool(tf.config.list_logical_devices("GPU"))
    device = read_device("GPU:0" if gpu else "CPU:0")
    budget = budget_bytes(device, parse_memory(memory_limit), headroom)
    return batches.batch_bytes() >= _STREAM_SHARE * budget


# ---------------------------------------------------------------- search


def _fit_line(points: Sequence[tuple[int, int]]) -> tuple[float, float] | None:
    """Least-squares ``peak = a + b * m`` over (m, peak) points."""
    sizes = sorted({m for m, _ in points})
    if len(sizes) < 2:
        return None
    m = np.array([p[0] for p in points], np.float64)
    y = np.array([p[1] for p in points], np.float64)
    b, a = np.polyfit(m, y, 1)
    return float(a), max(float(b), 1.0)


def _round(m: int) -> int:
    """Prefer multiples of 8 once m >= 8 (tensor-core and vector friendly)."""
    return m - m % 8 if m >= 8 else max(m, 1)


def probe(
    model: keras.Model,
    dataset: Any,
    batch_size: int,
    *,
    memory_limit: int | str | None = None,
    headroom: float = 0.1,
    cache: bool = True,
    jit_compile: bool | None = None,
    streaming: bool | str = "auto",
    _batches: LargeBatches | None = None,
) -> ProbeResult:
    """Find the largest micro-batch of ``model`` that fits, by real trial steps.

    Args:
        model: a compiled Keras model.
        dataset: the training data (single examples, as for ``fit_large_batch``); one
            real large batch of it is used for the trials.
        batch_size: the effective batch B; the micro-batch is capped at B (k = 1).
        memory_limit: a budget smaller than the device ("6GiB", "512MB" or bytes).
        headroom: the fraction of the budget left free (default 10%).
        cache: reuse/store the result under ``cache_dir()``.
        jit_compile: as for ``fit_large_batch``.
        streaming: trial the streaming step (micro-batches gathered from the arrays
            inside the loop); ``"auto"``: whenever the examples are arrays (see
            ``stream_by_default``). The result says which was chosen.

    Returns:
        A ``ProbeResult`` with the chosen ``micro_batch_size`` and every trial.

    Raises:
        NothingFitsError: not even one example fits; says what one example needs.

    Example:
        >>> result = autosplit.probe(model, (x, y), batch_size=4096, memory_limit="2GiB")
        >>> result.micro_batch_size, result.accumulation_steps
        (512, 8)
    """
    started = time.perf_counter()
    batch_size = check_size("batch_size", batch_size)
    limit = parse_memory(memory_limit)
    check_model(model)
    batches = _batches or LargeBatches(dataset, batch_size)
    with model.distribute_strategy.scope():
        _keras.build_model(model, batches.sample(min(batch_size, 8)))
    check_model(model)
    meter_device = "GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0"
    meter = PeakMeter(meter_device)
    meter.reset()
    baseline = meter.current_bytes()
    device = read_device(meter_device)
    budget_bytes(device, None, headroom)  # validates `headroom`
    # What this process may hold in all, in the meter's units: NVML's figure already
    # counts our own allocations; the CPU readings are what is still free.
    ceiling = device.available_bytes if device.kind == "GPU" else baseline + device.available_bytes
    if limit is not None and limit <= baseline:
        raise MemoryLimitError(
            f"Expected `memory_limit` above what the process already holds "
            f"({format_bytes(baseline)}: weights, optimizer state"
            f"{', runtime' if meter.source == 'rss-hwm' else ''}). Received: "
            f"memory_limit={format_bytes(limit)}. Raise the limit or use a smaller model."
        )
    if limit is not None:
        ceiling = min(ceiling, limit)
    budget = math.floor(ceiling * (1 - headroom))
    jit = bool(model.jit_compile if jit_compile is None else jit_compile)
    if streaming == "auto":
        streaming = stream_by_default(batches, model)
    streaming = bool(streaming)
    source = batches.source if streaming else None
    if streaming:
        # Only the row numbers travel; each micro-batch is gathered inside the loop.
        x, n_valid = batches.first_index()
        y = w = None
        in_flight = 0
    else:
        x, y, w, n_valid = batches.first()
        # While a step runs, the input pipeline holds the next large batch
        # (prefetch(1)). On the CPU it shares the allocator with the step; a GPU's
        # inputs wait in host memory, outside the device budget.
        in_flight = 0 if device.kind == "GPU" else sum(
            int(t.numpy().nbytes) for t in tf.nest.flatten((x, y, w)) if t is not None)
    # The live budget moves with whatever else holds memory right now; the key uses
    # what defines it: the device's total, the user's limit and the headroom.
    signature = source if streaming else (x, y, w)
    key = _fingerprint(model, signature, batch_size, limit, device, headroom, jit, streaming)
    if cache:
        try:
            cached = ProbeResult.from_dict(json.loads(_cache_path(key).read_text()))
            return dataclasses.replace(cached, from_cache=True)
        except (FileNotFoundError, ValueError, TypeError, KeyError):
            pass

    snapshot = Snapshot(model)
    trials: list[Trial] = []

    def trial(m: int, again: bool = False) -> Trial:
        for done in trials:
            if done.micro_batch_size == m and not again:
                return done
        t0 = time.perf_counter()
        step = None
        try:
            step = TrainStep(model, split_batch(batch_size, m), jit_compile=jit, source=source)
            # The first step traces and makes one-time allocations (kernel caches,
            # scratch buffers) that stay; the steady-state peak is what training sees.
            step(x, y, w, n_valid)
            meter.reset()
            for _ in range(_TRIAL_STEPS):
                step(x, y, w, n_valid)
            peak = meter.peak_bytes() + in_flight
            result = Trial(m, peak <= budget, False, int(peak), time.perf_counter() - t0)
        except tf.errors.ResourceExhaustedError:
            result = Trial(m, False, True, None, time.perf_counter() - t0)
        finally:
            snapshot.restore()
            # A TrainStep and its tf.function reference each other: collect the cycle
            # now, or the dead trial's buffers count against the next one.
            del step
            gc.collect()
        trials.append(result)
        return result

    try:
        chosen = _search(batch_size, trial, trials, budget)
        # Trials leave lasting allocations behind (kernel caches, scratch buffers for
        # each new shape), so what fit early may not fit now. Verify the choice last,
        # in a fresh step, as training will run it; step down through the fits if not.
        # (Not needed when the choice was the last trial: nothing ran after it.)
        last = trials[-1] if trials else None
        verified = last is not None and last.fits and last.micro_batch_size == chosen
        while chosen is not None and not verified:
            final = trial(chosen, again=True)
            if final.fits:
                break
            # Step down by 10% (a measured step), not to a far smaller earlier fit.
            smaller = _round(int(chosen * 0.9))
            chosen = smaller if 1 <= smaller < chosen else (chosen - 1 or None)
    finally:
        snapshot.restore()
    fitting = [t for t in trials if t.fits]
    line = _fit_line([(t.micro_batch_size, t.peak_bytes) for t in trials
                      if t.peak_bytes is not None])
    if chosen is None:
        per_example = line[1] if line else None
        smallest = min((t.peak_bytes for t in trials if t.peak_bytes), default=None)
        need = (f"about {format_bytes(int(per_example))} per example on top of "
                f"{format_bytes(int(line[0]))} fixed" if line else
                f"more than the budget at m=1 (peak {format_bytes(smallest)})"
                if smallest else "more than the budget even at m=1 (OOM)")
        raise NothingFitsError(
            f"Not even a micro-batch of 1 example fits: one example needs {need}, and the "
            f"budget is {format_bytes(budget)} ({int(headroom * 100)}% headroom kept). "
            "Raise `memory_limit`, lower `headroom`, or use a smaller model or inputs.",
            bytes_per_example=int(per_example) if per_example else None,
            budget_bytes=budget,
        )
    chosen_trial = [t for t in fitting if t.micro_batch_size == chosen][-1]
    result = ProbeResult(
        batch_size=batch_size,
        micro_batch_size=chosen,
        accumulation_steps=math.ceil(batch_size / chosen),
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
        seconds=time.perf_counter() - started,
        cache_key=key,
        streaming=streaming,
    )
    if cache:
        try:
            path = _cache_path(key)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(result.to_json())
        except OSError:
            pass
    return result


def _search(batch_size: int, trial, trials: list[Trial], budget: int) -> int | None:
    """Measure two sizes, predict, verify, bisect. Returns the chosen size or None.

    The two measured sizes are far apart (B/64 and B/4, at least 8 and 32): the peaks
    of nearby small sizes differ by less than the allocator's noise, and a slope fitted
    to them predicts nonsense. Each later guess comes from the line through the two
    largest sizes that fit (the most linear stretch, and the nearest to the answer); a
    guess outside the open interval (largest fit, smallest failure) is replaced by the
    midpoint, so a bad line costs one failed trial, not a walk down one size at a time.
    """
    first = min(batch_size, max(8, batch_size // 64))
    second = min(batch_size, max(32, batch_size // 4))
    for m in sorted({first, second}):
        if not trial(m).fits:
            break

    def bounds():
        lo = max((t.micro_batch_size for t in trials if t.fits), default=0)
        hi = min((t.micro_batch_size for t in trials if not t.fits), default=batch_size + 1)
        return lo, hi

    lo, hi = bounds()
    for _ in range(12):
        if lo == 0 or lo == batch_size or hi - lo <= max(1, _TOLERANCE * lo):
            break
        fitted = sorted((t.micro_batch_size, t.peak_bytes) for t in trials if t.fits)[-2:]
        line = _fit_line(fitted)
        guess = None
        if line is not None:
            a, b = line
            guess = min(_round(int((budget - a) / b)), batch_size)
        if guess is None or not lo < guess < hi:
            top = min(hi, batch_size + 1)
            guess = _round((lo + top) // 2)
            if not lo < guess < top:
                guess = (lo + top) // 2
            if not lo < guess < top:
                break
        result = trial(guess)
        lo, hi = bounds()
        if result.fits and (result.peak_bytes >= (1 - _TOLERANCE / 2) * budget
                            or guess == batch_size):
            break  # the prediction landed within a few percent of the budget
    if lo == 0:
        # Even the smallest measured size failed: one example decides, then bisect.
        if hi == 1 or not trial(1).fits:
            return None
        lo = 1
        while hi - lo > 1:
            trial((lo + hi) // 2)
            lo, hi = bounds()
    return lo
