"""The models, data and training methods the benchmarks share.

Models: the MLP 128-1024-1024-10 of the memory tests (any widths), the 2-layer
Transformer encoder of ``autosplit.builtin_models`` over (16, 16) inputs, its CNN over 32x32x3
images, and a small encoder on token ids (Embedding, attention, LayerNorm), all with
Adam and sparse categorical cross-entropy on logits, seeded. Data: Gaussian inputs
labelled by a random linear teacher; token ids labelled by their count of one token
(learnable, nothing downloaded).

Methods (:data:`METHODS`), each one epoch loop over the same rows:

- ``autosplit_examples`` / ``_arrays`` / ``_batched``: ``fit_large_batch(B, m)`` from a
  ``tf.data`` pipeline of single examples, from arrays, from a pipeline ``.batch(32)``;
- ``keras``: plain ``model.fit(batch_size=B)``; ``keras_at_m``: ``model.fit(batch_size=m)``;
- ``keras_accumulation``: ``model.fit(batch_size=m)`` with
  ``Adam(gradient_accumulation_steps=B // m)``;
- ``bare_loop``: the least a large-batch step can do (:func:`bare_loop`), from a
  ``tf.data`` pipeline of examples ``.batch(m)``; ``bare_batched``: the same from a
  pipeline ``.batch(32).rebatch(m)``.

:func:`timed` returns both the timed epochs and the whole call (set-up, tracing and the
warm-up epoch included: a user calls ``fit_large_batch`` once per experiment, a tuner
hundreds of times).

:func:`measure` runs one of them with an :class:`EpochMeter`: the first epoch is a
warm-up, every later one is timed and its allocator peak read.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np
import tensorflow as tf

import autosplit
from autosplit.data.pipeline import release
from autosplit.memory.peak_meter import PeakMeter
from benchmarks.harness import MIB, OOM, error_text

CLASSES = 10


@dataclass(frozen=True)
class ModelSpec:
    key: str  # "mlp", "transformer", "cnn" or "encoder"
    label: str
    input_shape: tuple[int, ...]
    hidden: tuple[int, ...] = (1024, 1024)  # the MLP's widths


def mlp_spec(features: int, hidden: Sequence[int]) -> ModelSpec:
    label = f"MLP {features}-{'-'.join(map(str, hidden))}-{CLASSES}"
    return ModelSpec("mlp", label, (features,), tuple(hidden))


MLP = mlp_spec(128, (1024, 1024))
TRANSFORMER = ModelSpec("transformer", "Transformer encoder (16, 16), 2 layers, 4 heads", (16, 16))
CNN = ModelSpec("cnn", "CNN 32x32x3, 3 conv layers (32, 64, 128)", (32, 32, 3))
VOCAB = 1000
ENCODER = ModelSpec("encoder", f"encoder on 32 token ids (vocab {VOCAB}, width 64, 1 block, "
                    "4 heads)", (32,))
MODELS = {spec.key: spec for spec in (MLP, TRANSFORMER, CNN, ENCODER)}


def token_encoder(input_shape: Sequence[int], classes: int = CLASSES, *, width: int = 64,
                  heads: int = 4) -> keras.Model:
    """Token ids -> Embedding -> one attention block with LayerNorm -> mean -> logits."""
    inputs = keras.Input(tuple(input_shape), dtype="int32")
    h = keras.layers.Embedding(VOCAB, width)(inputs)
    attention = keras.layers.MultiHeadAttention(heads, width // heads)(h, h)
    h = keras.layers.LayerNormalization()(h + attention)
    ff = keras.layers.Dense(2 * width, activation="gelu")(h)
    h = keras.layers.LayerNormalization()(h + keras.layers.Dense(width)(ff))
    h = keras.layers.GlobalAveragePooling1D()(h)
    return keras.Model(inputs, keras.layers.Dense(classes)(h), name="encoder")


def build_model(spec: ModelSpec, *, seed: int = 0, jit_compile: bool = False,
                weights: Sequence[np.ndarray] | None = None, **adam: Any) -> keras.Model:
    """A compiled model of ``spec``, seeded (or given ``weights``); ``adam`` goes to Adam."""
    keras.utils.set_random_seed(seed)
    if spec.key == "mlp":
        model = keras.Sequential(
            [keras.Input(spec.input_shape)]
            + [keras.layers.Dense(width, activation="relu") for width in spec.hidden]
            + [keras.layers.Dense(CLASSES)])
    elif spec.key == "encoder":
        model = token_encoder(spec.input_shape)
    else:
        from autosplit import builtin_models

        model = builtin_models.MODELS[spec.key](spec.input_shape, CLASSES)
    if weights is not None:
        model.set_weights(weights)
    model.compile(optimizer=keras.optimizers.Adam(1e-3, **adam),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=jit_compile)
    return model


def synthetic(rows: int, input_shape: Sequence[int], *, seed: int = 0
              ) -> tuple[np.ndarray, np.ndarray]:
    """``rows`` Gaussian examples labelled by a random linear teacher."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, *input_shape), dtype=np.float32)
    teacher = rng.standard_normal((int(np.prod(input_shape)), CLASSES), dtype=np.float32)
    y = np.argmax(x.reshape(rows, -1) @ teacher, axis=1).astype(np.int32)
    return x, y


def data_for(spec: ModelSpec, rows: int, *, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Synthetic data for ``spec``: :func:`synthetic`, or for the token encoder random
    ids labelled by how many of them are below 10, modulo 10."""
    if spec.key != "encoder":
        return synthetic(rows, spec.input_shape, seed=seed)
    ids = np.random.default_rng(seed).integers(0, VOCAB, (rows, *spec.input_shape),
                                               dtype=np.int32)
    return ids, ((ids < CLASSES).sum(axis=1) % CLASSES).astype(np.int32)


def example_bytes(x: np.ndarray, y: np.ndarray) -> int:
    """Bytes of one example's input and label."""
    return int(x[0].nbytes + y[0].nbytes)


class EpochMeter(keras.callbacks.Callback):
    """Wall time, allocator peak and optimizer applies of every epoch after the warm-up.

    Only epoch hooks, so ``model.fit`` keeps its asynchronous dispatch (the logs are
    floats at the end of an epoch: its work has finished). The bare loop calls the
    same hooks itself.
    """

    def __init__(self, meter: PeakMeter | None, samples_per_epoch: int, warmup: int = 1) -> None:
        super().__init__()
        self.meter, self.samples, self.warmup = meter, samples_per_epoch, warmup
        self.records: list[dict[str, float]] = []

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        if epoch >= self.warmup:
            if self.meter is not None:
                self.meter.reset()
            self._applies = int(self.model.optimizer.iterations)
            self._t0 = time.perf_counter()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if epoch < self.warmup:
            return
        seconds = time.perf_counter() - self._t0
        record = {"seconds": seconds, "samples": self.samples,
                  "applies": int(self.model.optimizer.iterations) - self._applies,
                  "loss": float((logs or {}).get("loss", float("nan")))}
        if self.meter is not None:
            record.update(peak_bytes=self.meter.peak_bytes(), held_bytes=self.meter.baseline_bytes)
        self.records.append(record)


# ---------------------------------------------------------------- the methods


def bare_step(model: keras.Model, *, batch_size: int, micro_batches: int
              ) -> Callable[[Any], tf.Tensor]:
    """The bare loop's compiled step: ``micro_batches`` pulls from an iterator in a
    ``tf.while_loop`` (``parallel_iterations=1``), each one's gradient of its summed loss
    over ``batch_size`` summed in carried tensors, one Adam apply; returns the loss."""
    variables, optimizer = model.trainable_variables, model.optimizer
    optimizer.build(variables)
    summed = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")

    @tf.function
    def step(iterator):
        def body(i, loss, grads):
            xb, yb = iterator.get_next()
            with tf.GradientTape() as tape:
                piece = summed(yb, model(xb, training=True)) / batch_size
            new = tape.gradient(piece, variables)
            return i + 1, loss + piece, [g + n for g, n in zip(grads, new, strict=True)]

        zeros = [tf.zeros(v.shape, v.dtype) for v in variables]
        _, loss, grads = tf.while_loop(lambda i, *_: i < micro_batches, body,
                                       (tf.constant(0), tf.constant(0.0), zeros),
                                       parallel_iterations=1)
        optimizer.apply_gradients(zip(grads, variables, strict=True))
        return loss

    return step


def bare_loop(model: keras.Model, x: np.ndarray, y: np.ndarray, *, batch_size: int,
              micro_batch_size: int, epochs: int, callback: keras.callbacks.Callback,
              batched: bool = False) -> None:
    """The least a large-batch step can do, as a yardstick for autosplit's.

    The micro-batches come from ``from_tensor_slices((x, y)).batch(m)``, or with
    ``batched`` from ``.batch(32).rebatch(m)`` (the yardstick for a batched input).

    One ``tf.function`` per large batch: a ``tf.while_loop`` (``parallel_iterations=1``:
    one micro-batch's activations at a time) pulls ``B // m`` micro-batches from a
    ``tf.data`` iterator, takes each one's gradient of its summed loss over B, sums the
    gradients in the loop's carried tensors, and Adam applies them once. No padding, no
    metrics, no OOM recovery: B must be a multiple of m. Each epoch's used iterator is
    deleted on a thread of its own (``autosplit.data.pipeline.release``), as fit_large_batch
    deletes its own: a yardstick without that waits 0.5 s and more at random epochs.
    """
    if batch_size % micro_batch_size:
        raise ValueError(f"Expected {batch_size=} to be a multiple of {micro_batch_size=} "
                         "for the bare loop.")
    steps = len(x) // batch_size
    step = bare_step(model, batch_size=batch_size, micro_batches=batch_size // micro_batch_size)
    data = tf.data.Dataset.from_tensor_slices((x, y))
    if batched:
        data = data.batch(32).rebatch(micro_batch_size, drop_remainder=True)
    else:
        data = data.batch(micro_batch_size, drop_remainder=True)
    data = data.prefetch(2)
    callback.set_model(model)
    for epoch in range(epochs):
        callback.on_epoch_begin(epoch)
        iterator = iter(data)
        for _ in range(steps):
            loss = step(iterator)
        callback.on_epoch_end(epoch, {"loss": float(loss)})
        used = [iterator]  # deleted off the clock (see the docstring)
        del iterator
        release(used)


def _autosplit(kind: str) -> Callable[..., dict[str, Any]]:
    def run(model, x, y, *, batch_size, micro_batch_size, epochs, callback, shuffle):
        if kind == "arrays":
            data: dict[str, Any] = {"x": x, "y": y}
        else:
            ds = tf.data.Dataset.from_tensor_slices((x, y))
            data = {"x": ds.batch(32) if kind == "batched" else ds}
        history = autosplit.fit_large_batch(
            model, **data, batch_size=batch_size, micro_batch_size=micro_batch_size,
            epochs=epochs, callbacks=[callback], shuffle=shuffle, verbose=0, cache=False)
        info = history.autosplit.to_dict()
        return {"micro_batch_size": info["micro_batch_size"],
                "accumulation_steps": info["accumulation_steps"],
                "oom_recoveries": info["oom_recoveries"], "input": info["input"]}
    return run


def _keras(at: str) -> Callable[..., dict[str, Any]]:
    def run(model, x, y, *, batch_size, micro_batch_size, epochs, callback, shuffle):
        batch = batch_size if at == "B" else micro_batch_size
        model.fit(x, y, batch_size=batch, epochs=epochs, callbacks=[callback], shuffle=shuffle,
                  verbose=0)
        return {"micro_batch_size": batch,
                "accumulation_steps": model.optimizer.gradient_accumulation_steps or 1}
    return run


def _bare(batched: bool) -> Callable[..., dict[str, Any]]:
    def run(model, x, y, *, batch_size, micro_batch_size, epochs, callback, shuffle):
        bare_loop(model, x, y, batch_size=batch_size, micro_batch_size=micro_batch_size,
                  epochs=epochs, callback=callback, batched=batched)
        return {"micro_batch_size": micro_batch_size,
                "accumulation_steps": batch_size // micro_batch_size}
    return run


@dataclass(frozen=True)
class Method:
    key: str
    label: str
    run: Callable[..., dict[str, Any]]
    accumulate: bool = False  # Adam(gradient_accumulation_steps=B // m)


METHODS = {m.key: m for m in (
    Method("autosplit_examples", "autosplit.fit_large_batch(B, m), tf.data of examples",
           _autosplit("examples")),
    Method("autosplit_arrays", "autosplit.fit_large_batch(B, m), arrays", _autosplit("arrays")),
    Method("autosplit_batched", "autosplit.fit_large_batch(B, m), tf.data .batch(32)",
           _autosplit("batched")),
    Method("keras", "plain Keras, model.fit(batch_size=B)", _keras(at="B")),
    Method("keras_at_m", "plain Keras, model.fit(batch_size=m)", _keras(at="m")),
    Method("keras_accumulation", "model.fit(batch_size=m), Adam(gradient_accumulation_steps=B/m)",
           _keras(at="m"), accumulate=True),
    Method("bare_loop", "bare loop: tf.while_loop over a tf.data iterator, one apply",
           _bare(batched=False)),
    Method("bare_batched", "bare loop over a tf.data .batch(32).rebatch(m)", _bare(batched=True)),
)}


def train(method: str, spec: ModelSpec, x: np.ndarray, y: np.ndarray, *, batch_size: int,
          micro_batch_size: int, epochs: int, callback: keras.callbacks.Callback,
          shuffle: bool = True, seed: int = 0, weights: Sequence[np.ndarray] | None = None,
          jit_compile: bool = False) -> tuple[keras.Model, dict[str, Any]]:
    """A fresh model of ``spec`` trained by ``method``; returns it and what the method says."""
    chosen = METHODS[method]
    k = batch_size // micro_batch_size
    # Keras refuses gradient_accumulation_steps=1: k = 1 is plain model.fit at B.
    adam = {"gradient_accumulation_steps": k} if chosen.accumulate and k > 1 else {}
    model = build_model(spec, seed=seed, weights=weights, jit_compile=jit_compile, **adam)
    start = time.perf_counter()
    info = chosen.run(model, x, y, batch_size=batch_size, micro_batch_size=micro_batch_size,
                      epochs=epochs, callback=callback, shuffle=shuffle)
    return model, {**info, "call_seconds": time.perf_counter() - start}


def measure(method: str, spec: ModelSpec, x: np.ndarray, y: np.ndarray, *, batch_size: int,
            micro_batch_size: int, repeats: int, device: str = "CPU:0", shuffle: bool = True,
            seed: int = 0) -> dict[str, Any]:
    """Peak memory and samples/s of ``method``: one warm-up epoch, then ``repeats``.

    The peak is the smallest over the measured epochs (noise only adds), samples/s the
    largest. ``status`` is ``"ok"`` or ``"OOM"`` (``ResourceExhaustedError``, or the
    probe's ``NothingFitsError``).
    """
    meter = PeakMeter(device)
    callback = EpochMeter(meter, samples_per_epoch=len(x))
    out: dict[str, Any] = {"method": method, "peak_source": meter.source, "device": device,
                           "example_bytes": example_bytes(x, y)}
    try:
        model, info = train(method, spec, x, y, batch_size=batch_size,
                            micro_batch_size=micro_batch_size, epochs=1 + repeats,
                            callback=callback, shuffle=shuffle, seed=seed)
        out.update(info, status="ok", trainable_weight_bytes=int(sum(
            math.prod(v.shape) * np.dtype(v.dtype).itemsize for v in model.trainable_variables)))
    except tf.errors.ResourceExhaustedError as error:
        out.update(status=OOM, oom_where="training", error=error_text(error))
    except autosplit.NothingFitsError as error:
        out.update(status=OOM, oom_where="probe: nothing fits", error=str(error)[:300])
    out["epochs"] = callback.records
    if out["status"] == "ok":
        best = min(callback.records, key=lambda r: r["peak_bytes"])
        out.update(peak_bytes=int(best["peak_bytes"]), held_bytes=int(best["held_bytes"]),
                   peak_mib=best["peak_bytes"] / MIB, held_mib=best["held_bytes"] / MIB,
                   samples_per_s=max(r["samples"] / r["seconds"] for r in callback.records))
    return out


def timed(method: str, spec: ModelSpec, x: np.ndarray, y: np.ndarray, *, batch_size: int,
          micro_batch_size: int, epochs: int, weights: Sequence[np.ndarray], seed: int = 0,
          jit_compile: bool = False) -> dict[str, Any]:
    """One timed run for :func:`benchmarks.harness.round_robin`: a warm-up epoch, then
    ``epochs`` timed; the same initial weights every time; the data in order. Also the
    whole call's seconds and samples (the warm-up epoch included; building the model
    excluded: every method needs one)."""
    callback = EpochMeter(None, samples_per_epoch=len(x))
    _, info = train(method, spec, x, y, batch_size=batch_size,
                    micro_batch_size=micro_batch_size, epochs=1 + epochs, callback=callback,
                    shuffle=False, seed=seed, weights=weights, jit_compile=jit_compile)
    return {**summed_epochs(callback.records), "call_seconds": info["call_seconds"],
            "call_samples": (1 + epochs) * len(x)}


def summed_epochs(records: Sequence[dict[str, float]]) -> dict[str, Any]:
    return {"seconds": sum(r["seconds"] for r in records),
            "samples": sum(r["samples"] for r in records),
            "applies": sum(r["applies"] for r in records),
            "loss": records[-1]["loss"]}
