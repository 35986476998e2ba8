"""Helpers shared by the tests and their child processes: data, small models, a plain
full-batch reference step and the comparisons (no pytest)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

from autosplit.capped import run_capped
from autosplit.keras_hooks import internals as _keras

TESTS = Path(__file__).parent  # beside the child scripts


def labelled(n, features, classes, seed=0):
    """Normal inputs and uniform integer labels, from a fixed seed."""
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(n, features)).astype("float32"),
            rng.integers(0, classes, size=(n,)).astype("int32"))


def three_classes(n, seed=0):
    """Six normal features; the label counts which of x[0] > 0 and x[1] > 1 hold (0 to 2)."""
    r = np.random.default_rng(seed)
    x = r.normal(size=(n, 6)).astype("float32")
    y = (x[:, 0] > 0).astype("int32") + (x[:, 1] > 1).astype("int32")
    return x, y


def tensor_relative_error(expected, actual) -> float:
    """Largest absolute difference over the expected tensor's largest entry."""
    e, a = np.asarray(expected, np.float64), np.asarray(actual, np.float64)
    if not e.size:
        return 0.0
    return float(np.max(np.abs(e - a))) / max(float(np.max(np.abs(e))), 1e-12)


def assert_within_reorder_noise(reference, reordered, weights, rtol=1e-5):
    """Each of ``weights`` within ``rtol`` of ``reference``'s, or 3x the distance between
    ``reference`` and ``reordered`` (trained on each large batch's rows in another order)
    where that is larger: a gradient that cancels moves with the summation order.

    A variable whose every entry is within ``rtol`` of the model's largest weight holds
    nothing float32 resolves at the model's scale: rounding noise (a gradient that cancels
    exactly, as an attention key bias's, since softmax ignores a shift that every key
    shares: it stays near 1e-10 beside weights near 0.4, and the reordering moves it by
    its own size). Its size says nothing, so its error is measured at the model's scale:
    within ``rtol`` of the largest weight. A gradient that did not cancel would move it by
    the learning rate's scale, far past that."""
    expected = reference.get_weights()
    model_scale = max(float(np.max(np.abs(w))) for w in expected if w.size)
    for variable, e, noisy, a in zip(reference.weights, expected,
                                     reordered.get_weights(), weights, strict=True):
        bound = max(rtol, 3 * tensor_relative_error(e, noisy))
        if tensor_relative_error(e, a) <= bound:
            continue
        assert e.size and float(np.max(np.abs(e))) <= rtol * model_scale, (variable.path, bound)
        error = float(np.max(np.abs(np.asarray(e, np.float64) - a))) / model_scale
        assert error <= rtol, (variable.path, "rounding noise alone", error)


def relative_error(expected, actual) -> float:
    """The largest :func:`tensor_relative_error` over lists of weights."""
    assert len(expected) == len(actual)
    return max(tensor_relative_error(e, a) for e, a in zip(expected, actual, strict=True))


def classifier(features, hidden, classes, optimizer=None, metrics=("accuracy",)):
    """The small model most tests train: Dense(hidden, relu) -> Dense(classes) logits."""
    model = keras.Sequential([keras.Input((features,)),
                              keras.layers.Dense(hidden, activation="relu"),
                              keras.layers.Dense(classes)])
    model.compile(optimizer=optimizer or keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=list(metrics))
    return model


def twin(make_model, sample):
    """Two identical compiled models (same initial weights), built on ``sample``."""
    reference, candidate = make_model(), make_model()
    for model in (reference, candidate):
        _keras.symbolic_build(model, sample)
    candidate.set_weights(reference.get_weights())
    return reference, candidate


def dense_reference_step(model, x, y, sample_weight=None):
    """A full-batch step whose gradient is made dense before the optimizer sees it.

    Equal to ``model.train_on_batch`` except for Embedding gradients: Keras applies an
    ``IndexedSlices`` gradient with repeated indices row by row (Adam then sums the
    squares of duplicates), autosplit applies the true, dense gradient of the batch.
    """
    with tf.GradientTape() as tape:
        y_pred = model(x, training=True)
        loss = model.compute_loss(x, y, y_pred, sample_weight, training=True)
    grads = tape.gradient(loss, model.trainable_variables)
    grads = [None if g is None else tf.convert_to_tensor(g) for g in grads]
    model.optimizer.apply_gradients(
        [(g, v) for g, v in zip(grads, model.trainable_variables, strict=True) if g is not None])
    return float(loss)


def assert_weights_close(expected, actual, rtol):
    """Every weight tensor equal to ``rtol`` relative to the tensor's largest entry."""
    assert len(expected) == len(actual)
    for index, (e, a) in enumerate(zip(expected, actual, strict=True)):
        err = tensor_relative_error(e, a)
        assert err <= rtol, (f"weight {index} {np.shape(e)}: relative error {err:.2e} > "
                             f"{rtol:.0e}")


def dense_gradients(optimizer_class):
    """``optimizer_class`` given dense gradients, for models with an Embedding.

    An Embedding's gradient is an ``IndexedSlices`` with repeated rows. Keras's Adam and
    RMSprop apply that sparse form differently from the dense gradient (README, "What exact
    means": autosplit accumulates densely and matches the step on the dense gradient), so
    the examples with an Embedding and an adaptive optimizer give both twins this subclass:
    model.fit's step then takes the same dense gradient that autosplit applies.
    """

    class Dense(optimizer_class):
        def apply(self, grads, trainable_variables=None):
            grads = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
                     for g in grads]
            return super().apply(grads, trainable_variables)

    Dense.__name__ = f"Dense{optimizer_class.__name__}"
    return Dense


class GuideStep(keras.Model):
    """The Keras guide's custom train_step: compute_loss, the loss tracker, compute_metrics
    (per-example metrics, sample weights)."""

    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred, sample_weight=sample_weight)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables, strict=True))
        return update_metrics(self, loss, y, y_pred, sample_weight)


def update_metrics(model, loss, y, y_pred, sample_weight=None):
    """The guide's metric updates: the loss tracker with ``loss``, every other metric with
    the rows; the results, by name."""
    for metric in model.metrics:
        if metric.name == "loss":
            metric.update_state(loss)
        else:
            metric.update_state(y, y_pred, sample_weight=sample_weight)
    return {m.name: m.result() for m in model.metrics}


class TwoViews(keras.Model):
    """SimSiam's pattern: one encoder (BatchNormalization on its raw inputs) called on
    two views in a step of its own, ``training`` as the step passes it."""

    def __init__(self, training=True):
        super().__init__()
        self.encoder = keras.Sequential([keras.Input((4,)), keras.layers.BatchNormalization(),
                                         keras.layers.Dense(3)])
        self.tracker = keras.metrics.Mean(name="loss")
        self.training = training

    @property
    def metrics(self):
        return [self.tracker]

    def train_step(self, data):
        a, b = data
        with tf.GradientTape() as tape:
            za = self.encoder(a, training=self.training)
            zb = self.encoder(b, training=self.training)
            loss = tf.reduce_mean(tf.square(za - zb))
        grads = tape.gradient(loss, self.encoder.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.encoder.trainable_variables,
                                            strict=True))
        self.tracker.update_state(loss)
        return {"loss": self.tracker.result()}


def run_child(scenario, tmp_path, limit_mib):
    """A scenario of capped_child.py under a real cap: (its report, its folder)."""
    run = run_capped([str(TESTS / "capped_child.py"), scenario, str(tmp_path)],
                     limit_mib * 2**20, timeout=600, capture=True,
                     env={"PYTHONPATH": f"{TESTS.parent}:{TESTS}"})
    assert run.returncode == 0, run.stderr[-3000:]
    return run.result, tmp_path


def child_env(**extra):
    """The environment of a child process that imports autosplit and these helpers."""
    env = dict(os.environ, PYTHONPATH=f"{TESTS.parent}:{TESTS}", TF_CPP_MIN_LOG_LEVEL="2")
    env.update(extra)
    return env


def free_ports(n):
    """``n`` TCP ports free on localhost now, for the workers of a local cluster."""
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def local_workers(argv_of, directory, *, env_of=None, timeout=400):
    """Two workers of one MultiWorkerMirroredStrategy on localhost, each ``python
    *argv_of(index)`` with its ``TF_CONFIG`` (``env_of(index, env)``: its environment,
    changed), stderr to ``directory/worker{index}.stderr`` (an unread pipe blocks a
    child once it fills, 64 KiB); their exit codes. A worker still running after
    ``timeout`` s fails the test, every worker killed."""
    cluster = {"worker": [f"127.0.0.1:{p}" for p in free_ports(2)]}
    procs = []
    for index in range(2):
        config = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})
        env = child_env(TF_CONFIG=config)
        if env_of is not None:
            env = env_of(index, env)
        with open(directory / f"worker{index}.stderr", "w") as stderr:
            procs.append(subprocess.Popen([sys.executable, *argv_of(index)], env=env,
                                          stdout=subprocess.DEVNULL, stderr=stderr))
    try:
        return [proc.wait(timeout=timeout) for proc in procs]
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        pytest.fail(f"a worker hung past {timeout} s")


def saved_steps(path):
    """The batches a worker saved step by step (``np.savez`` keys ``{step}_{part}``, as
    the sharding children write what TensorFlow's distributed iterator hands them): per
    step, a tuple of its parts."""
    saved = np.load(path)
    steps = sorted({int(key.split("_")[0]) for key in saved.files})
    parts = len({key.split("_")[1] for key in saved.files})
    return [tuple(saved[f"{step}_{part}"] for part in range(parts)) for step in steps]
