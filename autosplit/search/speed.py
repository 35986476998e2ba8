"""``objective="speed"``: after the search, time up to two more balanced sizes between
half the largest that fits and it, and keep the fastest when it is more than 5% faster
(DeepSpeed's autotuner looks there). Pure logic, as ``autosplit.search.policy``."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from autosplit.search.policy import Trial, achievable, reliable_fits

__all__ = ["FASTER", "fastest", "run_speed", "speed_candidates"]

FASTER = 1.05  # objective="speed" keeps a smaller size only when it is 5% faster


def speed_candidates(batch_size: int, largest: int, trials: Sequence[Trial],
                     most: int = 2) -> list[int]:
    """Up to ``most`` balanced sizes strictly between half of ``largest`` and it, spread in
    micro-batch count, that no trial measured yet (DeepSpeed's autotuner looks there).

    >>> speed_candidates(4096, 2048, [])  # only k = 3 lies strictly between k = 2 and 4
    [1366]
    >>> speed_candidates(4096, 1024, [Trial(820, True, False, 1, 1.0, 10.0)])
    [683, 586]
    """
    seen = {t.micro_batch_size for t in trials}
    sizes = sorted({achievable(batch_size, m) for m in range(largest // 2 + 1, largest)},
                   reverse=True)
    sizes = [m for m in sizes if largest // 2 < m < largest and m not in seen]
    if len(sizes) <= most:
        return sizes
    picks = [sizes[round(i * (len(sizes) - 1) / (most - 1))] for i in range(most)] if (
        most > 1) else sizes[:1]
    return sorted(set(picks), reverse=True)


def run_speed(batch_size: int, largest: int, trials: list[Trial],
              trial: Callable[[int], Trial]) -> tuple[int, str]:
    """``objective="speed"`` after the memory search found ``largest``: time up to two
    more sizes (:func:`speed_candidates`) with ``trial(m)``, appending to ``trials``,
    and return the size kept and why.

    A trial times two short steps, 10-30% apart run to run on a busy machine, and a
    smaller size wins only by more than 5%. The size that leads (:func:`fastest`) is a
    challenger only: it and the reference are timed twice more, in turn and mirrored
    (A B B A, so a drift of the machine's speed weighs on both alike), and it is kept
    only when it is more than 5% faster on those four timings alone: its earlier
    timing made it lead, so it is the likeliest to be high. A challenger that falls
    back competes no more, and the next size that leads is timed the same way.
    """
    for m in speed_candidates(batch_size, largest, trials):
        trials.append(trial(m))
    rejected: set[int] = set()
    while True:
        challenger, why = fastest(largest, trials, rejected)
        reference, _ = _standing(largest, trials)
        if challenger == reference:
            return challenger, why
        paired = [trial(m) for m in (reference, challenger, challenger, reference)]
        trials.extend(paired)
        if not all(t.fits for t in paired):
            continue  # the standing changed: a size that failed once competes no more
        kept, why = fastest(reference, paired)
        if kept == challenger:
            dropped = "" if reference == largest else f"{largest} failed when tried again; "
            return challenger, f"{dropped}{why}, timed in turn"
        rejected.add(challenger)


def _standing(largest: int, trials: Sequence[Trial]) -> tuple[int, list[int]]:
    """The size the speed rule measures against, and the sizes up to ``largest`` that
    always fit: ``largest``, or when it failed once, the largest that always fit (or
    ``largest`` still, when none did)."""
    reliable = [m for m in reliable_fits(trials) if m <= largest]
    return (reliable[0] if reliable else largest), reliable


def fastest(largest: int, trials: Sequence[Trial], rejected: Collection[int] = ()
            ) -> tuple[int, str]:
    """``objective="speed"``: the fitting size with the most samples per second, kept over
    the largest that fits only when it is more than 5% faster; returns (size, why).
    Sizes in ``rejected`` (whose lead fell back when timed in turn) compete no more.

    A size timed more than once counts its mean: a trial's two short steps move a lot
    on a busy machine, and the best of several timings rewards the noise. Only sizes
    that fit in every trial compete (:func:`reliable_fits`): when ``largest`` fails
    once timed again (a size that fit just under the cap can), the largest size that
    always fit takes its place.

    >>> t = [Trial(1024, True, False, 1, 1.0, 100.0), Trial(2048, True, False, 1, 1.0, 90.0)]
    >>> fastest(2048, t)
    (1024, '1024 runs 100.0 samples/s, 11% faster than the largest that fits (2048: 90.0)')
    """
    reference, reliable = _standing(largest, trials)
    if not reliable:
        return largest, "the largest that fits (no size fit in every trial)"
    dropped = "" if reference == largest else f"{largest} failed when tried again; "
    largest = reference
    timings: dict[int, list[float]] = {}
    for t in trials:
        if t.fits and t.samples_per_second and t.micro_batch_size in reliable:
            timings.setdefault(t.micro_batch_size, []).append(t.samples_per_second)
    speeds = {m: sum(v) / len(v) for m, v in timings.items()}
    if largest not in speeds:
        return largest, f"{dropped}the largest that fits (its speed was not measured)"
    best = max((m for m in speeds if m not in rejected or m == largest),
               key=lambda m: (speeds[m], m))
    if best != largest and speeds[best] > FASTER * speeds[largest]:
        gain = speeds[best] / speeds[largest] - 1
        return best, (f"{dropped}{best} runs {speeds[best]:.1f} samples/s, {gain:.0%} faster "
                      f"than the largest that fits ({largest}: {speeds[largest]:.1f})")
    return largest, (f"{dropped}the largest that fits is also the fastest within 5% "
                     f"({speeds[largest]:.1f} samples/s; {len(speeds)} sizes timed)")
