"""Whether the batch size is worth it: the gradient noise scale of a ``fit_large_batch``
call, per epoch in its logs (:class:`NoiseLogs`), in ``history.autosplit``
(:class:`GradientNoiseScale`), and as a sentence where B is far from it (:func:`advice`).

McCandlish et al.'s model ("An Empirical Model of Large-Batch Training", 2018): to reach
a given loss, a batch of B takes ``S = S_min (1 + B_noise / B)`` steps and
``E = E_min (1 + B / B_noise)`` examples. Up to about ``B_noise`` a larger batch nearly
divides the steps; far past it, each extra example buys almost nothing. The estimate is
``B_simple`` (``autosplit.step.noise_scale``), which the paper finds close to
``B_noise`` and uses in its place.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from autosplit.step.noise_scale import ratio

__all__ = ["FAR", "SMOOTHED", "GradientNoiseScale", "NoiseLogs", "advice",
           "steps_and_examples"]

KEY = "gradient_noise_scale"  # its name in the logs and in history.history
FAR = 4.0  # B this many times above or below the noise scale earns a sentence
SMOOTHED = 5  # the epochs GradientNoiseScale.smoothed pools


@dataclasses.dataclass(frozen=True)
class GradientNoiseScale:
    """The gradient noise scale measured during a ``fit_large_batch`` call:
    ``history.autosplit.gradient_noise_scale``.

    Example:
        >>> report = history.autosplit.gradient_noise_scale  # doctest: +SKIP
        >>> report.smoothed, report.unit  # doctest: +SKIP
        (812.4, 'rows')
        >>> print(report.advice)  # doctest: +SKIP
        B = 65536 is 81x the gradient noise scale (about 810 rows): ...
    """

    value: float | None
    """``B_simple`` of the last epoch that measured it, in :attr:`unit`, as
    ``history.history["gradient_noise_scale"]`` ends; None: absent (:attr:`absent` says
    why); ``inf``: the squared gradient's estimate was not positive (the gradient lost
    in its noise: the noise scale is past what B measures)."""
    unit: str
    """What it counts: ``"rows"``, ``"tokens"`` (the loss elements a Keras mask keeps)
    or ``"sample weight"`` (a loss over the sum of the sample weights)."""
    smoothed: float | None = None
    """The same ratio over the last :data:`SMOOTHED` epochs that measured it (a ratio of
    their means, weighed by large batches), steadier than one epoch's: what
    :attr:`advice` reads."""
    by_epoch: tuple[float, ...] = ()
    """Each epoch's figure (NaN: none measured), as ``history.history`` holds them."""
    noise_by_epoch: tuple[float, ...] = ()
    """Each epoch's mean estimate of ``tr(Sigma)``, one example's gradient variance (per
    large batch; NaN: none): pool epochs as you like, with :attr:`signal_by_epoch`."""
    signal_by_epoch: tuple[float, ...] = ()
    """Each epoch's mean estimate of ``|G|^2``, the true gradient's squared norm."""
    batch: float | None = None
    """The large batch in :attr:`unit`, on average (B in rows)."""
    advice: str = ""
    """What McCandlish et al.'s model says of B against :attr:`smoothed`, in a sentence;
    or why the estimate is absent."""
    absent: str | None = None
    """Why there is no estimate (None: there is one)."""

    @property
    def far(self) -> bool:
        """Whether B is :data:`FAR` times :attr:`smoothed` or more, either way."""
        if self.smoothed is None:
            return False
        size = self.batch or 0.0
        return (not math.isfinite(self.smoothed) or self.smoothed <= 0
                or not 1 / FAR < size / self.smoothed < FAR)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        for name in ("by_epoch", "noise_by_epoch", "signal_by_epoch"):
            data[name] = list(data[name])
        return data


def steps_and_examples(batch: float, noise_scale: float, other: float) -> tuple[float, float]:
    """By the model: the steps and the examples that a batch of ``other`` needs to reach
    a loss, as fractions of what a batch of ``batch`` needs there.

    >>> steps, examples = steps_and_examples(65536, 65536 / 80, 32768)
    >>> round(steps, 4), round(examples, 3)
    (1.0123, 0.506)
    """
    steps = (1 + noise_scale / other) / (1 + noise_scale / batch)
    examples = (1 + other / noise_scale) / (1 + batch / noise_scale)
    return steps, examples


def advice(batch_size: int, noise_scale: float, unit: str, batch: float | None = None
           ) -> str:
    """What the model says of ``batch_size`` against ``noise_scale`` (in ``unit``;
    ``batch``: the large batch in that unit, B where it counts rows), and whether B is
    far from it (:data:`FAR` times, either way): B halved, or doubled, and the steps
    and examples that would take.

    >>> print(advice(65536, 820.0, "rows"))  # doctest: +NORMALIZE_WHITESPACE
    B = 65536 is 80x the gradient noise scale (about 820 rows): by McCandlish et al.'s
    model, B = 32768 would need about 1.2% more steps for 51% of the examples.
    """
    size = float(batch if batch else batch_size)
    named = (f"B = {batch_size}" if unit == "rows" or not batch
             else f"B = {batch_size} rows (about {size:,.0f} {unit})")
    about = f"the gradient noise scale (about {_figure(noise_scale)} {unit})"
    if not math.isfinite(noise_scale):
        return (f"{named}: the gradient's squared norm measured no larger than its noise, "
                f"so the gradient noise scale is far above B; by McCandlish et al.'s model "
                f"a larger batch would need fewer steps for about as many examples.")
    if noise_scale <= 0:
        return (f"{named} is far above {about}: no noise measured, so by McCandlish et "
                f"al.'s model B = {batch_size // 2} would need as many steps for half the "
                f"examples.")
    ratio = size / noise_scale
    if ratio >= FAR:
        steps, examples = steps_and_examples(size, noise_scale, size / 2)
        return (f"{named} is {ratio:.0f}x {about}: by McCandlish et al.'s model, "
                f"B = {batch_size // 2} would need about {100 * (steps - 1):.1f}% more "
                f"steps for {100 * examples:.0f}% of the examples.")
    if ratio <= 1 / FAR:
        steps, examples = steps_and_examples(size, noise_scale, size * 2)
        return (f"{named} is 1/{1 / ratio:.0f} of {about}: by McCandlish et al.'s model, "
                f"B = {batch_size * 2} would need about {100 * (1 - steps):.0f}% fewer "
                f"steps for {100 * (examples - 1):.1f}% more examples.")
    return (f"{named} is {ratio:.2g}x {about}: near it, where by McCandlish et al.'s "
            f"model fewer steps and fewer examples trade about evenly.")


def _figure(value: float) -> str:
    """A noise scale as a person reads it: two significant figures past 100."""
    if value >= 100:
        return f"{float(f'{value:.2g}'):,.0f}"
    return f"{value:.2g}"


class NoiseLogs:
    """The gradient noise scale of one call: into each large batch's logs and each
    epoch's (``gradient_noise_scale``, the epoch's figure so far), then the report.

    Args:
        noise: the step's ``noise_scale.NoiseEpoch`` (None: not estimated).
        unit: what its examples are.
        absent: why there is no estimate (None: there is one), decided once per call:
            the logs keep the same keys in every epoch, as ``model.fit``'s do.
    """

    def __init__(self, noise: Any, unit: str, absent: str | None) -> None:
        self.noise, self.unit = noise, unit
        self.absent = absent if noise is not None or absent else "not estimated"
        self.epochs: list[tuple[float, float, float, float]] = []  # NoiseEpoch.read()'s

    def begin_epoch(self) -> None:
        if self.absent is None:
            self.noise.reset()

    def logs(self) -> dict[str, float]:
        """``{"gradient_noise_scale": the epoch's figure so far}``, or ``{}``: absent."""
        return {} if self.absent is not None else {KEY: self.noise.scale()}

    def end_epoch(self) -> dict[str, float]:
        """The epoch's figure, as its logs hold it; its sums kept for the report."""
        if self.absent is None:
            self.epochs.append(self.noise.read())
        return self.logs()

    def report(self, batch_size: int) -> GradientNoiseScale:
        """What the call measured, with what the model says of B against it."""
        by_epoch = tuple(ratio(noise, signal, counted)
                         for noise, signal, _, counted in self.epochs)
        measured = [sums for sums in self.epochs if sums[3]]
        if self.absent is not None or not measured:
            why = self.absent or (
                "no large batch gave an estimate (each had its gradients overflow, or one "
                "micro-batch holding every example)")
            return GradientNoiseScale(None, self.unit, by_epoch=by_epoch,
                                      advice=f"No gradient noise scale: {why}.", absent=why)
        recent = [sum(column) for column in zip(*measured[-SMOOTHED:], strict=True)]
        smoothed = ratio(recent[0], recent[1], recent[3])
        batch = float(batch_size) if self.unit == "rows" else recent[2] / recent[3]
        nan, last = float("nan"), measured[-1]
        return GradientNoiseScale(
            ratio(last[0], last[1], last[3]), self.unit, smoothed, by_epoch,
            tuple(n / c if c else nan for n, _, _, c in self.epochs),
            tuple(s / c if c else nan for _, s, _, c in self.epochs),
            batch, advice(batch_size, smoothed, self.unit, batch))
