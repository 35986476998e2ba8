"""The small model, data and input kinds the input tests share: ``model.fit`` on the
same rows is the reference."""

from __future__ import annotations

import math

import keras
import numpy as np

N, B, M = 230, 64, 16  # 230 = 3 * 64 + 38: a short last large batch every epoch


def make():
    model = keras.Sequential([
        keras.Input((6,)),
        keras.layers.Dense(16, activation="relu", kernel_regularizer=keras.regularizers.L2(1e-2)),
        keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def data(n=N):
    r = np.random.default_rng(0)
    return (r.normal(size=(n, 6)).astype("float32"), r.integers(0, 3, size=(n,)).astype("int32"),
            r.uniform(0.1, 2.0, size=(n,)).astype("float32"))


class Batches(keras.utils.PyDataset):
    def __init__(self, x, y, w, size):
        super().__init__()
        self.arrays, self.size = (x, y, w), size

    def __len__(self):
        return math.ceil(len(self.arrays[0]) / self.size)

    def __getitem__(self, i):
        return tuple(a[i * self.size:(i + 1) * self.size] for a in self.arrays)


def batches(x, y, w, size, forever=False):
    while True:
        for i in range(0, len(x), size):
            yield x[i:i + size], y[i:i + size], w[i:i + size]
        if not forever:
            return


def reference_and_initial(epochs, rows=N):
    x, y, w = data(max(rows, N))
    model = make()
    model.build((None, 6))
    initial = model.get_weights()
    model.fit(x[:rows], y[:rows], sample_weight=w[:rows], batch_size=B, epochs=epochs,
              shuffle=False, verbose=0)
    return model, initial


def candidate(initial):
    model = make()
    model.build((None, 6))
    model.set_weights(initial)
    return model
