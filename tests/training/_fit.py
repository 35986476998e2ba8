"""The small model and data the fit_large_batch tests share."""

from __future__ import annotations

import keras
from common import three_classes


def make_mlp(optimizer=None, metrics=("accuracy",)):
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(3)])
    model.compile(optimizer=optimizer or keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=list(metrics))
    return model


def data(n=230, seed=0):
    return three_classes(n, seed)
