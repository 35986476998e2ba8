"""``history.autosplit``: how ``fit_large_batch`` split its batches, and why."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from autosplit.data.sequences.stats import CutStats
from autosplit.training.noise_report import GradientNoiseScale
from autosplit.training.recovery import OomRecovery
from autosplit.warn import warn_user

if TYPE_CHECKING:
    from autosplit.search.probe import ProbeResult

__all__ = ["FitReport"]


@dataclasses.dataclass(frozen=True)
class FitReport:
    """How ``fit_large_batch`` split its batches, and why: ``history.autosplit``.

    Immutable, as :class:`autosplit.ProbeResult` is; ``to_dict()`` gives plain values,
    ready for JSON. Read as the dict it used to be (``history.autosplit["micro_batch_size"]``,
    ``.get``, ``.keys()``, ``.items()``, ``.values()``, ``in``, ``len``, iteration), it
    gives what ``to_dict()`` holds, with a ``DeprecationWarning``: read the attributes
    instead. That mapping protocol leaves in 0.4.0.

    Example:
        >>> history = autosplit.fit_large_batch(  # doctest: +SKIP
        ...     model, x, y, batch_size=4096, epochs=3)
        >>> history.autosplit.micro_batch_size  # doctest: +SKIP
        1366
        >>> history.autosplit.oom_recoveries  # doctest: +SKIP
        ()
    """

    batch_size: int
    """The effective batch B, over every replica."""
    micro_batch_size: int
    """Rows per micro-batch, per replica, at the end (after any out-of-memory recovery);
    with ``tokens``, the most rows a micro-batch holds."""
    accumulation_steps: int
    """Micro-batches per large batch, per replica, at ``micro_batch_size`` (with
    ``tokens``, as many as each large batch needs: ``cut`` counts them)."""
    padded_rows: int
    """Zero-weight rows that even out each replica's micro-batches at that size."""
    micro_batch_reason: str
    """``"given"``, or why the probe chose the size it started with."""
    input: str
    """The kind of input trained on (``"arrays"``, ``"generator"``, ...)."""
    batch_norm: str
    """``"pooled"`` or ``"micro"``: when BatchNormalization's moving statistics move."""
    replicas: int
    """Replicas in sync, over every worker."""
    workers: int
    """Worker processes of the run (1 without ``MultiWorkerMirroredStrategy``)."""
    micro_batch_sizes: tuple[int, ...]
    """Rows per micro-batch at the end of each epoch that ran."""
    oom_recoveries: tuple[OomRecovery, ...]
    """Every out-of-memory error survived, in order."""
    probe: ProbeResult | None
    """The probe's search, with ``micro_batch_size="auto"``; else None."""
    traces: int
    """Compiled functions traced by this call (0: every one was reused)."""
    padding: str | None = None
    """For rows that vary in length: ``"by length: ..."`` (each large batch's rows
    sorted by length, each part of a micro-batch padded to its own longest row) or
    ``"to the large batch's longest row: ..."``, each with why. None for rows of one
    shape."""
    tokens: int | None = None
    """Tokens (rows x padded length, summed over an example's lengths) per micro-batch
    at the end, where micro-batches are sized in tokens (``micro_batch_tokens``);
    ``micro_batch_size`` then caps their rows. None: micro-batches of
    ``micro_batch_size`` rows."""
    programs: int | None = None
    """Under XLA, for rows cut by length: the distinct shapes of micro-batch training gave
    its step, each a program XLA compiled (lengths rounded up to buckets, so at most
    ``Cut.programs``: 16 per length up to 512 in rows, 18 in tokens). None otherwise."""
    cut: CutStats | None = None
    """For rows that vary in length, cut by length or padded to the large batch's
    longest row: micro-batches per large batch, the share of padding fed and the real
    tokens, read from the first 4 large batches of an epoch in the input's order (None
    for an input read once). None for rows of one shape."""
    step: str = "summed: each micro-batch's gradients added up, applied once"
    """Which step trained, and why: ``"summed: ..."`` (the loss a sum over the rows, each
    micro-batch's gradients added up) or ``"outputs first, the loss over the whole batch,
    then the gradients: ..."`` with what makes the loss the whole batch's
    (``autosplit.step.whole_batch``)."""

    gradient_noise_scale: GradientNoiseScale | None = None
    """McCandlish et al.'s gradient noise scale, measured from the micro-batches'
    gradients (with ``noise_scale=True``), with what their model says of B
    against it, or why it is absent (one micro-batch per large batch, a loss over the
    whole batch, a custom ``train_step``, ``noise_scale=False``)."""

    def to_dict(self) -> dict[str, Any]:
        """Plain values: lists for tuples, dicts for records (the probe's too)."""
        data = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        data["micro_batch_sizes"] = list(self.micro_batch_sizes)
        data["oom_recoveries"] = [record.to_dict() for record in self.oom_recoveries]
        data["probe"] = None if self.probe is None else self.probe.to_dict()
        data["cut"] = None if self.cut is None else self.cut._asdict()
        data["gradient_noise_scale"] = (None if self.gradient_noise_scale is None
                                        else self.gradient_noise_scale.to_dict())
        return data

    # history.autosplit was a dict up to 0.2.0: the whole read-only mapping protocol
    # works on to_dict()'s values until 0.4.0, each use with a DeprecationWarning, so
    # that code written against the dict keeps running and learns what to read instead.

    def _as_dict(self, use: str, key: str = "micro_batch_size") -> dict[str, Any]:
        warn_user(f"history.autosplit{use} is deprecated: history.autosplit is a FitReport; "
                  f"read history.autosplit.{key}, or .to_dict() for a dict.",
                  DeprecationWarning)
        return self.to_dict()

    def __getitem__(self, key: str) -> Any:
        return self._as_dict(f"[{key!r}]", key)[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self._as_dict(f".get({key!r})", key).get(key, default)

    def keys(self) -> Any:
        return self._as_dict(".keys()").keys()

    def values(self) -> Any:
        return self._as_dict(".values()").values()

    def items(self) -> Any:
        return self._as_dict(".items()").items()

    def __contains__(self, key: object) -> bool:
        return key in self._as_dict(f": {key!r} in history.autosplit")

    def __iter__(self) -> Iterator[str]:
        return iter(self._as_dict(": iterating over it"))

    def __len__(self) -> int:
        return len(self._as_dict(": len()"))
