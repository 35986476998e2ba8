"""On a GPU: does autosplit keep the device's peak flat in B, what does the probe
choose, and how fast is it next to plain Keras at the micro-batch?

One command for a user with an NVIDIA GPU (``python -m benchmarks.gpu_check``), all in
this process on ``GPU:0``:

1. ``autosplit.probe`` at B = 16384 (``--memory-limit`` to search under a budget
   smaller than the GPU): the size chosen, why, and every trial;
2. the device's peak (``tf.config.experimental.get_memory_info('GPU:0')['peak']``,
   reset at the start of each measured epoch) at a fixed m = 128 for B = 512 ...
   16384, training with ``fit_large_batch`` from a ``tf.data`` pipeline of examples
   and from arrays, next to plain ``model.fit(batch_size=B)``; the data set is the
   same for every B (two of the largest batches);
3. samples/s of ``fit_large_batch`` at the largest B against plain
   ``model.fit(batch_size=m)``, round-robin.

Every point runs in this one process, whose holdings creep up from run to run
(caches ``keras.backend.clear_session`` keeps), so each point also records its peak
above what the process held when the epoch began: what the epoch itself added.

Checks, from the measured numbers: (a) for each input kind, that added peak grows from
the smallest to the largest B by at most one large batch of inputs plus 10% (target: a
quarter of a batch; autosplit's pipeline keeps the data on the host); (b) the speed
ratio is 0.95 or better.

Without a GPU the same code runs on ``CPU:0`` (peaks from TensorFlow's allocator when
the process starts with ``TF_CPU_ALLOCATOR_USE_BFC=true``, else the process's
resident high-water mark); ``tests/bench/`` runs it so with ``--quick``.

Units: MiB (2**20 bytes) of the device's allocator; samples/s = training examples per
wall-clock second over the timed epochs.

Reproduce::

    python -m benchmarks.gpu_check                      # a few minutes on one GPU
    python -m benchmarks.gpu_check --memory-limit 2GiB  # the probe under a budget
    python -m benchmarks.gpu_check --quick --out /tmp/gpu_check

The full run writes ``benchmarks/results/gpu_check.{json,md,png}``; ``--quick`` writes
files only with ``--out DIR``.
"""

from __future__ import annotations

import os
from pathlib import Path

if __name__ == "__main__":
    # Without a GPU, read TensorFlow's CPU allocator (set before TensorFlow loads).
    os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")

import gc
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import keras
import tensorflow as tf

import autosplit
from autosplit.memory.device import read_device
from benchmarks import harness, plots, workloads
from benchmarks.harness import MIB, OOM
from benchmarks.plots import Panel, Series

QUESTION = ("On a GPU, does autosplit keep the device's peak flat in B at a fixed "
            "micro-batch, what does the probe choose, and how fast is fit_large_batch next "
            "to plain Keras at the micro-batch?")
UNITS = ("peak memory in MiB (the device's TensorFlow allocator); samples/s = training "
         "examples per wall-clock second over the timed epochs")
METHODS = ("autosplit_examples", "autosplit_arrays", "keras")
SHORT = {"autosplit_examples": "autosplit, tf.data of examples",
         "autosplit_arrays": "autosplit, arrays", "keras": "plain Keras @B"}


@dataclass(frozen=True)
class Settings:
    model: workloads.ModelSpec
    batch_sizes: tuple[int, ...]
    micro_batch_size: int = 128
    repeats: int = 2  # measured epochs per peak, after one warm-up epoch
    speed_repeats: int = 3  # round-robin passes of the speed comparison
    speed_epochs: int = 2  # timed epochs per speed run
    memory_limit: str | None = None  # the probe's budget; None: the whole device
    seed: int = 0

    @property
    def rows(self) -> int:
        return 2 * max(self.batch_sizes)


FULL = Settings(model=workloads.TRANSFORMER, batch_sizes=tuple(512 * 2**i for i in range(6)))
QUICK = replace(FULL, model=workloads.mlp_spec(32, (64, 64)), batch_sizes=(256, 512),
                micro_batch_size=64, repeats=1, speed_repeats=1, speed_epochs=1)


def device_name() -> str:
    return "GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0"


def run_probe(s: Settings, x, y) -> dict[str, Any]:
    keras.backend.clear_session()
    model = workloads.build_model(s.model, seed=s.seed)
    B = max(s.batch_sizes)
    try:
        result = autosplit.probe(model, x, y, batch_size=B, memory_limit=s.memory_limit,
                                 cache=False)
    except autosplit.NothingFitsError as exc:
        return {"status": OOM, "batch_size": B, "error": str(exc)}
    return {"status": "ok", "reason": result.reason(), **result.to_dict()}


def peaks(s: Settings, device: str, x, y, say: harness.Log) -> list[dict[str, Any]]:
    points = []
    for B in s.batch_sizes:
        methods = {}
        for method in METHODS:
            keras.backend.clear_session()
            gc.collect()
            r = workloads.measure(method, s.model, x, y, batch_size=B,
                                  micro_batch_size=s.micro_batch_size, repeats=s.repeats,
                                  device=device, seed=s.seed)
            r.pop("epochs")
            if r["status"] == "ok":
                r["step_peak_mib"] = r["peak_mib"] - r["held_mib"]
            else:
                r["peak_mib"] = r["step_peak_mib"] = r["samples_per_s"] = r["status"]
            methods[method] = r
            say(f"  B={B:<6} {method:<19} " + (
                f"peak {r['peak_mib']:9.1f} MiB, {r['step_peak_mib']:8.1f} above what was "
                f"held  {r['samples_per_s']:9,.0f} samples/s"
                if r["status"] == "ok" else f"{r['status']} ({r.get('error', '')[:120]})"))
        points.append({"batch_size": B, "accumulation_steps": B // s.micro_batch_size,
                       "methods": methods})
    return points


def speed(s: Settings, x, y, say: harness.Log) -> dict[str, Any]:
    B, m = max(s.batch_sizes), s.micro_batch_size
    weights = workloads.build_model(s.model, seed=s.seed).get_weights()
    runs = {method: (lambda method=method: workloads.timed(
        method, s.model, x, y, batch_size=B, micro_batch_size=m, epochs=s.speed_epochs,
        weights=weights, seed=s.seed)) for method in ("autosplit_arrays", "keras_at_m")}
    say(f"# speed: fit_large_batch(B={B}, m={m}) vs model.fit(batch_size={m})")
    return {"batch_size": B, "micro_batch_size": m,
            "methods": harness.speed_summary(harness.round_robin(runs, s.speed_repeats, say),
                                             "keras_at_m")}


def checks(report: dict[str, Any]) -> list[dict[str, Any]]:
    points = report["points"]
    lo, hi = points[0], points[-1]
    batch_mib = hi["batch_size"] * report["example_bytes"] / MIB
    out = []
    for method in ("autosplit_examples", "autosplit_arrays"):
        a, b = (p["methods"][method]["step_peak_mib"] for p in (lo, hi))
        c = harness.growth_check(*(v if isinstance(v, float) else None for v in (a, b)),
                                 batch_mib, label=SHORT[method],
                                 from_batch_size=lo["batch_size"], to_batch_size=hi["batch_size"])
        c.update(id=f"a-{method.removeprefix('autosplit_')}", method=method)
        out.append(c)
    ratio = report["speed"]["methods"]["autosplit_arrays"]["ratio"]
    out.append({"id": "speed", "ratio": ratio, "status": harness.status(ratio >= 0.95),
                "summary": f"fit_large_batch(B={report['speed']['batch_size']}) / model.fit("
                           f"batch_size={report['speed']['micro_batch_size']}) samples/s = "
                           f"{ratio:.2f} (target >= 0.95)"})
    return out


def table(points: Sequence[dict[str, Any]], name: str, fmt: str):
    header = ["B", "k"] + [SHORT[m] for m in METHODS]
    return header, [[str(p["batch_size"]), str(p["accumulation_steps"])]
                    + [format(v, fmt) if isinstance(v := p["methods"][m][name], float) else
                       str(v) for m in METHODS] for p in points]


def markdown(report: dict[str, Any]) -> str:
    d, probe = report["device"], report["probe"]
    lines = harness.report_head("GPU check: device peak, probe and speed", report)
    lines += ["", f"Device: {d['name']} ({d['tf_device']}, {d['total_bytes'] / MIB:,.0f} MiB "
              f"total); peak source {report['peak_source']}. Model: {report['model']}; "
              f"m = {report['settings']['micro_batch_size']}.", "", "## The probe", "",
              f"B={probe.get('batch_size')}: micro-batch {probe.get('micro_batch_size', '-')} "
              f"(k={probe.get('accumulation_steps', '-')}): "
              f"{probe.get('reason') or probe.get('error')}", ""]
    lines += harness.md_table(["m", "fits", "OOM", "peak MiB", "seconds"], [
        [str(t["micro_batch_size"]), str(t["fits"]), str(t["oom"]),
         "-" if t["peak_bytes"] is None else f"{t['peak_bytes'] / MIB:.1f}",
         f"{t['seconds']:.2f}"] for t in probe.get("trials", [])])
    lines += ["", "## Peak memory, MiB", "", *harness.md_table(*table(report["points"],
                                                                     "peak_mib", ".1f"))]
    lines += ["", "## Peak above what the process held at the start of the epoch, MiB", "",
              "What the epoch itself added (its pipeline and its steps): the growth check "
              "reads this, because the points share one process, whose holdings creep up "
              "with each run (Keras and tf.data caches that `clear_session` keeps).", "",
              *harness.md_table(*table(report["points"], "step_peak_mib", ".1f"))]
    lines += ["", "## Samples/s (single epochs)", "",
              *harness.md_table(*table(report["points"], "samples_per_s", ",.0f"))]
    return "\n".join(lines) + harness.report_tail(report, "gpu_check.png")


def plot(report: dict[str, Any], path: Path) -> None:
    xs = [p["batch_size"] for p in report["points"]]
    panels = []
    for name, title in (("peak_mib", "peak"), ("step_peak_mib", "peak above what was held")):
        series = []
        for method in METHODS:
            ok = [p for p in report["points"] if isinstance(p["methods"][method][name], float)]
            series.append(Series(SHORT[method], [p["batch_size"] for p in ok],
                                 [p["methods"][method][name] for p in ok]))
        panels.append(Panel(f"{report['model']}: {title}", f"MiB ({report['peak_source']})",
                            series, logy=True, xticks=xs))
    plots.line_plot(path, [panels], f"{report['device']['name']}: device memory at m = "
                    f"{report['settings']['micro_batch_size']}")


def main(argv: Sequence[str] | None = None) -> int:
    p = harness.parser("On GPU:0 (else the CPU): the probe's choice and trials, the device "
                       "peak against B at a fixed micro-batch, and samples/s against plain "
                       "Keras at the micro-batch.", quick="a small MLP, B = 256 and 512",
                       repeats=FULL.repeats)
    p.add_argument("--memory-limit", help="the probe's budget, e.g. 2GiB (default: the device)")
    args = p.parse_args(argv)
    harness.at_least("repeats", args.repeats)
    s = QUICK if args.quick else FULL
    s = replace(s, repeats=args.repeats or s.repeats, memory_limit=args.memory_limit)
    device = device_name()
    info = harness.machine_info(devices=True)
    harness.log(f"# {harness.machine_line(info)}")
    if device == "CPU:0":
        harness.log("# no GPU: the same measurements on CPU:0")
    x, y = workloads.synthetic(s.rows, s.model.input_shape, seed=s.seed)
    report: dict[str, Any] = {
        "question": QUESTION, "command": harness.command("gpu_check", argv), "units": UNITS,
        "machine": info, "device": read_device(device).to_dict(), "model": s.model.label,
        "settings": {**asdict(s), "rows": s.rows},
        "example_bytes": workloads.example_bytes(x, y)}
    harness.log(f"# probe at B={max(s.batch_sizes)}")
    report["probe"] = run_probe(s, x, y)
    harness.log(f"  {report['probe'].get('reason') or report['probe'].get('error')}")
    harness.log(f"# peaks at m={s.micro_batch_size}")
    report["points"] = peaks(s, device, x, y, harness.log)
    report["peak_source"] = report["points"][0]["methods"]["autosplit_arrays"]["peak_source"]
    report["speed"] = speed(s, x, y, harness.log)
    report["checks"] = checks(report)

    harness.log(f"\nPeak MiB above what was held ({report['peak_source']}) on {device}:")
    harness.log(harness.text_table(*table(report["points"], "step_peak_mib", ".1f")))
    harness.conclude(harness.out_dir(args), "gpu_check", report, markdown(report),
                         lambda path: plot(report, path))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
