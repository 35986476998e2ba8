"""What does each piece of the per-micro-batch work cost inside the compiled step?

The step does more per micro-batch than the bare loop (``benchmarks.workloads``): it
copies the element to the host stash (so an out-of-memory error can resume it), keeps
the sums in variables (so a failed micro-batch loses nothing before it), records the
rows done, and updates the compiled metrics. (It pulls as the bare loop does, with a
counted ``get_next``: both inputs here know their length. An input whose end only its
iterator tells pulls with ``get_next_as_optional`` and a ``tf.cond`` instead.) This
script times one large batch of ``TrainStep.run`` (no callbacks, no Python loop around
it) against the bare loop's step, and again with one piece at a time switched off by
patching the library while the step is traced:

- ``nostash``: the stash keeps its counters but not the element's copy;
- ``nometric``: no per-micro-batch metric update;
- ``norecord``: no record of the rows done;
- ``all-off``: the three together.

Switched-off variants are not correct training (no recovery, no metrics): they only
measure. Each variant is traced once, then timed as the best of ``--calls`` large
batches, round-robin over ``--repeats`` passes (ratios best over best).

Units: samples/s of one large batch (B / seconds of one ``run`` call), and microseconds
per micro-batch (a call's seconds over k). Also the milliseconds it takes to make one
epoch's iterator, the bare loop's ``.batch(m)`` against autosplit's pipelines (each
epoch pays it once). ``--tiny`` runs a linear model on 8 features at m = 16, where there
is next to nothing to compute: its microseconds per micro-batch are the loop's own fixed
cost (written as ``step_costs_tiny.*``).

Reproduce (on an otherwise idle machine)::

    python -m benchmarks.step_costs            # MLP 784-1024-1024-10, B=4096, m=256, ~3 min
    python -m benchmarks.step_costs --tiny     # the fixed cost per micro-batch, ~1 min
    python -m benchmarks.step_costs --quick    # a small MLP, a few calls
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from benchmarks import harness, workloads

QUESTION = ("What does each piece of the per-micro-batch work (stash copy, metric update, "
            "record of rows done) cost in the compiled step, against the bare loop's step?")
UNITS = "samples/s of one large batch (B / seconds of one call of the compiled step)"
VARIANTS = ("bare", "arrays", "arrays:nostash", "arrays:nometric", "arrays:norecord",
            "arrays:all-off", "examples", "examples:all-off")


@dataclass(frozen=True)
class Settings:
    features: int = 784
    hidden: tuple[int, ...] = (1024, 1024)
    rows: int = 16384
    batch_size: int = 4096
    micro_batch_size: int = 256
    calls: int = 12  # timed calls per pass (the first two of each pass are dropped)
    repeats: int = 3
    seed: int = 0


FULL = Settings()
QUICK = replace(FULL, features=64, rows=2048, batch_size=1024, micro_batch_size=64, calls=4,
                repeats=1)
# A linear model on 8 features at m = 16: next to nothing to compute, so a call's time
# over k is the fixed cost of one micro-batch, the loop's own.
TINY = replace(FULL, features=8, hidden=(), micro_batch_size=16)


@contextlib.contextmanager
def switched_off(pieces: Sequence[str]) -> Iterator[None]:
    """Patch the library so that a step traced inside leaves ``pieces`` out."""
    from autosplit.step import sums
    from autosplit.step import update as update_module

    saved = (sums.Stash.put, update_module.update_metrics, sums.Stash.record)
    off = set(pieces)
    if "all-off" in off:
        off |= {"nostash", "nometric", "norecord"}
    if "nostash" in off:
        sums.Stash.put = lambda self, element: [  # type: ignore[method-assign]
            self.pulled.assign_add(1), self.done_rows.assign(0), self.pending.assign(True)]
    if "nometric" in off:
        update_module.update_metrics = lambda *args, **kwargs: None  # type: ignore[assignment]
    if "norecord" in off:
        sums.Stash.record = lambda self, end_row, rows: tf.constant(True)  # type: ignore[method-assign]
    try:
        yield
    finally:
        sums.Stash.put, update_module.update_metrics, sums.Stash.record = saved  # type: ignore[method-assign]


def _bare_batches(x: np.ndarray, y: np.ndarray, s: Settings) -> tf.data.Dataset:
    """The bare loop's input: ``.batch(m)`` of the rows."""
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(s.micro_batch_size,
                                                            drop_remainder=True)


def _bare(model: keras.Model, x: np.ndarray, y: np.ndarray, s: Settings) -> Callable[[], None]:
    """One call of the bare loop's step (``workloads.bare_step``), on a repeated input."""
    step = workloads.bare_step(model, batch_size=s.batch_size,
                               micro_batches=s.batch_size // s.micro_batch_size)
    iterator = iter(_bare_batches(x, y, s).repeat().prefetch(2))
    return lambda: float(step(iterator))


def _pipeline(x: np.ndarray, y: np.ndarray, s: Settings, kind: str):
    """The micro-batches of one input kind, built as ``fit`` builds them."""
    from autosplit.data.inputs import get_input
    from autosplit.data.pipeline import MicroBatches

    data = get_input(x, y, shuffle=False) if kind == "arrays" else get_input(
        tf.data.Dataset.from_tensor_slices((x, y)), shuffle=False)
    return MicroBatches(data, s.batch_size, s.micro_batch_size)


def iterator_ms(x: np.ndarray, y: np.ndarray, s: Settings, times: int = 10) -> dict[str, float]:
    """Milliseconds to make one epoch's iterator (median; what every epoch pays once):
    the bare loop's ``.batch(m)`` against autosplit's pipelines."""
    datasets = {"bare": _bare_batches(x, y, s).prefetch(2)}
    for kind in ("arrays", "examples"):
        datasets[kind] = _pipeline(x, y, s, kind).dataset()
    out = {}
    for name, dataset in datasets.items():
        seconds = []
        for _ in range(times):
            start = time.perf_counter()
            iterator = iter(dataset)
            seconds.append(time.perf_counter() - start)
            del iterator
        out[name] = 1000 * float(np.median(seconds))
    return out


def _ours(model: keras.Model, x: np.ndarray, y: np.ndarray, s: Settings, kind: str
          ) -> Callable[[], None]:
    """One call of ``TrainStep.run`` (one large batch), its input built as ``fit`` does."""
    from autosplit.step.train_step import step_for

    pipeline = _pipeline(x, y, s, kind)
    step = step_for(model, pipeline)
    iterator = iter(pipeline.dataset(repeat=True))
    k = s.batch_size // s.micro_batch_size
    return lambda: float(step.run(iterator, k)["loss"])


def measure(s: Settings, x: np.ndarray, y: np.ndarray, say: harness.Log) -> dict[str, Any]:
    spec = workloads.mlp_spec(s.features, s.hidden)
    weights = workloads.build_model(spec, seed=s.seed).get_weights()
    calls: dict[str, Callable[[], None]] = {}
    for variant in VARIANTS:
        kind, _, off = variant.partition(":")
        model = workloads.build_model(spec, seed=s.seed, weights=weights)
        with switched_off([off] if off else []):
            calls[variant] = _bare(model, x, y, s) if kind == "bare" else _ours(
                model, x, y, s, kind)
            calls[variant]()  # traced while patched
    best = {v: float("inf") for v in VARIANTS}
    for repeat in range(s.repeats):
        for variant in VARIANTS:
            times = []
            for _ in range(s.calls):
                start = time.perf_counter()
                calls[variant]()
                times.append(time.perf_counter() - start)
            best[variant] = min(best[variant], min(times[2:] or times))
            say(f"  repeat {repeat + 1}/{s.repeats}  {variant:<18} "
                f"{s.batch_size / best[variant]:>10,.0f} samples/s")
    bare = s.batch_size / best["bare"]
    k = s.batch_size // s.micro_batch_size
    return {v: {"samples_per_s": s.batch_size / t, "ratio_to_bare": s.batch_size / t / bare,
                "us_per_micro_batch": 1e6 * t / k} for v, t in best.items()}


def markdown(report: dict[str, Any]) -> str:
    s = report["settings"]
    lines = harness.report_head("Per-micro-batch costs inside the compiled step", report)
    lines += ["", f"{model_label(s)}, Adam, B={s['batch_size']}, "
              f"m={s['micro_batch_size']}; best of {s['calls']} calls x {s['repeats']} "
              "passes.", ""]
    lines += harness.md_table(HEADER, rows(report))
    lines += ["", "Making one epoch's iterator (median of 10, ms): "
              + ", ".join(f"{k} {v:.1f}" for k, v in report["iterator_ms"].items()) + "."]
    return "\n".join(lines) + harness.report_tail(report)


HEADER = ["variant", "samples/s", "ratio to bare", "us per micro-batch"]


def model_label(s: dict[str, Any]) -> str:
    return "-".join(["MLP " + str(s["features"]), *map(str, s["hidden"]), "10"])


def rows(report: dict[str, Any]) -> list[list[str]]:
    return [[v, f"{r['samples_per_s']:,.0f}", f"{r['ratio_to_bare']:.3f}",
             f"{r['us_per_micro_batch']:,.0f}"] for v, r in report["variants"].items()]


def main(argv: Sequence[str] | None = None) -> int:
    p = harness.parser("Per-micro-batch costs of the compiled step against the bare loop.",
                       quick="a small MLP, a few calls", repeats=FULL.repeats)
    p.add_argument("--tiny", action="store_true",
                   help="a linear model on 8 features at m=16: the fixed cost of one "
                        "micro-batch (writes step_costs_tiny.*)")
    p.add_argument("--features", type=int,
                   help=f"the MLP's input width (default {FULL.features})")
    args = p.parse_args(argv)
    harness.at_least("repeats", args.repeats)
    harness.at_least("features", args.features)
    s = QUICK if args.quick else (TINY if args.tiny else FULL)
    s = replace(s, features=args.features or s.features, repeats=args.repeats or s.repeats)
    info = harness.machine_info()
    harness.log(f"# {harness.machine_line(info)}")
    x, y = workloads.synthetic(s.rows, (s.features,), seed=s.seed)
    variants = measure(s, x, y, harness.log)
    report: dict[str, Any] = {"question": QUESTION, "command": harness.command("step_costs", argv),
                              "units": UNITS, "machine": info, "settings": asdict(s),
                              "variants": variants, "iterator_ms": iterator_ms(x, y, s),
                              "checks": []}
    harness.log(harness.text_table(HEADER, rows(report)))
    harness.log("iterator, ms: " + ", ".join(f"{k} {v:.1f}"
                                             for k, v in report["iterator_ms"].items()))
    harness.conclude(harness.out_dir(args), "step_costs_tiny" if args.tiny else "step_costs",
                     report, markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
