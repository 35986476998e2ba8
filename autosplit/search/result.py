"""What the probe found (:class:`ProbeResult`): immutable, JSON-serialisable, and why
its size (``reason``)."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from autosplit.data.split import split_batch
from autosplit.errors import NothingFitsError
from autosplit.memory.device_info import DeviceInfo
from autosplit.memory.peak_meter import PeakMeter
from autosplit.search import cache as _cache
from autosplit.search.policy import Trial, fit_line, reliable_fits
from autosplit.units import format_bytes

__all__ = ["ProbeResult", "invalidate_cache", "result_of"]


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
    # Searched in tokens (a cut by length): micro_batch_size rows of what the sample's
    # costliest row costs (its lengths summed), reference_length, make the micro-batch's
    # budget of `tokens`.
    tokens: int | None = None
    reference_length: int | None = None

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
        if self.tokens is not None:
            where += (f"{self.tokens} tokens per micro-batch ({self.micro_batch_size} rows "
                      f"of the costliest row sampled, {self.reference_length} tokens): ")
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


def result_of(trials: list[Trial], chosen: int | None, batch_size: int, device: DeviceInfo,
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
