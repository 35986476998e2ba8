"""Custom models from keras.io, shrunk, trained with model.fit and with fit_large_batch.

- guides/making_new_layers_and_models_via_subclassing.py: custom layers and a subclassed
  Model (weights created lazily).
- guides/functional_api.py: the ticket classifier, three named inputs, two named outputs
  with loss_weights.
- vision/captcha_ocr.py: the endpoint-layer pattern: the labels are an input, a layer
  adds the CTC loss with add_loss, the model is compiled without a loss.
- generative/vae.py: a VAE with a custom train_step and its own metric trackers.
- nlp/masked_language_modeling.py: a compute_loss that returns the sum of the masked
  tokens' losses, and a `metrics` property listing only its own tracker.

The siamese networks are in test_siamese.py.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from _compare import (
    ADAM_RTOL,
    SGD_RTOL,
    assert_same_training,
    dense_gradients,
    fit_both,
    steps,
    twins,
)
from keras import layers, ops


# making_new_layers_and_models_via_subclassing.py: Linear with add_weight, MLPBlock of
# three of them, lazily built, inside a subclassed Model.
class Linear(layers.Layer):
    def __init__(self, units=32):
        super().__init__()
        self.units = units

    def build(self, input_shape):
        self.w = self.add_weight(shape=(input_shape[-1], self.units),
                                 initializer="random_normal", trainable=True)
        self.b = self.add_weight(shape=(self.units,), initializer="random_normal",
                                 trainable=True)

    def call(self, inputs):
        return ops.matmul(inputs, self.w) + self.b


class MLPBlock(layers.Layer):
    def __init__(self):
        super().__init__()
        self.linear_1 = Linear(16)
        self.linear_2 = Linear(16)
        self.linear_3 = Linear(3)

    def call(self, inputs):
        x = ops.relu(self.linear_1(inputs))
        x = ops.relu(self.linear_2(x))
        return self.linear_3(x)


class Classifier(keras.Model):
    def __init__(self):
        super().__init__()
        self.block = MLPBlock()

    def call(self, inputs):
        return self.block(inputs)


def test_subclassed_model_with_custom_layers():
    n, batch, micro = 120, 60, 25
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 8)).astype("float32")
    y = (x[:, 0] > 0).astype("int32") + (x[:, 1] > 0.5).astype("int32")

    def make():
        model = Classifier()
        model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
        return model

    reference, candidate = twins(make, build=lambda model: model(x[:2]))
    expected, got = fit_both(reference, candidate, x, y, batch_size=batch,
                             micro_batch_size=micro, epochs=2)
    assert_same_training(reference, candidate, expected, got, rtol=SGD_RTOL,
                         steps=steps(n, batch, 2))


# functional_api.py: ticket priority and department from title, body and tags; vocab
# 10000, 4 departments, 12 tags; here vocab 50 and sequences of 10 and 20 words.
def test_multi_input_multi_output_with_loss_weights():
    num_tags, num_words, num_departments = 12, 50, 4
    n, batch, micro = 100, 50, 20
    rng = np.random.default_rng(0)
    title_data = rng.integers(0, num_words, size=(n, 10))
    body_data = rng.integers(0, num_words, size=(n, 20))
    tags_data = rng.integers(0, 2, size=(n, num_tags)).astype("float32")
    priority_targets = rng.random(size=(n, 1)).astype("float32")
    dept_targets = rng.integers(0, 2, size=(n, num_departments)).astype("float32")

    def make():
        title_input = keras.Input(shape=(None,), name="title")
        body_input = keras.Input(shape=(None,), name="body")
        tags_input = keras.Input(shape=(num_tags,), name="tags")
        title_features = layers.Embedding(num_words, 16)(title_input)
        body_features = layers.Embedding(num_words, 16)(body_input)
        title_features = layers.LSTM(8)(title_features)
        body_features = layers.LSTM(4)(body_features)
        x = layers.concatenate([title_features, body_features, tags_input])
        priority_pred = layers.Dense(1, name="priority")(x)
        department_pred = layers.Dense(num_departments, name="department")(x)
        model = keras.Model(inputs=[title_input, body_input, tags_input],
                            outputs={"priority": priority_pred,
                                     "department": department_pred})
        model.compile(
            optimizer=dense_gradients(keras.optimizers.RMSprop)(1e-3),
            loss={"priority": keras.losses.BinaryCrossentropy(from_logits=True),
                  "department": keras.losses.CategoricalCrossentropy(from_logits=True)},
            loss_weights={"priority": 1.0, "department": 0.2})
        return model

    reference, candidate = twins(make)
    x = {"title": title_data, "body": body_data, "tags": tags_data}
    y = {"priority": priority_targets, "department": dept_targets}
    expected, got = fit_both(reference, candidate, x, y, batch_size=batch,
                             micro_batch_size=micro, epochs=2)
    assert {"priority_loss", "department_loss"} <= set(expected)
    assert_same_training(reference, candidate, expected, got, rtol=ADAM_RTOL,
                         steps=steps(n, batch, 2))


# captcha_ocr.py: 200x50 captchas of 5 characters from 19, two conv blocks, two
# Bidirectional LSTMs (128, 64), a CTCLayer that add_loss()es the CTC loss; Adam, no
# compiled loss, the labels fed as the model's second input. Here 32x16 images, 3
# characters from 6, LSTM(8). The layer adds the mean over the batch of the per-example
# CTC loss (the example adds the (batch, 1) losses, which Keras 3 sums).
class CTCLayer(layers.Layer):
    def call(self, y_true, y_pred):
        batch_len = ops.shape(y_true)[0]
        input_length = ops.shape(y_pred)[1] * ops.ones((batch_len,), dtype="int32")
        label_length = ops.shape(y_true)[1] * ops.ones((batch_len,), dtype="int32")
        loss = ops.ctc_loss(y_true, y_pred, label_length, input_length)
        self.add_loss(ops.mean(loss))
        return y_pred


@pytest.mark.slow
def test_endpoint_layer_with_add_loss_and_no_compiled_loss():
    img_width, img_height, max_length, characters = 32, 16, 3, 6
    n, batch, micro = 60, 30, 13
    rng = np.random.default_rng(0)
    images = rng.uniform(0, 1, size=(n, img_width, img_height, 1)).astype("float32")
    labels = rng.integers(1, characters + 1, size=(n, max_length)).astype("int32")

    def make():
        input_img = layers.Input(shape=(img_width, img_height, 1), name="image")
        label_input = layers.Input(name="label", shape=(None,), dtype="int32")
        x = layers.Conv2D(8, (3, 3), activation="relu", kernel_initializer="he_normal",
                          padding="same", name="Conv1")(input_img)
        x = layers.MaxPooling2D((2, 2), name="pool1")(x)
        x = layers.Conv2D(8, (3, 3), activation="relu", kernel_initializer="he_normal",
                          padding="same", name="Conv2")(x)
        x = layers.MaxPooling2D((2, 2), name="pool2")(x)
        x = layers.Reshape(target_shape=(img_width // 4, (img_height // 4) * 8),
                           name="reshape")(x)
        x = layers.Dense(16, activation="relu", name="dense1")(x)
        x = layers.Dropout(0.0)(x)  # 0.2 in the example; the LSTMs' dropout 0.25 too
        x = layers.Bidirectional(layers.LSTM(8, return_sequences=True))(x)
        x = layers.Dense(characters + 2, activation="softmax", name="dense2")(x)
        output = CTCLayer(name="ctc_loss")(label_input, x)
        model = keras.Model(inputs=[input_img, label_input], outputs=output)
        model.compile(optimizer=keras.optimizers.Adam())
        return model

    reference, candidate = twins(make)
    x = {"image": images, "label": labels}
    with pytest.warns(UserWarning, match="adds losses in call"):
        expected, got = fit_both(reference, candidate, x, batch_size=batch,
                                 micro_batch_size=micro, epochs=2)
    assert_same_training(reference, candidate, expected, got, rtol=ADAM_RTOL,
                         steps=steps(n, batch, 2))


# vae.py: a convolutional VAE on MNIST (latent 2) whose train_step computes the
# reconstruction and KL losses under a GradientTape, calls apply_gradients once and
# updates three Mean trackers. Here 12x12 images, dense encoder and decoder. The example
# samples z with keras.random.normal; here the noise is an input ("eps"), so that a split
# step can equal a full one (random draws per micro-batch would not).
LATENT_DIM, SIDE = 2, 12


class Sampling(layers.Layer):
    def call(self, inputs):
        z_mean, z_log_var, epsilon = inputs
        return z_mean + ops.exp(0.5 * z_log_var) * epsilon


def vae_parts():
    encoder_inputs = keras.Input(shape=(SIDE, SIDE, 1), name="image")
    eps = keras.Input(shape=(LATENT_DIM,), name="eps")
    x = layers.Conv2D(4, 3, activation="relu", strides=2, padding="same")(encoder_inputs)
    x = layers.Flatten()(x)
    x = layers.Dense(16, activation="relu")(x)
    z_mean = layers.Dense(LATENT_DIM, name="z_mean")(x)
    z_log_var = layers.Dense(LATENT_DIM, name="z_log_var")(x)
    z = Sampling()([z_mean, z_log_var, eps])
    encoder = keras.Model({"image": encoder_inputs, "eps": eps}, [z_mean, z_log_var, z],
                          name="encoder")
    latent_inputs = keras.Input(shape=(LATENT_DIM,))
    x = layers.Dense(6 * 6 * 4, activation="relu")(latent_inputs)
    x = layers.Reshape((6, 6, 4))(x)
    x = layers.Conv2DTranspose(4, 3, activation="relu", strides=2, padding="same")(x)
    decoder_outputs = layers.Conv2DTranspose(1, 3, activation="sigmoid", padding="same")(x)
    decoder = keras.Model(latent_inputs, decoder_outputs, name="decoder")
    return encoder, decoder


class VAE(keras.Model):
    def __init__(self, encoder, decoder, **kwargs):
        super().__init__(**kwargs)
        self.encoder = encoder
        self.decoder = decoder
        self.total_loss_tracker = keras.metrics.Mean(name="total_loss")
        self.reconstruction_loss_tracker = keras.metrics.Mean(name="reconstruction_loss")
        self.kl_loss_tracker = keras.metrics.Mean(name="kl_loss")

    @property
    def metrics(self):
        return [self.total_loss_tracker, self.reconstruction_loss_tracker,
                self.kl_loss_tracker]

    def call(self, data):
        return self.decoder(self.encoder(data)[2])

    def train_step(self, data):
        if isinstance(data, tuple):
            data = data[0]
        with tf.GradientTape() as tape:
            z_mean, z_log_var, z = self.encoder(data)
            reconstruction = self.decoder(z)
            reconstruction_loss = ops.mean(ops.sum(
                keras.losses.binary_crossentropy(data["image"], reconstruction), axis=(1, 2)))
            kl_loss = -0.5 * (1 + z_log_var - ops.square(z_mean) - ops.exp(z_log_var))
            kl_loss = ops.mean(ops.sum(kl_loss, axis=1))
            total_loss = reconstruction_loss + kl_loss
        grads = tape.gradient(total_loss, self.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights, strict=True))
        self.total_loss_tracker.update_state(total_loss)
        self.reconstruction_loss_tracker.update_state(reconstruction_loss)
        self.kl_loss_tracker.update_state(kl_loss)
        return {"loss": self.total_loss_tracker.result(),
                "reconstruction_loss": self.reconstruction_loss_tracker.result(),
                "kl_loss": self.kl_loss_tracker.result()}


@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
def test_vae_with_custom_train_step(jit_compile):
    n, batch, micro = 90, 45, 20
    rng = np.random.default_rng(0)
    x = {"image": rng.uniform(0, 1, size=(n, SIDE, SIDE, 1)).astype("float32"),
         "eps": rng.normal(size=(n, LATENT_DIM)).astype("float32")}

    def make():
        vae = VAE(*vae_parts())
        vae.compile(optimizer=keras.optimizers.Adam(), jit_compile=jit_compile)
        return vae

    reference, candidate = twins(make, build=lambda model: model(
        {k: v[:2] for k, v in x.items()}))
    expected, got = fit_both(reference, candidate, x, batch_size=batch,
                             micro_batch_size=micro, epochs=2)
    assert set(expected) == {"loss", "reconstruction_loss", "kl_loss"}
    assert_same_training(reference, candidate, expected, got, rtol=ADAM_RTOL,
                         steps=steps(n, batch, 2))


# masked_language_modeling.py: a small BERT (token and position embeddings, one
# Transformer block) whose compute_loss returns ops.sum of the per-token losses,
# weighted by sample_weight (1 on the masked tokens), updates a module-level tracker
# and lists only it in `metrics`; Keras's default train_step still updates its own loss
# tracker. Before: refused as a step that keeps state of its own (Keras's tracker), and
# with that passed, the sum weighed as a mean (1.37 relative off model.fit with SGD).
def masked_language_model(tracker):
    vocab, length, width = 20, 8, 8
    loss_fn = keras.losses.SparseCategoricalCrossentropy(reduction=None)

    class MaskedLanguageModel(keras.Model):
        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None):
            loss = loss_fn(y, y_pred, sample_weight)
            tracker.update_state(loss, sample_weight=sample_weight)
            return ops.sum(loss)

        def compute_metrics(self, x, y, y_pred, sample_weight):
            return {"loss": tracker.result()}

        @property
        def metrics(self):
            return [tracker]

    inputs = layers.Input((length,), dtype="int64")
    embedded = (layers.Embedding(vocab, width)(inputs)
                + layers.Embedding(length, width)(ops.arange(length)))
    # The key projection's bias shifts every score of a query alike, which softmax
    # cancels: its gradient is rounding noise (as in model.fit), so none here.
    attention = layers.MultiHeadAttention(num_heads=2, key_dim=4, use_bias=False)(
        embedded, embedded, embedded)
    block = layers.LayerNormalization(epsilon=1e-6)(embedded + attention)
    ffn = layers.Dense(width)(layers.Dense(16, activation="relu")(block))
    outputs = layers.Dense(vocab, activation="softmax")(
        layers.LayerNormalization(epsilon=1e-6)(block + ffn))
    model = MaskedLanguageModel(inputs, outputs)
    model.compile(optimizer=keras.optimizers.SGD(0.05))
    return model


def test_masked_language_model_with_a_summed_loss_and_its_own_metrics_list():
    n, batch, micro, vocab = 90, 32, 7, 20
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, vocab - 1, (n, 8))
    tokens[:, -2:] = 0  # padding
    masked = (rng.random(tokens.shape) < 0.3) & (tokens > 2)
    inputs = np.where(masked, vocab - 1, tokens)
    weights = masked.astype("float32")
    data = tf.data.Dataset.from_tensor_slices((inputs, tokens, weights)).batch(batch)
    trackers = []

    def make():
        trackers.append(keras.metrics.Mean(name="loss"))
        return masked_language_model(trackers[-1])

    reference, candidate = twins(make)
    expected, got = fit_both(reference, candidate, data, batch_size=batch,
                             micro_batch_size=micro, epochs=2)
    assert set(expected) == {"loss"}
    assert_same_training(reference, candidate, expected, got, rtol=SGD_RTOL,
                         steps=steps(n, batch, 2))
