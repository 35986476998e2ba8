"""Shared fixtures: small real Keras models and a plain full-batch reference step."""

from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import pytest
import tensorflow as tf
from common import labelled, tensor_relative_error

from autosplit.keras_hooks import internals as _keras

__all__ = ["assert_weights_close", "classifier", "dense_reference_step", "labelled", "twin"]


def pytest_configure(config):
    # pytest-randomly shuffles the order and, by default, reseeds `random` and numpy
    # before each test's body, after _seed ran: Keras draws initial weights from
    # `random`, so every order seed would train other models. Only the order varies.
    if hasattr(config.option, "randomly_reset_seed"):
        config.option.randomly_reset_seed = False


def pytest_terminal_summary(terminalreporter, config):
    """The order seed at the end, where a failure is read (-q hides the header)."""
    seed = getattr(config.option, "randomly_seed", None)
    if isinstance(seed, int):
        terminalreporter.write_line(
            f"Test order: --randomly-seed={seed}. Replay it with "
            f"make test PYTEST_ARGS=--randomly-seed={seed} (add -n 0: one process)")


@pytest.fixture(autouse=True)
def _seed():
    keras.utils.set_random_seed(1234)
    yield
    keras.backend.clear_session()


@pytest.fixture(autouse=True)
def _probe_cache(tmp_path, monkeypatch):
    """Each test its own probe cache: a result one test stored is another's cache hit."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


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
