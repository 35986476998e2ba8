"""Mixed precision: what does deciding an overflow as the full batch does cost?

Under ``mixed_float16`` each large batch's summed gradients of float16 layers are
checked against float16's range once, before the apply (``autosplit/step/overflow.py``):
a largest absolute value per such gradient and one ``tf.cond``. This script trains the
MLP 784-1024-1024-10 of ``benchmarks/step_costs.py`` under ``mixed_float16`` (B = 4096,
m = 256: 16 micro-batches a large batch) with the check (``check``) and with it switched
off by patching the library (``off``: not correct where the full batch would overflow,
only measured), side by side, round-robin, on data where nothing overflows; and checks
that the two give the same weights there.

Units: seconds per large batch in the timed epochs (after a warm-up epoch), and their
ratio, check over off (paired per repeat).

Reproduce::

    python -m benchmarks.overflow_check            # ~2 min on 2 cores
    python -m benchmarks.overflow_check --quick    # a smoke run
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from benchmarks import harness

QUESTION = ("Under mixed_float16, what does deciding a large batch's overflow as the full "
            "batch does cost per large batch, where nothing overflows?")
UNITS = "seconds per large batch in the timed epochs; ratio check / off, paired per repeat"
METHODS = ("check", "off")


@dataclass(frozen=True)
class Settings:
    rows: int = 16384
    batch_size: int = 4096
    micro_batch_size: int = 256
    hidden: tuple[int, ...] = (1024, 1024)
    epochs: int = 4  # the first a warm-up
    repeats: int = 9


FULL = Settings()
QUICK = Settings(rows=1024, batch_size=256, micro_batch_size=64, hidden=(64,), repeats=1)


@contextlib.contextmanager
def _switched_off(method: str) -> Iterator[None]:
    """The library as it runs (``check``), or with the overflow check patched out."""
    import autosplit.step.contribution as contribution

    original = contribution.overflowed
    if method == "off":
        contribution.overflowed = lambda *args, **kwargs: None
    try:
        yield
    finally:
        contribution.overflowed = original


def run(method: str, settings: Settings) -> dict[str, Any]:
    """One training from the same weights: its timed seconds and final weights."""
    import keras
    import numpy as np

    import autosplit

    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        keras.utils.set_random_seed(0)
        layers = [keras.Input((784,))] + [keras.layers.Dense(width, activation="relu")
                                          for width in settings.hidden]
        model = keras.Sequential([*layers, keras.layers.Dense(10, dtype="float32")])
        model.compile(keras.optimizers.SGD(0.01),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        r = np.random.default_rng(0)
        x = r.normal(size=(settings.rows, 784)).astype("float32")
        y = r.integers(0, 10, settings.rows).astype("int32")
        seconds: list[float] = []
        timer = keras.callbacks.LambdaCallback(
            on_epoch_begin=lambda epoch, logs: seconds.append(-time.perf_counter()),
            on_epoch_end=lambda epoch, logs: seconds.__setitem__(
                -1, seconds[-1] + time.perf_counter()))
        with _switched_off(method):
            autosplit.fit_large_batch(model, x, y, batch_size=settings.batch_size,
                                      micro_batch_size=settings.micro_batch_size,
                                      epochs=settings.epochs, shuffle=False, verbose=0,
                                      callbacks=[timer])
        steps = settings.rows // settings.batch_size
        timed = sum(seconds[1:])
        return {"seconds": timed, "samples": steps * (settings.epochs - 1),
                "skipped": steps * settings.epochs - int(model.optimizer.iterations),
                "weights": model.get_weights()}
    finally:
        keras.mixed_precision.set_global_policy("float32")


def measure(settings: Settings) -> dict[str, Any]:
    import numpy as np

    runs = harness.round_robin({m: (lambda m=m: run(m, settings)) for m in METHODS},
                               settings.repeats)
    per_batch = {m: [r["seconds"] / r["samples"] for r in runs[m]] for m in METHODS}
    same = all(np.array_equal(a, b) for a, b in zip(runs["check"][0]["weights"],
                                                    runs["off"][0]["weights"], strict=True))
    return {"seconds_per_large_batch": {m: statistics.median(v) for m, v in per_batch.items()},
            "ratio": harness.paired_ratio(per_batch["check"], per_batch["off"]),
            "cost_ms": 1000 * statistics.median(
                a - b for a, b in zip(per_batch["check"], per_batch["off"], strict=True)),
            "same_weights": same, "skipped": runs["check"][0]["skipped"]}


def markdown(report: dict[str, Any]) -> str:
    r = report["results"]
    lines = harness.report_head("Mixed precision: the overflow check", report)
    lines += ["", *harness.md_table(
        ["method", "s per large batch"],
        [[m, f"{s:.4f}"] for m, s in r["seconds_per_large_batch"].items()])]
    lines += ["", f"Ratio check / off: {r['ratio']:.3f}; cost {r['cost_ms']:.2f} ms per large "
                  f"batch; the same weights: {r['same_weights']}."]
    return "\n".join(lines) + harness.report_tail(report)


def main(argv: Sequence[str] | None = None) -> int:
    p = harness.parser(QUESTION, quick="an MLP of 64, B=256, m=64", repeats=FULL.repeats)
    args = p.parse_args(argv)
    s, clock, info = harness.begin(args, FULL, QUICK)
    results = measure(s)
    checks = [
        {"id": "same-weights", "status": harness.status(results["same_weights"]),
         "summary": "where nothing overflows, the same weights with the check and without"},
        {"id": "no-overflow", "status": harness.status(results["skipped"] == 0),
         "summary": f"{results['skipped']} large batches skipped (target: none)"},
        {"id": "cost", "status": harness.status(results["ratio"] <= 1.02),
         "summary": f"the check costs {results['cost_ms']:.2f} ms per large batch, "
                    f"{results['ratio']:.3f}x (target <= 1.02x)"}]
    report: dict[str, Any] = {
        "question": QUESTION, "command": harness.command("overflow_check", argv),
        "units": UNITS, "machine": info, "settings": asdict(s), "results": results,
        "checks": checks}
    report["seconds"] = clock()
    harness.conclude(harness.out_dir(args), "overflow_check", report, markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
