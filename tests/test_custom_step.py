"""Models with their own ``train_step`` (Keras's guide, the VAE example): the step runs
per micro-batch, its one ``apply_gradients`` is caught and applied once per large batch.
Reference: ``model.fit`` at the same large batch. Refusals come before anything changes.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from common import relative_error

import autosplit
from autosplit.errors import UnsupportedModelError

N, B, M = 120, 60, 25  # 3 micro-batches of 20 per large batch


class Sampling(keras.layers.Layer):
    """z = mean + exp(log_var / 2) * eps; eps from a seeded generator."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(1337)

    def call(self, inputs):
        z_mean, z_log_var = inputs
        eps = keras.random.normal(keras.ops.shape(z_mean), seed=self.seed_generator)
        return z_mean + keras.ops.exp(0.5 * z_log_var) * eps * 0.0  # deterministic here


class VAE(keras.Model):
    """The Keras VAE example's train_step, on 8x8 images (sampling noise off, so that
    model.fit is deterministic and the split can be compared with it)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        inputs = keras.Input((8, 8, 1))
        h = keras.layers.Dense(16, activation="relu")(keras.layers.Flatten()(inputs))
        z_mean, z_log_var = keras.layers.Dense(2)(h), keras.layers.Dense(2)(h)
        self.encoder = keras.Model(inputs, [z_mean, z_log_var, Sampling()([z_mean, z_log_var])])
        latent = keras.Input((2,))
        out = keras.layers.Dense(64, activation="sigmoid")(
            keras.layers.Dense(16, activation="relu")(latent))
        self.decoder = keras.Model(latent, keras.layers.Reshape((8, 8, 1))(out))
        self.total_loss_tracker = keras.metrics.Mean(name="total_loss")
        self.reconstruction_loss_tracker = keras.metrics.Mean(name="reconstruction_loss")
        self.kl_loss_tracker = keras.metrics.Mean(name="kl_loss")

    @property
    def metrics(self):
        return [self.total_loss_tracker, self.reconstruction_loss_tracker,
                self.kl_loss_tracker]

    def train_step(self, data):
        with tf.GradientTape() as tape:
            z_mean, z_log_var, z = self.encoder(data)
            reconstruction = self.decoder(z)
            reconstruction_loss = keras.ops.mean(keras.ops.sum(
                keras.losses.binary_crossentropy(data, reconstruction), axis=(1, 2)))
            kl_loss = -0.5 * (1 + z_log_var - keras.ops.square(z_mean)
                              - keras.ops.exp(z_log_var))
            kl_loss = keras.ops.mean(keras.ops.sum(kl_loss, axis=1))
            total_loss = reconstruction_loss + kl_loss
        grads = tape.gradient(total_loss, self.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights, strict=True))
        self.total_loss_tracker.update_state(total_loss)
        self.reconstruction_loss_tracker.update_state(reconstruction_loss)
        self.kl_loss_tracker.update_state(kl_loss)
        return {"loss": self.total_loss_tracker.result(),
                "reconstruction_loss": self.reconstruction_loss_tracker.result(),
                "kl_loss": self.kl_loss_tracker.result()}


def images(n=N):
    return np.random.default_rng(0).uniform(size=(n, 8, 8, 1)).astype("float32")


def twin_vaes(jit_compile=False):
    reference, candidate = VAE(), VAE()
    candidate.set_weights(reference.get_weights())
    for model in (reference, candidate):
        model.compile(optimizer=keras.optimizers.Adam(0.01), jit_compile=jit_compile)
    return reference, candidate


def assert_same_as_fit(reference, candidate, expected, got, rtol=1e-4):
    assert relative_error(reference.get_weights(), candidate.get_weights()) <= rtol
    assert relative_error([v.numpy() for v in reference.optimizer.variables],
                          [v.numpy() for v in candidate.optimizer.variables]) <= rtol
    assert set(got.history) == set(expected.history)
    for name, values in expected.history.items():
        np.testing.assert_allclose(got.history[name], values, rtol=rtol, err_msg=name)


@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
def test_vae_train_step_equals_model_fit(jit_compile):
    x = images()
    reference, candidate = twin_vaes(jit_compile)
    expected = reference.fit(x, batch_size=B, epochs=2, shuffle=False, verbose=0)
    got = autosplit.fit_large_batch(candidate, x, batch_size=B, micro_batch_size=M, epochs=2,
                                    shuffle=False, verbose=0)
    assert got.autosplit["accumulation_steps"] == 3
    assert int(candidate.optimizer.iterations) == 2 * N // B
    assert_same_as_fit(reference, candidate, expected, got)


class Classifier(keras.Model):
    """The Keras guide's custom train_step: compute_loss, the loss tracker, compute_metrics
    (per-example metrics, sample weights)."""

    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred, sample_weight=sample_weight)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables, strict=True))
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred, sample_weight=sample_weight)
        return {m.name: m.result() for m in self.metrics}


def classifier():
    inputs = keras.Input((6,))
    model = Classifier(inputs, keras.layers.Dense(3)(
        keras.layers.Dense(12, activation="relu")(inputs)))
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def test_guide_train_step_with_compiled_loss_and_metrics_equals_model_fit():
    r = np.random.default_rng(1)
    x = r.normal(size=(N, 6)).astype("float32")
    y = (x[:, 0] > 0).astype("int32") + (x[:, 1] > 1)
    reference, candidate = classifier(), classifier()
    candidate.set_weights(reference.get_weights())
    expected = reference.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0)
    got = autosplit.fit_large_batch(candidate, x, y, batch_size=B, micro_batch_size=M,
                                    epochs=2, shuffle=False, verbose=0)
    assert_same_as_fit(reference, candidate, expected, got, rtol=1e-5)


class TwoApplies(keras.Model):
    def train_step(self, data):
        x, y = data
        for _ in range(2):
            with tf.GradientTape() as tape:
                loss = keras.ops.mean(keras.ops.square(self(x) - y))
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply_gradients(zip(grads, self.trainable_variables, strict=True))
        return {"loss": loss}


class TwoOptimizers(keras.Model):
    """A GAN-like step: a second optimizer of its own next to model.optimizer."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.other = keras.optimizers.SGD(0.1)

    def train_step(self, data):
        x, y = data
        with tf.GradientTape(persistent=True) as tape:
            loss = keras.ops.mean(keras.ops.square(self(x) - y))
        first, rest = self.trainable_variables[:1], self.trainable_variables[1:]
        self.optimizer.apply_gradients(zip(tape.gradient(loss, first), first, strict=True))
        self.other.apply_gradients(zip(tape.gradient(loss, rest), rest, strict=True))
        return {"loss": loss}


@pytest.mark.parametrize(("cls", "message"), [(TwoApplies, "more than once"),
                                              (TwoOptimizers, "another optimizer")])
def test_steps_without_an_exact_split_are_refused_before_anything_changes(cls, message):
    inputs = keras.Input((4,))
    model = cls(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer=keras.optimizers.SGD(0.1))
    r = np.random.default_rng(2)
    x, y = r.normal(size=(40, 4)).astype("float32"), r.normal(size=(40, 1)).astype("float32")
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(UnsupportedModelError, match=message):
        autosplit.fit_large_batch(model, x, y, batch_size=20, micro_batch_size=8, verbose=0)
    for a, b in zip(before, model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    assert int(model.optimizer.iterations) == 0
    # The patches are gone: plain Keras trains the same model afterwards.
    model.fit(x, y, batch_size=20, verbose=0) if cls is TwoApplies else None


def test_a_custom_step_without_an_optimizer_is_refused_with_the_reason():
    class GAN(keras.Model):
        def compile(self, d_optimizer, g_optimizer):
            super().compile()
            self.d_optimizer, self.g_optimizer = d_optimizer, g_optimizer

        def train_step(self, data):
            return {}

    inputs = keras.Input((4,))
    model = GAN(inputs, keras.layers.Dense(1)(inputs))
    model.compile(keras.optimizers.Adam(), keras.optimizers.Adam())
    with pytest.raises(UnsupportedModelError, match="GAN"):
        autosplit.fit_large_batch(model, np.zeros((8, 4), "float32"), batch_size=8,
                                  micro_batch_size=4, verbose=0)
