"""A ``keras.losses.Loss`` that computes its value in a ``__call__`` of its own: what
autosplit differentiates is what Keras's compiled loss computes, never ``call()`` alone:
such a loss's value is the whole batch's, which the whole-batch step computes."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from common import relative_error

import autosplit
from autosplit.step.reduction import own_call


class ScaledMSE(keras.losses.MeanSquaredError):
    """``call()`` Keras's, ``__call__`` ten times Keras's: model.fit trains on ten times."""

    def __call__(self, y_true, y_pred, sample_weight=None):
        return 10 * super().__call__(y_true, y_pred, sample_weight)


class OnlyCall(keras.losses.Loss):
    """keras-io's form (``SupervisedContrastiveLoss``): ``__call__`` alone, no ``call()``."""

    def __call__(self, y_true, y_pred, sample_weight=None):
        return keras.ops.mean(keras.ops.square(y_true - y_pred))


def test_a_loss_with_its_own_call_is_told_apart_from_keras_s():
    assert own_call(ScaledMSE()) and own_call(OnlyCall())
    assert not own_call(keras.losses.MeanSquaredError())
    assert not own_call(keras.losses.mean_squared_error)  # a function: Keras wraps it


def _model(loss):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.1), loss())
    return model


@pytest.mark.parametrize("loss", [ScaledMSE, OnlyCall])
def test_a_loss_with_its_own_call_trains_on_its_value_over_the_whole_batch(loss):
    # ScaledMSE trained silently on call(): loss 2.37 logged against model.fit's 22.46,
    # weights 8.9e-1 apart; OnlyCall crashed with a bare NotImplementedError.
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 3)).astype("float32"), rng.normal(size=(32, 1)).astype("float32")
    reference, model = _model(loss), _model(loss)
    expected = reference.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    got = autosplit.fit_large_batch(model, x, y, batch_size=16, micro_batch_size=4, epochs=2,
                                    shuffle=False, verbose=0)
    assert got.autosplit.step.startswith("outputs first, the loss over the whole batch")
    assert "overrides __call__" in got.autosplit.step
    assert int(model.optimizer.iterations) == 4
    assert relative_error(reference.get_weights(), model.get_weights()) <= 1e-5
    np.testing.assert_allclose(got.history["loss"], expected.history["loss"], rtol=1e-5)
