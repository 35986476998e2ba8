"""What does a larger batch cost in memory, with and without autosplit?

For target batch sizes B = 256, 512, ..., 16384 and two models (the MLP
128-1024-1024-10 of ``tests/capped_child.py`` and the small Transformer encoder of
``autosplit.models.transformer`` over (16, 16) inputs), each trained with Adam on
synthetic data from a fixed seed, this measures the peak memory of the training steps
and the training throughput of:

1. plain Keras: ``model.fit`` at the full batch B (or ``"OOM"``);
2. ``autosplit.fit_large_batch(model, data, batch_size=B, micro_batch_size="auto",
   cache=False)``: the micro-batch m its probe chose, and the peak and samples/s of
   the training steps that follow the probe;
3. Keras 3's own accumulation with autosplit's split: k = ceil(B / m) micro-batches,
   ``Adam(gradient_accumulation_steps=k)`` and ``model.fit(batch_size=B // k)``. Keras
   averages k equal batches, so its micro-batch is B // k (<= m) rather than m: with
   ``B // m`` steps of m, B = 1024 and m = 696 would not accumulate at all. Where k = 1
   it is plain Keras at B, the same run, and is not run twice;

and, for the checks below, two references: plain Keras at batch m, and autosplit with
one micro-batch m0 = min(B) / 2 fixed for every B (the same split size everywhere, so
only B changes).

Every point runs in its own fresh child process (re-executed with a hidden
``--child`` flag; JSON on stdout). Under the cap, a child's TensorFlow CPU allocator is
a BFC allocator hard-capped by ``autosplit.memory.capped_cpu_env(cap)``: going past it
raises a real ``tf.errors.ResourceExhaustedError``. One cap per model, the same for
every B, chosen so that plain Keras fails past some B and autosplit fits everywhere.
Without the cap, methods 1-3 run again in children whose allocator is the same BFC
allocator with a 20 GiB limit (never reached), so the peaks are read the same way and
plain Keras's growth shows past where the cap stops it; autosplit and Keras's
accumulation use the m found under the cap there, so the comparison is the same split.

Data: 2048 distinct rows, ``tf.data.Dataset.from_tensor_slices((x, y)).repeat()``.
autosplit gets the dataset of single examples; plain Keras and Keras's accumulation
get the same dataset ``.batch(b, drop_remainder=True).prefetch(1)``, which is the
pipeline autosplit builds itself (a batch, and one more in flight). So the data hold a
constant 1-2 MiB and every method holds the batch it trains on plus the next one.

Measuring: one warm-up epoch (tracing, optimizer slots; for autosplit it follows the
probe), then ``--repeats`` measured epochs. A callback resets the allocator's peak
(``PeakMeter``: ``tf.config.experimental.reset_memory_stats`` /
``get_memory_info("CPU:0")["peak"]``) at the start of each measured epoch and reads it
at the end, with the wall time. Peak source: tf-allocator (BFC), the allocator's chunks,
fragmentation included, everything the process holds in TensorFlow's allocator (the
weights, optimizer slots, input batches, activations). A point's peak is the smallest
over its measured epochs, its samples/s the largest. An epoch is max(2 large batches,
``samples_per_epoch``) examples; every method of a point trains on the same number.

Units: MiB (2**20 bytes) for memory, samples/s = training examples per wall-clock
second over a measured epoch, input pipeline included.

Reproduce (on an otherwise idle machine)::

    PYTHONPATH=. .venv/bin/python benchmarks/memory_scaling.py          # ~16 min on 2 cores
    PYTHONPATH=. .venv/bin/python benchmarks/memory_scaling.py --quick  # ~2.5 min smoke run

The full run writes ``benchmarks/results/memory_scaling.{json,md,png}``; ``--quick``
writes files only when ``--out DIR`` is given.
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse
import datetime
import inspect
import json
import math
import platform
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MIB = 2**20
OOM = "OOM"
NOT_RUN = "not run"
PEAK_SOURCE = "tf-allocator (BFC)"
UNITS = ("peak memory in MiB (TensorFlow allocator, BFC); throughput in samples/s "
         "(training examples per wall-clock second over a measured epoch)")
QUESTION = ("What does a larger batch cost in memory, with and without autosplit? Peak "
            "memory and samples/s of plain Keras at the full batch B, autosplit at B, and "
            "Keras 3's gradient_accumulation_steps, for B = 256 ... 16384, under one real "
            "memory cap and without it.")


@dataclass(frozen=True)
class ModelSpec:
    """One model and the cap it is measured under."""

    key: str  # "mlp" or "transformer"
    label: str
    input_shape: tuple[int, ...]
    cap_mib: int  # the hard cap of TensorFlow's CPU allocator, the same for every B
    samples_per_epoch: int  # examples per measured epoch (at least 2 large batches)


MLP = ModelSpec("mlp", "MLP 128-1024-1024-10", (128,), cap_mib=128, samples_per_epoch=8192)
TRANSFORMER = ModelSpec("transformer", "Transformer encoder (16, 16), 2 layers, 4 heads",
                        (16, 16), cap_mib=192, samples_per_epoch=4096)
MODELS = {spec.key: spec for spec in (MLP, TRANSFORMER)}


@dataclass(frozen=True)
class Settings:
    """One benchmark configuration."""

    models: tuple[ModelSpec, ...]
    batch_sizes: tuple[int, ...]  # target batch sizes B
    repeats: int  # measured epochs per point (after one warm-up epoch)
    rows: int = 2048  # distinct synthetic examples, repeated
    classes: int = 10
    learning_rate: float = 1e-3  # Adam, every method
    uncapped_mib: int = 20480  # the "no cap" children: BFC with a limit never reached
    seed: int = 0
    child_timeout_s: int = 1800
    run_streaming: bool = True  # the extra case of `streaming_case` (MLP, array input)

    @property
    def fixed_micro_batch(self) -> int:
        """m0: one micro-batch for every B, smaller than the smallest B (k >= 2 everywhere)."""
        return max(1, min(self.batch_sizes) // 2)


FULL = Settings(models=(MLP, TRANSFORMER),
                batch_sizes=tuple(256 * 2**i for i in range(7)), repeats=2)
# A smoke run: one model, B = 512 and 1024, a cap under which plain Keras fits at 512
# (about 40 MiB) and fails at 1024 (about 78 MiB).
QUICK = replace(FULL, models=(replace(TRANSFORMER, cap_mib=64, samples_per_epoch=1024),),
                batch_sizes=(512, 1024), repeats=1, run_streaming=False)


@dataclass(frozen=True)
class Method:
    key: str  # JSON key and the --child method
    label: str
    color: str
    marker: str


METHODS = {
    "keras": Method("keras", "plain Keras, model.fit(batch_size=B)", "tab:red", "o"),
    "autosplit": Method("autosplit", "autosplit.fit_large_batch(B, micro_batch_size='auto')",
                        "tab:blue", "s"),
    "keras_accumulation": Method(
        "keras_accumulation", "model.fit(batch_size=m), Adam(gradient_accumulation_steps=B//m)",
        "tab:green", "D"),
    "keras_at_m": Method("keras_at_m", "plain Keras at batch m (reference)", "tab:gray", "v"),
    "autosplit_fixed": Method("autosplit_fixed", "autosplit.fit_large_batch(B, m0 fixed)",
                              "tab:purple", "^"),
}
CAPPED_METHODS = ("keras", "autosplit", "keras_accumulation", "keras_at_m", "autosplit_fixed")
UNCAPPED_METHODS = ("keras", "autosplit", "keras_accumulation")


@dataclass(frozen=True)
class Task:
    """What one child runs: one method, one batch, one model, one cap."""

    model: str
    method: str  # "keras" (plain model.fit at `batch_size`), "autosplit", "keras_accumulation"
    batch_size: int  # B for autosplit and the accumulation; the fit batch for plain Keras
    micro_batch_size: int | str | None  # "auto", a fixed m, or None (plain Keras)
    samples_per_epoch: int
    limit_mib: int
    repeats: int
    rows: int
    classes: int
    learning_rate: float
    seed: int
    input_shape: tuple[int, ...] = field(default=())
    streaming: bool | str | None = None  # passed to fit_large_batch only when not None
    # Array input ``(x, y)`` of ``rows`` rows, one pass per epoch (streaming gathers
    # from arrays only); else the repeated tf.data pipeline of single examples.
    arrays: bool = False


# ---------------------------------------------------------------- the child


def steps_for(batch: int, samples: int) -> int:
    """Steps per epoch: at least two batches and at least ``samples`` examples."""
    return max(2, math.ceil(samples / batch))


def keras_split(batch_size: int, micro_batch_size: int) -> tuple[int, int]:
    """Keras's accumulation for autosplit's split: k = ceil(B / m) equal micro-batches
    of B // k (at most m, so it fits where m does). Keras averages k equal batches; with
    B // m steps of m instead, B = 1024, m = 696 would not accumulate at all."""
    k = math.ceil(batch_size / micro_batch_size)
    return k, batch_size // k


def build_model(task: Task, optimizer):
    import keras

    keras.utils.set_random_seed(task.seed)
    if task.model == "mlp":
        model = keras.Sequential([
            keras.Input(task.input_shape),
            keras.layers.Dense(1024, activation="relu"),
            keras.layers.Dense(1024, activation="relu"),
            keras.layers.Dense(task.classes),
        ])
    else:
        from autosplit import models

        model = models.MODELS[task.model](task.input_shape, task.classes)
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def run_child(task: Task) -> dict[str, Any]:
    import keras
    import numpy as np
    import tensorflow as tf

    import autosplit
    from autosplit.memory import PeakMeter

    meter = PeakMeter("CPU:0")
    if meter.source != "tf-allocator":
        raise SystemExit("Expected a child with TF_CPU_ALLOCATOR_USE_BFC=true (see "
                         f"capped_cpu_env). Received: peak source {meter.source!r}.")
    rng = np.random.default_rng(task.seed)
    x = rng.normal(size=(task.rows, *task.input_shape)).astype("float32")
    y = rng.integers(0, task.classes, size=(task.rows,)).astype("int32")
    examples = (x, y) if task.arrays else tf.data.Dataset.from_tensor_slices((x, y)).repeat()

    class Epochs(keras.callbacks.Callback):
        """Peak and wall time of every epoch after the first; only epoch hooks, so
        ``model.fit`` keeps its asynchronous dispatch (the logs are floats at the end)."""

        def __init__(self) -> None:
            super().__init__()
            self.records: list[dict[str, float]] = []

        def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
            if epoch >= 1:
                meter.reset()
                self.t0 = time.perf_counter()

        def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
            if epoch >= 1:
                seconds = time.perf_counter() - self.t0
                self.records.append({"peak_bytes": meter.peak_bytes(),
                                     "held_bytes": meter.baseline_bytes,
                                     "seconds": seconds,
                                     "loss": float((logs or {}).get("loss", float("nan")))})

    out: dict[str, Any] = {"task": asdict(task), "peak_source": meter.source,
                           "example_bytes": int(x[0].nbytes + y[0].nbytes),
                           "input_bytes": int(x[0].nbytes)}
    epochs = Epochs()
    lr = task.learning_rate
    B, m = task.batch_size, task.micro_batch_size
    model = None
    try:
        if task.method == "keras":
            steps = steps_for(B, task.samples_per_epoch)
            model = build_model(task, keras.optimizers.Adam(lr))
            out.update(step_batch=B, micro_batch_size=B, accumulation_steps=1,
                       samples=steps * B)
            model.fit(examples.batch(B, drop_remainder=True).prefetch(1), epochs=1 + task.repeats,
                      steps_per_epoch=steps, verbose=0, callbacks=[epochs])
        elif task.method == "keras_accumulation":
            k, mk = keras_split(B, m)
            steps = k * steps_for(B, task.samples_per_epoch)
            # Keras refuses gradient_accumulation_steps=1; k = 1 is plain model.fit at B.
            model = build_model(task, keras.optimizers.Adam(
                lr, gradient_accumulation_steps=k if k > 1 else None))
            out.update(step_batch=mk, micro_batch_size=mk, accumulation_steps=k,
                       samples=steps * mk)
            model.fit(examples.batch(mk, drop_remainder=True).prefetch(1),
                      epochs=1 + task.repeats, steps_per_epoch=steps, verbose=0,
                      callbacks=[epochs])
        elif task.method == "autosplit":
            model = build_model(task, keras.optimizers.Adam(lr))
            extra = {} if task.streaming is None else {"streaming": task.streaming}
            if task.arrays:  # one pass over the arrays per epoch
                out["samples"] = task.rows
            else:
                steps = steps_for(B, task.samples_per_epoch)
                out["samples"] = steps * B
                extra["steps_per_epoch"] = steps
            history = autosplit.fit_large_batch(
                model, examples, batch_size=B, micro_batch_size=m, cache=False, verbose=0,
                epochs=1 + task.repeats, callbacks=[epochs], **extra)
            info = history.autosplit
            out.update(step_batch=B, micro_batch_size=info["micro_batch_size"],
                       accumulation_steps=info["accumulation_steps"],
                       oom_recoveries=info["oom_recoveries"],
                       streaming=info.get("streaming"))
            probe = info.get("probe")
            if probe is not None:
                out["probe"] = {key: probe[key] for key in (
                    "micro_batch_size", "seconds", "ooms", "budget_bytes", "fixed_bytes",
                    "per_example_bytes", "measured_peak_bytes")}
                out["probe"]["trials"] = len(probe["trials"])
        else:
            raise SystemExit(f"Expected --child method in ('keras', 'autosplit', "
                             f"'keras_accumulation'). Received: {task.method!r}.")
        out["status"] = "ok"
    except tf.errors.ResourceExhaustedError as error:
        lines = str(error).splitlines()
        where = next((line for line in lines if "OOM when allocating" in line), lines[0])
        out.update(status=OOM, oom_where="training", error=where.strip()[:300])
    except autosplit.NothingFitsError as error:
        out.update(status=OOM, oom_where="probe: nothing fits", error=str(error)[:300])
    out["epochs"] = epochs.records
    if model is not None:
        out["trainable_weight_bytes"] = int(sum(
            int(np.prod(v.shape)) * 4 for v in model.trainable_variables))
    if out["status"] == "ok":
        best = min(epochs.records, key=lambda r: r["peak_bytes"])
        out["peak_bytes"] = int(best["peak_bytes"])
        out["held_bytes"] = int(best["held_bytes"])
        out["samples_per_s"] = max(out["samples"] / r["seconds"] for r in epochs.records)
    return out


# ---------------------------------------------------------------- the parent


def spawn(task: Task, log: Callable[[str], None], tag: str,
          timeout_s: int = FULL.child_timeout_s) -> dict[str, Any]:
    """Run one task in a fresh child under its cap; never raises for a failed child."""
    from autosplit.memory import capped_cpu_env

    env = capped_cpu_env(task.limit_mib * MIB)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    t0 = time.perf_counter()
    try:
        completed = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--child",
             json.dumps(asdict(task))],
            env=env, capture_output=True, text=True, timeout=timeout_s, check=False)
        wall = time.perf_counter() - t0
        if completed.returncode < 0 and task.limit_mib < FULL.uncapped_mib:
            # Seen on TF 2.21 at the cap: an allocation failure inside tf.data (the
            # pipeline building the next batch) ends the process with SIGSEGV instead of
            # raising ResourceExhaustedError. The same child without the cap trains.
            name = signal.Signals(-completed.returncode).name
            result = {"status": OOM, "oom_where": f"crashed ({name}) under the cap",
                      "error": f"exit {completed.returncode}: {completed.stderr[-2000:]}"}
        elif completed.returncode != 0:
            result = {"status": "error", "error": f"exit {completed.returncode}: "
                      f"{completed.stderr[-2000:]}"}
        else:
            lines = [line for line in completed.stdout.splitlines() if line.strip()]
            result = json.loads(lines[-1])
    except subprocess.TimeoutExpired:
        wall = time.perf_counter() - t0
        result = {"status": "error", "error": f"timed out after {timeout_s} s"}
    result["child_wall_s"] = wall
    result["limit_mib"] = task.limit_mib
    log(f"  {tag:<42} {describe(result)}  ({wall:.1f} s)")
    return result


def describe(r: dict[str, Any]) -> str:
    if r["status"] == "ok":
        split = f"m={r['micro_batch_size']} k={r['accumulation_steps']}"
        extra = f"  {len(r['oom_recoveries'])} OOM recoveries" if r.get("oom_recoveries") else ""
        return (f"{r['peak_bytes'] / MIB:8.1f} MiB  {r['samples_per_s']:9,.0f} samples/s  "
                f"{split}{extra}")
    if r["status"] == OOM:
        return f"     OOM ({r.get('oom_where', '')})"
    return f"   ERROR {r.get('error', '')[-300:]}"


def public(r: dict[str, Any] | None) -> dict[str, Any]:
    """A child's result with the two numbers every point must have: a number or 'OOM'."""
    if r is None:
        return {"status": NOT_RUN, "peak_mib": NOT_RUN, "samples_per_s": NOT_RUN}
    out = dict(r)
    out.pop("task", None)
    if r["status"] == "ok":
        out["peak_mib"] = r["peak_bytes"] / MIB
        out["held_mib"] = r["held_bytes"] / MIB
    else:
        value = OOM if r["status"] == OOM else "error"
        out["peak_mib"] = out["samples_per_s"] = value
    return out


def same_run(r: dict[str, Any]) -> dict[str, Any]:
    return {**r, "same_run_as": "keras (k = 1: no accumulation)"}


def measure_model(spec: ModelSpec, s: Settings, log: Callable[[str], None]) -> dict[str, Any]:
    """Every point of one model: capped children first (autosplit's m), then uncapped."""
    def task(method: str, batch: int, micro: int | str | None, capped: bool) -> Task:
        return Task(model=spec.key, method=method, batch_size=batch, micro_batch_size=micro,
                    samples_per_epoch=spec.samples_per_epoch,
                    limit_mib=spec.cap_mib if capped else s.uncapped_mib,
                    repeats=s.repeats, rows=s.rows, classes=s.classes,
                    learning_rate=s.learning_rate, seed=s.seed,
                    input_shape=spec.input_shape)

    m0 = s.fixed_micro_batch
    plain_at: dict[int, dict[str, Any]] = {}  # plain Keras under the cap, by fit batch
    points = []
    for B in s.batch_sizes:
        log(f"# {spec.key}  B={B}")
        capped: dict[str, dict[str, Any] | None] = dict.fromkeys(CAPPED_METHODS)
        uncapped: dict[str, dict[str, Any] | None] = dict.fromkeys(UNCAPPED_METHODS)
        capped["autosplit"] = spawn(task("autosplit", B, "auto", True), log,
                                    "capped   autosplit (auto)")
        ok = capped["autosplit"]["status"] == "ok"
        m = capped["autosplit"]["micro_batch_size"] if ok else None
        capped["keras"] = plain_at[B] = spawn(task("keras", B, None, True), log,
                                              "capped   plain Keras at B")
        # k = 1 (no split): Keras's accumulation is plain Keras at B, the same run.
        unsplit = m is not None and keras_split(B, m)[0] == 1
        if m is not None:
            if m not in plain_at:
                plain_at[m] = spawn(task("keras", m, None, True), log,
                                    f"capped   plain Keras at m={m}")
            capped["keras_at_m"] = plain_at[m]
            capped["keras_accumulation"] = (
                same_run(capped["keras"]) if unsplit else
                spawn(task("keras_accumulation", B, m, True), log,
                      f"capped   Keras accumulation (k={keras_split(B, m)[0]})"))
        capped["autosplit_fixed"] = spawn(task("autosplit", B, m0, True), log,
                                          f"capped   autosplit (m0={m0})")
        uncapped["keras"] = spawn(task("keras", B, None, False), log,
                                  "uncapped plain Keras at B")
        if m is not None:
            uncapped["autosplit"] = spawn(task("autosplit", B, m, False), log,
                                          f"uncapped autosplit (m={m} fixed)")
            uncapped["keras_accumulation"] = (
                same_run(uncapped["keras"]) if unsplit else
                spawn(task("keras_accumulation", B, m, False), log,
                      f"uncapped Keras accumulation (k={keras_split(B, m)[0]})"))
        points.append({
            "batch_size": B,
            "micro_batch_size": m,
            "accumulation_steps": capped["autosplit"].get("accumulation_steps") if ok else None,
            "capped": {key: public(r) for key, r in capped.items()},
            "uncapped": {key: public(r) for key, r in uncapped.items()},
        })
    first = next((r for p in points for r in p["capped"].values()
                  if r.get("example_bytes")), {})
    weights = next((r["trainable_weight_bytes"] for p in points for r in p["capped"].values()
                    if r.get("trainable_weight_bytes")), None)
    return {
        "label": spec.label,
        "input_shape": list(spec.input_shape),
        "cap_mib": spec.cap_mib,
        "samples_per_epoch": spec.samples_per_epoch,
        "fixed_micro_batch_size": m0,
        "example_bytes": first.get("example_bytes"),
        "input_bytes": first.get("input_bytes"),
        "trainable_weight_bytes": weights,
        "points": points,
    }


def streaming_available() -> bool:
    import autosplit

    return "streaming" in inspect.signature(autosplit.fit_large_batch).parameters


def streaming_case(s: Settings, log: Callable[[str], None]) -> dict[str, Any]:
    """The MLP with array input ``(x, y)`` of max(B) rows, where ``streaming`` applies
    (a ``tf.data.Dataset`` is always batched whole).

    1. References at the largest B with m0 fixed, under the MLP's cap: the peak with
       ``streaming=True`` and with ``streaming=False``; and ``streaming=True`` at B = 512,
       which gives check (a) for the streaming path. (And ``streaming=False`` at 512, the
       same check for the materialised path with array input.)
    2. A cap whose budget (90% of it, the probe's default headroom) lies halfway
       between the two peaks at the largest B: ``streaming=False`` must run out of
       memory there (``ResourceExhaustedError`` or ``NothingFitsError``) and
       ``streaming=True`` must train, both with ``micro_batch_size="auto"``.
    """
    B = max(s.batch_sizes)
    if not streaming_available():
        return {"available": False, "batch_size": B,
                "note": "autosplit.fit_large_batch has no `streaming=` parameter; the case "
                        "was not run."}
    spec, m0 = MLP, s.fixed_micro_batch
    b_lo = 512 if 512 in s.batch_sizes and B > 512 else min(s.batch_sizes)

    def run(batch: int, micro: int | str, streaming: bool, limit: int) -> dict[str, Any]:
        task = Task(model=spec.key, method="autosplit", batch_size=batch,
                    micro_batch_size=micro, samples_per_epoch=B, limit_mib=limit,
                    repeats=s.repeats, rows=B, classes=s.classes,
                    learning_rate=s.learning_rate, seed=s.seed, input_shape=spec.input_shape,
                    streaming=streaming, arrays=True)
        return public(spawn(task, log, f"arrays, streaming={streaming}, B={batch}, "
                                       f"m={micro}, cap {limit} MiB"))

    growth: dict[str, Any] = {"micro_batch_size": m0, "from_batch_size": b_lo,
                              "to_batch_size": B, "cap_mib": spec.cap_mib}
    for streaming in (True, False):
        name = f"streaming={streaming}"
        lo, hi = run(b_lo, m0, streaming, spec.cap_mib), run(B, m0, streaming, spec.cap_mib)
        entry: dict[str, Any] = {str(b_lo): lo, str(B): hi}
        if lo["status"] == "ok" and hi["status"] == "ok":
            copy_mib = B * hi["example_bytes"] / MIB
            allowed = 0.05 * lo["peak_mib"] + copy_mib
            grown = hi["peak_mib"] - lo["peak_mib"]
            entry.update(peak_from_mib=lo["peak_mib"], peak_to_mib=hi["peak_mib"],
                         growth_mib=grown, growth_relative=grown / lo["peak_mib"],
                         input_batch_copy_mib=copy_mib, allowed_mib=allowed,
                         status="PASS" if grown <= allowed else "MISS")
        growth[name] = entry
    out: dict[str, Any] = {"available": True, "model": spec.key, "batch_size": B,
                           "rows": B, "growth": growth}
    peaks = [growth[f"streaming={v}"][str(B)].get("peak_mib") for v in (True, False)]
    if not all(isinstance(v, float) for v in peaks) or peaks[0] >= peaks[1]:
        out.update(status="N/A", note="no pair of reference peaks to place the cap between")
        return out
    # The probe plans for 90% of the cap (its default headroom): put that budget
    # halfway between the two peaks.
    cap = math.ceil((peaks[0] + peaks[1]) / 2 / 0.9)
    results = {f"streaming={v}": run(B, "auto", v, cap) for v in (False, True)}
    only_streaming = (results["streaming=False"]["status"] == OOM
                      and results["streaming=True"]["status"] == "ok")
    out.update(cap_mib=cap, results=results, status="PASS" if only_streaming else "MISS")
    return out


# ---------------------------------------------------------------- checks


def _peak(point: dict[str, Any], method: str, capped: bool = True) -> float | None:
    r = point["capped" if capped else "uncapped"].get(method) or {}
    return r["peak_mib"] if isinstance(r.get("peak_mib"), (int, float)) else None


def _rate(point: dict[str, Any], method: str) -> float | None:
    r = point["capped"].get(method) or {}
    return r["samples_per_s"] if isinstance(r.get("samples_per_s"), (int, float)) else None


def checks_for(key: str, model: dict[str, Any]) -> list[dict[str, Any]]:
    """The four checks of the issue, from the measured numbers."""
    points = {p["batch_size"]: p for p in model["points"]}
    sizes = sorted(points)
    b_hi = sizes[-1]
    b_lo = 512 if 512 in points and b_hi > 512 else sizes[0]
    copy_mib = b_hi * (model["example_bytes"] or 0) / MIB
    weights_mib = (model["trainable_weight_bytes"] or 0) / MIB
    out = []

    # (a) the same split everywhere: growth <= 5% of the B_lo peak + one input batch.
    lo, hi = _peak(points[b_lo], "autosplit_fixed"), _peak(points[b_hi], "autosplit_fixed")
    check: dict[str, Any] = {"id": "a", "model": key, "from_batch_size": b_lo,
                             "to_batch_size": b_hi,
                             "micro_batch_size": model["fixed_micro_batch_size"],
                             "input_batch_copy_mib": copy_mib}
    if lo is None or hi is None:
        check.update(status="N/A", summary="autosplit (m0 fixed) has no peak at both ends")
    else:
        growth = hi - lo
        allowed = 0.05 * lo + copy_mib
        check.update(
            peak_from_mib=lo, peak_to_mib=hi, growth_mib=growth, growth_relative=growth / lo,
            allowed_mib=allowed, growth_in_input_copies=growth / copy_mib if copy_mib else None,
            growth_beyond_one_copy_relative=(growth - copy_mib) / lo,
            status="PASS" if growth <= allowed else "MISS",
            summary=(f"autosplit with m0={model['fixed_micro_batch_size']} fixed: peak "
                     f"{lo:.1f} MiB at B={b_lo} -> {hi:.1f} MiB at B={b_hi}, growth "
                     f"{growth:+.1f} MiB ({100 * growth / lo:+.1f}%) = "
                     f"{growth / copy_mib:.2f} input-batch copies of {copy_mib:.1f} MiB; "
                     f"target <= 5% + 1 copy = {allowed:.1f} MiB"))
    auto_lo, auto_hi = _peak(points[b_lo], "autosplit"), _peak(points[b_hi], "autosplit")
    if auto_lo is not None and auto_hi is not None:
        check["auto_micro_batch"] = {"peak_from_mib": auto_lo, "peak_to_mib": auto_hi,
                                     "growth_relative": (auto_hi - auto_lo) / auto_lo}
    out.append(check)

    # (b) autosplit at B vs plain Keras at its m plus one float32 copy of the weights.
    rows = []
    for B in sizes:
        p = points[B]
        a, ref = _peak(p, "autosplit"), _peak(p, "keras_at_m")
        if a is None or ref is None or (p["accumulation_steps"] or 1) < 2:
            continue
        expected = ref + weights_mib
        # Between steps each holds its weights, Adam and its input batches (autosplit
        # also its accumulator); the rest of the peak is the step's own working memory.
        held_a = p["capped"]["autosplit"]["held_mib"]
        held_ref = p["capped"]["keras_at_m"]["held_mib"]
        rows.append({"batch_size": B, "micro_batch_size": p["micro_batch_size"],
                     "autosplit_mib": a, "keras_at_m_mib": ref, "expected_mib": expected,
                     "ratio": a / expected, "excess_mib": a - expected,
                     "held_excess_mib": held_a - held_ref,
                     "transient_excess_mib": (a - held_a) - (ref - held_ref),
                     "input_batch_mib": B * (model["example_bytes"] or 0) / MIB})
    if not rows:
        out.append({"id": "b", "model": key, "status": "N/A", "rows": rows,
                    "summary": "no B at which autosplit split (k >= 2) with a plain-Keras "
                               "peak at its m"})
    else:
        worst = max(rows, key=lambda r: abs(r["ratio"] - 1))
        ratios = ", ".join(f"B={r['batch_size']} {r['ratio']:.2f}" for r in rows)
        ok = all(abs(r["ratio"] - 1) <= 0.10 for r in rows)
        out.append({"id": "b", "model": key, "status": "PASS" if ok else "MISS",
                    "weights_mib": weights_mib, "rows": rows, "worst": worst,
                    "summary": (f"autosplit peak / (plain Keras at m + {weights_mib:.2f} MiB "
                                f"weights): {ratios}; "
                                f"worst {worst['ratio']:.2f} at B={worst['batch_size']}: "
                                f"{worst['autosplit_mib']:.1f} vs {worst['expected_mib']:.1f} "
                                f"MiB, excess {worst['excess_mib']:+.1f} MiB = held between "
                                f"steps {worst['held_excess_mib']:+.1f} (one input batch is "
                                f"{worst['input_batch_mib']:.1f}) + within the step "
                                f"{worst['transient_excess_mib']:+.1f}; target within 10%")})

    # (c) autosplit trains at every B under the cap; plain Keras fails past some B.
    trained = [B for B in sizes if points[B]["capped"]["autosplit"]["status"] == "ok"]
    keras_oom = [B for B in sizes if points[B]["capped"]["keras"]["status"] == OOM]
    recoveries = sum(len(points[B]["capped"]["autosplit"].get("oom_recoveries") or [])
                     for B in trained)
    ok = len(trained) == len(sizes) and bool(keras_oom)
    out.append({"id": "c", "model": key, "status": "PASS" if ok else "MISS",
                "autosplit_trained": trained, "keras_oom": keras_oom,
                "autosplit_oom_recoveries": recoveries, "cap_mib": model["cap_mib"],
                "summary": (f"under {model['cap_mib']} MiB autosplit trained at "
                            f"{len(trained)}/{len(sizes)} sizes"
                            f"{f' ({recoveries} OOM recoveries in training)' if recoveries else ''}"
                            f"; plain Keras OOM at B in {keras_oom or 'none'}")})

    # (d) autosplit samples/s at the largest B >= plain Keras samples/s at m.
    rows = []
    for B in sizes:
        a, ref = _rate(points[B], "autosplit"), _rate(points[B], "keras_at_m")
        if a is not None and ref is not None and (points[B]["accumulation_steps"] or 1) >= 2:
            rows.append({"batch_size": B, "micro_batch_size": points[B]["micro_batch_size"],
                         "autosplit_samples_per_s": a, "keras_at_m_samples_per_s": ref,
                         "ratio": a / ref})
    top = next((r for r in rows if r["batch_size"] == b_hi), None)
    ratios = ", ".join(f"B={r['batch_size']} {r['ratio']:.2f}" for r in rows)
    if top is None:
        out.append({"id": "d", "model": key, "status": "N/A", "rows": rows,
                    "summary": f"no autosplit / plain-Keras-at-m pair at B={b_hi}"})
    else:
        out.append({"id": "d", "model": key, "status": "PASS" if top["ratio"] >= 1 else "MISS",
                    "rows": rows,
                    "summary": (f"at B={b_hi}: autosplit {top['autosplit_samples_per_s']:,.0f} "
                                f"vs plain Keras at m={top['micro_batch_size']} "
                                f"{top['keras_at_m_samples_per_s']:,.0f} samples/s "
                                f"(ratio {top['ratio']:.2f}; at every B that splits: "
                                f"{ratios})")})
    return out


# ---------------------------------------------------------------- reporting


def _cell(r: dict[str, Any] | None, field_name: str, fmt: str) -> str:
    if not r:
        return "-"
    value = r.get(field_name)
    if isinstance(value, (int, float)):
        text = format(value, fmt)
        return f"{text}*" if r.get("oom_recoveries") else text
    if value == OOM:
        crashed = str(r.get("oom_where", "")).startswith("crashed")
        return "**OOM** (SIGSEGV)" if crashed else "**OOM**"
    return str(value or "-")


_COLUMNS = (("capped", "keras", "plain Keras @B"), ("uncapped", "keras", "plain Keras @B, no cap"),
            ("capped", "autosplit", "autosplit"), ("uncapped", "autosplit", "autosplit, no cap"),
            ("capped", "keras_accumulation", "Keras accum."),
            ("uncapped", "keras_accumulation", "Keras accum., no cap"),
            ("capped", "keras_at_m", "plain Keras @m"),
            ("capped", "autosplit_fixed", "autosplit @m0"))


def table_rows(model: dict[str, Any], field_name: str, fmt: str) -> list[list[str]]:
    rows = []
    for p in model["points"]:
        split = "-" if p["micro_batch_size"] is None else (
            f"{p['micro_batch_size']} ({p['accumulation_steps']})")
        rows.append([f"{p['batch_size']}", split] + [
            _cell(p[cond].get(method), field_name, fmt) for cond, method, _ in _COLUMNS])
    return rows


def table_header(model: dict[str, Any]) -> list[str]:
    return ["B", "m (k)"] + [label.replace("@m0", f"m0={model['fixed_micro_batch_size']}")
                             for _, _, label in _COLUMNS]


def text_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(header, widths, strict=True)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    return (["| " + " | ".join(header) + " |", "|" + "|".join(["---:"] * len(header)) + "|"]
            + ["| " + " | ".join(r) + " |" for r in rows])


def notes(report: dict[str, Any]) -> list[str]:
    out = []
    for key, model in report["models"].items():
        for p in model["points"]:
            for cond in ("capped", "uncapped"):
                for method, r in p[cond].items():
                    if r.get("oom_recoveries"):
                        out.append(f"{key}, B={p['batch_size']}, {cond} {method}: OOM during "
                                   f"training, recovered by autosplit: {r['oom_recoveries']} "
                                   "(marked * in the tables; the peak is the smallest over the "
                                   "measured epochs).")
                    if r.get("status") == "error":
                        out.append(f"{key}, B={p['batch_size']}, {cond} {method}: the child "
                                   f"failed: {r.get('error', '')[-300:]}")
                    if str(r.get("oom_where", "")).startswith("crashed"):
                        out.append(f"{key}, B={p['batch_size']}, {cond} {method}: the child "
                                   f"{r['oom_where']}: counted as OOM (SIGSEGV in the table).")
                    if r.get("oom_where") == "probe: nothing fits":
                        out.append(f"{key}, B={p['batch_size']}, {cond} {method}: the probe "
                                   "found nothing that fits (NothingFitsError).")
    return out


def markdown(report: dict[str, Any]) -> str:
    info, s = report["machine"], report["settings"]
    lines = [
        "# Memory scaling: peak memory and samples/s vs the target batch size",
        "",
        report["question"],
        "",
        f"Reproduce: `{report['command']}`",
        "",
        f"Machine: {info['cpu_count']} CPUs, TensorFlow {info['tensorflow']}, Keras "
        f"{info['keras']}, Python {info['python']}; {info['date']}; load average at start "
        f"{info['load_average_at_start']}.",
        "",
        f"Peak source: {report['peak_source']}. Units: {report['units']}. Each point is a "
        f"fresh child process; peak = smallest, samples/s = largest over {s['repeats']} "
        "measured epoch(s) after one warm-up epoch. m (k): autosplit's micro-batch under "
        "the cap (accumulation steps); the uncapped autosplit uses that m, Keras's "
        "accumulation k = ceil(B/m) micro-batches of B // k (the same run as plain Keras "
        "at B where k = 1). `OOM`: `ResourceExhaustedError` (or, for autosplit, "
        "`NothingFitsError`) under the cap. `*`: autosplit recovered from an OOM during "
        "training (see the notes).",
    ]
    for model in report["models"].values():
        header = table_header(model)
        lines += ["", f"## {model['label']} (cap {model['cap_mib']} MiB)", "",
                  f"Input {model['input_bytes']} bytes per example ({model['example_bytes']} "
                  f"with the label); trainable weights "
                  f"{(model['trainable_weight_bytes'] or 0) / MIB:.2f} MiB (float32).", "",
                  "Peak memory, MiB:", ""]
        lines += md_table(header, table_rows(model, "peak_mib", ".1f"))
        lines += ["", "Throughput, samples/s:", ""]
        lines += md_table(header, table_rows(model, "samples_per_s", ",.0f"))
    lines += ["", "## Checks", ""]
    lines += [f"- ({c['id']}) {c['model']}: **{c['status']}**: {c['summary']}"
              for c in report["checks"]]
    lines += ["", "## Streaming (array input)", "", *streaming_lines(report["streaming"])]
    if report["notes"]:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in report["notes"]]
    lines += ["", "![memory scaling](memory_scaling.png)"]
    return "\n".join(lines) + "\n"


def streaming_lines(stream: dict[str, Any]) -> list[str]:
    """The streaming case in sentences (Markdown and the console)."""
    if not stream.get("available") or "growth" not in stream:
        return [stream.get("note", "not run")]
    lines = []
    if "results" in stream:
        lines += [f"MLP, array input (x, y) of {stream['rows']} rows, "
                  f"B={stream['batch_size']}, `micro_batch_size='auto'`, under "
                  f"{stream['cap_mib']} MiB (90% of it halfway between the two peaks at m0): "
                  + "; ".join(f"{name}: {describe_public(r)}"
                              for name, r in stream["results"].items())
                  + f" -> **{stream['status']}** (target: only streaming fits)."]
    else:
        lines += [f"Only streaming fits: {stream['status']}, {stream.get('note', '')}."]
    g = stream["growth"]
    for name in ("streaming=True", "streaming=False"):
        e = g[name]
        if "status" in e:
            lines += ["", f"Check (a) with array input, {name} (m0={g['micro_batch_size']} "
                      f"fixed, under {g['cap_mib']} MiB): {e['peak_from_mib']:.1f} MiB at "
                      f"B={g['from_batch_size']} -> {e['peak_to_mib']:.1f} MiB at "
                      f"B={g['to_batch_size']}, growth {e['growth_mib']:+.1f} MiB "
                      f"({100 * e['growth_relative']:+.1f}%) = "
                      f"{e['growth_mib'] / e['input_batch_copy_mib']:.2f} input-batch copies; "
                      f"target <= {e['allowed_mib']:.1f} MiB: **{e['status']}**."]
        else:
            lines += ["", f"Check (a) with array input, {name}: no peak at both sizes "
                      f"({describe_public(e[str(g['from_batch_size'])])}; "
                      f"{describe_public(e[str(g['to_batch_size'])])})."]
    return lines


def describe_public(r: dict[str, Any]) -> str:
    if r["status"] == "ok":
        return (f"{r['peak_mib']:.1f} MiB, {r['samples_per_s']:,.0f} samples/s, "
                f"m={r['micro_batch_size']}")
    return str(r["peak_mib"])


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    models = report["models"]
    fig, axes = plt.subplots(2, len(models), figsize=(7.5 * len(models), 9.5), squeeze=False)
    series = [("capped", "keras", "-", "plain Keras @B"),
              ("uncapped", "keras", "--", "plain Keras @B, no cap"),
              ("capped", "autosplit", "-", "autosplit (auto m)"),
              ("uncapped", "autosplit", "--", "autosplit (same m), no cap"),
              ("capped", "keras_accumulation", "-", "Keras gradient_accumulation_steps"),
              ("uncapped", "keras_accumulation", "--", "Keras accumulation, no cap"),
              ("capped", "autosplit_fixed", ":", "autosplit, m0 fixed"),
              ("capped", "keras_at_m", ":", "plain Keras @m (reference)")]
    for col, model in enumerate(models.values()):
        top, bottom = axes[0][col], axes[1][col]
        cap = model["cap_mib"]
        for cond, method, style, label in series:
            spec = METHODS[method]
            if method == "autosplit_fixed":
                label = label.replace("m0", f"m0={model['fixed_micro_batch_size']}")
            hollow = cond == "uncapped"
            kwargs = dict(color=spec.color, linestyle=style, marker=spec.marker, markersize=5,
                          markerfacecolor="white" if hollow else spec.color,
                          linewidth=1.0 if method == "keras_at_m" else 1.6)
            xs, peaks, rates, ooms = [], [], [], []
            for p in model["points"]:
                r = p[cond].get(method) or {}
                if isinstance(r.get("peak_mib"), (int, float)):
                    xs.append(p["batch_size"])
                    peaks.append(r["peak_mib"])
                    rates.append(r["samples_per_s"])
                elif r.get("peak_mib") == OOM:
                    ooms.append(p["batch_size"])
            top.plot(xs, peaks, label=label, **kwargs)
            bottom.plot(xs, rates, label=label, **kwargs)
            if ooms:
                top.plot(ooms, [cap] * len(ooms), linestyle="none", marker="x",
                         markersize=11, markeredgewidth=2.5, color=spec.color,
                         label=f"{label}: OOM")
        top.axhline(cap, color="black", linewidth=1.2, linestyle="-.",
                    label=f"cap {cap} MiB")
        for p in model["points"]:
            peak = _peak(p, "autosplit")
            if peak is not None:
                top.annotate(f"m={p['micro_batch_size']}", (p["batch_size"], peak),
                             textcoords="offset points", xytext=(0, -13), ha="center",
                             fontsize=7, color=METHODS["autosplit"].color,
                             bbox={"fc": "white", "ec": "none", "alpha": 0.7, "pad": 0.5})
        for ax in (top, bottom):
            ax.set_xscale("log", base=2)
            ax.set_xticks([p["batch_size"] for p in model["points"]])
            ax.set_xticklabels([str(p["batch_size"]) for p in model["points"]])
            ax.grid(True, which="both", alpha=0.3)
            ax.set_xlabel("target batch size B (examples)")
        top.set_yscale("log")
        top.yaxis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        top.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        top.yaxis.set_minor_formatter(ticker.NullFormatter())
        bottom.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:,.0f}"))
        top.set_ylabel("peak memory of a training step (MiB, TF allocator)")
        top.set_title(f"{model['label']}: peak memory (cap {cap} MiB)")
        bottom.set_ylabel("samples/s")
        bottom.set_ylim(bottom=0)
        bottom.set_title(f"{model['label']}: throughput")
    handles: dict[str, Any] = {}
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault("cap" if label.startswith("cap ") else label, handle)
    labels = ["memory cap (see each title)" if label == "cap" else label for label in handles]
    fig.legend(list(handles.values()), labels, loc="lower center", ncol=4, fontsize=8,
               frameon=False)
    fig.suptitle(f"Memory scaling with the batch size (peak source: {report['peak_source']})")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
        description="Peak memory (TF allocator) and samples/s vs the target batch size B "
                    "for plain Keras, autosplit.fit_large_batch and Keras's "
                    "gradient_accumulation_steps, under one real memory cap and without.")
    parser.add_argument("--quick", action="store_true",
                        help="the Transformer only, B = 512 and 1024, a 64 MiB cap "
                             "(~2.5 min); writes files only with --out")
    parser.add_argument("--out", type=Path,
                        help="write memory_scaling.{json,md,png} here (default "
                             "benchmarks/results; none with --quick)")
    parser.add_argument("--repeats", type=int,
                        help="measured epochs per point; peak = smallest, samples/s = "
                             "largest (default 2; quick 1)")
    parser.add_argument("--models", help=f"comma-separated subset of {sorted(MODELS)}")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        fields = json.loads(args.child)
        fields["input_shape"] = tuple(fields["input_shape"])
        print(json.dumps(run_child(Task(**fields))))
        return 0

    s = QUICK if args.quick else FULL
    if args.repeats is not None:
        if args.repeats < 1:
            raise SystemExit(f"Expected `--repeats` >= 1. Received: {args.repeats}.")
        s = replace(s, repeats=args.repeats)
    if args.models:
        wanted = [name.strip() for name in args.models.split(",") if name.strip()]
        unknown = [name for name in wanted if name not in MODELS]
        if unknown or not wanted:
            raise SystemExit(f"Expected `--models` from {sorted(MODELS)}. "
                             f"Received: {args.models!r}.")
        chosen = {spec.key: spec for spec in s.models}
        s = replace(s, models=tuple(chosen.get(name, MODELS[name]) for name in wanted))

    info = machine_info()
    command = " ".join(["python", "benchmarks/memory_scaling.py",
                        *(sys.argv[1:] if argv is None else argv)])
    print(f"# {info['date']}  cpus={info['cpu_count']}  load={info['load_average_at_start']}"
          f"  TF {info['tensorflow']}  Keras {info['keras']}")
    print(f"# B = {', '.join(map(str, s.batch_sizes))}; m0 = {s.fixed_micro_batch}; "
          f"{s.repeats} measured epoch(s) per point; peak source: {PEAK_SOURCE}", flush=True)

    def log(line: str) -> None:
        print(line, flush=True)

    t0 = time.perf_counter()
    models = {spec.key: measure_model(spec, s, log) for spec in s.models}
    if s.run_streaming and "mlp" in models:
        streaming = streaming_case(s, log)
    else:
        streaming = {"available": streaming_available(), "note": "not run in this "
                     "configuration (full run with the MLP only)."}
    report: dict[str, Any] = {
        "question": QUESTION,
        "command": command,
        "units": UNITS,
        "peak_source": PEAK_SOURCE,
        "machine": info,
        "settings": {**asdict(s), "fixed_micro_batch_size": s.fixed_micro_batch},
        "models": models,
        "checks": [c for key, model in models.items() for c in checks_for(key, model)],
        "streaming": streaming,
        "seconds": time.perf_counter() - t0,
    }
    report["notes"] = notes(report)

    print()
    print(f"Peak source: {PEAK_SOURCE}. Units: {UNITS}.")
    for model in models.values():
        header = table_header(model)
        print(f"\n{model['label']}, cap {model['cap_mib']} MiB: peak MiB")
        print(text_table(header, table_rows(model, "peak_mib", ".1f")))
        print(f"\n{model['label']}, cap {model['cap_mib']} MiB: samples/s")
        print(text_table(header, table_rows(model, "samples_per_s", ",.0f")))
    print("\nChecks:")
    for c in report["checks"]:
        print(f"  ({c['id']}) {c['model']:<12} {c['status']:<4}  {c['summary']}")
    print("Streaming:")
    for line in streaming_lines(streaming):
        if line:
            print(f"  {line.replace('**', '')}")
    for line in report["notes"]:
        print(f"note: {line}")
    print(f"total {report['seconds']:.0f} s")

    out = args.out if args.out is not None else (None if args.quick else RESULTS)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "memory_scaling.json").write_text(json.dumps(report, indent=2) + "\n")
        (out / "memory_scaling.md").write_text(markdown(report))
        plot(report, out / "memory_scaling.png")
        print(f"wrote {out / 'memory_scaling.json'}, .md, .png")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
