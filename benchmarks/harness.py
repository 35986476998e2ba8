"""The machinery every benchmark shares, so that each script keeps only its question.

After accelerate's ``benchmarks/fsdp2/measure_utils.py``: what surrounds a measurement
lives here once; ``benchmarks.workloads`` holds the models, data and training methods.

- the command line every script takes (:func:`parser`: ``--quick``, ``--out``,
  ``--repeats``, ``--jobs``) and the machine it ran on (:func:`machine_info`);
- one measurement in a fresh child process under a real TensorFlow memory cap
  (:func:`run_child`, a thin wrapper over ``autosplit.capped.run_capped``;
  :func:`serve_child` on the child's side);
- side-by-side timing (:func:`round_robin`, :func:`speed_summary`) and the growth of a
  peak with the batch (:func:`growth_check`);
- the report: text and Markdown tables, the checks printed and the JSON/Markdown/PNG
  files written (:func:`conclude`, :func:`write_report`); ``benchmarks.plots`` draws
  the PNG.

Nothing here imports TensorFlow at module level: a parent that only starts children
stays light.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from importlib import metadata
from pathlib import Path
from typing import Any

from autosplit.units import MIB

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
OOM = "OOM"

Log = Callable[[str], None]


def log(line: str) -> None:
    print(line, flush=True)


# ---------------------------------------------------------------- command line


def parser(description: str, *, quick: str, repeats: int | None = None,
           children: bool = False) -> argparse.ArgumentParser:
    """The arguments every script takes: ``--quick``, ``--out``; ``--repeats`` when the
    script repeats its measurements (``repeats`` is the default), and with ``children``
    ``--jobs`` and the hidden ``--child`` (the task a child process runs)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true",
                   help=f"a smoke run ({quick}); writes files only with --out")
    p.add_argument("--out", type=Path,
                   help="write the .json, .md and .png here (default benchmarks/results; "
                        "none with --quick)")
    if repeats is not None:
        p.add_argument("--repeats", type=int,
                       help=f"measured repeats per point (default {repeats}; quick 1)")
    if children:
        p.add_argument("--jobs", type=int, default=1,
                       help="children run at once (default 1; more is fine for peaks, not "
                            "for samples/s)")
        p.add_argument("--child", help=argparse.SUPPRESS)
    return p


def at_least(name: str, value: int | None, minimum: int = 1) -> None:
    if value is not None and value < minimum:
        raise SystemExit(f"Expected `--{name.replace('_', '-')}` >= {minimum}. "
                         f"Received: {value}.")


def subset(name: str, text: str, known: Sequence[str]) -> list[str]:
    """The comma-separated names of ``--name``, each one of ``known``, in order."""
    wanted = [w.strip() for w in text.split(",") if w.strip()]
    if not wanted or any(w not in known for w in wanted):
        raise SystemExit(f"Expected `--{name}` from {list(known)}. Received: {text!r}.")
    return wanted


def out_dir(args: argparse.Namespace) -> Path | None:
    """Where the files go: ``--out``, else benchmarks/results, never for ``--quick``."""
    if args.out is not None:
        return args.out
    return None if args.quick else RESULTS


def command(module: str, argv: Sequence[str] | None) -> str:
    return " ".join(["python -m", f"benchmarks.{module}",
                     *(sys.argv[1:] if argv is None else argv)])


def _version(*names: str) -> str:
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return "unknown"


def machine_info(*, devices: bool = False) -> dict[str, Any]:
    """The machine, the libraries and the load; ``devices`` loads TensorFlow to list
    them (scripts that measure in their own process)."""
    import autosplit

    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    try:
        load = [round(v, 2) for v in os.getloadavg()]
    except OSError:
        load = None
    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "load_average_at_start": load,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "tensorflow": _version("tensorflow", "tensorflow-cpu", "tf-nightly"),
        "keras": _version("keras"),
        "numpy": _version("numpy"),
        "autosplit": autosplit.__version__,
        "gpus": None,
    }
    if devices:
        import tensorflow as tf

        info["gpus"] = [tf.config.experimental.get_device_details(g).get("device_name", g.name)
                        for g in tf.config.list_physical_devices("GPU")]
    return info


def machine_line(info: Mapping[str, Any]) -> str:
    gpus = "not read" if info["gpus"] is None else (", ".join(info["gpus"]) or "none")
    return (f"{info['cpu_count']} CPUs ({info['cpus_usable']} usable), GPUs: {gpus}; "
            f"TensorFlow {info['tensorflow']}, Keras {info['keras']}, autosplit "
            f"{info['autosplit']}, Python {info['python']}; {info['date']}; load average at "
            f"start {info['load_average_at_start']}")


# ---------------------------------------------------------------- children under a cap


def run_child(module: str, task: Mapping[str, Any], limit_mib: int | None, *,
              timeout: float) -> dict[str, Any]:
    """Run ``task`` in ``python -m benchmarks.<module> --child TASK`` under a real cap.

    The child hides any GPU (``CUDA_VISIBLE_DEVICES=-1``): the capped benchmarks
    measure TensorFlow's CPU allocator. Never raises for the child: a child killed by
    a signal under the cap counts as out of memory (TF 2.21 has died of SIGSEGV when
    an allocation inside tf.data failed at the cap), any other failure is an error.
    """
    from autosplit.capped import run_capped

    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "CUDA_VISIBLE_DEVICES": "-1"}
    argv = ["-m", f"benchmarks.{module}", "--child", json.dumps(task)]
    limit = None if limit_mib is None else limit_mib * MIB
    try:
        run = run_capped(argv, limit, timeout=timeout, env=env, capture=True)
    except subprocess.TimeoutExpired:
        return {"status": "error", "error": f"timed out after {timeout} s",
                "child_wall_s": timeout, "limit_mib": limit_mib}
    stderr = (run.stderr or "")[-2000:]
    if run.returncode == 0 and isinstance(run.result, dict):
        result = dict(run.result)
    elif run.returncode < 0 and limit is not None:
        name = signal.Signals(-run.returncode).name
        result = {"status": OOM, "oom_where": f"crashed ({name}) under the cap", "error": stderr}
    else:
        result = {"status": "error", "error": f"exit {run.returncode}: {stderr}"}
    result.update(child_wall_s=run.seconds, limit_mib=limit_mib)
    return result


def run_all(calls: Sequence[Callable[[], dict[str, Any]]], jobs: int) -> list[dict[str, Any]]:
    """Every call, ``jobs`` at a time, results in order."""
    if jobs <= 1:
        return [call() for call in calls]
    with ThreadPoolExecutor(jobs) as pool:
        return list(pool.map(lambda call: call(), calls))


def serve_child(task_json: str, run: Callable[[dict[str, Any]], dict[str, Any]]) -> int:
    """The child's side of :func:`run_child`: run the task, hand the result back."""
    from autosplit.capped import write_result

    write_result(run(json.loads(task_json)))
    return 0


def error_text(error: BaseException) -> str:
    """The line of a TensorFlow error that says what failed, short."""
    lines = str(error).splitlines() or [type(error).__name__]
    return next((line for line in lines if "OOM when allocating" in line), lines[0]).strip()[:300]


# ---------------------------------------------------------------- timing and growth


def round_robin(runs: Mapping[str, Callable[[], dict[str, Any]]], repeats: int,
                say: Log = log) -> dict[str, list[dict[str, Any]]]:
    """Each run ``repeats`` times, side by side; the order rotates by one each repeat.

    A run returns at least ``samples`` and ``seconds``; Keras's session is cleared and
    garbage collected before each, so no run pays for another's leftovers.
    """
    import keras

    names = list(runs)
    out: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for repeat in range(repeats):
        shift = repeat % len(names)
        for name in names[shift:] + names[:shift]:
            keras.backend.clear_session()
            gc.collect()
            result = runs[name]()
            out[name].append(result)
            say(f"  repeat {repeat + 1}/{repeats}  {name:<22} "
                f"{result['samples'] / result['seconds']:>10,.0f} samples/s  "
                f"({result['seconds']:.2f} s)")
    return out


def speed_summary(runs: Mapping[str, Sequence[Mapping[str, Any]]], baseline: str
                  ) -> dict[str, dict[str, Any]]:
    """Best and median samples/s per method, and both as ratios to ``baseline``'s; and
    the paired ratio, the median over the repeats of each repeat's ratio to the
    baseline's run of the same repeat (side by side in :func:`round_robin`, so a drift
    of the machine's speed weighs on both: on 2 busy cores a best over best moved by
    10% from one run to the next where the paired ratio moved by a few percent)."""
    def rates(name: str) -> list[float]:
        return [r["samples"] / r["seconds"] for r in runs[name]]

    base = rates(baseline)
    out = {}
    for name in runs:
        values = rates(name)
        out[name] = {"samples_per_s_best": max(values),
                     "samples_per_s_median": statistics.median(values),
                     "samples_per_s_all": values,
                     "ratio": max(values) / max(base),
                     "ratio_median": statistics.median(values) / statistics.median(base),
                     "ratio_paired": paired_ratio(values, base)}
    return out


def paired_ratio(values: Sequence[float], base: Sequence[float]) -> float:
    """The median over the repeats of ``values[i] / base[i]``: runs of one repeat side by
    side (:func:`round_robin`).

    >>> paired_ratio([100.0, 50.0], [25.0, 50.0])
    2.5
    """
    return statistics.median(v / b for v, b in zip(values, base, strict=True))


def growth_check(peak_from_mib: float | None, peak_to_mib: float | None, batch_mib: float, *,
                 slack: float = 0.10, target: float = 0.25, label: str = "peak",
                 from_batch_size: int | None = None, to_batch_size: int | None = None
                 ) -> dict[str, Any]:
    """How much a peak grew from the smallest to the largest batch, in large batches.

    The bound: one large batch of inputs (``batch_mib``) plus ``slack`` of the first
    peak; the target: ``target`` of one large batch. ``N/A`` without both peaks. The
    ``summary`` line names ``label`` and the two batch sizes.
    """
    if peak_from_mib is None or peak_to_mib is None:
        return {"status": "N/A", "target_met": None, "summary": f"{label}: no peak at both B"}
    growth = peak_to_mib - peak_from_mib
    allowed = batch_mib + slack * peak_from_mib
    met = growth <= target * batch_mib
    summary = (
        f"{label}: {peak_from_mib:.1f} MiB at B={from_batch_size} -> {peak_to_mib:.1f} MiB at "
        f"B={to_batch_size}, growth {growth:+.1f} MiB = {growth / batch_mib:.2f} large batches "
        f"of inputs ({batch_mib:.1f} MiB); bound 1 batch + {slack:.0%} = {allowed:.1f} MiB; "
        f"target <= {target:g} batch {'met' if met else 'missed'}")
    return {"peak_from_mib": peak_from_mib, "peak_to_mib": peak_to_mib, "growth_mib": growth,
            "input_batch_mib": batch_mib, "growth_in_batches": growth / batch_mib,
            "allowed_mib": allowed, "status": "PASS" if growth <= allowed else "MISS",
            "target_batches": target, "target_met": met, "summary": summary}


def status(passed: bool | None) -> str:
    return "N/A" if passed is None else ("PASS" if passed else "MISS")


# ---------------------------------------------------------------- the report


def text_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain table: the first column left-aligned, the others right."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def line(row: Sequence[str]) -> str:
        cells = [str(row[0]).ljust(widths[0])]
        cells += [str(c).rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)]
        return "  ".join(cells).rstrip()

    return "\n".join([line(header), "  ".join("-" * w for w in widths),
                      *(line(r) for r in rows)])


def md_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """A Markdown table: the first column left-aligned, the others right."""
    return (["| " + " | ".join(header) + " |",
             "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
            + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])


def report_head(title: str, report: Mapping[str, Any]) -> list[str]:
    """The lines every Markdown report opens with."""
    return [f"# {title}", "", report["question"], "", f"Reproduce: `{report['command']}`", "",
            f"Machine: {machine_line(report['machine'])}.", "", f"Units: {report['units']}."]


def check_lines(checks: Sequence[Mapping[str, Any]]) -> list[str]:
    return [f"- ({c['id']}) **{c['status']}**: {c['summary']}" for c in checks]


def report_tail(report: Mapping[str, Any], image: str | None = None) -> str:
    """The end of every Markdown report: checks, notes, the plot; the whole text."""
    lines = ["", "", "## Checks", "", *check_lines(report["checks"])]
    if report.get("notes"):
        lines += ["", "## Notes", "", *(f"- {n}" for n in report["notes"])]
    if image:
        lines += ["", f"![{image.rsplit('.', 1)[0].replace('_', ' ')}]({image})"]
    return "\n".join(lines) + "\n"


def conclude(out: Path | None, name: str, report: Mapping[str, Any], markdown: str,
             plot: Callable[[Path], None] | None = None) -> list[Path]:
    """Print the report's checks, notes and total time, then :func:`write_report`."""
    log("\nChecks:")
    for c in report.get("checks", []):
        log(f"  ({c['id']}) {c['status']:<4}  {c['summary']}")
    for line in report.get("notes", []):
        log(f"note: {line}")
    if "seconds" in report:
        log(f"total {report['seconds']:.0f} s")
    return write_report(out, name, report, markdown, plot)


def write_report(out: Path | None, name: str, report: Mapping[str, Any], markdown: str,
                 plot: Callable[[Path], None] | None = None) -> list[Path]:
    """``name``.json, ``name``.md and, with ``plot``, ``name``.png in ``out`` (none if None)."""
    if out is None:
        return []
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{name}.json", out / f"{name}.md"]
    paths[0].write_text(json.dumps(report, indent=2) + "\n")
    paths[1].write_text(markdown)
    if plot is not None:
        paths.append(out / f"{name}.png")
        plot(paths[-1])
    log("wrote " + ", ".join(str(p) for p in paths))
    return paths


def wall_clock() -> Callable[[], float]:
    """Seconds since this call, for a script's total."""
    start = time.perf_counter()
    return lambda: time.perf_counter() - start


def begin(args: argparse.Namespace, full: Any, quick: Any
          ) -> tuple[Any, Callable[[], float], dict[str, Any]]:
    """A script's start: its settings (``quick``'s or ``full``'s, ``--repeats`` as
    given), its clock (:func:`wall_clock`) and the machine, logged."""
    at_least("repeats", args.repeats)
    settings = quick if args.quick else full
    settings = dataclasses.replace(settings, repeats=args.repeats or settings.repeats)
    clock, info = wall_clock(), machine_info()
    log(f"# {machine_line(info)}")
    return settings, clock, info
