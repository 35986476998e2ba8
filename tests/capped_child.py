"""Child-process scenarios run under a real TensorFlow memory cap (capped BFC allocator).

Invoked as ``python tests/capped_child.py SCENARIO OUT.json``; the parent sets the cap
through ``autosplit.memory.capped_cpu_env`` and reads the JSON this writes.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

import autosplit
from autosplit.step import TrainStep, split_batch


def demo_mlp(optimizer):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((128,)),
        keras.layers.Dense(1024, activation="relu"),
        keras.layers.Dense(1024, activation="relu"),
        keras.layers.Dense(10),
    ])
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def data(n):
    rng = np.random.default_rng(0)
    return (rng.normal(size=(n, 128)).astype("float32"),
            rng.integers(0, 10, size=(n,)).astype("int32"))


def probe_then_check(out):
    """Probe under the cap; train at m; try 2m (or the next size up)."""
    x, y = data(4096)
    model = demo_mlp(keras.optimizers.Adam(1e-3))
    result = autosplit.probe(model, (x, y), 4096, cache=False)
    report = {"result": result.to_dict()}
    m = result.micro_batch_size
    before = [w.copy() for w in model.get_weights()]
    opt_before = [np.array(v.numpy(), copy=True) for v in model.optimizer.variables]
    report["weights_unchanged"] = all(
        np.array_equal(a, b) for a, b in zip(before, model.get_weights(), strict=True))
    report["optimizer_unchanged"] = int(model.optimizer.iterations) == 0 and all(
        np.array_equal(a, v.numpy()) for a, v in zip(opt_before, model.optimizer.variables,
                                                      strict=True))
    xb, yb = tf.constant(x), tf.constant(y)
    step = TrainStep(model, split_batch(4096, m))
    step(xb, yb, None, tf.constant(4096))
    report["chosen_trained"] = True
    bigger = min(2 * m, 4096)
    report["bigger"] = bigger
    try:
        big = TrainStep(model, split_batch(4096, bigger))
        for _ in range(2):
            big(xb, yb, None, tf.constant(4096))
        report["bigger_fits"] = True
    except tf.errors.ResourceExhaustedError:
        report["bigger_fits"] = False
    out.write(json.dumps(report))


def recover_from_real_oom(out):
    """A fixed micro-batch too large for the cap: recover and finish exactly."""
    x, y = data(8192)
    model = demo_mlp(keras.optimizers.SGD(0.05))
    history = autosplit.fit_large_batch(model, (x, y), batch_size=4096, micro_batch_size=4096,
                                        epochs=1, shuffle=False, verbose=0)
    np.savez(out.name + ".npz", *model.get_weights())
    out.write(json.dumps({"autosplit": history.autosplit,
                          "iterations": int(model.optimizer.iterations)}))


def nothing_fits(out):
    """A budget of what the model holds plus 1 MiB: not even one example fits."""
    x, y = data(256)
    model = demo_mlp(keras.optimizers.Adam(1e-3))
    autosplit._keras.build_model(model, (x[:8], y[:8], None))
    before = [w.copy() for w in model.get_weights()]
    held = tf.config.experimental.get_memory_info("CPU:0")["current"]
    report = {}
    try:
        autosplit.probe(model, (x, y), 256, memory_limit=held + 2**20, headroom=0.0,
                        cache=False)
        report["error"] = None
    except autosplit.NothingFitsError as exc:
        report.update(error=type(exc).__name__, message=str(exc),
                      budget_bytes=exc.budget_bytes)
    report["weights_unchanged"] = all(
        np.array_equal(a, b) for a, b in zip(before, model.get_weights(), strict=True))
    out.write(json.dumps(report))


def stream(out):
    """A batch whose inputs alone crowd the budget: only streaming fits."""
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4096, 2048)).astype("float32")  # 32 MiB of inputs per batch
    y = rng.integers(0, 10, size=(4096,)).astype("int32")
    model = keras.Sequential([keras.Input((2048,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(10)])
    model.compile(optimizer=keras.optimizers.SGD(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    autosplit._keras.build_model(model, (x[:8], y[:8], None))
    x, y = tf.constant(x), tf.constant(y)  # one copy of the data, shared by every call
    held = tf.config.experimental.get_memory_info("CPU:0")["current"]
    # The arrays and the model are held already; the budget leaves room for
    # activations, not for two more copies of a 32 MiB large batch.
    limit = held + 40 * 2**20
    report = {}
    try:
        autosplit.probe(model, (x, y), 4096, memory_limit=limit, headroom=0.0, cache=False,
                        streaming=False)
        report["materialised"] = "fits"
    except autosplit.NothingFitsError as exc:
        report["materialised"] = type(exc).__name__
    result = autosplit.probe(model, (x, y), 4096, memory_limit=limit, headroom=0.0,
                             cache=False)
    report.update(auto_streaming=result.streaming, micro=result.micro_batch_size,
                  peak_bytes=result.measured_peak_bytes, budget_bytes=result.budget_bytes)
    autosplit.fit_large_batch(model, (x, y), batch_size=4096, memory_limit=limit,
                              headroom=0.0, cache=False, epochs=2, verbose=0)
    report["trained_iterations"] = int(model.optimizer.iterations)
    out.write(json.dumps(report))


if __name__ == "__main__":
    scenario, path = sys.argv[1], sys.argv[2]
    with open(path, "w") as handle:
        scenarios = {"probe": probe_then_check, "recover": recover_from_real_oom,
                     "nothing": nothing_fits, "stream": stream}
        scenarios[scenario](handle)
