"""``check`` on models with their own ``train_step``: checked as fit runs the step, and
refused with fit's own typed error where fit refuses it."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from autosplit.equivalence import check
from autosplit.errors import UnsupportedModelError


class OwnStepModel(keras.Model):
    """A model whose train_step computes its own loss: per example (a mean of squared
    errors), or mixing the batch's examples (SimCLR's similarity matrix of the batch)."""

    def __init__(self, mixes):
        super().__init__()
        self.mixes, self.dense = mixes, keras.layers.Dense(8)

    def call(self, x):
        return self.dense(x)

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            z = self(x, training=True)
            if self.mixes:
                z = tf.math.l2_normalize(z, axis=1)
                similarity = z @ tf.transpose(z) * 5.0
                loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
                    tf.range(tf.shape(z)[0]), similarity, from_logits=True))
            else:
                loss = tf.reduce_mean(tf.square(z - y[:, None]))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables, strict=True))
        return {"loss": loss}


@pytest.mark.parametrize("mixes", [False, True])
def test_a_model_with_its_own_train_step_is_checked_as_fit_runs_it(mixes):
    # Its step once per micro-batch against once on the whole batch. Before, a step with
    # no compiled loss failed with Keras's "No loss to compute", though docs/fit.md sends
    # a step that mixes examples here.
    keras.utils.set_random_seed(0)
    model = OwnStepModel(mixes)
    model.compile(optimizer=keras.optimizers.SGD(0.1))
    model(np.zeros((1, 4), "float32"))
    before = [w.copy() for w in model.get_weights()]
    x = np.random.default_rng(0).normal(size=(16, 4)).astype("float32")
    y = np.random.default_rng(1).normal(size=(16,)).astype("float32")
    if mixes:  # refused by the reading of its loss, before anything runs
        with pytest.raises(UnsupportedModelError, match="mixes the batch's rows"):
            check(model, x, y, micro_batch_size=4)
    else:
        report = check(model, x, y, micro_batch_size=4)
        assert report.exact and report.decomposes
        assert report.loss_full > 0 and report.loss_split is None
        assert report.max_relative_difference < 1e-5 and report.culprits == ()
    assert int(model.optimizer.iterations) == 0
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights(), strict=True))


class NoCallModel(keras.Model):
    """The Keras 3 VAE's shape: a train_step of its own and no call(); only tracing the
    step builds it (Keras's symbolic build cannot)."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(1)

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(self.dense(x)[:, 0] - y))
        grads = tape.gradient(loss, self.trainable_variables)
        self.applying().apply_gradients(zip(grads, self.trainable_variables, strict=True))
        return {"loss": loss}

    def applying(self):
        return self.optimizer


class NeverApplies(NoCallModel):
    def train_step(self, data):
        return {"loss": tf.reduce_mean(self.dense(data[0]))}


class TwoOptimizers(NoCallModel):
    """A GAN's shape: a second optimizer of its own."""

    def __init__(self):
        super().__init__()
        self.other = keras.optimizers.SGD(0.1)

    def applying(self):
        return self.other


def test_an_unbuilt_model_with_no_call_is_built_by_its_step_as_fit_builds_it():
    # check built every unbuilt model symbolically; one with no call() (the Keras VAE)
    # raised Keras's "Unable to automatically build the model".
    model = NoCallModel()
    model.compile(optimizer=keras.optimizers.SGD(0.1))
    x = np.random.default_rng(0).normal(size=(16, 4)).astype("float32")
    y = np.random.default_rng(1).normal(size=(16,)).astype("float32")
    report = check(model, x, y, micro_batch_size=4)
    assert report.exact and report.loss_full > 0
    assert int(model.optimizer.iterations) == 0


@pytest.mark.parametrize(("make", "optimizer", "message"), [
    (NeverApplies, "sgd", "never does"),
    (TwoOptimizers, "sgd", "applies another optimizer"),
    (NoCallModel, None, "compiled with an optimizer"),
], ids=["never-applies", "two-optimizers", "no-optimizer"])
def test_a_step_fit_refuses_is_refused_by_check_with_the_same_typed_error(
        make, optimizer, message):
    # They were TensorFlow's StagingError around the message, or an AttributeError.
    from autosplit.errors import UnsupportedModelError

    model = make()
    model.compile(optimizer=optimizer)
    x = np.zeros((8, 4), "float32")
    with pytest.raises(UnsupportedModelError, match=message):
        check(model, x, np.zeros((8,), "float32"), micro_batch_size=4)
