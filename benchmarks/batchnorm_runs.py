"""The models, data and training runs behind ``benchmarks.batchnorm_stats``.

That script's docstring describes the method; this module holds what it trains and how
one run is compared with the reference:

- the two conv nets (:func:`build`: ``conv_bn``, ``bn_first``), compiled alike, and their
  synthetic data (:func:`data`: a class's coarse pattern plus noise, shifted and scaled
  per channel), both read off one :class:`Settings`;
- one training run from given weights (:func:`train`: the reference ``model.fit`` or
  ``fit_large_batch`` in one ``batch_norm`` mode), what it is compared on
  (:func:`state`) and how far it is from the reference (:func:`errors`) and from the
  statistics computed in float64 (:func:`input_statistics`, :func:`float64_error`);
- :func:`measure`: the reference and both modes at every k, for one model; :func:`find`
  reads one run back.

The script keeps the question, the settings of the full and quick runs, the checks, the
tables, the plot and the command line.
"""

from __future__ import annotations

import gc
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np

import autosplit
from benchmarks import harness

CLASSES = 10
MODES = ("pooled", "micro")
MODELS = ("conv_bn", "bn_first")
MODEL_LABELS = {
    "conv_bn": "conv net, BatchNormalization after each of 3 convs",
    "bn_first": "the same with BatchNormalization first, on the raw inputs",
}
OFFSET = np.array([3.0, -2.0, 10.0], np.float32)  # per channel: the inputs' means ...
SCALE = np.array([2.0, 5.0, 0.5], np.float32)  # ... and scales (x noise of std ~1)


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
