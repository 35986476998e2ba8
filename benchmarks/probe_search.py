"""How close to the true largest micro-batch does each search get, and at what cost?

Every method searches the same model (the MLP 128-1024-1024-10 with Adam), the same
data (B rows) and the same large batch B under the same real memory cap: each runs
in its own fresh child process whose TensorFlow CPU allocator is hard-capped
(``autosplit.capped.run_capped``; a real ``ResourceExhaustedError`` at the cap, about
10 s per OOM while the allocator retries).

1. ``exhaustive``: the ground truth, the largest micro-batch with which
   ``fit_large_batch`` trains 3 large batches without an OOM, to one example: m = B
   first (no split), then bisection over [1, B - 1], then two confirmation trials.
2. ``autosplit.probe(..., cache=False, headroom=0.0)``, which targets the same cap as
   the others, and the default ``headroom=0.1``.
3. Lightning's ``scale_batch_size(mode="binsearch")``: double from ``init_val=2`` until
   an OOM, then bisect; ``max_trials=25`` successful trials, as Lightning counts them.
4. accelerate's ``find_executable_batch_size``: start at B, ``int(m * 0.9)`` per OOM
   (PR #3684, "Stop halving my batch"; earlier versions halved).

A trial of methods 1, 3 and 4 is ``fit_large_batch(micro_batch_size=m, epochs=3,
on_oom="raise")`` over the B rows: three full large batches of ``ceil(B /
ceil(B / m))`` rows per micro-batch (sizes that give the same rows are tried once).
autosplit's trials are its own: two micro-batches and the apply, three times.

And the probe's seconds against B (B = 1024 ... 8192 under a tighter cap, one child
each, the default headroom): a trial no longer runs the whole large batch, so the
seconds should stay flat while B/m grows.

Units: micro-batch sizes in examples (rows actually run); fraction = size found / the
exhaustive size; trials = distinct sizes tried; seconds = wall clock of the search
inside its child (start-up and model building excluded); peak = the allocator's peak
in the last trial that fitted at the size found, in MiB.

Reproduce (on an otherwise idle machine)::

    python -m benchmarks.probe_search          # B=4096 under 72 MiB, ~10 min
    python -m benchmarks.probe_search --quick  # B=256, nothing runs out of memory

The full run writes ``benchmarks/results/probe_search.{json,md,png}``; ``--quick``
writes files only with ``--out DIR``.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks import harness, plots
from benchmarks.harness import MIB
from benchmarks.plots import Panel, Series

QUESTION = ("How close to the true largest micro-batch does each search get, in how many "
            "trials, OOMs and seconds, under the same real memory cap? And do the probe's "
            "seconds grow with B?")
UNITS = ("micro-batch sizes in examples (rows run); fraction of the exhaustive size; trials = "
         "distinct sizes tried; seconds = wall clock of the search")
LABELS = {"exhaustive": "exhaustive (bisection to 1) [ground truth]",
          "autosplit": "autosplit.probe (headroom 0)",
          "autosplit_headroom": "autosplit.probe (10% headroom)",
          "lightning": "Lightning-style power scaling + binsearch",
          "accelerate": "accelerate-style x0.9 back-off from B"}
TRUTH = "exhaustive"


@dataclass(frozen=True)
class Settings:
    batch_size: int  # B of the comparison; the search space is m in [1, B]
    limit_mib: int  # the hard cap of every comparison child
    series: tuple[int, ...]  # B for the probe's seconds against B
    series_limit_mib: int
    features: int = 128
    hidden: tuple[int, ...] = (1024, 1024)
    steps_per_trial: int = 3  # large batches per baseline trial
    lightning_init_val: int = 2  # Lightning's default
    lightning_max_trials: int = 25  # Lightning's default; counts successful trials
    accelerate_factor: float = 0.9  # accelerate's back-off since PR #3684 (was 0.5)
    seed: int = 0
    child_timeout_s: int = 3600


FULL = Settings(batch_size=4096, limit_mib=72, series=(1024, 2048, 4096, 8192),
                series_limit_mib=48)
# A smoke run: under 64 MiB the whole batch of 256 fits, so no trial waits for an OOM.
QUICK = replace(FULL, batch_size=256, limit_mib=64, series=(256, 512), series_limit_mib=64,
                lightning_init_val=32)


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
    """Lightning's ``_run_binary_scaling``, the "dataset" being the large batch.

    As in Lightning: ``low`` starts at 1 without a trial, ``max_trials`` counts
    successful trials only, and the doubling is clamped to B and stops once B fits.
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


def run_method(task: dict[str, Any]) -> dict[str, Any]:
    """One search in this (capped) process; returns what it found and every trial."""
    import tensorflow as tf

    import autosplit
    from autosplit.memory.host import is_tf_bfc_capped
    from autosplit.memory.peak_meter import PeakMeter
    from benchmarks import workloads

    s = Settings(**{**task["settings"], "hidden": tuple(task["settings"]["hidden"]),
                    "series": tuple(task["settings"]["series"])})
    method, B = task["method"], task["batch_size"]
    cap = is_tf_bfc_capped()
    if cap is None:
        raise SystemExit("Expected a child of autosplit.capped.run_capped. Received: "
                         "TF_CPU_ALLOCATOR_USE_BFC unset. Run without --child.")
    x, y = workloads.synthetic(task["rows"], (s.features,), seed=s.seed)
    model = workloads.build_model(workloads.mlp_spec(s.features, s.hidden), seed=s.seed)
    model.optimizer.build(model.trainable_variables)  # every search starts from this state
    gc.collect()
    meter = PeakMeter("CPU:0")
    out: dict[str, Any] = {"method": method, "batch_size": B, "cap_bytes": cap,
                           "baseline_bytes": meter.current_bytes()}
    t0 = time.perf_counter()
    if method.startswith("autosplit"):
        headroom = 0.1 if method == "autosplit_headroom" else 0.0
        try:
            result = autosplit.probe(model, x, y, batch_size=B, cache=False, headroom=headroom)
        except autosplit.NothingFitsError as exc:
            return {**out, "found": 0, "seconds": time.perf_counter() - t0, "trials": [],
                    "error": str(exc)}
        trials = [{**asdict(t), "rows": t.micro_batch_size} for t in result.trials]
        return {**out, "found": result.micro_batch_size, "seconds": time.perf_counter() - t0,
                "trials": trials, "accumulation_steps": result.accumulation_steps,
                "probe": {"headroom": headroom, "reason": result.reason(),
                          "budget_bytes": result.budget_bytes, "fixed_bytes": result.fixed_bytes,
                          "per_example_bytes": result.per_example_bytes,
                          "predicted_peak_bytes": result.predicted_peak_bytes,
                          "measured_peak_bytes": result.measured_peak_bytes,
                          "peak_source": result.peak_source, "seconds": result.seconds}}

    trials: list[dict[str, Any]] = []
    seen: dict[int, bool] = {}

    def fits(m: int) -> bool:
        rows = autosplit.split_batch(B, m).micro_batch_size
        if rows in seen:  # the same micro-batches as an earlier size: no new trial
            return seen[rows]
        meter.reset()
        start, oom = time.perf_counter(), False
        try:
            autosplit.fit_large_batch(model, x, y, batch_size=B, micro_batch_size=rows,
                                      epochs=s.steps_per_trial, shuffle=False,
                                      on_oom="raise", verbose=0)
        except tf.errors.ResourceExhaustedError:
            oom = True
        peak = None if oom else meter.peak_bytes()
        gc.collect()  # a dead trial's buffers must not count against the next one
        trials.append({"micro_batch_size": m, "rows": rows, "fits": not oom, "oom": oom,
                       "peak_bytes": peak, "seconds": time.perf_counter() - start})
        seen[rows] = not oom
        return not oom

    if method == TRUTH:
        unsplit = fits(B)
        largest_split = bisection(B - 1, fits)
        found = B if unsplit else largest_split
        out.update(unsplit_fits=unsplit, largest_split=largest_split,
                   largest_split_rows=autosplit.split_batch(B, largest_split).micro_batch_size
                   if largest_split else 0)
    elif method == "lightning":
        found = lightning_binsearch(B, fits, init_val=s.lightning_init_val,
                                    max_trials=s.lightning_max_trials)
    elif method == "accelerate":
        found = accelerate_backoff(B, fits, factor=s.accelerate_factor)
    else:
        raise SystemExit(f"Expected a method in {list(LABELS)}. Received: {method!r}.")
    out.update(found=autosplit.split_batch(B, found).micro_batch_size if found else 0,
               seconds=time.perf_counter() - t0, trials=trials)
    if method == TRUTH:
        # The bisection assumed fitting is monotone in m: ask again at the end, in
        # fresh steps, after every trial's lasting allocations are in place.
        n, split = len(trials), out["largest_split"]
        seen.clear()
        out["confirm"] = {str(m): fits(m) for m in (split, split + 1) if 1 <= m < B}
        out["trials"], out["confirm_trials"] = trials[:n], trials[n:]
    return out


# ---------------------------------------------------------------- the parent


def sequence(trials: Sequence[dict[str, Any]]) -> str:
    """The rows tried, in order: ``x`` an OOM, ``~`` ran but over autosplit's budget."""
    return " ".join(f"{t['rows']}{'x' if t['oom'] else ('' if t['fits'] else '~')}"
                    for t in trials)


def summarise(raw: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    truth = raw[TRUTH]["found"]
    out = {}
    for method, r in raw.items():
        trials, ran = r.get("trials", []), "found" in r  # else the child failed
        peaks = [t["peak_bytes"] for t in trials if t["fits"] and t["rows"] == r.get("found")]
        out[method] = {"label": LABELS[method], "found": r.get("found"),
                       "fraction_of_true_max": r["found"] / truth if truth and ran else None,
                       "trials": len(trials) if ran else None,
                       "ooms": sum(t["oom"] for t in trials) if ran else None,
                       "seconds": r.get("seconds"),
                       "peak_mib_at_found": peaks[-1] / MIB if peaks else None,
                       "sequence": sequence(trials), "error": r.get("error")}
    return out


def series_summary(raw: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for r in raw:
        clean = [t["seconds"] for t in r.get("trials", []) if not t["oom"]]
        rows.append({"batch_size": r["batch_size"], "found": r.get("found"),
                     "accumulation_steps": r.get("accumulation_steps"),
                     "trials": len(r.get("trials", [])),
                     "ooms": sum(t["oom"] for t in r.get("trials", [])),
                     "seconds": r.get("seconds"),
                     "seconds_per_trial": statistics.mean(clean) if clean else None,
                     "error": r.get("error")})
    return rows


def checks(summary: dict[str, dict[str, Any]], series: Sequence[dict[str, Any]]
           ) -> list[dict[str, Any]]:
    a = summary["autosplit"]
    baselines = [summary[m] for m in ("lightning", "accelerate")]
    fraction = a["fraction_of_true_max"]
    out = [{"id": "close", "status": harness.status(None if fraction is None
                                                    else fraction >= 0.9),
            "summary": f"autosplit.probe (headroom 0) found {a['found']}, "
                       f"{'-' if fraction is None else f'{fraction:.2f}'} of the exhaustive "
                       f"{summary[TRUTH]['found']} (target >= 0.90)"}]
    for name, unit, strict in (("trials", "trials", True), ("ooms", "OOMs", False),
                               ("seconds", "s", True)):
        mine, theirs = a[name], [b[name] for b in baselines]
        if mine is None or None in theirs:
            out.append({"id": name, "status": "N/A", "summary": f"no {unit} from every search"})
            continue
        ok = all(mine < t if strict else mine <= t for t in theirs)
        out.append({"id": name, "status": harness.status(ok),
                    "summary": f"autosplit.probe {mine:.4g} {unit} vs Lightning "
                               f"{theirs[0]:.4g} and accelerate {theirs[1]:.4g} (target: "
                               f"{'fewer than' if strict else 'no more than'} both)"})
    timed = [r for r in series if r["seconds_per_trial"]]
    if len(timed) >= 2:
        lo, hi = timed[0], timed[-1]
        ratio = hi["seconds_per_trial"] / lo["seconds_per_trial"]
        out.append({"id": "flat", "ratio": ratio, "status": harness.status(ratio <= 1.5),
                    "summary": f"probe seconds per trial {lo['seconds_per_trial']:.2f} s at "
                               f"B={lo['batch_size']} (k={lo['accumulation_steps']}) -> "
                               f"{hi['seconds_per_trial']:.2f} s at B={hi['batch_size']} "
                               f"(k={hi['accumulation_steps']}): x{ratio:.2f} (target <= 1.5)"})
    else:
        out.append({"id": "flat", "status": "N/A", "summary": "fewer than two probes finished"})
    return out


def notes(report: dict[str, Any]) -> list[str]:
    """What a reader should know that the table does not say."""
    raw, summary = report["raw"], report["methods"]
    truth, t = summary[TRUTH]["found"], raw[TRUTH]
    split, confirm, out = t.get("largest_split"), t.get("confirm", {}), []
    if t.get("unsplit_fits"):
        out.append(f"m = B (no split) fits; the largest split runs micro-batches of "
                   f"{t.get('largest_split_rows')} rows.")
    if confirm.get(str(split)) is False:
        out.append(f"{split} did NOT fit again when re-tried at the end of the exhaustive "
                   "child: treat the ground truth as an upper estimate.")
    if confirm.get(str(split + 1) if split is not None else "") is True:
        out.append(f"{split + 1} fitted when re-tried: fitting was not monotone in m.")
    for method, r in summary.items():
        if r["error"]:
            out.append(f"{r['label']}: {r['error'][-300:]}")
        if method != TRUTH and truth and (r["found"] or 0) > truth:
            out.append(f"{r['label']} found {r['found']} > the exhaustive {truth}: fitting "
                       "differs between processes (allocator state, fragmentation).")
    return out


HEADER = ["method", "size found", "of exhaustive", "trials", "OOMs", "search s",
          "peak MiB at size"]
SERIES_HEADER = ["B", "m found", "k", "trials", "OOMs", "seconds", "s per trial"]


def _num(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def rows(summary: dict[str, dict[str, Any]]) -> list[list[str]]:
    return [[r["label"], _num(r["found"], "d"), _num(r["fraction_of_true_max"], ".3f"),
             _num(r["trials"], "d"), _num(r["ooms"], "d"), _num(r["seconds"], ".1f"),
             _num(r["peak_mib_at_found"], ".1f")] for r in summary.values()]


def series_rows(series: Sequence[dict[str, Any]]) -> list[list[str]]:
    return [[str(r["batch_size"]), _num(r["found"], "d"), _num(r["accumulation_steps"], "d"),
             str(r["trials"]), str(r["ooms"]), _num(r["seconds"], ".1f"),
             _num(r["seconds_per_trial"], ".2f")] for r in series]


def markdown(report: dict[str, Any]) -> str:
    s = report["settings"]
    lines = harness.report_head("Micro-batch search: size found, trials and seconds", report)
    lines += ["", f"MLP {s['features']}-{'-'.join(map(str, s['hidden']))}-10, Adam; "
              f"B={s['batch_size']}; each method in its own child capped at {s['limit_mib']} "
              "MiB. A baseline trial: `fit_large_batch` over "
              f"{s['steps_per_trial']} large batches at that size.", ""]
    lines += harness.md_table(HEADER, rows(report["methods"]))
    lines += ["", "Sizes tried, in order (`x`: OOM; `~`: ran, over autosplit's budget):", ""]
    lines += [f"- {r['label']}: {r['sequence']}" for r in report["methods"].values()]
    lines += ["", f"## The probe's seconds against B (cap {s['series_limit_mib']} MiB, "
              "10% headroom)", ""]
    lines += harness.md_table(SERIES_HEADER, series_rows(report["series"]))
    return "\n".join(lines) + harness.report_tail(report, "probe_search.png")


def plot(report: dict[str, Any], path: Path) -> None:
    done = [r for r in report["series"] if r["seconds"] is not None]
    xs = [r["batch_size"] for r in done]
    seconds = Panel("autosplit.probe: seconds against B", "seconds", [
        Series("search, total", xs, [r["seconds"] for r in done]),
        Series("per trial (no OOM)", xs, [r["seconds_per_trial"] or 0 for r in done],
               marker="s")], xticks=xs)
    steps = Panel("micro-batches per large batch (k = B/m)", "k", [
        Series("k chosen", xs, [r["accumulation_steps"] or 0 for r in done], marker="D")],
        xticks=xs)
    plots.line_plot(path, [[seconds, steps]], "autosplit.probe: seconds and k against B")


def main(argv: Sequence[str] | None = None) -> int:
    p = harness.parser("Largest micro-batch found, trials, OOMs and seconds of autosplit.probe "
                       "vs exhaustive bisection, Lightning-style and accelerate-style searches "
                       "under one real memory cap; and the probe's seconds against B.",
                       quick="B=256 under 64 MiB, nothing runs out of memory", children=True)
    p.add_argument("--batch-size", type=int, help=f"B (default {FULL.batch_size})")
    p.add_argument("--limit-mib", type=int, help=f"the cap in MiB (default {FULL.limit_mib})")
    args = p.parse_args(argv)
    if args.child:
        return harness.serve_child(args.child, run_method)
    for name in ("batch_size", "limit_mib", "jobs"):
        harness.at_least(name, getattr(args, name))
    s = QUICK if args.quick else FULL
    s = replace(s, batch_size=args.batch_size or s.batch_size,
                limit_mib=args.limit_mib or s.limit_mib)

    clock, info = harness.wall_clock(), harness.machine_info()
    harness.log(f"# {harness.machine_line(info)}")
    harness.log(f"# B={s.batch_size} under {s.limit_mib} MiB; probe against B = "
                f"{', '.join(map(str, s.series))} under {s.series_limit_mib} MiB")

    def call(method: str, B: int, rows: int, limit: int):
        def go() -> dict[str, Any]:
            task = {"method": method, "batch_size": B, "rows": rows, "settings": asdict(s)}
            r = harness.run_child("probe_search", task, limit, timeout=s.child_timeout_s)
            r.setdefault("batch_size", B)
            r.setdefault("error", None if "found" in r else r.get("oom_where", "no result"))
            harness.log(f"  {method:<19} B={B:<5} found {r.get('found', '-')!s:>5}  trials "
                        f"{len(r.get('trials', [])):>3}  OOMs "
                        f"{sum(t['oom'] for t in r.get('trials', [])):>3}  "
                        f"{r.get('seconds') or 0:7.1f} s  [{sequence(r.get('trials', []))}]")
            return r
        return go

    calls = [call(m, s.batch_size, s.batch_size, s.limit_mib) for m in LABELS]
    calls += [call("autosplit_headroom", B, max(s.series), s.series_limit_mib) for B in s.series]
    results = harness.run_all(calls, args.jobs)
    raw = dict(zip(LABELS, results[:len(LABELS)], strict=True))
    summary, series = summarise(raw), series_summary(results[len(LABELS):])
    report: dict[str, Any] = {
        "question": QUESTION, "command": harness.command("probe_search", argv), "units": UNITS,
        "machine": info, "settings": asdict(s), "methods": summary, "series": series,
        "checks": checks(summary, series), "raw": raw}
    report["notes"] = notes(report)
    report["seconds"] = clock()

    harness.log(f"\nUnits: {UNITS}")
    harness.log(harness.text_table(HEADER, rows(summary)))
    harness.log(f"\nautosplit.probe against B (cap {s.series_limit_mib} MiB):")
    harness.log(harness.text_table(SERIES_HEADER, series_rows(series)))
    harness.conclude(harness.out_dir(args), "probe_search", report, markdown(report),
                         lambda path: plot(report, path))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
