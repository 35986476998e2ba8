"""How close to the true largest micro-batch does each search get, and at what cost?

Every method searches the same model, the same data and the same large batch B under
the same real memory cap: a child process whose TensorFlow CPU allocator is a BFC
allocator hard-capped by ``autosplit.memory.capped_cpu_env`` (a real
``tf.errors.ResourceExhaustedError`` at the cap, about 10 s per OOM while the allocator
retries). Each method runs in its own fresh child, one after the other:

1. ``exhaustive``: the ground truth, the largest micro-batch m at which
   ``TrainStep(model, split_batch(B, m))`` runs 3 steps without an OOM, to one
   example. m = B is tried first and on its own: it is a different program (k = 1: no
   accumulator, no padded copy of the inputs) whose peak can be LOWER than at m = B - 1,
   so fitting is not monotone there. Then bisection over [1, B - 1] gives the largest
   split size (reported too); the true maximum is B if B fits, else that. Two
   confirmation trials (the largest split size again, then one more) check at the end
   that the answer still holds; they are reported apart from the search's trials.
2. ``autosplit``: ``autosplit.probe(model, (x, y), B, cache=False, headroom=0.0)``, so
   it targets the same cap as the others; and ``autosplit (10% headroom)``, the default.
3. ``lightning``: PyTorch Lightning's ``scale_batch_size(mode="binsearch")``: start at
   ``init_val=2``, double until an OOM, then bisect between the last success and the
   failure; ``max_trials=25`` successful trials, as Lightning counts them.
4. ``accelerate``: accelerate's ``find_executable_batch_size``: start at B and, on each
   OOM, ``batch_size = int(batch_size * 0.9)``. That is the current back-off (PR #3684,
   "Stop halving my batch"); versions before it halved (``batch_size //= 2``).

A trial of methods 1, 3 and 4 is a fresh ``TrainStep`` at that m run for 3 steps on
the same large batch, then ``gc.collect()`` (a ``TrainStep`` and its ``tf.function``
form a reference cycle that otherwise keeps the dead trial's buffers alive). A trial
fits when it raised no ``ResourceExhaustedError``. autosplit's trials are its own:
it counts a size as fitting only when the measured peak, plus two copies of the
large batch's inputs that its input pipeline holds in flight during training, stays
under the budget, so its answer is below the bare ``TrainStep`` maximum by design.

Units: micro-batch sizes in examples; fraction = size found / true maximum; trials =
trial steps run (each is 3 training steps at one size); seconds = wall clock of the
search inside its child (TensorFlow start-up and model building excluded); peak = the
capped allocator's peak (``get_memory_info``) in the last trial at the size found
(autosplit's without the in-flight inputs it adds), in MiB.

Reproduce (on an otherwise idle machine)::

    PYTHONPATH=. .venv/bin/python benchmarks/probe_search.py           # B=4096, 72 MiB cap
    PYTHONPATH=. .venv/bin/python benchmarks/probe_search.py --quick   # B=1024, 48 MiB

The full run writes ``benchmarks/results/probe_search.json`` and ``probe_search.md``;
``--quick`` writes files only where ``--json`` / ``--markdown`` say.
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse
import datetime
import gc
import json
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MIB = 2**20
UNITS = ("micro-batch sizes in examples; fraction of the true maximum; trials = trial "
         "steps (3 training steps each); seconds = wall clock of the search")


@dataclass(frozen=True)
class Settings:
    """One benchmark configuration; every method sees exactly this."""

    batch_size: int  # B, the large batch; the search space is m in [1, B]
    limit_mib: int  # the hard cap of TensorFlow's CPU allocator in each child
    features: int = 128
    hidden: tuple[int, ...] = (1024, 1024)
    classes: int = 10
    learning_rate: float = 1e-3  # Adam
    steps_per_trial: int = 3  # training steps per trial (methods 1, 3, 4)
    lightning_init_val: int = 2  # Lightning's default
    lightning_max_trials: int = 25  # Lightning's default; counts successful trials
    accelerate_factor: float = 0.9  # accelerate's back-off since PR #3684 (was 0.5)
    seed: int = 0
    child_timeout_s: int = 3600


FULL = Settings(batch_size=4096, limit_mib=72)
# A smoke test, not the comparison. At B=1024 what the process holds whatever m is
# dominates (about 29 MiB at the smallest trials on TF 2.21, 33-39 MiB as autosplit
# measures it) and the unsplit step (m = B) peaks near 37 MiB, below any cap that
# leaves autosplit's 10%-headroom row room to run (40 MiB raised NothingFitsError),
# so here every method may find B.
QUICK = replace(FULL, batch_size=1024, limit_mib=48)


@dataclass(frozen=True)
class TrialRecord:
    """One trial at one micro-batch size, as a child saw it."""

    micro_batch_size: int
    fits: bool  # the method's own verdict
    oom: bool  # raised ResourceExhaustedError
    peak_bytes: int | None  # allocator peak during the trial (None after an OOM)
    seconds: float


@dataclass(frozen=True)
class Method:
    key: str  # JSON key and the --child argument
    label: str  # table label


METHODS = (
    Method("exhaustive", "exhaustive (bisection to 1) [ground truth]"),
    Method("autosplit", "autosplit.probe (headroom 0)"),
    Method("autosplit_headroom", "autosplit.probe (10% headroom)"),
    Method("lightning", "lightning-style power scaling + binsearch"),
    Method("accelerate", "accelerate-style x0.9 back-off from B"),
)
TRUTH = "exhaustive"


# ---------------------------------------------------------------- the searches
# Pure functions of B and a `fits(m) -> bool` trial; the trial records itself.


def bisection(batch_size: int, fits: Callable[[int], bool]) -> int:
    """The largest m in [1, B] that fits, to one example (0 when none does).

    Exact only where fitting is monotone in m.
    """
    lo, hi = 0, batch_size + 1  # lo fits (0: none known yet), hi does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def lightning_binsearch(batch_size: int, fits: Callable[[int], bool], *, init_val: int = 2,
                        max_trials: int = 25) -> int:
    """Lightning's ``_run_binary_scaling``, with the "dataset" being the large batch.

    As in Lightning: ``low`` starts at 1 without a trial, ``max_trials`` counts successful
    trials only, and a size at or above the dataset's length stops the doubling (here
    the doubling is clamped to B, then stops once B fits).
    """
    new, low, high, count = min(init_val, batch_size), 1, None, 0
    while True:
        if fits(new):
            count += 1
            if count > max_trials:
                break
            low = new
            if high:
                if high - low <= 1:
                    break
                new = (high + low) // 2
            else:
                if new >= batch_size:
                    break
                new = min(2 * new, batch_size)
        else:
            high = new
            new = (high + low) // 2
            if high - low <= 1:
                break
    return new


def accelerate_backoff(batch_size: int, fits: Callable[[int], bool], *,
                       factor: float = 0.9) -> int:
    """accelerate's ``find_executable_batch_size``: start at B, ``int(m * 0.9)`` per OOM."""
    m = batch_size
    while m > 0:
        if fits(m):
            return m
        m = int(m * factor)
    return 0


# ---------------------------------------------------------------- the child


def make_data(s: Settings):
    """The data of ``tests/capped_child.py``: one large batch of Gaussian rows."""
    import numpy as np

    rng = np.random.default_rng(s.seed)
    return (rng.normal(size=(s.batch_size, s.features)).astype("float32"),
            rng.integers(0, s.classes, size=(s.batch_size,)).astype("int32"))


def make_model(s: Settings):
    """The MLP of ``tests/capped_child.py`` (128-1024-1024-10, Adam), seeded."""
    import keras

    keras.utils.set_random_seed(s.seed)
    model = keras.Sequential([keras.Input((s.features,))]
                             + [keras.layers.Dense(w, activation="relu") for w in s.hidden]
                             + [keras.layers.Dense(s.classes)])
    model.compile(optimizer=keras.optimizers.Adam(s.learning_rate),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def run_child(method: str, s: Settings) -> dict[str, Any]:
    """Run one method in this (capped) process and return what it found."""
    import keras
    import tensorflow as tf

    import autosplit
    from autosplit import _keras
    from autosplit.memory import is_tf_bfc_capped
    from autosplit.step import TrainStep, split_batch

    cap = is_tf_bfc_capped()
    in_flight = None
    if cap is None:
        raise SystemExit("Expected a child started with autosplit.memory.capped_cpu_env. "
                         "Received: TF_CPU_ALLOCATOR_USE_BFC unset. Run without --child.")
    x, y = make_data(s)
    model = make_model(s)
    B = s.batch_size
    out: dict[str, Any] = {"method": method, "cap_bytes": cap,
                           "tensorflow": tf.__version__, "keras": keras.__version__}

    # Every child starts its search from the same state: model, loss, metrics and
    # Adam's slots built (probe() would do this itself; doing it here is a no-op for it).
    _keras.build_model(model, (x[:8], y[:8], None))
    gc.collect()
    out["baseline_bytes"] = int(tf.config.experimental.get_memory_info("CPU:0")["current"])

    if method in ("autosplit", "autosplit_headroom"):
        headroom = 0.0 if method == "autosplit" else 0.1
        # probe() adds one copy of the large batch's inputs (the prefetched batch) to
        # every measured peak.
        in_flight = x.nbytes + y.nbytes
        t0 = time.perf_counter()
        try:
            result = autosplit.probe(model, (x, y), B, cache=False, headroom=headroom)
        except autosplit.NothingFitsError as exc:
            # The error carries no trials; the search still ran and took its time.
            out.update(found=0, seconds=time.perf_counter() - t0, trials=[],
                       error=str(exc))
            return out
        seconds = time.perf_counter() - t0
        trials = [TrialRecord(t.micro_batch_size, t.fits, t.oom, t.peak_bytes, t.seconds)
                  for t in result.trials]
        out.update(found=result.micro_batch_size, seconds=seconds,
                   trials=[asdict(t) for t in trials],
                   probe={"headroom": headroom, "budget_bytes": result.budget_bytes,
                          "fixed_bytes": result.fixed_bytes,
                          "per_example_bytes": result.per_example_bytes,
                          "measured_peak_bytes": result.measured_peak_bytes,
                          "predicted_peak_bytes": result.predicted_peak_bytes,
                          "peak_source": result.peak_source,
                          "in_flight_bytes": in_flight,
                          "limit_source": result.device.get("limit_source"),
                          "probe_seconds": result.seconds})
        return out

    # Hold what a training process holds while it trains: the data set, the current
    # large batch and the next one (the pipeline's prefetch). The ground truth is then
    # the largest micro-batch that fit_large_batch can train with, which is what
    # probe() is after, not that of a bare step in an otherwise empty process.
    from autosplit.data import LargeBatches

    holder = LargeBatches((x, y), B, shuffle=False)
    xb, yb, _, n_valid = holder.first()
    in_flight_copy = holder.first()  # noqa: F841 -- the prefetched batch, kept alive
    trials: list[TrialRecord] = []

    def fits(m: int) -> bool:
        tf.config.experimental.reset_memory_stats("CPU:0")
        t0 = time.perf_counter()
        step, oom = None, False
        try:
            step = TrainStep(model, split_batch(B, m))
            for _ in range(s.steps_per_trial):
                logs = step(xb, yb, None, n_valid)
            float(logs["loss"])
        except tf.errors.ResourceExhaustedError:
            oom = True
            if step is not None:
                step.restore()
        finally:
            peak = None if oom else int(tf.config.experimental.get_memory_info("CPU:0")["peak"])
            del step
            gc.collect()
        trials.append(TrialRecord(m, not oom, oom, peak, time.perf_counter() - t0))
        return not oom

    t0 = time.perf_counter()
    if method == "exhaustive":
        unsplit = fits(B)
        largest_split = bisection(B - 1, fits)
        found = B if unsplit else largest_split
        out.update(unsplit_fits=unsplit, largest_split=largest_split)
    elif method == "lightning":
        found = lightning_binsearch(B, fits, init_val=s.lightning_init_val,
                                    max_trials=s.lightning_max_trials)
    elif method == "accelerate":
        found = accelerate_backoff(B, fits, factor=s.accelerate_factor)
    else:
        raise SystemExit(f"Expected --child to be one of {[m.key for m in METHODS]}. "
                         f"Received: {method!r}.")
    seconds = time.perf_counter() - t0
    out.update(found=found, seconds=seconds, trials=[asdict(t) for t in trials])
    if method == "exhaustive":
        # The search assumed that fitting is monotone in m. Ask again at the end, in
        # fresh steps, after every trial's lasting allocations are in place.
        n_search = len(trials)
        checks = [m for m in (largest_split, largest_split + 1) if 1 <= m < B]
        out["confirm"] = {str(m): fits(m) for m in checks}
        out["confirm_trials"] = [asdict(t) for t in trials[n_search:]]
        out["trials"] = out["trials"][:n_search]
    return out


# ---------------------------------------------------------------- the parent


def spawn(method: str, s: Settings) -> dict[str, Any]:
    """Run one method in a fresh child under the cap; return its JSON and wall time."""
    from autosplit.memory import capped_cpu_env

    env = capped_cpu_env(s.limit_mib * MIB)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    t0 = time.perf_counter()
    completed = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--child", method,
         "--settings", json.dumps(asdict(s))],
        env=env, capture_output=True, text=True, timeout=s.child_timeout_s, check=False)
    wall = time.perf_counter() - t0
    if completed.returncode != 0:
        raise RuntimeError(f"The {method!r} child failed (exit {completed.returncode}):\n"
                           f"{completed.stderr[-3000:]}")
    lines = [line for line in completed.stdout.splitlines() if line.strip()]
    result = json.loads(lines[-1])
    result["child_wall_seconds"] = wall
    return result


def summarise(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    truth = results[TRUTH]["found"]
    out = {}
    for method in METHODS:
        r = results[method.key]
        trials = r["trials"]
        out[method.key] = {
            "label": method.label,
            "found": r["found"],
            "fraction_of_true_max": r["found"] / truth if truth else None,
            "trials": len(trials),
            "ooms": sum(t["oom"] for t in trials),
            "peak_bytes_at_found": peak_at(trials, r["found"],
                                           (r.get("probe") or {}).get("in_flight_bytes", 0)),
            "seconds": r["seconds"],
            "child_wall_seconds": r["child_wall_seconds"],
            "sequence": sequence(trials),
        }
    return out


def peak_at(trials: Sequence[dict[str, Any]], m: int, in_flight: int = 0) -> int | None:
    """The allocator peak of the last trial that fitted at ``m``, less the in-flight
    inputs autosplit adds to its own readings, so every row reads the same thing."""
    peaks = [t["peak_bytes"] for t in trials if t["micro_batch_size"] == m and t["fits"]]
    return peaks[-1] - in_flight if peaks else None


def sequence(trials: Sequence[dict[str, Any]]) -> str:
    """'2 ok, 4 ok, 8 OOM' -> compact: '2 4 8x' (x: OOM, ~: ran but over budget)."""
    marks = []
    for t in trials:
        mark = "x" if t["oom"] else ("" if t["fits"] else "~")
        marks.append(f"{t['micro_batch_size']}{mark}")
    return " ".join(marks)


_HEADER = ("method", "size found", "of true max", "trials", "OOMs", "search s",
           "peak MiB at size")


def _rows(summary: dict[str, dict[str, Any]]) -> list[tuple[str, ...]]:
    return [
        (r["label"], f"{r['found']}",
         "-" if r["fraction_of_true_max"] is None else f"{r['fraction_of_true_max']:.3f}",
         f"{r['trials']}", f"{r['ooms']}", f"{r['seconds']:.1f}",
         "-" if r["peak_bytes_at_found"] is None else f"{r['peak_bytes_at_found'] / MIB:.1f}")
        for r in summary.values()
    ]


def text_table(summary: dict[str, dict[str, Any]]) -> str:
    rows = [_HEADER, *_rows(summary)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_HEADER))]
    lines = []
    for n, row in enumerate(rows):
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:],
                                                                           strict=True)]
        lines.append("  ".join(cells))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def notes(report: dict[str, Any]) -> list[str]:
    """Things a reader should know that the table does not say."""
    truth = report["methods"][TRUTH]["found"]
    raw_truth = report["raw"][TRUTH]
    split = raw_truth["largest_split"]
    out = []
    if raw_truth["unsplit_fits"]:
        out.append(f"m = B = {truth} (no split) fits, while the largest split size is {split}: "
                   "the unsplit step holds no accumulator and no padded inputs.")
    confirm = raw_truth.get("confirm", {})
    if confirm.get(str(split)) is False:
        out.append(f"The largest split size {split} did NOT fit again when re-tried at the end "
                   "of the exhaustive child: lasting allocations from earlier trials (or "
                   "fragmentation) shrank the room; treat it as an upper estimate.")
    if confirm.get(str(split + 1)) is True:
        out.append(f"{split + 1} fitted when re-tried at the end of the exhaustive child: "
                   "fitting was not monotone in m during the bisection.")
    baselines = {k: r.get("baseline_bytes") for k, r in report["raw"].items()}
    if None not in baselines.values():
        lo, hi = min(baselines.values()), max(baselines.values())
        out.append(f"Allocator bytes in use when each search started: {lo / MIB:.2f} to "
                   f"{hi / MIB:.2f} MiB across the children.")
    for key, r in report["methods"].items():
        if key != TRUTH and truth and r["found"] > truth:
            out.append(f"{r['label']} found {r['found']} > the bisection's {truth}: fitting "
                       "is not monotone in m, or differs between processes (allocator "
                       "state, fragmentation).")
    for key, r in report["raw"].items():
        if key == TRUTH:
            continue
        ooms_at = sorted({t["micro_batch_size"] for t in r["trials"] if t["oom"]})
        below = [m for m in ooms_at if m <= truth]
        if below:
            out.append(f"{report['methods'][key]['label']}: OOM at {below}, at or below the "
                       f"true maximum {truth} (allocator state differs between trials).")
    return out


def markdown(report: dict[str, Any]) -> str:
    s, info = report["settings"], report["machine"]
    lines = [
        "# Micro-batch search: size found, trials and seconds per method",
        "",
        report["question"],
        "",
        f"Reproduce: `{report['command']}`",
        "",
        f"Machine: {info['cpu_count']} CPUs, TensorFlow {info['tensorflow']}, Keras "
        f"{info['keras']}, Python {info['python']}; {info['date']}; load average at start "
        f"{info['load_average_at_start']}.",
        "",
        f"Model: MLP {s['features']}-{'-'.join(map(str, s['hidden']))}-{s['classes']} (relu), "
        f"Adam lr {s['learning_rate']}. B={s['batch_size']}; each method in its own child "
        f"process whose TensorFlow CPU allocator is hard-capped at {s['limit_mib']} MiB "
        "(`capped_cpu_env`; a real `ResourceExhaustedError` at the cap). A trial of the "
        f"baselines = a fresh `TrainStep` at m, {s['steps_per_trial']} steps, then "
        "`gc.collect()`.",
        "",
        f"Units: {report['units']}.",
        "",
        "| " + " | ".join(_HEADER) + " |",
        "|" + "|".join(["---"] + ["---:"] * (len(_HEADER) - 1)) + "|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in _rows(report["methods"])]
    lines += ["", "Sizes tried, in order (`x`: OOM; `~`: ran, but over autosplit's budget):",
              ""]
    lines += [f"- {r['label']}: {r['sequence']}" for r in report["methods"].values()]
    raw_truth = report["raw"][TRUTH]
    lines += ["", f"Exhaustive: m = B = {s['batch_size']} (no split) "
              f"{'fits' if raw_truth['unsplit_fits'] else 'runs out of memory'}; the largest "
              f"split size (bisection over [1, B - 1]) is {raw_truth['largest_split']}."]
    confirm = raw_truth.get("confirm")
    if confirm:
        lines += ["", "Re-tried at the end of the exhaustive child: "
                  + ", ".join(f"{m} {'fits' if ok else 'OOM'}" for m, ok in confirm.items())
                  + "."]
    extra = report["notes"]
    if extra:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in extra]
    return "\n".join(lines) + "\n"


def machine_info() -> dict[str, Any]:
    import keras
    import tensorflow as tf

    try:
        load = [round(v, 2) for v in os.getloadavg()]
    except OSError:
        load = None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "load_average_at_start": load,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Largest micro-batch found, trials, OOMs and seconds of autosplit.probe "
                    "vs exhaustive bisection, Lightning-style and accelerate-style searches, "
                    "under one real TensorFlow memory cap.")
    parser.add_argument("--quick", action="store_true",
                        help=f"B={QUICK.batch_size} and a {QUICK.limit_mib} MiB cap (a few "
                             "minutes); writes no files unless asked")
    parser.add_argument("--limit-mib", type=int,
                        help=f"the cap in MiB (default {FULL.limit_mib}; quick "
                             f"{QUICK.limit_mib})")
    parser.add_argument("--batch-size", type=int,
                        help=f"B (default {FULL.batch_size}; quick {QUICK.batch_size})")
    parser.add_argument("--json", type=Path, help="write results here (default "
                        "benchmarks/results/probe_search.json; none with --quick)")
    parser.add_argument("--markdown", type=Path, help="write the Markdown report here "
                        "(default: next to --json, with a .md suffix)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--settings", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        fields = json.loads(args.settings)
        s = Settings(**{**fields, "hidden": tuple(fields["hidden"])})
        print(json.dumps(run_child(args.child, s)))
        return 0

    s = QUICK if args.quick else FULL
    if args.limit_mib is not None:
        s = replace(s, limit_mib=args.limit_mib)
    if args.batch_size is not None:
        s = replace(s, batch_size=args.batch_size)
    for name in ("limit_mib", "batch_size"):
        if getattr(s, name) < 1:
            raise SystemExit(f"Expected `--{name.replace('_', '-')}` >= 1. "
                             f"Received: {getattr(s, name)}.")

    info = machine_info()
    command = " ".join(["python", "benchmarks/probe_search.py",
                        *(sys.argv[1:] if argv is None else argv)])
    print(f"# {info['date']}  cpus={info['cpu_count']}  load={info['load_average_at_start']}"
          f"  TF {info['tensorflow']}  Keras {info['keras']}")
    print(f"# MLP {s.features}-{'-'.join(map(str, s.hidden))}-{s.classes} (Adam), "
          f"B={s.batch_size}, cap {s.limit_mib} MiB per child")

    raw: dict[str, dict[str, Any]] = {}
    for method in METHODS:
        r = spawn(method.key, s)
        raw[method.key] = r
        print(f"  {method.key:<20} found {r['found']:>5}  trials {len(r['trials']):>3}  "
              f"OOMs {sum(t['oom'] for t in r['trials']):>3}  {r['seconds']:7.1f} s  "
              f"(child {r['child_wall_seconds']:.1f} s)  [{sequence(r['trials'])}]",
              flush=True)
    summary = summarise(raw)
    report = {
        "question": "How close to the true largest micro-batch does each search get, in "
                    "how many trial steps and seconds, under the same real memory cap?",
        "command": command,
        "units": UNITS,
        "truth": TRUTH,
        "machine": info,
        "settings": asdict(s),
        "methods": summary,
        "raw": raw,
    }
    report["notes"] = notes(report)
    print()
    print(f"Units: {UNITS}")
    print(text_table(summary))
    print(f"exhaustive: m=B={s.batch_size} (unsplit) "
          f"{'fits' if raw[TRUTH]['unsplit_fits'] else 'OOM'}; largest split size "
          f"{raw[TRUTH]['largest_split']}")
    confirm = raw[TRUTH].get("confirm")
    if confirm:
        print("exhaustive, re-tried at the end: "
              + ", ".join(f"{m} {'fits' if ok else 'OOM'}" for m, ok in confirm.items()))
    for line in report["notes"]:
        print(f"note: {line}")

    json_path, md_path = args.json, args.markdown
    if json_path is None and not args.quick:
        json_path = RESULTS / "probe_search.json"
    if md_path is None and json_path is not None:
        md_path = json_path.with_suffix(".md")
    for path, text in ((json_path, json.dumps(report, indent=2) + "\n"),
                       (md_path, markdown(report))):
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
