"""Sequences on two replicas: each replica's own pieces against the dealt cut.

The question: on two replicas of a ``MirroredStrategy``, how much padding does the cut
by length feed, and how many real tokens per second does it reach, now that each
micro-step gives each replica one of the pieces one device cuts (each of its own shape),
against the cut that dealt each large batch's sorted rows out a row at a time (one shape
per micro-step, each piece spanning twice the sorted rows)?

Data and models (``benchmarks/sequence_data.py``): the masked GRU classifier on
IMDB-shaped lognormal lengths (divided by ``--scale 4``) and the Transformer
encoder-decoder on WMT14-shaped pairs, two lengths per example.

Methods, each from the same weights, side by side (round-robin repeats), each in a
process of its own on two logical CPU devices:
- ``one_device``: ``fit_large_batch`` on one device, m rows (or the budget) per
  micro-batch: the padding two replicas should match;
- ``dealt``: two replicas, m per replica, the package as it was at ``BASELINE`` (the
  last commit that dealt sorted rows out), unpacked from git into a temporary folder;
- ``own``: two replicas, m per replica, this tree.

Each in rows (``micro_batch_size=m``, cut by length) and in tokens
(``micro_batch_tokens``: m rows of the corpus's costliest row).

Units: real tokens per second over the timed epochs (the second and third); padding share = 1 - real
tokens / token cells fed, as ``FitReport.cut`` counts it (each replica's own shape for
``own``; the stacked shape for ``dealt``, which every replica computes at).

Two logical devices share the machine's cores: the tokens/s compare the cells computed,
not two accelerators' parallel speed.

Reproduce (needs the git history: the baseline is unpacked from it)::

    python -m benchmarks.sequence_replicas            # ~12 min on 2 cores
    python -m benchmarks.sequence_replicas --quick    # a smoke run
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks import sequence_data as data

QUESTION = ("On two replicas, how much padding does the cut by length feed, and how many "
            "real tokens per second does it reach, each replica cut on its own against "
            "the sorted rows dealt out a row at a time?")
UNITS = ("real tokens per second over the timed (second and third) epochs; padding "
         "share = 1 - real tokens / token cells fed")
BASELINE = "cfc051f"  # the last commit whose cut dealt sorted rows out to the replicas
MODELS = ("gru", "translation")
CUTS = ("rows", "tokens")
METHODS = ("one_device", "dealt", "own")


@dataclass(frozen=True)
class Settings:
    rows: int = 512
    batch_size: int = 128
    micro_batch_size: int = 16
    scale: int = 4
    repeats: int = 3
    models: tuple[str, ...] = MODELS


FULL = Settings()
QUICK = Settings(rows=128, batch_size=64, micro_batch_size=8, scale=16, repeats=1,
                 models=("gru",))


def budget(settings: Settings, kind: str) -> int:
    """The budget in tokens: m rows of the corpus's costliest row."""
    return settings.micro_batch_size * data.longest(kind, data.lengths(
        kind, settings.rows, settings.scale))


# ---------------------------------------------------------------- the child


def child(task: dict[str, Any]) -> dict[str, Any]:
    """One run: ``fit_large_batch`` for three epochs, the last two timed."""
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import keras

    import autosplit

    kind, settings = task["kind"], Settings(**{**task["settings"], "models": ()})
    strategy = (tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
                if task["replicas"] > 1 else tf.distribute.get_strategy())
    with strategy.scope():
        model = data.build(kind, jit_compile=False)
    times: list[float] = []

    class Timer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            times.append(time.perf_counter())

        def on_epoch_end(self, epoch, logs=None):
            times[-1] = time.perf_counter() - times[-1]

    size = ({"micro_batch_tokens": budget(settings, kind)} if task["cut"] == "tokens"
            else {"micro_batch_size": settings.micro_batch_size, "micro_batch_tokens": None})
    rows = data.examples(kind, data.lengths(kind, settings.rows, settings.scale))
    history = autosplit.fit_large_batch(model, rows, batch_size=settings.batch_size,
                                        epochs=3, verbose=0, by_length=True, cache=False,
                                        callbacks=[Timer()], **size)
    report = history.autosplit
    return {"seconds": sum(times[1:]), "padding_share": report.cut.padding_share,
            "padding": report.padding, "package": autosplit.__file__}


def epoch_tokens(settings: Settings, kind: str) -> int:
    """Real tokens in an epoch: each row's length, a pair's two lengths summed."""
    return sum(sum(size) if kind in data.PAIRS else size
               for size in data.lengths(kind, settings.rows, settings.scale))


def baseline_tree(folder: Path) -> Path:
    """The package at :data:`BASELINE`, unpacked from git into ``folder``."""
    archive = subprocess.run(["git", "-C", str(harness.ROOT), "archive", BASELINE, "autosplit"],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return folder


def run_one(task: dict[str, Any], package: Path, timeout: float = 900) -> dict[str, Any]:
    """``task`` in a child process whose ``autosplit`` is ``package``'s."""
    from autosplit.capped import run_capped

    env = {"PYTHONPATH": str(harness.ROOT), "CUDA_VISIBLE_DEVICES": "-1"}
    # First on the path, ahead of the working folder that ``python -c`` puts there.
    code = (f"import sys; sys.path.insert(0, {str(package)!r}); "
            "from benchmarks.sequence_replicas import main; "
            f"raise SystemExit(main(['--child', {json.dumps(task)!r}]))")
    run = run_capped(["-c", code], None, timeout=timeout, env=env, capture=True)
    if run.returncode != 0 or not isinstance(run.result, dict):
        raise RuntimeError(f"{task}: exit {run.returncode}: {(run.stderr or '')[-2000:]}")
    if not run.result["package"].startswith(str(package)):
        raise RuntimeError(f"Expected autosplit from {package}. Received: {run.result['package']}")
    return dict(run.result)


# ---------------------------------------------------------------- the parent


def measure(settings: Settings, baseline: Path) -> dict[str, Any]:
    packages = {"one_device": harness.ROOT, "dealt": baseline, "own": harness.ROOT}
    results: dict[str, Any] = {}
    for kind in settings.models:
        tokens = epoch_tokens(settings, kind)
        for cut in CUTS:
            runs = harness.round_robin({method: (lambda method=method, cut=cut, kind=kind,
                                                tokens=tokens: {
                **run_one({"kind": kind, "cut": cut, "replicas": 1 if method == "one_device"
                           else 2, "settings": asdict(settings)}, packages[method]),
                "samples": 2 * tokens}) for method in METHODS}, settings.repeats,
                say=lambda line, kind=kind, cut=cut: harness.log(f"{kind} {cut}: {line}"))
            speed = harness.speed_summary(runs, "dealt")
            results[f"{kind}_{cut}"] = {method: {
                "tokens_per_s": speed[method]["samples_per_s_median"],
                "vs_dealt": speed[method]["ratio_paired"],
                "padding_share": runs[method][0]["padding_share"],
                "padding": runs[method][0]["padding"]} for method in METHODS}
    return results


def checks(results: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for case, by in results.items():
        own, one, dealt = by["own"], by["one_device"], by["dealt"]
        out += [
            {"id": f"{case}-padding", "status": harness.status(
                own["padding_share"] <= 1.1 * one["padding_share"]),
             "summary": f"{case}: two replicas feed padding {own['padding_share']:.3f}, one "
                        f"device {one['padding_share']:.3f} (target <= 1.1x); the dealt cut "
                        f"{dealt['padding_share']:.3f}"},
            {"id": f"{case}-speed", "status": harness.status(own["vs_dealt"] >= 1.0),
             "summary": f"{case}: each replica cut on its own reaches {own['vs_dealt']:.2f}x "
                        "the dealt cut's tokens/s on two replicas (target >= 1)"}]
    return out


def markdown(report: dict[str, Any]) -> str:
    lines = harness.report_head("Sequences on two replicas: each replica's own cut", report)
    header = ["model and cut", "method", "tokens/s", "vs dealt", "padding share"]
    rows = [[case, method, f"{r['tokens_per_s']:,.0f}", f"{r['vs_dealt']:.2f}",
             f"{r['padding_share']:.3f}"]
            for case, by in report["results"].items() for method, r in by.items()]
    lines += ["", *harness.md_table(header, rows)]
    return "\n".join(lines) + harness.report_tail(report)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--child"]:
        return harness.serve_child(argv[1], child)
    p = harness.parser(QUESTION, quick="128 rows, B=64, m=8, the GRU, lengths / 16",
                       repeats=FULL.repeats)
    args = p.parse_args(argv)
    harness.at_least("repeats", args.repeats)
    s = QUICK if args.quick else FULL
    s = replace(s, repeats=args.repeats or s.repeats)
    clock, info = harness.wall_clock(), harness.machine_info()
    harness.log(f"# {harness.machine_line(info)}")
    with tempfile.TemporaryDirectory() as folder:
        results = measure(s, baseline_tree(Path(folder)))
    report: dict[str, Any] = {
        "question": QUESTION, "command": harness.command("sequence_replicas", argv),
        "units": UNITS, "machine": info, "settings": asdict(s), "results": results,
        "checks": checks(results),
        "notes": [f"dealt: the package at {BASELINE}, unpacked from git; tokens: a budget of "
                  "m rows of the costliest row, " + ", ".join(
                      f"{kind} {budget(s, kind):,}" for kind in s.models) + " tokens per "
                  "replica's micro-batch. Two logical devices share the machine's cores."]}
    report["seconds"] = clock()
    harness.conclude(harness.out_dir(args), "sequence_replicas", report, markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
