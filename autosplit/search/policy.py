"""The micro-batch search as pure logic: which size to try next, given what was seen.

Not a blind halving (accelerate's ``find_executable_batch_size`` lesson, PR #3684:
"stop halving my batch"): measure the real peak at two sizes far apart, fit
``peak = fixed + per_example * m``, predict the largest ``m`` under the budget, verify
it, and bisect between the largest size that fit and the smallest that did not
whenever the line points outside that interval. Each out-of-memory trial is slow (the
allocator retries before it gives up), so the search is built to provoke few.

:func:`search` is a generator: it yields ``(size, again)`` requests and receives the
:class:`Trial` for each, so the same logic runs one trial at a time in one process or
in lockstep across the workers of a multi-worker job, and is tested with a fake trial
in milliseconds (``tests/search/test_search.py``). No TensorFlow here.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Generator, Sequence

import numpy as np

from autosplit.data.split import split_batch

__all__ = ["OBJECTIVES", "Trial", "achievable", "between", "fit_line", "reliable_fits",
           "run_search", "search", "second_size", "shrink_micro_batch", "sizes_between"]

TOLERANCE = 0.05  # stop bisecting when the gap is within 5% of the best fit
GROWTH = 4  # before any failure, a guess is at most 4x the largest size that fit
OBJECTIVES = ("memory", "speed")


@dataclasses.dataclass(frozen=True)
class Trial:
    """One trial step at one micro-batch size."""

    micro_batch_size: int
    fits: bool  # ran without OOM and peaked under the budget
    oom: bool  # raised ResourceExhaustedError
    peak_bytes: int | None  # measured peak (None after an OOM)
    seconds: float
    samples_per_second: float | None = None  # over the measured steps (None after an OOM)
    # Memory in use when the trial began, and when it ended with its buffers released
    # (None when not read): what earlier trials left behind, and what this one did.
    held_before: int | None = None
    held_after: int | None = None
    # The trial's process ended (a kernel crashed on an allocation failure); it ran in a
    # child (autosplit.search.isolation) and counts as out of memory.
    crashed: bool = False


def fit_line(points: Sequence[tuple[int, int]]) -> tuple[float, float] | None:
    """Least-squares ``peak = a + b * m`` over (m, peak) points; None with one size.

    The slope is at least one byte per example, so a prediction never divides by 0.

    >>> fit_line([(8, 100), (32, 196)])
    (68.0, 4.0)
    >>> fit_line([(8, 100), (8, 104)]) is None
    True
    """
    if len({m for m, _ in points}) < 2:
        return None
    m = np.array([p[0] for p in points], np.float64)
    y = np.array([p[1] for p in points], np.float64)
    b, a = np.polyfit(m, y, 1)
    return round(float(a), 6), max(round(float(b), 6), 1.0)


def achievable(batch_size: int, m: int) -> int:
    """The rows a balanced split actually runs for a bound of ``m``: ceil(B / ceil(B / m)).

    >>> [achievable(4096, m) for m in (4096, 3000, 2048, 1500, 1366)]
    [4096, 2048, 2048, 1366, 1366]
    """
    return split_batch(batch_size, max(1, m)).micro_batch_size


def _steps(batch_size: int, rows: int) -> int:
    return math.ceil(batch_size / rows)


def between(batch_size: int, lo: int, hi: int) -> int | None:
    """The achievable size halfway (in micro-batch count) strictly between ``lo`` and ``hi``.

    >>> between(4096, 1024, 4096), between(4096, 2048, 4096)
    (2048, None)
    """
    sizes = sizes_between(batch_size, lo, hi)
    if not sizes:
        return None
    # The middle count, rounded towards fewer (larger) micro-batches: the search wants the
    # largest size that fits, and between k = 2 and k = 3 it should try k = 2 first.
    return sizes[(len(sizes) - 1) // 2]


def sizes_between(batch_size: int, lo: int, hi: int) -> list[int]:
    """The sizes a balanced split of ``batch_size`` runs strictly between ``lo`` and
    ``hi``, largest first (one per micro-batch count, fewest first)."""
    if hi <= lo + 1:
        return []
    k_small = _steps(batch_size, min(hi - 1, batch_size))
    k_large = _steps(batch_size, max(lo, 1))
    sizes = (math.ceil(batch_size / k) for k in range(k_small, k_large + 1))
    return [m for m in sizes if lo < m < hi]


Request = tuple[int, bool]  # (micro-batch size, measure again even if tried before)


def search(batch_size: int, budget: int) -> Generator[Request, Trial, int | None]:
    """Yield sizes to try; receive their trials; return the chosen size or None.

    Every size asked is achievable: a balanced split of B runs ceil(B / k) rows, so the
    search moves over those values only. The first size is B/64 (8 to 64 rows): small,
    yet large enough that its peak is more than the allocator's noise. The second
    (:func:`second_size`) follows from the first one's peak, not from B, and fits
    whatever the model's fixed memory is, so the line gets two points.
    Each later guess comes from the line through the largest size that fit and the
    largest one at most half of it, and while nothing has failed it is at most 4x the
    largest fit (a line through two small sizes can be mostly noise); a guess outside
    the open interval (largest fit, smallest failure), or no such pair, means the size
    below where the line through their two peaks meets the budget when the failure
    ran over it, or the one just above whose fit would end the search
    (:func:`_secant`), else the size halfway between them in micro-batch
    count (rounded to the larger size) after an out-of-memory error, so a bad line
    costs one trial. Once the smallest failure ran out of memory, the line that
    pointed there is not trusted past that halfway size either: an out-of-memory
    trial costs the allocator's retries, several times an extra trial below it.
    Trials may leave lasting allocations behind (kernel caches, scratch buffers). When
    the choice was not the last trial, its peak is moved to what the last trial left
    held (:func:`_still_fits`); only if that is over the budget, or not read, is the
    choice measured once more, and stepped down until it fits.
    """
    trials: list[Trial] = []

    def ask(m: int, again: bool = False) -> Generator[Request, Trial, Trial]:
        if not again:
            for done in trials:
                if done.micro_batch_size == m:
                    return done
        result = yield (m, again)
        trials.append(result)
        return result

    def bounds() -> tuple[int, int]:
        lo = max((t.micro_batch_size for t in trials if t.fits), default=0)
        hi = min((t.micro_batch_size for t in trials if not t.fits), default=batch_size + 1)
        return lo, hi

    first = achievable(batch_size, max(8, min(64, batch_size // 64)))
    if (yield from ask(first)).fits and first < batch_size:
        yield from ask(second_size(batch_size, first, trials[-1].peak_bytes, budget))
    lo, hi = bounds()
    for _ in range(12):
        if lo == 0 or lo == batch_size or _close_enough(lo, hi):
            break
        guess = _next_guess(batch_size, budget, trials, lo, hi)
        if guess is None:
            break
        result = yield from ask(guess)
        lo, hi = bounds()
        if result.fits and result.peak_bytes is not None and (
                result.peak_bytes >= (1 - TOLERANCE / 2) * budget or guess == batch_size):
            break  # the prediction landed within a few percent of the budget
    if lo == 0:
        # Even the smallest measured size failed: one example decides, then bisect.
        if hi == 1 or not (yield from ask(1)).fits:
            return None
        lo = 1
        while (guess := between(batch_size, lo, hi)) is not None:
            yield from ask(guess)
            lo, hi = bounds()
    chosen: int | None = lo
    last = trials[-1]
    verified = (last.fits and last.micro_batch_size == chosen) or (
        chosen is not None and _still_fits(trials, chosen, budget))
    while chosen is not None and not verified:
        if (yield from ask(chosen, again=True)).fits:
            break
        # Step down by about 10% (one measured step), not to a far smaller earlier fit.
        smaller = achievable(batch_size, int(chosen * 0.9))
        if smaller >= chosen:
            smaller = achievable(batch_size, chosen - 1) if chosen > 1 else 0
        chosen = smaller or None
    return chosen


def _next_guess(batch_size: int, budget: int, trials: Sequence[Trial], lo: int, hi: int
                ) -> int | None:
    """The next size :func:`search` asks, strictly between ``lo`` (the largest fit) and
    ``hi`` (the smallest failure); None to stop."""
    line = fit_line(_far_pair(trials))
    guess = None
    if line is not None:
        a, b = line
        guess = achievable(batch_size, int((budget - a) / b))
        if guess <= lo:
            return None  # the line puts the budget below the next size a split can run
        if hi > batch_size:
            # Nothing failed yet: the line is extrapolated, and through two small
            # sizes the allocator's noise can hide its slope. Steps of at most 4x.
            guess = min(guess, achievable(batch_size, GROWTH * lo))
    if guess is not None and lo < guess < hi and _ran_out_at(trials, hi):
        # The line pointed at or past a size that ran out of memory: above the
        # halfway size (in micro-batch count) it is not trusted again.
        middle = between(batch_size, lo, hi)
        guess = min(guess, middle) if middle is not None else None
    if guess is None or not lo < guess < hi:
        guess = _secant(batch_size, budget, trials, lo, hi) or between(batch_size, lo, hi)
    return guess


def second_size(batch_size: int, first: int, peak: int | None, budget: int) -> int:
    """The second size to measure, from the first trial alone: a geometric step of 2x to
    16x the first, as far as the budget allows if the whole peak grew with the rows.

    A peak ``fixed + per_example * m`` with ``fixed >= 0`` reaches the budget no earlier
    than that line through the origin does, so this size fits whatever the fixed part
    is (below 2x, where the fixed part would be most of the budget, 2x is tried anyway),
    and the line fit gets two sizes at least 2x apart. It depends on the memory the
    model needs, not on B: a fixed fraction of B asked a 4096 batch for 1024 rows, an
    out-of-memory trial that taught nothing. 16x keeps the step a step: a line through
    the origin may be far off when the budget reads more than the device can give.

    >>> second_size(4096, 64, 1_000, 10_000), second_size(4096, 64, 9_000, 10_000)
    (586, 128)
    >>> second_size(512, 8, 10, 10_000), second_size(40, 8, 1008, 1130)
    (128, 14)
    """
    bound = first * budget // max(1, peak or 1)
    return achievable(batch_size, min(16 * first, max(2 * first, bound)))


def _secant(batch_size: int, budget: int, trials: Sequence[Trial], lo: int, hi: int
            ) -> int | None:
    """Between the largest fit ``lo`` and a smallest failure ``hi`` that ran (over the
    budget, its peak measured), the largest size at or below where the straight line
    through their two peaks meets the budget (the smallest size above ``lo`` when none
    is), or the smallest size whose fit ends the search when that lies within 5% above
    it (below); None after an out-of-memory error (no peak) or without a size a split
    can run strictly between them.

    The peak can climb in steps (an allocator growing its pool), so the line through
    the far pair of fits may point past a failure that ran; the two peaks around the
    budget locate it better than halving the micro-batch count.

    A size below the crossing that leaves sizes to try above it (more than 5% larger,
    below ``hi``) costs a trial more when it fits, so the size whose fit ends the
    search is asked instead when it lies within 5% above the crossing, inside the
    allocator's noise on two peaks.

    >>> seen = [Trial(179, True, False, 158, 1.0), Trial(274, False, False, 248, 1.0)]
    >>> _secant(4096, 230, seen, 179, 274)  # the line meets 230 at 255.0 rows (k = 17: 241)
    256
    >>> _secant(4096, 230, seen[:1] + [Trial(274, False, False, 268, 1.0)], 179, 274)
    241
    """
    def peak(m: int, fits: bool) -> int | None:
        return next((t.peak_bytes for t in reversed(trials)
                     if t.micro_batch_size == m and t.fits == fits and not t.oom), None)

    low, high = peak(lo, True), peak(hi, False)
    if low is None or high is None or high <= low:
        return None
    crossing = lo + (budget - low) * (hi - lo) / (high - low)
    inside = sizes_between(batch_size, lo, hi)
    if not inside:
        return None
    # The largest the line says fits, as for the line's own guess: one too small costs
    # a trial, one too large may run out of memory (the allocator's retries).
    under = [m for m in inside if m <= crossing]
    if not under:
        return min(inside)
    # A fit at the largest size inside leaves none above it; a smaller one may be close
    # enough to hi already.
    ending = min(m for m in inside if m == inside[0] or _close_enough(m, hi))
    return ending if max(under) < ending <= crossing * (1 + TOLERANCE) else max(under)


def _close_enough(lo: int, hi: int) -> bool:
    """Whether the largest fit ``lo`` and the smallest failure ``hi`` end the search: the
    gap is within 5% of ``lo`` (or one row). The loop of :func:`search` stops there,
    and :func:`_secant` asks for the size whose fit would stop it."""
    return hi - lo <= max(1, TOLERANCE * lo)


def _still_fits(trials: Sequence[Trial], m: int, budget: int) -> bool:
    """Whether ``m``'s last trial, if it fit, would still fit with what the later trials
    left held (what trials leave does not grow, so no trial is needed to tell); False
    without those readings.

    >>> seen = [Trial(256, True, False, 172, 1.0, held_before=12, held_after=8),
    ...         Trial(274, False, False, 248, 1.0, held_before=8, held_after=9)]
    >>> _still_fits(seen, 256, 230), _still_fits(seen, 256, 168)
    (True, False)
    >>> _still_fits(seen + [Trial(256, False, False, 240, 1.0, held_before=9)], 256, 230)
    False
    """
    run = next((t for t in reversed(trials) if t.micro_batch_size == m), None)
    held_now = trials[-1].held_after if trials else None
    if (run is None or not run.fits or run.peak_bytes is None or run.held_before is None
            or held_now is None):
        return False
    return run.peak_bytes - run.held_before + held_now <= budget


def _ran_out_at(trials: Sequence[Trial], m: int) -> bool:
    return any(t.oom and t.micro_batch_size == m for t in trials)


def _far_pair(trials: Sequence[Trial]) -> list[tuple[int, int]]:
    """The largest fitting size and the largest fitting one at most half of it: sizes
    closer than 2x differ by little more than the allocator's noise, and a slope
    through them would be a guess."""
    fits = sorted((t.micro_batch_size, t.peak_bytes) for t in trials
                  if t.fits and t.peak_bytes is not None)
    if not fits:
        return []
    top = fits[-1]
    below = [p for p in fits if 2 * p[0] <= top[0]]
    return [below[-1], top] if below else [top]


def run_search(batch_size: int, budget: int, trial: Callable[[int], Trial]
               ) -> tuple[int | None, list[Trial]]:
    """Drive :func:`search` with ``trial(m)``; returns (chosen, every trial in order)."""
    trials: list[Trial] = []
    generator = search(batch_size, budget)
    try:
        request = next(generator)
        while True:
            result = trial(request[0])
            trials.append(result)
            request = generator.send(result)
    except StopIteration as stop:
        return stop.value, trials


def reliable_fits(trials: Sequence[Trial]) -> list[int]:
    """Sizes that fit in every trial they had, largest first: one that ran out of memory
    or over the budget once (memory near the cap moves from run to run) will again.

    >>> reliable_fits([Trial(342, True, False, 1, 1.0), Trial(171, True, False, 1, 1.0),
    ...                Trial(342, False, True, None, 1.0)])
    [171]
    """
    failed = {t.micro_batch_size for t in trials if not t.fits}
    return sorted({t.micro_batch_size for t in trials if t.fits} - failed, reverse=True)


def shrink_micro_batch(failed: int, fits: Sequence[int] = ()) -> int:
    """The next micro-batch bound to try after ``failed`` rows ran out of memory.

    Half of it, rounded down to a multiple of 8 once it is at least 8 (0 when
    ``failed`` is 1); or the largest size below ``failed`` already known to fit, when
    that is larger. A known fit further down is not taken: the probe's small first
    trials fit, but the rest of the run would pay for each step at a fraction of the
    speed, where half the rows risks one more out-of-memory error (seconds of the
    allocator's retries, once).

    >>> shrink_micro_batch(512), shrink_micro_batch(100), shrink_micro_batch(5)
    (256, 48, 2)
    >>> shrink_micro_batch(512, fits=[96, 384, 640]), shrink_micro_batch(2048, fits=[64, 512])
    (384, 1024)
    """
    half = failed // 2
    if half >= 8:
        half -= half % 8
    half = max(half, 1) if failed > 1 else 0
    return max([half] + [m for m in fits if m < failed])
