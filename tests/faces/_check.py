"""The models, data and state snapshots the tests of ``check`` share."""

from __future__ import annotations

import keras
import numpy as np

rng = np.random.default_rng


SCE = keras.losses.SparseCategoricalCrossentropy


def mlp(*hidden, loss=None, inputs=True):
    """12 -> Dense(16) -> hidden layers -> Dense(5), compiled with metrics."""
    layers = [keras.Input((12,))] if inputs else []
    model = keras.Sequential([*layers, keras.layers.Dense(16, activation="tanh"), *hidden,
                              keras.layers.Dense(5)])
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss or SCE(from_logits=True),
                  metrics=["accuracy"])
    return model


def data(batch=50, seed=0):
    r = rng(seed)
    x = r.normal(size=(batch, 12)).astype("float32")
    y = r.integers(0, 5, size=(batch,)).astype("int32")
    w = r.uniform(0.1, 2.0, size=(batch,)).astype("float32")
    return x, y, w


def state(model):
    """Every variable check could touch: weights, BN statistics, seeds, metrics, optimizer."""
    variables = (list(model.variables) + list(model.metrics_variables)
                 + list(model.optimizer.variables))
    return [np.array(v.numpy(), copy=True) for v in variables]


def assert_state_unchanged(before, model):
    after = state(model)
    assert len(before) == len(after)
    for b, a in zip(before, after, strict=True):
        assert b.dtype == a.dtype and np.array_equal(b, a)  # bitwise
