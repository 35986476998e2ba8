"""How far are BatchNormalization's moving statistics from the full batch's under a split?

The question: after training with ``fit_large_batch(batch_size=B, micro_batch_size=B // k)``,
how far are the moving mean and variance of every BatchNormalization layer, and the
model's inference-mode loss and accuracy, from plain ``model.fit(batch_size=B)``'s, with
``batch_norm="pooled"`` (one update per large batch with the pooled statistics) and with
``batch_norm="micro"`` (Keras's update once per micro-batch)?

Method. Two small conv nets on 16x16x3 inputs, 10 classes, Adam (lr 1e-3), no Dropout,
BatchNormalization with momentum 0.9 (so that 20 updates carry the moving statistics
most of the way from their initial 0 and 1; Keras's default 0.99 would leave 82% of
the initial values after 20 steps):

- ``conv_bn``: three blocks Conv2D(16/32/64, 3, no bias) -> BatchNormalization -> ReLU
  (-> MaxPooling after the first two), GlobalAveragePooling, Dense(10);
- ``bn_first``: the same with one more BatchNormalization on the raw inputs. Its moving
  statistics depend on the data only, not on the weights: the clean signal.

Synthetic data: each class is a coarse random 4x4x3 pattern (upsampled to 16x16) plus
unit Gaussian noise, then shifted and scaled per channel (means 3, -2, 10; scales 2, 5,
0.5): learnable, and far from zero-mean/unit-variance, so the statistics matter. 20
large batches of training rows (one epoch, in order: ``shuffle=False`` everywhere) and
a held-out set drawn alike.

Every run starts from the same initial weights: the reference ``model.fit(batch_size=B,
shuffle=False)``, then ``fit_large_batch(batch_size=B, micro_batch_size=B // k,
batch_norm=mode, shuffle=False)`` for both modes and k = 1, 2, 4, 8, 16, B = 512; then the
same at k = 8 over 100 large batches, where every moving average has forgotten its
initial values (the short run's inference accuracy mostly measures that forgetting).

What is reported, against the reference after the 20 large batches:

- per BatchNormalization layer, the largest relative error over channels of
  ``moving_variance`` (|v - v_ref| / v_ref) and of ``moving_mean`` (|mu - mu_ref| /
  |mu_ref|, and |mu - mu_ref| / sqrt(v_ref), in standard deviations, since a mean near
  zero makes the relative error meaningless);
- the relative error of the trained weights, ||w - w_ref|| / ||w_ref|| over every
  trainable variable: the forward pass normalises each micro-batch by its own statistics
  in both split modes (ghost batch norm), so beyond the first layer the weights, and
  with them the activations whose statistics are pooled, differ from the reference by
  this much; the statistics' error reads against it;
- ``model.evaluate`` (inference mode: the moving statistics) on the held-out rows.

Units: relative errors (dimensionless, max over channels); loss = sparse categorical
cross-entropy; accuracy = fraction of held-out rows.

Reproduce (CPU; accuracy, not speed, so a busy machine is fine)::

    python -m benchmarks.batchnorm_stats          # ~3-5 min on 2 cores
    python -m benchmarks.batchnorm_stats --quick  # 8x8 inputs, B=128, k in {1, 4}

``--ks``, ``--steps`` and ``--models`` change the sweep, the training length and the
models.

The full run writes ``benchmarks/results/batchnorm_stats.{json,md,png}``; ``--quick``
writes files only with ``--out DIR``.
"""

from __future__ import annotations

import gc
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import keras
import numpy as np

import autosplit
from benchmarks import harness
from benchmarks.harness import Panel, Series

QUESTION = ("How far are BatchNormalization's moving statistics, and the model's "
            "inference-mode loss and accuracy, from the full-batch reference "
            "model.fit(batch_size=B) when the large batch is split into k micro-batches, "
            "with batch_norm=\"pooled\" and with batch_norm=\"micro\"?")
UNITS = ("relative errors against model.fit(batch_size=B) (max over channels; weights: "
         "||w - w_ref|| / ||w_ref||); held-out loss (cross-entropy) and accuracy (fraction)")
CLASSES = 10
MODES = ("pooled", "micro")
MODELS = ("conv_bn", "bn_first")
MODEL_LABELS = {
    "conv_bn": "conv net, BatchNormalization after each of 3 convs",
    "bn_first": "the same with BatchNormalization first, on the raw inputs",
}
OFFSET = np.array([3.0, -2.0, 10.0], np.float32)  # per channel: the inputs' means ...
SCALE = np.array([2.0, 5.0, 0.5], np.float32)  # ... and scales (x noise of std ~1)
FLOOR = 1e-7  # where a plot's log scale meets an exact zero


@dataclass(frozen=True)
class Settings:
    image: int = 16  # inputs image x image x 3
    batch_size: int = 512  # B
    steps: int = 20  # large batches trained (one epoch)
    ks: tuple[int, ...] = (1, 2, 4, 8, 16)  # micro-batches per large batch
    main_k: int = 8  # the k of the main table
    eval_rows: int = 2048
    filters: tuple[int, ...] = (16, 32, 64)
    momentum: float = 0.9  # BatchNormalization's
    amplitude: float = 0.5  # the class pattern, against noise of std 1
    learning_rate: float = 1e-3
    long_steps: int = 100  # then once more at main_k, the moving averages converged (0: no)
    models: tuple[str, ...] = MODELS
    seed: int = 0


FULL = Settings()
# Quick: bn_first only (its first layer is the robust fact, its others the deeper ones).
QUICK = replace(FULL, image=8, batch_size=128, steps=4, ks=(1, 4), main_k=4, eval_rows=256,
                filters=(8, 16, 16), long_steps=0, models=("bn_first",))


# ---------------------------------------------------------------- model and data


def build(name: str, s: Settings, weights: Sequence[np.ndarray] | None = None) -> keras.Model:
    """``conv_bn`` or ``bn_first``, compiled (Adam, no XLA), seeded or given ``weights``."""
    keras.utils.set_random_seed(s.seed)
    inputs = keras.Input((s.image, s.image, 3))
    h = inputs
    if name == "bn_first":
        h = keras.layers.BatchNormalization(momentum=s.momentum, name="bn_input")(h)
    for i, filters in enumerate(s.filters, start=1):
        h = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False, name=f"conv{i}")(h)
        h = keras.layers.BatchNormalization(momentum=s.momentum, name=f"bn{i}")(h)
        h = keras.layers.ReLU()(h)
        if i < len(s.filters):
            h = keras.layers.MaxPooling2D()(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    model = keras.Model(inputs, keras.layers.Dense(CLASSES, name="logits")(h), name=name)
    if weights is not None:
        model.set_weights(weights)
    model.compile(optimizer=keras.optimizers.Adam(s.learning_rate),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], jit_compile=False)
    return model


def data(rows: int, s: Settings, *, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``rows`` examples: a class's coarse pattern plus noise, shifted and scaled per
    channel; the patterns are the same for every ``seed`` (train and held-out)."""
    cells = 4
    patterns = np.random.default_rng(1000 + s.seed).standard_normal(
        (CLASSES, cells, cells, 3)).astype(np.float32)
    patterns = np.repeat(np.repeat(patterns, s.image // cells, 1), s.image // cells, 2)
    rng = np.random.default_rng(seed)
    y = rng.integers(0, CLASSES, rows).astype(np.int32)
    noise = rng.standard_normal((rows, s.image, s.image, 3), dtype=np.float32)
    return OFFSET + SCALE * (s.amplitude * patterns[y] + noise), y


# ---------------------------------------------------------------- one run


def bn_layers(model: keras.Model) -> list:
    return [layer for layer in model.layers
            if isinstance(layer, keras.layers.BatchNormalization)]


def state(model: keras.Model) -> dict[str, Any]:
    """What a run is compared on: the moving statistics, the trainable weights."""
    return {"stats": {layer.name: (np.array(layer.moving_mean.numpy(), np.float64),
                                   np.array(layer.moving_variance.numpy(), np.float64))
                      for layer in bn_layers(model)},
            "weights": [np.array(v.numpy(), np.float64) for v in model.trainable_variables]}


def train(name: str, s: Settings, weights: Sequence[np.ndarray], data_: dict[str, Any], *,
          k: int | None = None, mode: str | None = None) -> dict[str, Any]:
    """One run from ``weights``: the reference (``k`` None) or ``fit_large_batch``."""
    keras.backend.clear_session()
    gc.collect()
    model = build(name, s, weights)
    x, y = data_["train"]
    start = time.perf_counter()
    if k is None:
        history = model.fit(x, y, batch_size=s.batch_size, epochs=1, shuffle=False, verbose=0)
    else:
        with warnings.catch_warnings():  # the ghost-batch-norm notice, once per run
            warnings.filterwarnings("ignore", "This model has BatchNormalization")
            history = autosplit.fit_large_batch(
                model, x, y, batch_size=s.batch_size, micro_batch_size=s.batch_size // k,
                batch_norm=mode, epochs=1, shuffle=False, verbose=0)
        assert history.autosplit.batch_norm == mode, history.autosplit
    seconds = time.perf_counter() - start
    loss, accuracy = model.evaluate(*data_["held_out"], batch_size=256, verbose=0)
    return {"train_loss": float(history.history["loss"][-1]), "held_out_loss": float(loss),
            "held_out_accuracy": float(accuracy), "applies": int(model.optimizer.iterations),
            "seconds": seconds, **state(model)}


def errors(run: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    """``run``'s moving statistics and weights against the reference's."""
    layers = {}
    for layer, (mean, var) in run["stats"].items():
        ref_mean, ref_var = ref["stats"][layer]
        delta = np.abs(mean - ref_mean)
        layers[layer] = {
            "variance_rel": float(np.max(np.abs(var - ref_var) / ref_var)),
            "mean_rel": float(np.max(delta / np.maximum(np.abs(ref_mean), 1e-30))),
            "mean_in_std": float(np.max(delta / np.sqrt(ref_var))),
        }
    diff = np.sqrt(sum(np.sum((w - r) ** 2) for w, r in zip(run["weights"], ref["weights"],
                                                           strict=True)))
    norm = np.sqrt(sum(np.sum(r ** 2) for r in ref["weights"]))
    worst = max(float(np.linalg.norm(w - r) / max(np.linalg.norm(r), 1e-30))
                for w, r in zip(run["weights"], ref["weights"], strict=True))
    return {"layers": layers,
            "worst_variance_rel": max(v["variance_rel"] for v in layers.values()),
            "worst_mean_rel": max(v["mean_rel"] for v in layers.values()),
            "worst_mean_in_std": max(v["mean_in_std"] for v in layers.values()),
            "weights_rel": float(diff / norm), "worst_variable_rel": worst}


def summary(run: dict[str, Any]) -> dict[str, Any]:
    return {key: run[key] for key in ("train_loss", "held_out_loss", "held_out_accuracy",
                                      "applies", "seconds", "bn_input_vs_float64")
            if key in run}


def input_statistics(x: np.ndarray, s: Settings) -> tuple[np.ndarray, np.ndarray]:
    """In float64: the moving mean and variance a BatchNormalization on the raw inputs
    reaches after ``s.steps`` large batches of ``x`` in order (Keras's update, biased
    variance, from 0 and 1): what both model.fit and the pooled mode compute in float32."""
    mean, var = np.zeros(3), np.ones(3)
    for step in range(s.steps):
        rows = x[step * s.batch_size:(step + 1) * s.batch_size].astype(np.float64)
        mean = s.momentum * mean + (1 - s.momentum) * rows.mean(axis=(0, 1, 2))
        var = s.momentum * var + (1 - s.momentum) * rows.var(axis=(0, 1, 2))
    return mean, var


def float64_error(run: dict[str, Any], exact: tuple[np.ndarray, np.ndarray]) -> dict[str, float]:
    mean, var = run["stats"]["bn_input"]
    return {"variance_rel": float(np.max(np.abs(var - exact[1]) / exact[1])),
            "mean_in_std": float(np.max(np.abs(mean - exact[0]) / np.sqrt(exact[1])))}


def measure(name: str, s: Settings, data_: dict[str, Any], say: harness.Log) -> dict[str, Any]:
    """The reference and both modes at every k, for one model."""
    weights = build(name, s).get_weights()
    ref = train(name, s, weights, data_)
    exact = input_statistics(data_["train"][0], s) if name == "bn_first" else None
    if exact is not None:
        ref["bn_input_vs_float64"] = float64_error(ref, exact)
    say(f"# {name}: reference model.fit(B={s.batch_size}): held-out loss "
        f"{ref['held_out_loss']:.4f}, accuracy {ref['held_out_accuracy']:.4f} "
        f"({ref['seconds']:.1f} s)")
    runs = []
    for k in s.ks:
        for mode in MODES:
            run = train(name, s, weights, data_, k=k, mode=mode)
            r = {"k": k, "micro_batch_size": s.batch_size // k, "mode": mode, **summary(run),
                 **errors(run, ref)}
            if exact is not None:
                r["bn_input_vs_float64"] = float64_error(run, exact)
            runs.append(r)
            say(f"  k={k:<3} {mode:<6} variance err (worst layer) {r['worst_variance_rel']:.2e}"
                f"  mean err {r['worst_mean_in_std']:.2e} std  weights {r['weights_rel']:.2e}"
                f"  held-out acc {r['held_out_accuracy']:.4f}  ({r['seconds']:.1f} s)")
    return {"label": MODEL_LABELS[name], "layers": list(ref["stats"]),
            "reference": summary(ref), "runs": runs}


def find(model: dict[str, Any], k: int, mode: str) -> dict[str, Any]:
    return next(r for r in model["runs"] if r["k"] == k and r["mode"] == mode)


# ---------------------------------------------------------------- checks and report


def deeper(models: dict[str, Any]) -> str:
    """The model whose BatchNormalization layers after convs the tables read."""
    return "conv_bn" if "conv_bn" in models else next(iter(models))


def deeper_variance(run: dict[str, Any]) -> float:
    """The worst moving-variance error over the layers after a conv."""
    return max(e["variance_rel"] for layer, e in run["layers"].items() if layer != "bn_input")


def checks(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Computed from the measured errors (thresholds: float32 rounding vs a real gap)."""
    s, models = report["settings"], report["models"]
    out = []
    first = models.get("bn_first")
    if first is not None:
        split = [k for k in s["ks"] if k > 1]
        pooled = max(find(first, k, "pooled")["layers"]["bn_input"]["variance_rel"]
                     for k in s["ks"])
        pooled_mean = max(find(first, k, "pooled")["layers"]["bn_input"]["mean_in_std"]
                          for k in s["ks"])
        micro = min((find(first, k, "micro")["layers"]["bn_input"]["variance_rel"]
                     for k in split), default=float("nan"))
        ok = pooled <= 1e-4 and pooled_mean <= 1e-4 and micro >= 1e-3
        own = first["reference"]["bn_input_vs_float64"]["variance_rel"]
        out.append({"id": "first-layer", "status": harness.status(ok),
                    "pooled_variance_rel": pooled, "pooled_mean_in_std": pooled_mean,
                    "micro_variance_rel_min": micro,
                    "summary": f"BatchNormalization on the raw inputs: pooled's moving "
                               f"statistics at most {pooled:.1e} (variance) and "
                               f"{pooled_mean:.1e} std (mean) from model.fit's at every k "
                               f"(target <= 1e-4: float32 rounding; model.fit's own variance "
                               f"is {own:.1e} from the float64 statistics); micro's variance "
                               f"at least {micro:.1e} off at k > 1 (expected >= 1e-3)"})
    if 1 in s["ks"]:
        worst = max(max(find(m, 1, mode)["worst_variance_rel"], find(m, 1, mode)["weights_rel"])
                    for m in models.values() for mode in MODES)
        out.append({"id": "k1", "status": harness.status(worst <= 1e-4), "worst": worst,
                    "summary": f"k = 1 (no split): both modes within {worst:.1e} of model.fit "
                               f"in moving variance and weights (target <= 1e-4)"})
    name, k = deeper(models), s["main_k"]
    p, m = find(models[name], k, "pooled"), find(models[name], k, "micro")
    closer = deeper_variance(p) < deeper_variance(m)
    out.append({"id": "deeper", "status": harness.status(closer), "model": name,
                "pooled": deeper_variance(p), "micro": deeper_variance(m),
                "summary": f"{name} at k = {k}, BatchNormalization after convs: worst "
                           f"moving-variance error pooled {deeper_variance(p):.2e} vs micro "
                           f"{deeper_variance(m):.2e} (the weights differ from the "
                           f"reference's by {p['weights_rel']:.1e} / {m['weights_rel']:.1e})"})
    return out


def fmt(value: float) -> str:
    return f"{value:.1e}" if value < 0.01 else f"{value:.3f}"


def main_rows(model: dict[str, Any], k: int) -> list[list[str]]:
    ref = model["reference"]
    rows = [["model.fit(batch_size=B) [reference]", f"{ref['held_out_loss']:.4f}",
             f"{ref['held_out_accuracy']:.4f}", "0", "0", "0"]]
    for mode in MODES:
        r = find(model, k, mode)
        rows.append([f'fit_large_batch(m=B/{k}, batch_norm="{mode}")',
                     f"{r['held_out_loss']:.4f}", f"{r['held_out_accuracy']:.4f}",
                     fmt(r["worst_variance_rel"]), fmt(r["worst_mean_in_std"]),
                     fmt(r["weights_rel"])])
    return rows


MAIN_HEADER = ["run", "held-out loss", "held-out acc", "moving var err (worst layer)",
               "moving mean err (worst, std)", "weights rel err"]


def layer_rows(model: dict[str, Any], k: int) -> list[list[str]]:
    rows = []
    for layer in model["layers"]:
        cells = [layer]
        for mode in MODES:
            e = find(model, k, mode)["layers"][layer]
            cells += [fmt(e["variance_rel"]), fmt(e["mean_rel"]), fmt(e["mean_in_std"])]
        rows.append(cells)
    return rows


LAYER_HEADER = ["layer", "pooled: var rel", "mean rel", "mean (std)", "micro: var rel",
                "mean rel", "mean (std)"]


def sweep_rows(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The errors against k: bn_input's (bn_first) and the deeper model's."""
    models = report["models"]
    name = deeper(models)
    header = ["k", "m"]
    if "bn_first" in models:
        header += ["bn_input var err: pooled", "micro", "pooled vs float64"]
    header += [f"{name} worst var err after a conv: pooled", "micro",
               f"{name} weights err: pooled", "micro", f"{name} held-out acc: pooled", "micro"]
    rows = []
    for k in report["settings"]["ks"]:
        cells = [str(k), str(report["settings"]["batch_size"] // k)]
        if "bn_first" in models:
            cells += [fmt(find(models["bn_first"], k, mode)["layers"]["bn_input"]
                          ["variance_rel"]) for mode in MODES]
            cells.append(fmt(find(models["bn_first"], k, "pooled")["bn_input_vs_float64"]
                             ["variance_rel"]))
        runs = [find(models[name], k, mode) for mode in MODES]
        cells += [fmt(deeper_variance(r)) for r in runs]
        cells += [fmt(r["weights_rel"]) for r in runs]
        cells += [f"{r['held_out_accuracy']:.4f}" for r in runs]
        rows.append(cells)
    return header, rows


def markdown(report: dict[str, Any]) -> str:
    s = report["settings"]
    lines = harness.report_head("BatchNormalization's moving statistics under a split", report)
    lines += ["", f"Inputs {s['image']}x{s['image']}x3, B = {s['batch_size']}, {s['steps']} "
              f"large batches (one epoch, in order), Adam lr {s['learning_rate']:g}, "
              f"BatchNormalization momentum {s['momentum']:g}, {s['eval_rows']} held-out rows. "
              f"The reference is model.fit(batch_size=B, shuffle=False) from the same initial "
              f"weights."]
    for name, model in report["models"].items():
        lines += ["", f"## {name}: {model['label']}, k = {s['main_k']}", ""]
        lines += harness.md_table(MAIN_HEADER, main_rows(model, s["main_k"]))
        lines += ["", "Per layer, relative to the reference:", ""]
        lines += harness.md_table(LAYER_HEADER, layer_rows(model, s["main_k"]))
    lines += ["", "## Moving-variance error against k", ""]
    if "bn_first" in report["models"]:
        own = report["models"]["bn_first"]["reference"]["bn_input_vs_float64"]
        lines += [f"bn_input's statistics depend on the data only: computed in float64 they "
                  f"are the yardstick for both; model.fit's own are {fmt(own['variance_rel'])} "
                  f"(variance) and {fmt(own['mean_in_std'])} std (mean) from them.", ""]
    lines += harness.md_table(*sweep_rows(report))
    for name, model in report["long"].items():
        lines += ["", f"## Longer: {name} after {s['long_steps']} large batches, "
                  f"k = {s['main_k']}", "", f"{s['long_steps'] * s['batch_size']} training "
                  f"rows drawn alike, everything else as above: the moving averages have "
                  f"forgotten their initial 0 and 1 ({s['momentum']:g}^{s['long_steps']} = "
                  f"{s['momentum'] ** s['long_steps']:.0e}).", ""]
        lines += harness.md_table(MAIN_HEADER, main_rows(model, s["main_k"]))
        lines += ["", "Per layer:", ""]
        lines += harness.md_table(LAYER_HEADER, layer_rows(model, s["main_k"]))
    return "\n".join(lines) + harness.report_tail(report, "batchnorm_stats.png")


def plot(report: dict[str, Any], path) -> None:
    s, models = report["settings"], report["models"]
    ks, name = list(s["ks"]), deeper(models)
    colors = {"pooled": "tab:blue", "micro": "tab:orange"}

    def errs(model: str, mode: str, key) -> list[float]:
        return [max(key(find(models[model], k, mode)), FLOOR) for k in ks]

    panels = []
    if "bn_first" in models:
        panels.append(Panel(
            "BN on the raw inputs (bn_first: bn_input)", "moving-variance relative error",
            [*(Series(f'batch_norm="{mode}"', ks,
                      errs("bn_first", mode, lambda r: r["layers"]["bn_input"]["variance_rel"]),
                      color=colors[mode]) for mode in MODES),
             Series('"pooled" vs float64 statistics', ks,
                    errs("bn_first", "pooled",
                         lambda r: r["bn_input_vs_float64"]["variance_rel"]),
                    color=colors["pooled"], marker="^"),
             Series("model.fit(B) vs float64 statistics", ks,
                    [max(models["bn_first"]["reference"]["bn_input_vs_float64"]
                         ["variance_rel"], FLOOR)] * len(ks), color="black", marker="")],
            xlabel="k = B / m", logy=True, xticks=ks))
    panels.append(Panel(
        f"BN after convs ({name}: worst layer)", "relative error",
        [*(Series(f'batch_norm="{mode}"', ks, errs(name, mode, deeper_variance),
                  color=colors[mode]) for mode in MODES),
         *(Series(f'weights, batch_norm="{mode}"', ks,
                  errs(name, mode, lambda r: r["weights_rel"]), color=colors[mode],
                  marker="s") for mode in MODES)],
        xlabel="k = B / m", logy=True, xticks=ks))
    ref = models[name]["reference"]["held_out_accuracy"]
    panels.append(Panel(
        f"{name}: held-out accuracy, inference mode", "accuracy",
        [Series(f'batch_norm="{mode}"', ks,
                [find(models[name], k, mode)["held_out_accuracy"] for k in ks],
                color=colors[mode]) for mode in MODES]
        + [Series(f"model.fit(B) reference {ref:.3f}", ks, [ref] * len(ks), color="black",
                  marker="")],
        xlabel="k = B / m", xticks=ks))
    harness.line_plot(path, [panels[:2], panels[2:]],
                      f"BatchNormalization moving statistics vs model.fit(batch_size="
                      f"{s['batch_size']}), {s['steps']} large batches; floor {FLOOR:g}")


def main(argv: Sequence[str] | None = None) -> int:
    p = harness.parser("BatchNormalization's moving statistics and inference-mode quality "
                       "under a split: batch_norm='pooled' vs 'micro' vs model.fit at B.",
                       quick="8x8 inputs, B=128, 4 large batches, k in {1, 4}")
    p.add_argument("--ks", help="comma-separated k = B/m (default 1,2,4,8,16; quick 1,4)")
    p.add_argument("--steps", type=int,
                   help=f"large batches trained (default {FULL.steps}; quick {QUICK.steps})")
    p.add_argument("--models", help="comma-separated subset of conv_bn,bn_first")
    args = p.parse_args(argv)
    harness.at_least("steps", args.steps)
    s = QUICK if args.quick else FULL
    if args.steps:
        s = replace(s, steps=args.steps)
    if args.models:
        s = replace(s, models=tuple(harness.subset("models", args.models, MODELS)))
    if args.ks:
        try:
            ks = tuple(int(k) for k in args.ks.split(","))
        except ValueError:
            ks = ()
        if not ks or any(k < 1 or s.batch_size % k for k in ks):
            raise SystemExit(f"Expected `--ks` as divisors of B={s.batch_size}, e.g. 1,2,4,8. "
                             f"Received: {args.ks!r}.")
        s = replace(s, ks=tuple(sorted(set(ks))), main_k=max(ks))

    clock = harness.wall_clock()
    info = harness.machine_info(devices=True)
    harness.log(f"# {harness.machine_line(info)}")
    data_ = {"train": data(s.steps * s.batch_size, s, seed=s.seed),
             "held_out": data(s.eval_rows, s, seed=s.seed + 1)}
    models = {name: measure(name, s, data_, harness.log) for name in s.models}
    long: dict[str, Any] = {}
    if s.long_steps:
        harness.log(f"# longer: {s.long_steps} large batches at k = {s.main_k}")
        ls = replace(s, steps=s.long_steps, ks=(s.main_k,))
        data_["train"] = data(ls.steps * ls.batch_size, ls, seed=s.seed)
        long = {name: measure(name, ls, data_, harness.log) for name in s.models}
    report: dict[str, Any] = {
        "question": QUESTION, "command": harness.command("batchnorm_stats", argv),
        "units": UNITS, "machine": info, "settings": asdict(s), "models": models,
        "long": long}
    report["checks"] = checks(report)
    report["seconds"] = clock()
    for name, model in models.items():
        harness.log(f"\n{name}: {model['label']}, k = {s.main_k}")
        harness.log(harness.text_table(MAIN_HEADER, main_rows(model, s.main_k)))
        harness.log(harness.text_table(LAYER_HEADER, layer_rows(model, s.main_k)))
    for name, model in long.items():
        harness.log(f"\n{name} after {s.long_steps} large batches, k = {s.main_k}")
        harness.log(harness.text_table(MAIN_HEADER, main_rows(model, s.main_k)))
        harness.log(harness.text_table(LAYER_HEADER, layer_rows(model, s.main_k)))
    harness.log("\nmoving-variance error against k")
    harness.log(harness.text_table(*sweep_rows(report)))
    harness.conclude(harness.out_dir(args), "batchnorm_stats", report, markdown(report),
                     lambda path: plot(report, path))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
