"""What does splitting a large batch cost per sample, for every input kind and width?

Every comparison is measured side by side in one run (round-robin repeats, the order
rotating by one each repeat; ratios are best over best, never absolute times alone),
twice: **per epoch** (the timed epochs after a warm-up) and **per call** (the whole call,
set-up, tracing and the warm-up epoch included: a user calls ``fit_large_batch`` once per
experiment, a tuner hundreds of times).

**The bare loop** (``benchmarks.workloads.bare_loop``) is the yardstick: one
``tf.function`` whose ``tf.while_loop`` pulls the micro-batches from a ``tf.data``
iterator (``.batch(m)``, or ``.batch(32).rebatch(m)`` for a batched input), sums the
gradients and applies once: the least a large-batch step can do, with no padding, no
metrics and no recovery. Target: ``fit_large_batch`` at 0.95 of it or better, per epoch
and per call, from arrays, from a dataset of examples and from a batched dataset, on:

- an MLP 128-1024-1024-10 and an MLP 784-1024-1024-10, B = 4096, m = 256 (k = 16); the
  784-wide one also against ``model.fit(batch_size=m)``, Keras's
  ``Adam(gradient_accumulation_steps=16)`` and the classic hand loop (a ``tf.function``
  returns one micro-batch's gradients, ``np.mean`` on the host, one apply);
- the CNN of ``autosplit.builtin_models`` on 32x32x3 images, B = 1024, m = 128 (k = 8);
- a Dense stack of 50 layers of 64 (102 variables: many variables, little compute, where
  the set-up of a call shows), B = 2048, m = 128 (k = 16), from arrays and from a
  dataset of examples, also against ``model.fit(batch_size=m)``.

**Against Keras at the micro-batch.** A small encoder on token ids (Embedding,
attention, LayerNorm) at B = 8192, m = 512 (k = 16) from a dataset of examples, and the
2-layer Transformer of ``memory_scaling`` at B = 16384, m = 128 (k = 128) from arrays,
against plain ``model.fit(batch_size=m)`` (one apply per m, so it does k times the
optimizer work). Targets: 1.0 for the encoder, 0.95 at k = 128.

Every run starts from the same initial weights with a fresh Adam (lr 1e-3) and reads
the data in order (``shuffle=False`` everywhere, so the ratios measure the loops, not
the shuffle).

``--profile python`` runs ``fit_large_batch`` once more under cProfile and writes the
top functions by cumulative time; ``--profile tf`` records TensorFlow's profiler trace
of it (open with TensorBoard's profile plugin).

Units: samples/s = training examples per wall-clock second.

Reproduce (on an otherwise idle machine)::

    python -m benchmarks.overhead          # ~10 min on 2 cores
    python -m benchmarks.overhead --quick  # small models, one repeat
    python -m benchmarks.overhead --cases mlp784,encoder

The full run writes ``benchmarks/results/overhead.{json,md}``; ``--quick`` writes files
only with ``--out DIR``.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from benchmarks import harness, workloads
from benchmarks.workloads import TRANSFORMER, EpochMeter, ModelSpec

QUESTION = ("What does splitting a large batch into micro-batches cost per training sample, "
            "per epoch and per call, against a bare while-loop for every input kind (arrays, "
            "examples, batched) and width, and against plain model.fit at the micro-batch?")
UNITS = ("samples/s (training examples per wall-clock second; per epoch: the timed epochs; "
         "per call: the whole call, set-up and warm-up epoch included)")
LABELS = {
    "autosplit_arrays": "autosplit.fit_large_batch(B, m), arrays",
    "autosplit_examples": "autosplit.fit_large_batch(B, m), tf.data of examples",
    "autosplit_batched": "autosplit.fit_large_batch(B, m), tf.data .batch(32)",
    "keras_at_m": "model.fit(batch_size=m)",
    "keras_accumulation": "model.fit(m), Adam(gradient_accumulation_steps=B/m)",
    "hand_loop": "hand loop: tf.function grads, np.mean, 1 apply",
    "bare_loop": "bare loop over .batch(m), 1 apply",
    "bare_batched": "bare loop over .batch(32).rebatch(m), 1 apply",
}
TARGET = 0.95
# Each autosplit input kind against its yardstick.
YARDSTICK = {"autosplit_arrays": "bare_loop", "autosplit_examples": "bare_loop",
             "autosplit_batched": "bare_batched"}


@dataclass(frozen=True)
class Case:
    """One side-by-side comparison; ``targets`` maps a method to (baseline, least ratio)."""

    name: str
    model: ModelSpec
    rows: int
    batch_size: int
    micro_batch_size: int
    methods: tuple[str, ...]
    baseline: str = "bare_loop"
    targets: tuple[tuple[str, str, float], ...] = ()

    @property
    def accumulation_steps(self) -> int:
        return self.batch_size // self.micro_batch_size


def _against_bare(name: str, model: ModelSpec, rows: int, batch_size: int, m: int,
                  extra: tuple[str, ...] = ()) -> Case:
    kinds = tuple(YARDSTICK)
    return Case(name, model, rows, batch_size, m,
                (*kinds, "bare_loop", "bare_batched", *extra),
                targets=tuple((k, YARDSTICK[k], TARGET) for k in kinds))


def _against_keras(name: str, model: ModelSpec, rows: int, batch_size: int, m: int,
                   method: str, target: float) -> Case:
    return Case(name, model, rows, batch_size, m, (method, "keras_at_m"),
                baseline="keras_at_m", targets=((method, "keras_at_m", target),))


def _deep(name: str, layers: int, width: int, rows: int, batch_size: int, m: int) -> Case:
    """A Dense stack of many narrow layers: what a call costs where a model has hundreds
    of variables (a ResNet, a BERT) and little compute, against the bare loop and
    ``model.fit(batch_size=m)``; from arrays and from a dataset of examples."""
    spec = ModelSpec("mlp", f"Dense stack 32-({width} x {layers})-10, {2 * layers + 2} "
                     "variables", (32,), (width,) * layers)
    kinds = ("autosplit_arrays", "autosplit_examples")
    return Case(name, spec, rows, batch_size, m, (*kinds, "bare_loop", "keras_at_m"),
                targets=tuple((k, "bare_loop", TARGET) for k in kinds))


@dataclass(frozen=True)
class Settings:
    cases: tuple[Case, ...]
    epochs: int = 2  # timed epochs per run, after one warm-up epoch
    repeats: int = 3  # round-robin passes over the methods
    seed: int = 0
    jit_compile: bool = False


FULL = Settings(cases=(
    _against_bare("mlp128", workloads.mlp_spec(128, (1024, 1024)), 16384, 4096, 256),
    _against_bare("mlp784", workloads.mlp_spec(784, (1024, 1024)), 16384, 4096, 256,
                  extra=("keras_at_m", "keras_accumulation", "hand_loop")),
    _against_bare("cnn", workloads.CNN, 4096, 1024, 128),
    _deep("deep", 50, 64, 8192, 2048, 128),
    _against_keras("encoder", workloads.ENCODER, 32768, 8192, 512, "autosplit_examples", 1.0),
    _against_keras("large_k", TRANSFORMER, 32768, 16384, 128, "autosplit_arrays", TARGET),
))
QUICK = replace(FULL, epochs=1, repeats=1, cases=(
    _against_bare("mlp128", workloads.mlp_spec(64, (128, 128)), 2048, 1024, 64,
                  extra=("keras_at_m", "keras_accumulation", "hand_loop")),
    _against_bare("cnn", replace(workloads.CNN, input_shape=(8, 8, 3)), 512, 256, 32),
    _deep("deep", 8, 16, 1024, 512, 64),
    _against_keras("encoder", workloads.ENCODER, 1024, 512, 64, "autosplit_examples", 1.0),
    _against_keras("large_k", replace(TRANSFORMER, input_shape=(8, 8), label="Transformer "
                   "encoder (8, 8), 2 layers, 4 heads"), 2048, 1024, 32, "autosplit_arrays",
                   TARGET),
))


def hand_loop(case: Case, x: np.ndarray, y: np.ndarray, *, epochs: int,
              weights: Sequence[np.ndarray], jit_compile: bool) -> dict[str, Any]:
    """The StackOverflow recipe, kept as written: per-micro-batch gradients come back
    to the host, are averaged there with NumPy, and one eager ``apply_gradients``."""
    model = workloads.build_model(case.model, weights=weights)
    optimizer, variables = model.optimizer, model.trainable_variables
    loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function(jit_compile=jit_compile)
    def micro_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_object(yb, model(xb, training=True))
        return loss, tape.gradient(loss, variables)

    clock = EpochMeter(None, samples_per_epoch=len(x))
    clock.set_model(model)
    began = time.perf_counter()
    B, m = case.batch_size, case.micro_batch_size
    for epoch in range(1 + epochs):
        clock.on_epoch_begin(epoch)
        losses = []
        for start in range(0, len(x), B):
            xb, yb = x[start:start + B], y[start:start + B]
            per_micro = []
            for i in range(case.accumulation_steps):
                loss, grads = micro_step(xb[i * m:(i + 1) * m], yb[i * m:(i + 1) * m])
                per_micro.append([g.numpy() for g in grads])
                losses.append(loss.numpy())
            mean = [np.mean(np.stack(gs), axis=0) for gs in zip(*per_micro, strict=True)]
            optimizer.apply_gradients(zip(mean, variables, strict=True))
        clock.on_epoch_end(epoch, {"loss": float(np.mean(losses))})
    return {**workloads.summed_epochs(clock.records),
            "call_seconds": time.perf_counter() - began, "call_samples": (1 + epochs) * len(x)}


def compare(case: Case, s: Settings, say: harness.Log) -> dict[str, Any]:
    """Every method of ``case``, round-robin; samples/s per epoch and per call, ratios."""
    x, y = workloads.data_for(case.model, case.rows, seed=s.seed)
    weights = workloads.build_model(case.model, seed=s.seed).get_weights()

    def run(method: str):
        if method == "hand_loop":
            return lambda: hand_loop(case, x, y, epochs=s.epochs, weights=weights,
                                     jit_compile=s.jit_compile)
        return lambda: workloads.timed(
            method, case.model, x, y, batch_size=case.batch_size,
            micro_batch_size=case.micro_batch_size, epochs=s.epochs, weights=weights,
            seed=s.seed, jit_compile=s.jit_compile)

    say(f"# {case.name}: {case.model.label}, {case.rows} examples, B={case.batch_size}, "
        f"m={case.micro_batch_size} (k={case.accumulation_steps})")
    runs = harness.round_robin({m: run(m) for m in case.methods}, s.repeats, say)
    summary = harness.speed_summary(runs, case.baseline)
    per_call = harness.speed_summary(
        {m: [{"samples": r["call_samples"], "seconds": r["call_seconds"]} for r in results]
         for m, results in runs.items()}, case.baseline)
    for method, r in summary.items():
        effective = case.micro_batch_size if method == "keras_at_m" else case.batch_size
        call = per_call[method]
        r.update(label=LABELS[method], effective_batch=effective,
                 applies_per_epoch=runs[method][-1]["applies"] / s.epochs,
                 final_loss=runs[method][-1]["loss"],
                 call_samples_per_s_best=call["samples_per_s_best"],
                 call_samples_per_s_median=call["samples_per_s_median"],
                 call_samples_per_s_all=call["samples_per_s_all"],
                 call_ratio=call["ratio"], call_ratio_paired=call["ratio_paired"],
                 setup_seconds=min(setup_seconds(run, s.epochs) for run in runs[method]))
    return {"label": case.model.label, **{k: v for k, v in asdict(case).items()
                                          if k != "model"},
            "accumulation_steps": case.accumulation_steps, "methods": summary}


def setup_seconds(run: dict[str, Any], epochs: int) -> float:
    """What a call costs beyond its epochs at their steady speed: set-up, tracing, and
    the warm-up epoch's own extra (the call's seconds less 1 + ``epochs`` timed epochs)."""
    return run["call_seconds"] - run["seconds"] * (1 + epochs) / epochs


def checks(cases: dict[str, Any]) -> list[dict[str, Any]]:
    """Each case's targets, per epoch and per call, from the measured best samples/s."""
    out = []
    for case in cases.values():
        methods = case["methods"]
        for method, baseline, target in case["targets"]:
            for scope, key, every in (
                    ("per epoch", "samples_per_s_best", "samples_per_s_all"),
                    ("per call", "call_samples_per_s_best", "call_samples_per_s_all")):
                ratio = methods[method][key] / methods[baseline][key]
                paired = harness.paired_ratio(methods[method][every], methods[baseline][every])
                out.append({
                    "id": f"{case['name']}:{method}:{scope.replace(' ', '-')}",
                    "ratio": ratio, "target": target,
                    "status": harness.status(ratio >= target),
                    "summary": f"{case['name']}, {scope}: {LABELS[method]} "
                               f"{methods[method][key]:,.0f} vs {LABELS[baseline]} "
                               f"{methods[baseline][key]:,.0f} samples/s, ratio {ratio:.2f} "
                               f"(target >= {target}; paired {paired:.2f})"})
    return out


class _Profiled(keras.callbacks.Callback):
    """Profiles the epochs after the warm-up (tracing is not the question)."""

    def __init__(self, how: str, path: Path) -> None:
        super().__init__()
        self.how, self.path, self.profiler = how, path, cProfile.Profile()

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        if epoch == 1:
            if self.how == "tf":
                tf.profiler.experimental.start(str(self.path))
            else:
                self.profiler.enable()

    def on_train_end(self, logs: dict | None = None) -> None:
        if self.how == "tf":
            tf.profiler.experimental.stop()
            return
        self.profiler.disable()
        text = io.StringIO()
        pstats.Stats(self.profiler, stream=text).sort_stats("cumulative").print_stats(40)
        self.path.write_text(text.getvalue())


def profile(case: Case, s: Settings, how: str, folder: Path) -> Path:
    """One more ``fit_large_batch`` run of ``case``; its timed epochs under cProfile
    (the top 40 functions by cumulative time) or TensorFlow's profiler (a trace)."""
    import autosplit

    x, y = workloads.data_for(case.model, case.rows, seed=s.seed)
    keras.backend.clear_session()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / ("overhead_tf_profile" if how == "tf" else "overhead_profile.txt")
    autosplit.fit_large_batch(
        workloads.build_model(case.model, seed=s.seed, jit_compile=s.jit_compile), x, y,
        batch_size=case.batch_size, micro_batch_size=case.micro_batch_size,
        epochs=1 + s.epochs, shuffle=False, verbose=0, callbacks=[_Profiled(how, path)])
    return path


def rows(case: dict[str, Any]) -> list[list[str]]:
    return [[r["label"], str(r["effective_batch"]), f"{r['samples_per_s_best']:,.0f}",
             f"{r['samples_per_s_median']:,.0f}", f"{r['ratio']:.2f}",
             f"{r['ratio_paired']:.2f}", f"{r['call_samples_per_s_best']:,.0f}",
             f"{r['call_ratio']:.2f}", f"{r['call_ratio_paired']:.2f}",
             f"{r['setup_seconds']:.2f}", f"{r['applies_per_epoch']:g}"]
            for r in case["methods"].values()]


HEADER = ["method", "eff. batch", "per epoch best", "median", "ratio", "paired",
          "per call best", "ratio", "paired", "set-up s", "applies/epoch"]


def markdown(report: dict[str, Any]) -> str:
    s = report["settings"]
    lines = harness.report_head("Overhead of splitting: samples/s per method", report)
    lines += ["", f"{s['epochs']} timed epoch(s) after one warm-up, {s['repeats']} round-robin "
              f"repeat(s), jit_compile={s['jit_compile']}, data in order. Samples/s per "
              "epoch (timed epochs) and per call (the whole call: set-up, tracing and the "
              "warm-up epoch included); ratio: best over the baseline's best (the checks' "
              "figure); paired: the median over the repeats of each repeat's ratio to "
              "the baseline's run beside it. Set-up s: "
              "the least, over the repeats, that a call took beyond its epochs at their "
              "steady speed (set-up, tracing, the warm-up epoch's extra)."]
    for case in report["cases"].values():
        lines += ["", f"## {case['name']}: {case['label']}, B={case['batch_size']}, "
                  f"m={case['micro_batch_size']} (k={case['accumulation_steps']})", "",
                  f"{case['rows']} synthetic examples, Adam lr 1e-3; baseline: "
                  f"{LABELS[case['baseline']]}.", ""]
        lines += harness.md_table(HEADER, rows(case))
    return "\n".join(lines) + harness.report_tail(report)


def main(argv: Sequence[str] | None = None) -> int:
    p = harness.parser("Samples/s of autosplit.fit_large_batch, per epoch and per call, vs a "
                       "bare while-loop for every input kind, model.fit at m, Keras's "
                       "gradient_accumulation_steps and a hand loop.",
                       quick="small models, one repeat, one timed epoch", repeats=FULL.repeats)
    p.add_argument("--epochs", type=int,
                   help=f"timed epochs per run (default {FULL.epochs}; quick {QUICK.epochs})")
    p.add_argument("--jit-compile", action="store_true", help="XLA for every method")
    p.add_argument("--cases", help="comma-separated subset of "
                   + ",".join(c.name for c in FULL.cases))
    p.add_argument("--profile", choices=("python", "tf"),
                   help="profile one more fit_large_batch run of the first case")
    args = p.parse_args(argv)
    harness.at_least("repeats", args.repeats)
    harness.at_least("epochs", args.epochs)
    s = QUICK if args.quick else FULL
    s = replace(s, jit_compile=args.jit_compile, repeats=args.repeats or s.repeats,
                epochs=args.epochs or s.epochs)
    if args.cases:
        known = {c.name: c for c in s.cases}
        s = replace(s, cases=tuple(known[c] for c in harness.subset("cases", args.cases,
                                                                     sorted(known))))

    info = harness.machine_info(devices=True)
    harness.log(f"# {harness.machine_line(info)}")
    cases = {case.name: compare(case, s, harness.log) for case in s.cases}
    report: dict[str, Any] = {"question": QUESTION, "command": harness.command("overhead", argv),
                              "units": UNITS, "machine": info,
                              "settings": {k: v for k, v in asdict(s).items() if k != "cases"},
                              "cases": cases, "checks": checks(cases)}
    for case in cases.values():
        harness.log(f"\n{case['name']}: {case['label']}, B={case['batch_size']}, "
                    f"m={case['micro_batch_size']}; {UNITS}")
        harness.log(harness.text_table(HEADER, rows(case)))
    out = harness.out_dir(args)
    if args.profile:
        folder = out if out is not None else Path(tempfile.mkdtemp(prefix="autosplit-profile-"))
        report["profile"] = str(profile(s.cases[0], s, args.profile, folder))
        harness.log(f"profile of fit_large_batch ({args.profile}): {report['profile']}")
    harness.conclude(out, "overhead", report, markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
