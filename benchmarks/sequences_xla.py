"""Sequences under XLA: micro-batches in tokens with a bounded set of programs.

On a GPU, Keras's ``compile()`` turns XLA on (``jit_compile="auto"``), and XLA compiles
a program per shape of a step's inputs. The question: cut in tokens under XLA (each
length rounded up to a geometric bucket, each micro-batch's rows to one of two counts,
``autosplit/data/sequences/by_length.py``), how many real tokens per second does
training reach against the same cut without XLA, how much padding does it feed, how many
programs does it compile, and how long does its first epoch (compiling them) take
against a steady one's and against Keras's own gradient accumulation under XLA?

Data and models: ``benchmarks/sequence_data.py``'s IMDB-shaped lengths (divided by 4:
up to 625 tokens), a masked GRU classifier (``gru``) and a causal language model
(``causal_lm``), as in ``benchmarks/sequences.py``. Methods, from the same weights, side
by side (round-robin repeats):

- ``tokens``: ``fit_large_batch(micro_batch_tokens=m x the longest row,
  jit_compile=False)``;
- ``tokens_xla``: the same with ``jit_compile=True``;
- ``keras_accumulation_xla``: ``model.fit`` on ``padded_batch(m)`` with
  ``Adam(gradient_accumulation_steps=B/m)``, compiled with ``jit_compile=True``: a
  program per distinct padded length of a micro-batch.

Each run is a fresh child process (``harness.run_child``, no cap): its first epoch is
a user's first, with nothing compiled before it, and XLA's compiled code, which a
process keeps, does not pile up (a run of every method in one process failed in LLVM,
"Cannot allocate memory", after some hundreds of Keras's programs).

Units: real tokens per second in the last (steady) epoch; the first epoch's seconds,
set-up included (the whole call's time less its later epochs'), and its ratio to a
steady epoch's; programs: ``FitReport.programs`` (the shapes given to the XLA step)
for autosplit, the distinct shapes of ``padded_batch(m)`` for Keras; padding share =
1 - real tokens / token cells fed; peak: TensorFlow's CPU allocator (BFC) in the steady
epoch, MiB (XLA's CPU runtime allocates its temporaries outside it: autosplit's own
figures under XLA are the BFC's share only).

Reproduce::

    python -m benchmarks.sequences_xla            # ~19 min on 2 cores
    python -m benchmarks.sequences_xla --quick    # a smoke run
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from typing import Any

from benchmarks import harness
from benchmarks import sequence_data as data
from benchmarks.sequences import Settings, budget, examples, shares_and_runs

QUESTION = ("Cut in tokens under XLA, how many real tokens per second does training "
            "reach against the same cut without XLA, with how much padding, how many "
            "programs, and how long a first epoch against Keras's accumulation under XLA?")
UNITS = ("real tokens per second in the steady epoch; first epoch seconds (set-up "
         "included) and its ratio to a steady one; programs compiled; padding share; "
         "peak MiB of TensorFlow's CPU allocator")
MODELS = ("gru", "causal_lm")
METHODS = ("tokens", "tokens_xla", "keras_accumulation_xla")
EPOCHS = 2

FULL = Settings(models=MODELS)
QUICK = Settings(rows=256, batch_size=64, micro_batch_size=16, scale=16, repeats=1,
                 models=MODELS)


def run(kind: str, method: str, settings: Settings) -> dict[str, Any]:
    """One method on one model: ``EPOCHS`` epochs, each timed."""
    import keras

    import autosplit
    from autosplit.memory.peak_meter import PeakMeter

    meter, records = PeakMeter(), []
    m, b = settings.micro_batch_size, settings.batch_size

    class Timer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            meter.reset()
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            records.append({"seconds": time.perf_counter() - self.start,
                            "peak": meter.peak_bytes()})

    rows, programs = examples(kind, settings), None
    start = time.perf_counter()
    if method == "keras_accumulation_xla":
        data.build(kind, b // m, jit_compile=True).fit(
            rows.padded_batch(m), epochs=EPOCHS, verbose=0, callbacks=[Timer()])
        programs = len({tuple(t.shape) for x, *_ in rows.padded_batch(m)
                        for t in x.values()} if kind in data.PAIRS
                       else {tuple(x.shape) for x, *_ in rows.padded_batch(m)})
    else:
        history = autosplit.fit_large_batch(
            data.build(kind, jit_compile=method == "tokens_xla"), rows, batch_size=b,
            micro_batch_tokens=budget(settings, kind), epochs=EPOCHS, verbose=0,
            by_length=True, callbacks=[Timer()], cache=False)
        programs = history.autosplit.programs
    total = time.perf_counter() - start
    steady = records[-1]["seconds"]
    return {"seconds": steady, "first_seconds": total - sum(r["seconds"] for r in records[1:]),
            "peak_mib": records[-1]["peak"] / 2**20, "programs": programs}


def _in_child(kind: str, method: str, settings: Settings) -> dict[str, Any]:
    found = harness.run_child("sequences_xla", {"kind": kind, "method": method,
                                                "settings": asdict(settings)}, None,
                              timeout=1800)
    if "seconds" not in found:
        raise RuntimeError(f"{kind} {method}: {found.get('error')}")
    return found


def _child(task: dict[str, Any]) -> dict[str, Any]:
    settings = Settings(**{k: tuple(v) if isinstance(v, list) else v
                           for k, v in task["settings"].items()})
    return run(task["kind"], task["method"], settings)


def measure(settings: Settings) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for kind in settings.models:
        shares, runs = shares_and_runs(kind, settings, METHODS, _in_child)
        speed = harness.speed_summary(runs, "tokens")
        results[kind] = {method: {
            "tokens_per_s": speed[method]["samples_per_s_median"],
            "vs_tokens": speed[method]["ratio_paired"],
            "first_seconds": statistics.median(r["first_seconds"] for r in runs[method]),
            "first_vs_steady": statistics.median(r["first_seconds"] / r["seconds"]
                                                 for r in runs[method]),
            "first_vs_keras": harness.paired_ratio(
                [r["first_seconds"] for r in runs[method]],
                [r["first_seconds"] for r in runs["keras_accumulation_xla"]]),
            "programs": runs[method][0]["programs"],
            "padding_share": shares[method][0],
            "peak_mib": statistics.median(r["peak_mib"] for r in runs[method])}
            for method in METHODS}
    return results


def checks(results: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for kind, by in results.items():
        xla = by["tokens_xla"]
        out += [
            {"id": f"{kind}-xla-speed", "status": harness.status(xla["vs_tokens"] >= 1.0),
             "summary": f"{kind}: in tokens under XLA {xla['vs_tokens']:.2f}x the tokens/s "
                        "of the same run without XLA (target >= 1)"},
            {"id": f"{kind}-xla-first-epoch", "status": harness.status(
                xla["first_vs_keras"] <= 0.5),
             "summary": f"{kind}: first epoch {xla['first_seconds']:.1f} s under XLA, "
                        f"{xla['first_vs_keras']:.2f} of Keras's accumulation under XLA "
                        f"({by['keras_accumulation_xla']['first_seconds']:.1f} s) (target "
                        "<= 0.5)"},
            {"id": f"{kind}-xla-programs", "status": harness.status(
                xla["programs"] is not None and xla["programs"] <= 20),
             "summary": f"{kind}: {xla['programs']} programs under XLA (target <= 20), "
                        f"Keras's accumulation {by['keras_accumulation_xla']['programs']}"}]
    return out


def markdown(report: dict[str, Any]) -> str:
    lines = harness.report_head("Sequences under XLA: tokens in a bounded set of programs",
                                report)
    header = ["model", "method", "tokens/s", "vs tokens", "first epoch s", "first / steady",
              "programs", "padding share", "peak MiB"]
    rows = [[kind, method, f"{r['tokens_per_s']:,.0f}", f"{r['vs_tokens']:.2f}",
             f"{r['first_seconds']:.1f}", f"{r['first_vs_steady']:.1f}", str(r["programs"]),
             f"{r['padding_share']:.2f}", f"{r['peak_mib']:.0f}"]
            for kind, by in report["results"].items() for method, r in by.items()]
    lines += ["", *harness.md_table(header, rows)]
    return "\n".join(lines) + harness.report_tail(report)


def main(argv: Sequence[str] | None = None) -> int:
    p = harness.parser(QUESTION, quick="256 rows, B=64, m=16, lengths / 16",
                       repeats=FULL.repeats, children=True)
    p.add_argument("--models", help=f"a comma-separated subset of {', '.join(MODELS)}")
    args = p.parse_args(argv)
    if "tensorflow" not in sys.modules:  # the CPU allocator's peak per epoch (else: RSS)
        os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
    if args.child:
        return harness.serve_child(args.child, _child)
    models = tuple(harness.subset("models", args.models, MODELS)) if args.models else MODELS
    s, clock, info = harness.begin(args, FULL, QUICK)
    s = replace(s, models=models)
    results = measure(s)
    report: dict[str, Any] = {
        "question": QUESTION, "command": harness.command("sequences_xla", argv),
        "units": UNITS, "machine": info, "settings": asdict(s), "results": results,
        "checks": checks(results),
        "notes": ["tokens: a budget of m rows of the costliest row, " + ", ".join(
            f"{kind} {budget(s, kind):,}" for kind in s.models) + " tokens per micro-batch."]}
    report["seconds"] = clock()
    harness.conclude(harness.out_dir(args), "sequences_xla", report, markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
