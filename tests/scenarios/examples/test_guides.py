"""The Keras guides' custom steps, rebuilt small: each trained by ``model.fit`` and by
``fit_large_batch`` at an uneven split, compared on weights, optimizer variables,
iterations and logs (``_compare``); what cannot be split exactly is refused before
anything changes.

- custom_train_step_in_tensorflow.py ("Customizing what happens in fit()"): a step with
  the compiled loss and metrics; the low-level form with its own loss and trackers; one
  that passes sample weights; a test step of its own, used for validation; the end-to-end
  GAN (two optimizers), refused.
- knowledge_distillation.py (keras-io/examples/vision): a Distiller with its own
  ``compile`` signature and a ``compute_loss`` override, the teacher frozen.
- a ``compute_loss`` override that adds a penalty to the compiled loss.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from _compare import ADAM_RTOL, SGD_RTOL, assert_exact, twins
from common import GuideStep, update_metrics
from keras import layers, ops

import autosplit

N, B, M = 96, 32, 12  # 3 micro-batches of 11, 11, 10 rows per large batch


def data(n=N, seed=0):
    r = np.random.default_rng(seed)
    x = r.normal(size=(n, 8)).astype("float32")
    y = (x[:, 0] + x[:, 1] > 0).astype("int32") + (x[:, 2] > 1).astype("int32")
    return x, y


def functional(cls, outputs=3):
    inputs = keras.Input((8,))
    hidden = layers.Dense(16, activation="relu")(inputs)
    return cls(inputs, layers.Dense(outputs)(hidden))


def compiled(model, optimizer):
    """``model`` compiled as the guides compile their classifiers: logits, accuracy."""
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def assert_exact_with_momentum(cls):
    """``functional(cls)`` compiled with SGD and momentum: trained by fit_large_batch exactly
    as by ``model.fit``."""
    def make():
        return compiled(functional(cls), keras.optimizers.SGD(0.1, momentum=0.9))

    x, y = data()
    assert_exact(make, x, y, n=N, batch_size=B, micro_batch_size=M, rtol=SGD_RTOL)


# ----------------------------------------------- "A first simple example", Keras 3 form


class CompiledLossStep(keras.Model):
    """The guide's first train_step: compute_loss (the compiled loss), apply_gradients,
    then every metric updated (the loss tracker with the loss)."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(gradients, self.trainable_variables, strict=True))
        return update_metrics(self, loss, y, y_pred)


def test_the_guide_s_step_with_the_compiled_loss_and_metrics():
    assert_exact_with_momentum(CompiledLossStep)


# ----------------------------------------------- "Going lower-level"


class LowLevelStep(keras.Model):
    """No compiled loss or metrics: its own loss function and trackers, listed in
    ``metrics`` so that Keras resets them each epoch."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.mae_metric = keras.metrics.MeanAbsoluteError(name="mae")
        self.loss_fn = keras.losses.MeanSquaredError()

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.loss_fn(y, y_pred)
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(gradients, self.trainable_variables, strict=True))
        self.loss_tracker.update_state(loss)
        self.mae_metric.update_state(y, y_pred)
        return {"loss": self.loss_tracker.result(), "mae": self.mae_metric.result()}

    @property
    def metrics(self):
        return [self.loss_tracker, self.mae_metric]


def test_the_guide_s_lower_level_step_with_its_own_loss_and_trackers():
    def make():
        model = functional(LowLevelStep, outputs=1)
        model.compile(optimizer=keras.optimizers.Adam(1e-2))
        return model

    x, _ = data()
    y = (x[:, :1] * 2 - x[:, 1:2]).astype("float32")
    assert_exact(make, x, y, n=N, batch_size=B, micro_batch_size=M, rtol=ADAM_RTOL)


# ----------------------------------------------- "Supporting sample_weight & class_weight"


def weighted_classifier(cls=GuideStep):
    return compiled(functional(cls), keras.optimizers.SGD(0.1))


@pytest.mark.parametrize("weights", ["sample_weight", "class_weight"])
def test_the_guide_s_step_with_sample_weights(weights):
    x, y = data()
    extra = ({"sample_weight": np.random.default_rng(1).uniform(0.1, 2, N).astype("float32")}
             if weights == "sample_weight" else {"class_weight": {0: 1.0, 1: 3.0, 2: 0.5}})
    assert_exact(weighted_classifier, x, y, n=N, batch_size=B, micro_batch_size=M,
                 rtol=SGD_RTOL, **extra)


# ----------------------------------------------- "Providing your own evaluation step"


class OwnEvaluation(GuideStep):
    def test_step(self, data):
        x, y = data
        y_pred = self(x, training=False)
        loss = self.compute_loss(y=y, y_pred=y_pred)
        return update_metrics(self, loss, y, y_pred)


def test_the_guide_s_own_test_step_validates_as_in_model_fit():
    x, y = data()
    # Validation batches of B rows, as model.fit's validation_batch_size defaults to.
    vx, vy = data(2 * B, seed=2)
    assert_exact(lambda: weighted_classifier(OwnEvaluation), x, y, n=N, batch_size=B,
                 micro_batch_size=M, rtol=SGD_RTOL, validation_data=(vx, vy))


# ----------------------------------------------- knowledge_distillation.py


class Distiller(keras.Model):
    """The keras-io example's Keras 3 form: its own compile arguments, a compute_loss
    override that mixes the student's loss with the KL divergence to the teacher's
    softened predictions, call() the student's."""

    def __init__(self, student, teacher):
        super().__init__()
        self.teacher, self.student = teacher, student

    def compile(self, optimizer, metrics, student_loss_fn, distillation_loss_fn, alpha=0.1,
                temperature=3):
        super().compile(optimizer=optimizer, metrics=metrics)
        self.student_loss_fn, self.distillation_loss_fn = student_loss_fn, distillation_loss_fn
        self.alpha, self.temperature = alpha, temperature

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None,
                     allow_empty=False, training=True):
        teacher_pred = self.teacher(x, training=False)
        student_loss = self.student_loss_fn(y, y_pred)
        distillation_loss = self.distillation_loss_fn(
            ops.softmax(teacher_pred / self.temperature, axis=1),
            ops.softmax(y_pred / self.temperature, axis=1)) * self.temperature**2
        return self.alpha * student_loss + (1 - self.alpha) * distillation_loss

    def call(self, x):
        return self.student(x)


def mlp(width, name):
    return keras.Sequential([keras.Input((8,)), layers.Dense(width, activation="relu"),
                             layers.Dense(3)], name=name)


def test_knowledge_distillation_with_a_frozen_teacher():
    x, y = data()
    keras.utils.set_random_seed(5)
    teacher = mlp(32, "teacher")
    teacher.compile(optimizer="adam",
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    teacher.fit(x, y, batch_size=B, epochs=3, verbose=0)
    teacher.trainable = False

    def make():
        distiller = Distiller(student=mlp(8, "student"), teacher=teacher)
        distiller.compile(optimizer=keras.optimizers.Adam(1e-2),
                          metrics=[keras.metrics.SparseCategoricalAccuracy()],
                          student_loss_fn=keras.losses.SparseCategoricalCrossentropy(
                              from_logits=True),
                          distillation_loss_fn=keras.losses.KLDivergence(),
                          alpha=0.1, temperature=10)
        distiller.build((None, 8))
        return distiller

    teacher_weights = [w.copy() for w in teacher.get_weights()]
    _, candidate = assert_exact(make, x, y, n=N, batch_size=B, micro_batch_size=M,
                                rtol=ADAM_RTOL)
    assert len(candidate.trainable_weights) == 4  # the student's only
    assert all(np.array_equal(a, b) for a, b in
               zip(teacher_weights, teacher.get_weights(), strict=True))


# ----------------------------------------------- a compute_loss override


class Penalised(keras.Model):
    """The compiled loss plus a mean-over-rows penalty on the logits' size."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None,
                     training=True):
        loss = super().compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight,
                                    training=training)
        return loss + 0.01 * ops.mean(ops.sum(ops.square(y_pred), axis=-1))


def test_a_compute_loss_override_over_the_compiled_loss():
    assert_exact_with_momentum(Penalised)


# ----------------------------------------------- "Wrapping up: an end-to-end GAN example"


class GAN(keras.Model):
    """The guide's GAN: its own compile (two optimizers, a loss function), a train_step
    that draws latent vectors and applies each optimizer once."""

    def __init__(self, discriminator, generator, latent_dim, seeded=True):
        super().__init__()
        self.discriminator, self.generator = discriminator, generator
        self.latent_dim = latent_dim
        self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
        self.g_loss_tracker = keras.metrics.Mean(name="g_loss")
        # The guide's seed generator; None: Keras's global one, made on first use.
        self.seed_generator = keras.random.SeedGenerator(1337) if seeded else None

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer, self.g_optimizer, self.loss_fn = d_optimizer, g_optimizer, loss_fn

    @property
    def metrics(self):
        return [self.d_loss_tracker, self.g_loss_tracker]

    def train_step(self, real_images):
        batch_size = tf.shape(real_images)[0]
        latent = keras.random.normal((batch_size, self.latent_dim), seed=self.seed_generator)
        combined = tf.concat([self.generator(latent), real_images], axis=0)
        labels = tf.concat([tf.ones((batch_size, 1)), tf.zeros((batch_size, 1))], axis=0)
        with tf.GradientTape() as tape:
            d_loss = self.loss_fn(labels, self.discriminator(combined))
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(
            zip(grads, self.discriminator.trainable_weights, strict=True))
        latent = keras.random.normal((batch_size, self.latent_dim), seed=self.seed_generator)
        with tf.GradientTape() as tape:
            g_loss = self.loss_fn(tf.zeros((batch_size, 1)),
                                  self.discriminator(self.generator(latent)))
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights,
                                             strict=True))
        self.d_loss_tracker.update_state(d_loss)
        self.g_loss_tracker.update_state(g_loss)
        return {"d_loss": self.d_loss_tracker.result(), "g_loss": self.g_loss_tracker.result()}


@pytest.mark.parametrize("seeded", [True, False], ids=["seed_generator", "global_seed"])
def test_the_guide_s_gan_is_refused_before_anything_changes(seeded):
    # Unseeded, the refusal's trace (never run) once made Keras's global SeedGenerator
    # with its variable never initialized: gan.fit then failed ("seed must have shape
    # [2], not [0]").
    latent_dim = 4
    discriminator = keras.Sequential([keras.Input((8,)), layers.Dense(8, activation="relu"),
                                      layers.Dense(1)], name="discriminator")
    generator = keras.Sequential([keras.Input((latent_dim,)), layers.Dense(8)],
                                 name="generator")
    gan = GAN(discriminator, generator, latent_dim, seeded)
    d_optimizer, g_optimizer = keras.optimizers.Adam(3e-4), keras.optimizers.Adam(3e-4)
    gan.compile(d_optimizer, g_optimizer,
                keras.losses.BinaryCrossentropy(from_logits=True))
    x, _ = data()
    before = [w.copy() for w in gan.get_weights()]
    with pytest.raises(autosplit.UnsupportedModelError, match="GAN") as refused:
        autosplit.fit_large_batch(gan, x, batch_size=B, micro_batch_size=M, verbose=0)
    assert "fit" in str(refused.value)  # it says what to use instead
    assert all(np.array_equal(a, b) for a, b in zip(before, gan.get_weights(), strict=True))
    assert int(d_optimizer.iterations) == int(g_optimizer.iterations) == 0
    assert all(float(m.result()) == 0 for m in gan.metrics)
    gan.fit(x, batch_size=B, epochs=1, verbose=0)  # Keras trains it afterwards
    assert int(d_optimizer.iterations) == int(g_optimizer.iterations) == N // B


def test_twins_start_equal():  # the helper every test here relies on
    a, b = twins(lambda: weighted_classifier())
    assert all(np.array_equal(p, q) for p, q in zip(a.get_weights(), b.get_weights(),
                                                     strict=True))
