"""Does the probe's answer depend on B, and does ``objective="speed"`` find a faster size?

Two questions of issue 17, asked of the command line as a user runs it (``autosplit
probe ... --json``: each call its own process, under a real cap through TensorFlow's
capped CPU allocator, its synthetic data a stream of micro-batches):

1. **The same answer at every B.** The CNN (32x32x3) under 256 MiB at B = 512 and at
   B = 4096, alternating, ``--repeats`` times each. A balanced split of 512 can only
   run 512, 256, 171, 128, ... rows; the answer at 4096 should land within one of those
   steps of the answer at 512, and its search should take at most 1.5x as long.
2. **The fastest size, not only the largest.** ``--objective speed`` at B = 4096 on
   the CNN and on the MLP 784-512-512-10 (the CLI's ``mlp``): the samples/s of every
   fitting size the trials timed (the largest, the sizes the search passed, and up to
   two between half the largest and it), and which one the probe kept. A smaller size
   is kept only when it is more than 5% faster than the largest on their timings in
   turn (A B B A); when none is, that is the honest answer, and the curve says how flat
   samples/s is in m on this machine.

Units: micro-batch sizes in rows (balanced); seconds = the probe's search inside its
child (``ProbeResult.seconds``) and the whole command's wall clock; samples/s over a
trial's two measured steps.

Reproduce (on an otherwise idle machine)::

    python -m benchmarks.probe_choices          # ~4 min
    python -m benchmarks.probe_choices --quick  # small MLP, B = 64 and 128, ~1 min
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from benchmarks import harness

QUESTION = ("Under one real memory cap, does autosplit probe give the same micro-batch at a small "
            "and a large B (512 and 4096; the quick run 64 and 128), how much longer does the "
            "larger B take, and does "
            "objective='speed' find a size faster than the largest that fits?")
UNITS = ("micro-batch sizes in rows; seconds of the search (inside the capped child) and of "
         "the whole command; samples/s over a trial's measured steps")


@dataclass(frozen=True)
class Model:
    name: str  # what --model takes
    input_shape: str  # what --input-shape takes
    label: str


CNN = Model("cnn", "32,32,3", "CNN 32x32x3, 3 conv layers (32, 64, 128)")
MLP784 = Model("mlp", "784", "MLP 784-512-512-10")
SMALL = Model("mlp", "32", "MLP 32-512-512-10")


@dataclass(frozen=True)
class Settings:
    same: Model  # part 1's model
    small_batch: int
    large_batch: int
    limit: str  # the cap of every call, as --memory-limit takes it
    repeats: int
    speed: tuple[Model, ...]  # part 2's models, at large_batch
    speed_limit: str
    timeout_s: int = 900


FULL = Settings(same=CNN, small_batch=512, large_batch=4096, limit="256MiB", repeats=2,
                speed=(CNN, MLP784), speed_limit="256MiB")
QUICK = Settings(same=SMALL, small_batch=64, large_batch=128, limit="128MiB", repeats=1,
                 speed=(SMALL,), speed_limit="128MiB")


def run_probe(model: Model, batch_size: int, limit: str, objective: str = "memory",
              *, timeout: int) -> dict[str, Any]:
    """``autosplit probe ... --json`` in its own process; its result and wall clock."""
    argv = [sys.executable, "-m", "autosplit", "probe", "--model", model.name,
            "--input-shape", model.input_shape, "--batch-size", str(batch_size),
            "--memory-limit", limit, "--objective", objective, "--no-cache", "--json"]
    began = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                          cwd=harness.ROOT)
    wall = time.perf_counter() - began
    if done.returncode != 0:
        return {"error": f"exit {done.returncode}: {done.stderr[-1500:]}", "wall_s": wall,
                "batch_size": batch_size, "objective": objective}
    result = json.loads(done.stdout)
    return {"batch_size": batch_size, "objective": objective, "wall_s": wall,
            "micro_batch_size": result["micro_batch_size"], "seconds": result["seconds"],
            "ooms": result["ooms"], "reason": result.get("speed_reason"),
            "trials": [{key: t[key] for key in ("micro_batch_size", "fits", "oom", "peak_bytes",
                                               "seconds", "samples_per_second")}
                       for t in result["trials"]]}


def grid(batch_size: int) -> list[int]:
    """The rows a balanced split of ``batch_size`` can run, largest first.

    >>> grid(8)
    [8, 4, 3, 2, 1]
    """
    return sorted({-(-batch_size // k) for k in range(1, batch_size + 1)}, reverse=True)


def steps_apart(batch_size: int, a: int, b: int) -> int:
    """How many sizes of ``grid(batch_size)`` lie between ``a`` and ``b``, each first
    rounded down to that grid (what a split of ``batch_size`` would run for it), plus one.

    >>> steps_apart(512, 256, 256), steps_apart(512, 256, 342), steps_apart(512, 256, 171)
    (0, 0, 1)
    """
    sizes = grid(batch_size)

    def index(m: int) -> int:
        return next(i for i, size in enumerate(sizes) if size <= m)

    return abs(index(a) - index(b))


def trials_text(trials: Sequence[dict[str, Any]]) -> str:
    """The sizes tried, in order: ``x`` an OOM, ``~`` ran but over the budget."""
    return " ".join(f"{t['micro_batch_size']}{'x' if t['oom'] else ('' if t['fits'] else '~')}"
                    for t in trials)


def curve(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Mean samples/s of every size timed that fit in all its trials (as the probe's
    rule counts them: a size that failed once is out), largest size first, relative to
    the largest of them; with every timing."""
    trials = result.get("trials", [])
    failed = {t["micro_batch_size"] for t in trials if not t["fits"]}
    timings: dict[int, list[float]] = {}
    for t in trials:
        if t["fits"] and t["samples_per_second"] and t["micro_batch_size"] not in failed:
            timings.setdefault(t["micro_batch_size"], []).append(t["samples_per_second"])
    if not timings:
        return []
    mean = {m: sum(v) / len(v) for m, v in timings.items()}
    top = mean[max(mean)]
    return [{"micro_batch_size": m, "samples_per_second": mean[m], "relative": mean[m] / top,
             "timings": timings[m]} for m in sorted(mean, reverse=True)]


def in_turn(result: dict[str, Any]) -> dict[int, float]:
    """Every size timed in turn against the reference (``A B B A`` in the trials, all
    fitting): the mean of its two timings over the reference's two, the last such round
    of each size."""
    trials = result.get("trials", [])
    ratios: dict[int, float] = {}
    for i in range(len(trials) - 3):
        a, b, c, d = trials[i:i + 4]
        if (a["micro_batch_size"] == d["micro_batch_size"] != b["micro_batch_size"]
                == c["micro_batch_size"]
                and all(t["fits"] and t["samples_per_second"] for t in (a, b, c, d))):
            ratios[b["micro_batch_size"]] = (
                (b["samples_per_second"] + c["samples_per_second"])
                / (a["samples_per_second"] + d["samples_per_second"]))
    return ratios


def turns_winner(turns: dict[int, float]) -> int | None:
    """The size that won its turn by more than 5% (the probe stops at the first)."""
    return next((m for m, ratio in turns.items() if ratio > 1.05), None)


def checks(same: dict[int, list[dict[str, Any]]], speed: Sequence[dict[str, Any]],
           s: Settings) -> list[dict[str, Any]]:
    small, large = same[s.small_batch], same[s.large_batch]
    ok = [r for r in small + large if "error" not in r]
    if len(ok) < len(small) + len(large):
        return [{"id": "same", "status": "N/A", "summary": "a probe failed (see the notes)"}]
    apart = max(steps_apart(s.small_batch, a["micro_batch_size"], b["micro_batch_size"])
                for a in small for b in large)
    out = [{"id": "same", "status": harness.status(apart <= 1),
            "summary": f"B={s.large_batch} chose {sorted({r['micro_batch_size'] for r in large})}"
                       f", B={s.small_batch} chose "
                       f"{sorted({r['micro_batch_size'] for r in small})}: at most {apart} "
                       f"balanced size(s) of {s.small_batch} apart (target <= 1)"}]
    ratio = statistics.median(r["seconds"] for r in large) / statistics.median(
        r["seconds"] for r in small)
    out.append({"id": "time", "ratio": ratio, "status": harness.status(ratio <= 1.5),
                "summary": f"median search {statistics.median(r['seconds'] for r in large):.1f}"
                           f" s at B={s.large_batch} vs "
                           f"{statistics.median(r['seconds'] for r in small):.1f} s at "
                           f"B={s.small_batch}: x{ratio:.2f} (target <= 1.5)"})
    for r in speed:
        points = curve(r)
        if "error" in r or not points:
            out.append({"id": f"speed-{r['model']}", "status": "N/A",
                        "summary": f"{r['model']}: no timed trial"})
            continue
        chosen, largest = r["micro_batch_size"], points[0]
        turns = in_turn(r)
        # The probe's rule, re-derived: a smaller size is kept only when it was more than
        # 5% faster than the largest on the timings in turn (A B B A); a size that leads
        # on its mean must have been timed so.
        untried = [p for p in points[1:] if p["micro_batch_size"] not in turns
                   and p["relative"] > 1.05]
        rule = (chosen == turns_winner(turns)) if chosen != largest["micro_batch_size"] else (
            turns_winner(turns) is None and not untried)
        said = ", ".join(f"{m} x{v:.2f}" for m, v in turns.items()) or "none"
        top = largest["micro_batch_size"]
        out.append({"id": f"speed-{r['model']}", "status": harness.status(rule),
                    "summary": f"{r['model']}: kept {chosen} of {len(points)} sizes timed; "
                               f"timed in turn against the largest ({top}): "
                               f"{said}; rule: a smaller size only when > 1.05x in turn"})
    return out


def markdown(report: dict[str, Any]) -> str:
    s = report["settings"]
    lines = harness.report_head("The probe's answer against B, and objective='speed'", report)
    lines += ["", f"## 1. {s['same']['label']} under {s['limit']}: the same answer at every B",
              "", f"`autosplit probe --model {s['same']['name']} --input-shape "
              f"{s['same']['input_shape']} --memory-limit {s['limit']} --no-cache --json "
              "--batch-size B`, alternating B.", ""]
    lines += harness.md_table(["B", "chose", "trials (x OOM, ~ over budget)", "OOMs",
                               "search s", "command s"], same_rows(report["same"]))
    lines += ["", f"## 2. objective='speed' at B={s['large_batch']} under {s['speed_limit']}",
              ""]
    for r in report["speed"]:
        lines += [f"### {r['label']}", "", f"Kept **{r.get('micro_batch_size', '-')}**: "
                  f"{r.get('reason') or r.get('error', '')}", "",
                  f"Trials: {trials_text(r.get('trials', []))}; search "
                  f"{r.get('seconds', 0):.1f} s.", ""]
        turns = in_turn(r)
        lines += harness.md_table(
            ["m", "samples/s (mean)", "of the largest", "in turn (A B B A)", "every timing"],
            [[str(p["micro_batch_size"]), f"{p['samples_per_second']:,.0f}",
              f"{p['relative']:.2f}",
              f"{turns[p['micro_batch_size']]:.2f}" if p["micro_batch_size"] in turns else "-",
              ", ".join(f"{v:,.0f}" for v in p["timings"])]
             for p in curve(r)])
        lines += [""]
    return "\n".join(lines) + harness.report_tail(report)


def same_rows(same: dict[str, list[dict[str, Any]]]) -> list[list[str]]:
    return [[str(r["batch_size"]), str(r.get("micro_batch_size", "-")),
             trials_text(r.get("trials", [])), str(r.get("ooms", "-")),
             f"{r['seconds']:.1f}" if "seconds" in r else "-", f"{r['wall_s']:.1f}"]
            for runs in same.values() for r in runs]


def main(argv: Sequence[str] | None = None) -> int:
    p = harness.parser("The probe's answer at two batch sizes under one cap, and what "
                       "objective='speed' keeps, through the autosplit command line.",
                       quick="a small MLP at B = 64 and 128", repeats=FULL.repeats)
    args = p.parse_args(argv)
    s, clock, info = harness.begin(args, FULL, QUICK)

    same: dict[int, list[dict[str, Any]]] = {s.small_batch: [], s.large_batch: []}
    for _ in range(s.repeats):
        for batch_size in same:
            r = run_probe(s.same, batch_size, s.limit, timeout=s.timeout_s)
            same[batch_size].append(r)
            harness.log(f"  B={batch_size:<5} chose {r.get('micro_batch_size', '-')!s:>5}  "
                        f"{r.get('seconds', 0):6.1f} s  [{trials_text(r.get('trials', []))}]"
                        f"{'  ' + r['error'] if 'error' in r else ''}")
    speed = []
    for model in s.speed:
        r = run_probe(model, s.large_batch, s.speed_limit, "speed", timeout=s.timeout_s)
        r.update(model=f"{model.name} {model.input_shape}", label=model.label)
        speed.append(r)
        harness.log(f"  speed {r['model']}: kept {r.get('micro_batch_size', '-')}: "
                    f"{r.get('reason') or r.get('error', '')}")
        for point in curve(r):
            harness.log(f"    m={point['micro_batch_size']:<5} "
                        f"{point['samples_per_second']:10,.0f} samples/s  "
                        f"x{point['relative']:.2f}")
    report: dict[str, Any] = {
        "question": QUESTION, "command": harness.command("probe_choices", argv), "units": UNITS,
        "machine": info, "settings": asdict(s),
        "same": {str(b): runs for b, runs in same.items()}, "speed": speed,
        "checks": checks(same, speed, s)}
    report["notes"] = [f"{r.get('model', r['batch_size'])}: {r['error'][-300:]}"
                       for r in [*(x for runs in same.values() for x in runs), *speed]
                       if "error" in r]
    report["seconds"] = clock()
    harness.conclude(harness.out_dir(args), "probe_choices", report, markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
