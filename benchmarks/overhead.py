"""What does splitting a large batch cost per sample?

One run trains the same MLP on the same synthetic data (made here from a fixed seed,
nothing downloaded) four ways and reports training throughput in samples/second:

1. ``autosplit.fit_large_batch(batch_size=B, micro_batch_size=m)``: the micro-batches
   of one large batch run in one compiled step, the optimizer applies once per B;
2. ``model.fit(batch_size=m)``: the baseline (no accumulation; one apply per m);
3. ``model.fit(batch_size=m)`` with Keras 3's own
   ``Adam(gradient_accumulation_steps=B // m)``;
4. the classic hand-written loop (the well-known StackOverflow answer): a
   ``tf.function`` returns ONE micro-batch's loss and gradients, the host averages the
   B // m gradient lists with ``np.mean`` and calls ``optimizer.apply_gradients`` once.

Every method starts from a fresh model with the same initial weights and a fresh Adam
(lr 1e-3); the first epoch of each run is a warm-up (tracing, compilation, optimizer
slots) and is not timed. The methods run round-robin ``--repeats`` times (the order
rotates by one each repeat) and each reports the best and the median over the repeats.
Ratios are best / best against the baseline. Throughput counts training examples
processed per wall-clock second over the timed epochs, input pipeline included.

Reproduce (on an otherwise idle machine)::

    PYTHONPATH=. .venv/bin/python benchmarks/overhead.py           # full, ~minutes
    PYTHONPATH=. .venv/bin/python benchmarks/overhead.py --quick   # <1 min smoke run

The full run writes ``benchmarks/results/overhead.json`` and ``overhead.md``; ``--quick``
writes files only where ``--json`` / ``--markdown`` say, so it never overwrites them.
"""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse
import datetime
import gc
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import keras
import numpy as np
import tensorflow as tf

RESULTS = Path(__file__).resolve().parent / "results"
UNITS = "samples/s (training examples per wall-clock second, timed epochs only)"


@dataclass(frozen=True)
class Settings:
    """One benchmark configuration; every method sees exactly this."""

    examples: int  # rows of synthetic data; a multiple of batch_size
    features: int  # input width
    hidden: tuple[int, ...]  # Dense widths (relu)
    classes: int  # logits
    batch_size: int  # B, the large (effective) batch
    micro_batch_size: int  # m, the micro-batch (and the baseline's batch)
    epochs: int  # timed epochs per run (after one warm-up epoch)
    repeats: int  # round-robin passes over all methods
    seed: int
    jit_compile: bool  # XLA for every compiled step, the hand loop's included
    learning_rate: float = 1e-3

    @property
    def accumulation_steps(self) -> int:
        return self.batch_size // self.micro_batch_size


FULL = Settings(examples=32768, features=256, hidden=(1024, 1024), classes=10,
                batch_size=4096, micro_batch_size=256, epochs=3, repeats=3, seed=0,
                jit_compile=False)
QUICK = replace(FULL, examples=8192, features=64, hidden=(128, 128), batch_size=1024,
                micro_batch_size=64, epochs=2, repeats=2)


@dataclass(frozen=True)
class Run:
    """One timed run of one method."""

    seconds: float  # wall clock over the timed epochs
    samples: int  # examples processed in those epochs
    applies: int  # optimizer applies in those epochs
    final_loss: float  # training loss of the last epoch, a sanity check

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds


# ---------------------------------------------------------------- data and model


def make_data(s: Settings) -> tuple[np.ndarray, np.ndarray]:
    """Gaussian inputs labelled by a random linear teacher (learnable, fixed seed)."""
    rng = np.random.default_rng(s.seed)
    x = rng.standard_normal((s.examples, s.features), dtype=np.float32)
    teacher = rng.standard_normal((s.features, s.classes), dtype=np.float32)
    y = np.argmax(x @ teacher, axis=1).astype(np.int32)
    return x, y


def make_model(s: Settings, weights: Sequence[np.ndarray] | None = None) -> keras.Model:
    layers = [keras.Input((s.features,))]
    layers += [keras.layers.Dense(width, activation="relu") for width in s.hidden]
    layers.append(keras.layers.Dense(s.classes))
    model = keras.Sequential(layers)
    if weights is not None:
        model.set_weights(weights)
    return model


def loss_fn() -> keras.losses.Loss:
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def compiled(s: Settings, weights: Sequence[np.ndarray], **adam: Any) -> keras.Model:
    model = make_model(s, weights)
    model.compile(optimizer=keras.optimizers.Adam(s.learning_rate, **adam), loss=loss_fn(),
                  jit_compile=s.jit_compile)
    return model


# ---------------------------------------------------------------- the four methods


class _EpochClock(keras.callbacks.Callback):
    """Wall time and optimizer applies at the end of every epoch.

    Only epoch hooks are overridden, so ``model.fit`` keeps its asynchronous batch
    dispatch; the logs arrive as Python floats, so the epoch's work has finished.
    """

    def __init__(self) -> None:
        super().__init__()
        self.marks: list[tuple[float, int, float]] = []

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        loss = float((logs or {}).get("loss", float("nan")))
        # `iterations` counts real applies, also under gradient_accumulation_steps.
        self.marks.append((time.perf_counter(), int(self.model.optimizer.iterations), loss))

    def run(self, s: Settings) -> Run:
        (t0, it0, _), (t1, it1, loss) = self.marks[0], self.marks[-1]
        return Run(seconds=t1 - t0, samples=s.examples * s.epochs, applies=it1 - it0,
                   final_loss=loss)


def run_fit_large_batch(s: Settings, weights, x, y) -> Run:
    import autosplit

    model = compiled(s, weights)
    clock = _EpochClock()
    history = autosplit.fit_large_batch(
        model, (x, y), batch_size=s.batch_size, micro_batch_size=s.micro_batch_size,
        epochs=1 + s.epochs, verbose=0, callbacks=[clock],
    )
    info = history.autosplit
    if (info["micro_batch_size"], info["accumulation_steps"]) != (
            s.micro_batch_size, s.accumulation_steps):
        raise RuntimeError(f"fit_large_batch did not split as asked: {info}")
    return clock.run(s)


def run_model_fit(s: Settings, weights, x, y) -> Run:
    model = compiled(s, weights)
    clock = _EpochClock()
    model.fit(x, y, batch_size=s.micro_batch_size, epochs=1 + s.epochs, verbose=0,
              callbacks=[clock])
    return clock.run(s)


def run_keras_accumulation(s: Settings, weights, x, y) -> Run:
    model = compiled(s, weights, gradient_accumulation_steps=s.accumulation_steps)
    clock = _EpochClock()
    model.fit(x, y, batch_size=s.micro_batch_size, epochs=1 + s.epochs, verbose=0,
              callbacks=[clock])
    return clock.run(s)


def run_hand_loop(s: Settings, weights, x, y) -> Run:
    """The StackOverflow recipe, kept as written: per-micro-batch gradients come back
    to the host, are averaged there with NumPy, and one eager ``apply_gradients``."""
    model = make_model(s, weights)
    optimizer = keras.optimizers.Adam(s.learning_rate)
    loss_object = loss_fn()
    variables = model.trainable_variables

    @tf.function(jit_compile=s.jit_compile)
    def micro_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_object(yb, model(xb, training=True))
        return loss, tape.gradient(loss, variables)

    rng = np.random.default_rng(s.seed + 1)
    k, m = s.accumulation_steps, s.micro_batch_size
    marks: list[tuple[float, int, float]] = []
    for _ in range(1 + s.epochs):
        order = rng.permutation(s.examples)
        losses = []
        for start in range(0, s.examples, s.batch_size):
            rows = order[start:start + s.batch_size]
            xb, yb = x[rows], y[rows]
            per_micro = []
            for i in range(k):
                loss, grads = micro_step(xb[i * m:(i + 1) * m], yb[i * m:(i + 1) * m])
                per_micro.append([g.numpy() for g in grads])
                losses.append(loss.numpy())
            mean = [np.mean(np.stack(gs), axis=0) for gs in zip(*per_micro, strict=True)]
            optimizer.apply_gradients(zip(mean, variables, strict=True))
        marks.append((time.perf_counter(), int(optimizer.iterations), float(np.mean(losses))))
    (t0, it0, _), (t1, it1, loss) = marks[0], marks[-1]
    return Run(seconds=t1 - t0, samples=s.examples * s.epochs, applies=it1 - it0,
               final_loss=loss)


@dataclass(frozen=True)
class Method:
    key: str  # JSON key
    label: str  # table label
    effective_batch: Callable[[Settings], int]
    run: Callable[..., Run]


METHODS = (
    Method("fit_large_batch", "autosplit.fit_large_batch(B, m)",
           lambda s: s.batch_size, run_fit_large_batch),
    Method("model_fit", "model.fit(batch_size=m) [baseline]",
           lambda s: s.micro_batch_size, run_model_fit),
    Method("keras_accumulation", "model.fit(m), Adam(gradient_accumulation_steps=B/m)",
           lambda s: s.batch_size, run_keras_accumulation),
    Method("hand_loop", "hand loop: tf.function grads, np.mean, 1 apply",
           lambda s: s.batch_size, run_hand_loop),
)
BASELINE = "model_fit"


# ---------------------------------------------------------------- running and reporting


def machine_info() -> dict[str, Any]:
    devices = [f"{d.device_type}:{d.name}" for d in tf.config.list_physical_devices()]
    gpus = []
    for gpu in tf.config.list_physical_devices("GPU"):
        details = tf.config.experimental.get_device_details(gpu)
        gpus.append(details.get("device_name", gpu.name))
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    try:
        load = [round(v, 2) for v in os.getloadavg()]
    except OSError:
        load = None
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "load_average_at_start": load,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "numpy": np.__version__,
        "devices": devices,
        "gpus": gpus,
    }


def benchmark(s: Settings, log: Callable[[str], None] = print) -> dict[str, list[Run]]:
    x, y = make_data(s)
    keras.utils.set_random_seed(s.seed)
    weights = make_model(s).get_weights()
    runs: dict[str, list[Run]] = {m.key: [] for m in METHODS}
    for repeat in range(s.repeats):
        shift = repeat % len(METHODS)
        for method in METHODS[shift:] + METHODS[:shift]:
            keras.backend.clear_session()
            gc.collect()
            keras.utils.set_random_seed(s.seed)
            run = method.run(s, weights, x, y)
            runs[method.key].append(run)
            log(f"  repeat {repeat + 1}/{s.repeats}  {method.key:<20} "
                f"{run.samples_per_s:>12,.0f} samples/s  ({run.seconds:.2f} s, "
                f"loss {run.final_loss:.4f})")
    return runs


def summarise(s: Settings, runs: dict[str, list[Run]]) -> dict[str, dict[str, Any]]:
    best_base = max(r.samples_per_s for r in runs[BASELINE])
    median_base = statistics.median(r.samples_per_s for r in runs[BASELINE])
    out = {}
    for method in METHODS:
        rates = [r.samples_per_s for r in runs[method.key]]
        best, median = max(rates), statistics.median(rates)
        out[method.key] = {
            "label": method.label,
            "effective_batch": method.effective_batch(s),
            "samples_per_s_best": best,
            "samples_per_s_median": median,
            "ratio_to_baseline": best / best_base,
            "ratio_to_baseline_median": median / median_base,
            "applies_per_epoch": runs[method.key][-1].applies / s.epochs,
            "samples_per_s_all": rates,
            "final_loss": runs[method.key][-1].final_loss,
        }
    return out


_HEADER = ("method", "eff. batch", "samples/s best", "samples/s median", "ratio",
           "applies/epoch")


def _rows(summary: dict[str, dict[str, Any]]) -> list[tuple[str, ...]]:
    return [
        (r["label"], f"{r['effective_batch']}", f"{r['samples_per_s_best']:,.0f}",
         f"{r['samples_per_s_median']:,.0f}", f"{r['ratio_to_baseline']:.2f}",
         f"{r['applies_per_epoch']:g}")
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


def markdown(report: dict[str, Any]) -> str:
    s, info = report["settings"], report["machine"]
    lines = [
        "# Overhead of splitting: samples/s per method",
        "",
        report["question"],
        "",
        f"Reproduce: `{report['command']}`",
        "",
        f"Machine: {info['cpu_count']} CPUs ({info['cpus_usable']} usable), "
        f"GPUs: {', '.join(info['gpus']) or 'none'}; TensorFlow {info['tensorflow']}, "
        f"Keras {info['keras']}; {info['date']}; load average at start "
        f"{info['load_average_at_start']}.",
        "",
        f"Model: MLP {s['features']}-{'-'.join(map(str, s['hidden']))}-{s['classes']} (relu), "
        f"sparse categorical crossentropy from logits, Adam lr {s['learning_rate']}, "
        f"jit_compile={s['jit_compile']}. Data: {s['examples']} synthetic examples. "
        f"B={s['batch_size']}, m={s['micro_batch_size']} ({s['accumulation_steps']} "
        f"micro-batches per large batch). {s['epochs']} timed epochs after 1 warm-up, "
        f"{s['repeats']} round-robin repeats.",
        "",
        f"Units: {report['units']}. Ratio: best samples/s over the baseline's best.",
        "",
        "| " + " | ".join(_HEADER) + " |",
        "|" + "|".join(["---"] + ["---:"] * (len(_HEADER) - 1)) + "|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in _rows(report["methods"])]
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Samples/s of autosplit.fit_large_batch vs model.fit, Keras "
                    "gradient_accumulation_steps and a hand-written accumulation loop.")
    parser.add_argument("--quick", action="store_true",
                        help="small model and data (<1 min); writes no files unless asked")
    parser.add_argument("--epochs", type=int, help="timed epochs per run (default 3; quick 2)")
    parser.add_argument("--repeats", type=int,
                        help="round-robin passes over the methods (default 3; quick 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jit-compile", action="store_true",
                        help="XLA for every method (default off for all)")
    parser.add_argument("--json", type=Path, help="write results here "
                        "(default benchmarks/results/overhead.json; none with --quick)")
    parser.add_argument("--markdown", type=Path, help="write the Markdown table here "
                        "(default: next to --json, with a .md suffix)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    s = QUICK if args.quick else FULL
    s = replace(s, seed=args.seed, jit_compile=args.jit_compile,
                epochs=args.epochs if args.epochs is not None else s.epochs,
                repeats=args.repeats if args.repeats is not None else s.repeats)
    for name in ("epochs", "repeats"):
        if getattr(s, name) < 1:
            raise SystemExit(f"Expected `--{name}` >= 1. Received: {getattr(s, name)}.")

    info = machine_info()
    command = " ".join(["python", "benchmarks/overhead.py",
                        *(sys.argv[1:] if argv is None else argv)])
    print(f"# {info['date']}  cpus={info['cpu_count']} (usable {info['cpus_usable']})  "
          f"load={info['load_average_at_start']}  TF {info['tensorflow']}  "
          f"Keras {info['keras']}  GPUs: {', '.join(info['gpus']) or 'none'}")
    print(f"# MLP {s.features}-{'-'.join(map(str, s.hidden))}-{s.classes}, "
          f"{s.examples} examples, B={s.batch_size}, m={s.micro_batch_size} "
          f"(k={s.accumulation_steps}), {s.epochs} timed epoch(s) + 1 warm-up, "
          f"{s.repeats} repeat(s), jit_compile={s.jit_compile}")

    runs = benchmark(s)
    summary = summarise(s, runs)
    print()
    print(f"Units: {UNITS}; ratio = best / baseline best")
    print(text_table(summary))

    json_path, md_path = args.json, args.markdown
    if json_path is None and not args.quick:
        json_path = RESULTS / "overhead.json"
    if md_path is None and json_path is not None:
        md_path = json_path.with_suffix(".md")
    report = {
        "question": "What does splitting a large batch into micro-batches cost per "
                    "training sample, against plain model.fit at the micro-batch size "
                    "and two other ways to accumulate gradients?",
        "command": command,
        "units": UNITS,
        "baseline": BASELINE,
        "machine": info,
        "settings": {**asdict(s), "accumulation_steps": s.accumulation_steps},
        "methods": summary,
    }
    for path, text in ((json_path, json.dumps(report, indent=2) + "\n"),
                       (md_path, markdown(report))):
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    raise SystemExit(main())
