"""Models whose loss compares the rows of a batch, and their reference: model.fit on the
full batch, for the whole-batch step's tests (and their child on two replicas)."""

from __future__ import annotations

import contextlib

import keras
import numpy as np
import tensorflow as tf
from common import relative_error

import autosplit

N, B, M, D = 128, 32, 8, 8


def pairs(n=N, seed=0):
    """Queries and their documents: a noisy linear map of the query, in-batch negatives'
    data (x of two inputs, y unused zeros)."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(n, 6)).astype("float32")
    d = (q @ rng.normal(size=(6, 6)) + 0.3 * rng.normal(size=(n, 6))).astype("float32")
    return [q, d], np.zeros((n, 1), "float32")


def in_batch_softmax(y_true, y_pred):
    """CLIP's and DPR's loss: each query's softmax over every document of the batch, the
    right one its own row's; one value per row, each over the whole batch."""
    y_pred = tf.cast(y_pred, tf.float32)
    a = tf.math.l2_normalize(y_pred[:, :D], axis=1)
    b = tf.math.l2_normalize(y_pred[:, D:], axis=1)
    logits = tf.matmul(a, b, transpose_b=True) * 10.0
    return keras.losses.sparse_categorical_crossentropy(tf.range(tf.shape(logits)[0]), logits,
                                                        from_logits=True)


def dual_encoder(optimizer="sgd", dropout=0.0, jit_compile=False, metrics=(),
                 penalties=False, learning_rate=0.5, activation="relu"):
    """Two towers, their embeddings side by side: compile(loss=in_batch_softmax);
    ``penalties``: a weight penalty and an activity regularizer (a loss added in call())."""
    keras.utils.set_random_seed(1)
    xq, xd = keras.Input((6,)), keras.Input((6,))
    hidden = keras.layers.Dense(16, activation=activation, **(
        {"kernel_regularizer": "l2", "activity_regularizer": "l1"} if penalties else {}))(xq)
    tower_q = keras.layers.Dense(D)(keras.layers.Dropout(dropout)(hidden))
    tower_d = keras.layers.Dense(D)(keras.layers.Dense(16, activation=activation)(xd))
    model = keras.Model([xq, xd], keras.layers.Concatenate(dtype="float32")([tower_q, tower_d]))
    model.compile(keras.optimizers.SGD(learning_rate) if optimizer == "sgd"
                  else keras.optimizers.Adam(1e-2), in_batch_softmax, metrics=list(metrics),
                  jit_compile=jit_compile)
    return model


class SupervisedContrastiveLoss(keras.losses.Loss):
    """keras-io's vision/supervised-contrastive-learning loss as published: ``__call__``
    overridden, ``tfa.losses.npairs_loss`` (written here: a softmax cross-entropy over
    the similarity matrix against the rows of the same label, normalised)."""

    def __init__(self, temperature=1, name=None):
        super().__init__(name=name)
        self.temperature = temperature

    def __call__(self, labels, feature_vectors, sample_weight=None):
        feature_vectors_normalized = tf.math.l2_normalize(feature_vectors, axis=1)
        logits = tf.divide(tf.matmul(feature_vectors_normalized,
                                     tf.transpose(feature_vectors_normalized)),
                           self.temperature)
        return npairs_loss(tf.squeeze(labels), logits)


def npairs_loss(y_true, y_pred):
    """tensorflow_addons' ``npairs_loss``."""
    y_true = tf.cast(tf.equal(tf.expand_dims(y_true, 0), tf.expand_dims(y_true, 1)),
                     y_pred.dtype)
    y_true /= tf.reduce_sum(y_true, 1, keepdims=True)
    loss = tf.nn.softmax_cross_entropy_with_logits(logits=y_pred, labels=y_true)
    return tf.reduce_mean(loss)


def labelled(n=N, seed=0):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 4, size=(n, 1)).astype("int32")
    x = (rng.normal(size=(n, 6)) + y).astype("float32")
    return x, y


def projection(loss, optimizer="adam", outputs=1):
    """An encoder and a projection head (keras-io's add_projection_head, small)."""
    keras.utils.set_random_seed(2)
    inputs = keras.Input((6,))
    features = keras.layers.Dense(16, activation="relu")(inputs)
    head = keras.layers.Dense(8, activation="relu", name="head")(features)
    if outputs == 1:
        model = keras.Model(inputs, head)
    else:  # a second output, its own per-row loss
        model = keras.Model(inputs, [head, keras.layers.Dense(1, name="value")(features)])
    model.compile(keras.optimizers.Adam(1e-2) if optimizer == "adam"
                  else keras.optimizers.SGD(0.1), loss)
    return model


def chi_square(y_true, y_pred):
    """One value per batch: a chi-square between the batch's soft histogram of its
    predictions and its targets' (the seed thread's example)."""
    centres = tf.linspace(-2.0, 2.0, 8)

    def histogram(values):
        weights = tf.nn.softmax(-tf.square(values[:, None] - centres[None, :]) * 4.0, axis=1)
        return tf.reduce_mean(weights, axis=0)

    predicted = histogram(tf.reshape(tf.cast(y_pred, tf.float32), [-1]))
    expected = histogram(tf.reshape(tf.cast(y_true, tf.float32), [-1]))
    return tf.reduce_sum(tf.square(predicted - expected) / (expected + 1e-3))


def trains_as_model_fit(make, x, y, *, rtol=1e-5, epochs=2, strategy=None, batch_size=B,
                        **options):
    """fit_large_batch on a twin of ``make()`` equals model.fit on full batches of
    ``batch_size`` (one device): weights within ``rtol``, iterations, logs."""
    reference = make()
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        model = make()
    model.set_weights(reference.get_weights())
    validation = {k: options[k] for k in ("validation_data", "validation_batch_size")
                  if k in options}
    expected = reference.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False,
                             verbose=0, **validation)
    options.setdefault("micro_batch_size", M)
    got = autosplit.fit_large_batch(model, x, y, batch_size=batch_size, epochs=epochs,
                                    shuffle=False, verbose=0, **options)
    assert got.autosplit.step.startswith("outputs first, the loss over the whole batch")
    error = relative_error(reference.get_weights(), model.get_weights())
    assert error <= rtol, error
    assert int(model.optimizer.iterations.numpy()) == int(reference.optimizer.iterations)
    for name, values in expected.history.items():
        np.testing.assert_allclose(got.history[name], values, rtol=max(rtol, 1e-5),
                                   err_msg=name)
    return got, reference, model


class DualEncoder(keras.Model):
    """Keras 3's way of writing one's own loss: ``compute_loss`` overridden, in-batch
    negatives plus a per-row term on the queries, through Keras's own compiled-less step."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        negatives = keras.ops.mean(in_batch_softmax(y, y_pred))
        norms = keras.ops.mean(keras.ops.square(keras.ops.norm(y_pred[:, :D], axis=1) - 1.0))
        return negatives + 0.1 * norms + keras.ops.sum(self.losses)


def own_loss_encoder(regularized=False):
    keras.utils.set_random_seed(1)
    xq, xd = keras.Input((6,)), keras.Input((6,))
    dense = {"kernel_regularizer": "l2"} if regularized else {}
    towers = [keras.layers.Dense(D, **dense)(keras.layers.Dense(16, activation="relu")(t))
              for t in (xq, xd)]
    model = DualEncoder([xq, xd], keras.layers.Concatenate()(towers))
    model.compile(keras.optimizers.SGD(0.5))
    return model
