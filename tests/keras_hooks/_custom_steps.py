"""What the tests of models with their own ``train_step`` share: the sizes, the guide's
classifier and the comparison with ``model.fit``."""

from __future__ import annotations

import keras
import numpy as np
from common import GuideStep, relative_error

N, B, M = 120, 60, 25  # 3 micro-batches of 20 per large batch


def assert_same_as_fit(reference, candidate, expected, got, rtol):
    assert relative_error(reference.get_weights(), candidate.get_weights()) <= rtol
    assert relative_error([v.numpy() for v in reference.optimizer.variables],
                          [v.numpy() for v in candidate.optimizer.variables]) <= rtol
    assert set(got.history) == set(expected.history)
    for name, values in expected.history.items():
        np.testing.assert_allclose(got.history[name], values, rtol=rtol, err_msg=name)


def classifier():
    inputs = keras.Input((6,))
    model = GuideStep(inputs, keras.layers.Dense(3)(
        keras.layers.Dense(12, activation="relu")(inputs)))
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model
