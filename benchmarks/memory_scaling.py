"""What does a larger batch cost in memory, at a fixed micro-batch?

For B = 512, 1024, ..., 16384 and a fixed micro-batch m = 128, two models (the MLP
128-1024-1024-10 and the 2-layer Transformer encoder over (16, 16) inputs, Adam) are
trained six ways (``benchmarks.workloads.METHODS``):

1. ``autosplit.fit_large_batch(B, m)`` from a ``tf.data`` pipeline of single examples,
2. from arrays ``(x, y)``,
3. from a pipeline already batched by 32 (autosplit rebatches it);
4. plain Keras ``model.fit(batch_size=B)`` (runs out of memory at large B under the cap);
5. Keras's own accumulation: ``Adam(gradient_accumulation_steps=B // m)`` and
   ``model.fit(batch_size=m)``;
6. the bare loop: one ``tf.function`` whose ``tf.while_loop`` (``parallel_iterations=1``)
   pulls micro-batches from a ``tf.data`` iterator, sums their gradients, applies once.

The data set is the same for every B: 2 x 16384 rows, so every epoch holds at least
two large batches (a prefetched large batch would show). Every point (model, B,
method) runs in its own fresh child process whose TensorFlow CPU allocator is a BFC
allocator hard-capped at the model's cap (``autosplit.capped.run_capped``): going past it
raises a real ``ResourceExhaustedError``. One warm-up epoch, then ``--repeats``
measured epochs; the ``PeakMeter`` (``tf.config.experimental.get_memory_info``) is
reset at the start of each and read at its end. A point's peak is the smallest over
its measured epochs, its samples/s the largest.

Checks, computed from the measured numbers:

- (a) for each input kind: autosplit's peak grows from B = 512 to 16384 by at most one
  large batch of inputs plus 10% of its peak at 512 (target: a quarter of a batch);
- (b) for each input kind: autosplit's peak at or below Keras's accumulation at the
  same m, at every B;
- (c) under the cap autosplit trains at every B, and plain Keras does not.

Units: MiB (2**20 bytes) of TensorFlow's allocator (BFC chunks, fragmentation
included); samples/s = training examples per wall-clock second of a measured epoch.

Reproduce (on an otherwise idle machine)::

    python -m benchmarks.memory_scaling          # 72 children, ~20 min on 2 cores
    python -m benchmarks.memory_scaling --quick  # the Transformer, B = 512, 1024

The full run writes ``benchmarks/results/memory_scaling.{json,md,png}``; ``--quick``
writes files only with ``--out DIR``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks import harness, plots
from benchmarks.harness import MIB, OOM
from benchmarks.plots import Panel, Series

QUESTION = ("What does a larger batch cost in memory at a fixed micro-batch? Peak TensorFlow "
            "allocator memory of autosplit (three input kinds), plain Keras at B, Keras's "
            "gradient_accumulation_steps and a bare while-loop, for B = 512 ... 16384 at "
            "m = 128, each point in its own child under a real memory cap.")
UNITS = ("peak memory in MiB (TensorFlow CPU allocator, BFC); samples/s = training examples "
         "per wall-clock second over a measured epoch")
KINDS = {"examples": "tf.data of examples", "arrays": "arrays", "batched": "tf.data .batch(32)"}
METHODS = ("autosplit_examples", "autosplit_arrays", "autosplit_batched", "keras",
           "keras_accumulation", "bare_loop")
SHORT = {"autosplit_examples": "autosplit, examples", "autosplit_arrays": "autosplit, arrays",
         "autosplit_batched": "autosplit, .batch(32)", "keras": "plain Keras @B",
         "keras_accumulation": "Keras accumulation @m", "bare_loop": "bare loop @m"}
NOT_RUN = {"status": "not run", "peak_mib": "not run", "samples_per_s": "not run"}
STYLE = {"autosplit_examples": ("tab:blue", "s"), "autosplit_arrays": ("tab:cyan", "^"),
         "autosplit_batched": ("tab:purple", "v"), "keras": ("tab:red", "o"),
         "keras_accumulation": ("tab:green", "D"), "bare_loop": ("tab:gray", "x")}


@dataclass(frozen=True)
class Case:
    """One model and the cap it is measured under (the same for every B)."""

    model: str  # a key of benchmarks.workloads.MODELS
    cap_mib: int


@dataclass(frozen=True)
class Settings:
    cases: tuple[Case, ...]
    batch_sizes: tuple[int, ...]
    micro_batch_size: int = 128
    repeats: int = 2  # measured epochs per point, after one warm-up epoch
    methods: tuple[str, ...] = METHODS
    seed: int = 0
    child_timeout_s: int = 1800

    @property
    def rows(self) -> int:
        """The data set, the same for every B: two of the largest batches."""
        return 2 * max(self.batch_sizes)


FULL = Settings(cases=(Case("mlp", 128), Case("transformer", 192)),
                batch_sizes=tuple(512 * 2**i for i in range(6)))
# Plain Keras at B = 1024 needs about 78 MiB for the Transformer: it fails under 64.
QUICK = replace(FULL, cases=(Case("transformer", 64),), batch_sizes=(512, 1024), repeats=1)


# ---------------------------------------------------------------- the child


def run_point(task: dict[str, Any]) -> dict[str, Any]:
    """One method at one B in this (capped) process."""
    from benchmarks import workloads

    spec = workloads.MODELS[task["model"]]
    x, y = workloads.synthetic(task["rows"], spec.input_shape, seed=task["seed"])
    result = workloads.measure(task["method"], spec, x, y, batch_size=task["batch_size"],
                               micro_batch_size=task["micro_batch_size"],
                               repeats=task["repeats"], seed=task["seed"])
    return {**result, "model_label": spec.label}


# ---------------------------------------------------------------- the parent


def public(r: dict[str, Any]) -> dict[str, Any]:
    """A child's result with a number or a word for the peak and samples/s."""
    out = dict(r)
    out.pop("epochs", None)
    if r["status"] != "ok":
        out["peak_mib"] = out["samples_per_s"] = OOM if r["status"] == OOM else "error"
    return out


def describe(r: dict[str, Any]) -> str:
    if r["status"] == "ok":
        ooms = len(r.get("oom_recoveries") or [])
        recovered = f"  {ooms} OOM recoveries" if ooms else ""
        return (f"{r['peak_mib']:8.1f} MiB  {r['samples_per_s']:9,.0f} samples/s  "
                f"m={r['micro_batch_size']} k={r['accumulation_steps']}{recovered}")
    return f"     {r['status']} ({r.get('oom_where') or r.get('error', '')[-200:]})"


def measure_case(case: Case, s: Settings, jobs: int, say: harness.Log) -> dict[str, Any]:
    """Every point of one model, each in its own capped child (this process never
    loads TensorFlow)."""
    tasks = [{"model": case.model, "method": method, "batch_size": B,
              "micro_batch_size": s.micro_batch_size, "rows": s.rows, "repeats": s.repeats,
              "seed": s.seed} for B in s.batch_sizes for method in s.methods]

    def call(task: dict[str, Any]):
        def go() -> dict[str, Any]:
            r = harness.run_child("memory_scaling", task, case.cap_mib,
                                  timeout=s.child_timeout_s)
            say(f"  {case.model:<11} B={task['batch_size']:<6} {task['method']:<19} "
                f"{describe(r)}  ({r['child_wall_s']:.1f} s)")
            return r
        return go

    # The largest B first: with --jobs > 1 the longest children (and the OOMs, which
    # wait ~10 s in the allocator's retries) start early.
    tasks.sort(key=lambda t: -t["batch_size"])
    results = harness.run_all([call(t) for t in tasks], jobs)
    by_point = {(t["batch_size"], t["method"]): public(r)
                for t, r in zip(tasks, results, strict=True)}
    first = next((r for r in results if r.get("example_bytes")), {})
    weights = next((r["trainable_weight_bytes"] for r in results
                    if r.get("trainable_weight_bytes")), None)
    return {"label": first.get("model_label", case.model), "cap_mib": case.cap_mib,
            "rows": s.rows, "micro_batch_size": s.micro_batch_size,
            "example_bytes": first.get("example_bytes"), "trainable_weight_bytes": weights,
            "points": [{"batch_size": B, "accumulation_steps": B // s.micro_batch_size,
                        "methods": {m: by_point.get((B, m), NOT_RUN) for m in METHODS}}
                       for B in s.batch_sizes]}


# ---------------------------------------------------------------- checks


def _peak(point: dict[str, Any], method: str) -> float | None:
    value = (point["methods"].get(method) or {}).get("peak_mib")
    return value if isinstance(value, (int, float)) else None


def checks_for(key: str, model: dict[str, Any]) -> list[dict[str, Any]]:
    """Checks (a), (b), (c) of one model, from its measured points."""
    points = sorted(model["points"], key=lambda p: p["batch_size"])
    lo, hi = points[0], points[-1]
    batch_mib = hi["batch_size"] * (model["example_bytes"] or 0) / MIB
    out = []
    for kind, label in KINDS.items():
        method = f"autosplit_{kind}"
        c = harness.growth_check(_peak(lo, method), _peak(hi, method), batch_mib,
                                 label=f"{key}, autosplit from {label}",
                                 from_batch_size=lo["batch_size"], to_batch_size=hi["batch_size"])
        c.update(id=f"a-{kind}", model=key, method=method, from_batch_size=lo["batch_size"],
                 to_batch_size=hi["batch_size"])
        out.append(c)
    for kind, label in KINDS.items():
        method = f"autosplit_{kind}"
        rows = [{"batch_size": p["batch_size"], "autosplit_mib": a, "keras_accumulation_mib": k,
                 "ratio": a / k} for p in points
                if (a := _peak(p, method)) is not None
                and (k := _peak(p, "keras_accumulation")) is not None]
        c = {"id": f"b-{kind}", "model": key, "method": method, "rows": rows,
             "status": harness.status(all(r["ratio"] <= 1 for r in rows) if rows else None)}
        if rows:
            worst = max(rows, key=lambda r: r["ratio"])
            c["summary"] = (f"{key}, autosplit from {label} / Keras accumulation at m: "
                            + ", ".join(f"B={r['batch_size']} {r['ratio']:.2f}" for r in rows)
                            + f"; worst {worst['ratio']:.2f} at B={worst['batch_size']} "
                            f"({worst['autosplit_mib']:.1f} vs "
                            f"{worst['keras_accumulation_mib']:.1f} MiB); target <= 1")
        else:
            c["summary"] = f"{key}, autosplit from {label}: no B with both peaks"
        out.append(c)
    ran = [kind for kind in KINDS
           if all(p["methods"][f"autosplit_{kind}"] is not NOT_RUN for p in points)]
    trained = {kind: [p["batch_size"] for p in points
                      if p["methods"][f"autosplit_{kind}"]["status"] == "ok"] for kind in ran}
    keras_oom = [p["batch_size"] for p in points if p["methods"]["keras"]["status"] == OOM]
    keras_ran = all(p["methods"]["keras"] is not NOT_RUN for p in points)
    everywhere = all(len(b) == len(points) for b in trained.values())
    out.append({"id": "c", "model": key, "trained": trained, "keras_oom": keras_oom,
                "status": harness.status(everywhere and bool(keras_oom)
                                         if ran and keras_ran else None),
                "summary": (f"{key} under {model['cap_mib']} MiB: autosplit trained at "
                            + (", ".join(f"{len(b)}/{len(points)} ({kind})"
                                         for kind, b in trained.items()) or "- (not run)")
                            + " sizes; plain Keras OOM at B in "
                            + (str(keras_oom or "none") if keras_ran else "- (not run)"))})
    return out


def notes(models: dict[str, Any]) -> list[str]:
    out = []
    for key, model in models.items():
        for p in model["points"]:
            for method, r in p["methods"].items():
                where = f"{key}, B={p['batch_size']}, {method}"
                if r.get("oom_recoveries"):
                    out.append(f"{where}: recovered from an OOM in training "
                               f"{r['oom_recoveries']} (marked * in the tables).")
                if r["status"] == "error":
                    out.append(f"{where}: the child failed: {r.get('error', '')[-300:]}")
                if str(r.get("oom_where", "")).startswith("crashed"):
                    out.append(f"{where}: the child {r['oom_where']}; counted as OOM.")
                if r["status"] == "ok" and r.get("peak_source") != "tf-allocator":
                    out.append(f"{where}: peak source {r.get('peak_source')}, not the allocator.")
    return out


# ---------------------------------------------------------------- reporting


def _cell(r: dict[str, Any], name: str, fmt: str) -> str:
    value = r.get(name)
    if isinstance(value, (int, float)):
        return format(value, fmt) + ("*" if r.get("oom_recoveries") else "")
    return f"**{value}**" if value == OOM else str(value)


def table(model: dict[str, Any], name: str, fmt: str) -> tuple[list[str], list[list[str]]]:
    header = ["B", "k"] + [SHORT[m] for m in METHODS]
    rows = [[str(p["batch_size"]), str(p["accumulation_steps"])]
            + [_cell(p["methods"][m], name, fmt) for m in METHODS] for p in model["points"]]
    return header, rows


def markdown(report: dict[str, Any]) -> str:
    s = report["settings"]
    lines = harness.report_head("Memory scaling: peak memory vs the batch size at a fixed "
                                "micro-batch", report)
    lines += ["", f"m = {s['micro_batch_size']} for every B; {s['repeats']} measured epoch(s) "
              "after one warm-up; each point a fresh child process under the model's cap. "
              "`OOM`: a real `ResourceExhaustedError` under the cap; `*`: autosplit recovered "
              "from one in training."]
    for model in report["models"].values():
        lines += ["", f"## {model['label']} (cap {model['cap_mib']} MiB)", "",
                  f"{model['rows']} rows of {model['example_bytes']} bytes (input and label); "
                  f"trainable weights {(model['trainable_weight_bytes'] or 0) / MIB:.2f} MiB.",
                  "", "Peak memory, MiB:", ""]
        lines += harness.md_table(*table(model, "peak_mib", ".1f"))
        lines += ["", "Throughput, samples/s:", ""]
        lines += harness.md_table(*table(model, "samples_per_s", ",.0f"))
    return "\n".join(lines) + harness.report_tail(report, "memory_scaling.png")


def plot(report: dict[str, Any], path: Path) -> None:
    tops, bottoms = [], []
    for model in report["models"].values():
        sizes = [p["batch_size"] for p in model["points"]]
        peaks, rates = [], []
        for method in METHODS:
            ok = [p for p in model["points"] if _peak(p, method) is not None]
            color, marker = STYLE[method]
            failed = [p["batch_size"] for p in model["points"]
                      if p["methods"][method]["status"] == OOM]
            peaks.append(Series(SHORT[method], [p["batch_size"] for p in ok],
                                [p["methods"][method]["peak_mib"] for p in ok], color, marker,
                                failed=failed, failed_y=model["cap_mib"]))
            rates.append(Series(SHORT[method], [p["batch_size"] for p in ok],
                                [p["methods"][method]["samples_per_s"] for p in ok], color,
                                marker))
        tops.append(Panel(f"{model['label']}: peak memory", "peak MiB (TF allocator)", peaks,
                          logy=True, hline=(model["cap_mib"], f"cap {model['cap_mib']} MiB"),
                          xticks=sizes))
        bottoms.append(Panel(f"{model['label']}: throughput", "samples/s", rates, xticks=sizes))
    plots.line_plot(path, [tops, bottoms], f"Memory scaling at m = "
                    f"{report['settings']['micro_batch_size']} (peak source: TF allocator)")


def main(argv: Sequence[str] | None = None) -> int:
    p = harness.parser(
        "Peak memory (TF allocator, under a real cap) vs the batch size B at a fixed "
        "micro-batch: autosplit from three input kinds, plain Keras, Keras's accumulation "
        "and a bare while-loop.", quick="the Transformer, B = 512 and 1024, a 64 MiB cap",
        repeats=FULL.repeats, children=True)
    p.add_argument("--methods", help=f"comma-separated subset of {','.join(METHODS)}")
    args = p.parse_args(argv)
    if args.child:
        return harness.serve_child(args.child, run_point)
    harness.at_least("repeats", args.repeats)
    harness.at_least("jobs", args.jobs)
    s = QUICK if args.quick else FULL
    if args.repeats is not None:
        s = replace(s, repeats=args.repeats)
    if args.methods:
        s = replace(s, methods=tuple(harness.subset("methods", args.methods, list(METHODS))))

    clock, info = harness.wall_clock(), harness.machine_info()
    harness.log(f"# {harness.machine_line(info)}")
    harness.log(f"# B = {', '.join(map(str, s.batch_sizes))}; m = {s.micro_batch_size}; "
                f"{s.rows} rows; {s.repeats} measured epoch(s) per point")
    models = {case.model: measure_case(case, s, args.jobs, harness.log) for case in s.cases}
    report: dict[str, Any] = {
        "question": QUESTION, "command": harness.command("memory_scaling", argv),
        "units": UNITS, "machine": info, "settings": {**asdict(s), "rows": s.rows},
        "models": models,
        "checks": [c for key, model in models.items() for c in checks_for(key, model)],
        "notes": notes(models)}
    report["seconds"] = clock()

    for model in models.values():
        harness.log(f"\n{model['label']}, cap {model['cap_mib']} MiB: peak MiB")
        harness.log(harness.text_table(*table(model, "peak_mib", ".1f")))
        harness.log(f"\n{model['label']}: samples/s")
        harness.log(harness.text_table(*table(model, "samples_per_s", ",.0f")))
    harness.conclude(harness.out_dir(args), "memory_scaling", report, markdown(report),
                         lambda path: plot(report, path))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
