"""The small model and data the fit_large_batch tests share."""

from __future__ import annotations

import keras
import numpy as np


def make_mlp(optimizer=None, metrics=("accuracy",)):
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(3)])
    model.compile(optimizer=optimizer or keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=list(metrics))
    return model


def data(n=230, seed=0):
    r = np.random.default_rng(seed)
    x = r.normal(size=(n, 6)).astype("float32")
    y = (x[:, 0] > 0).astype("int32") + (x[:, 1] > 1).astype("int32")
    return x, y
