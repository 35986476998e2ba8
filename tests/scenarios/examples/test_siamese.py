"""Siamese networks from keras.io, shrunk, trained with model.fit and with fit_large_batch.

- vision/siamese_contrastive.py: twin towers on a list of two images, contrastive loss.
- vision/siamese_network.py: triplets through one embedding network, a custom
  train_step whose tape target is the per-triplet loss vector, not its mean.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from _compare import ADAM_RTOL, assert_runs, assert_same_training, fit_both, steps, twins
from keras import layers, ops

import autosplit


# siamese_contrastive.py: pairs of 28x28 MNIST digits through one tower (BatchNormalization,
# two tanh Conv2D and AveragePooling, BatchNormalization, Dense(10, tanh)), the Euclidean
# distance, BatchNormalization, Dense(1, sigmoid); contrastive loss with margin 1, RMSprop,
# batch 16. Here 16x16 digits. BatchNormalization in training mode normalises each
# micro-batch by itself, so the example as written is checked to train; without its
# BatchNormalization layers it must equal model.fit.
def loss(margin=1, per_example=False):
    def contrastive_loss(y_true, y_pred):
        square_pred = ops.square(y_pred)
        margin_square = ops.square(ops.maximum(margin - (y_pred), 0))
        losses = (1 - y_true) * square_pred + (y_true) * margin_square
        # The example returns the batch mean (one value per batch); per_example returns
        # one value per pair, which Keras then averages: the same loss and gradient.
        return losses if per_example else ops.mean(losses)

    return contrastive_loss


def euclidean_distance(vects):
    x, y = vects
    sum_square = ops.sum(ops.square(x - y), axis=1, keepdims=True)
    return ops.sqrt(ops.maximum(sum_square, keras.backend.epsilon()))


def siamese(batch_norm, per_example=False):
    def norm(x):
        return layers.BatchNormalization()(x) if batch_norm else x

    side = 16
    inp = keras.layers.Input((side, side, 1))
    x = norm(inp)
    x = keras.layers.Conv2D(4, (5, 5), activation="tanh")(x)
    x = keras.layers.AveragePooling2D(pool_size=(2, 2))(x)
    x = keras.layers.Conv2D(8, (3, 3), activation="tanh")(x)
    x = keras.layers.AveragePooling2D(pool_size=(2, 2))(x)
    x = keras.layers.Flatten()(x)
    x = norm(x)
    x = keras.layers.Dense(10, activation="tanh")(x)
    embedding_network = keras.Model(inp, x)
    input_1 = keras.layers.Input((side, side, 1))
    input_2 = keras.layers.Input((side, side, 1))
    tower_1 = embedding_network(input_1)
    tower_2 = embedding_network(input_2)
    merge_layer = keras.layers.Lambda(euclidean_distance, output_shape=(1,))(
        [tower_1, tower_2])
    normal_layer = norm(merge_layer)
    output_layer = keras.layers.Dense(1, activation="sigmoid")(normal_layer)
    model = keras.Model(inputs=[input_1, input_2], outputs=output_layer)
    model.compile(loss=loss(margin=1, per_example=per_example), optimizer="RMSprop",
                  metrics=["accuracy"])
    return model


def pairs(n, seed=0):
    rng = np.random.default_rng(seed)
    x1 = rng.uniform(0, 1, size=(n, 16, 16, 1)).astype("float32")
    x2 = rng.uniform(0, 1, size=(n, 16, 16, 1)).astype("float32")
    return x1, x2, rng.integers(0, 2, size=(n, 1)).astype("float32")


def test_siamese_contrastive_as_written_with_batch_norm_runs():
    n, batch, micro = 64, 32, 12
    x1, x2, labels = pairs(n)
    model = siamese(batch_norm=True)
    with pytest.warns(UserWarning, match="ghost batch norm"):
        history = autosplit.fit_large_batch(model, [x1, x2], labels, batch_size=batch,
                                            micro_batch_size=micro, epochs=2,
                                            shuffle=False, verbose=0).history
    assert_runs(model, history, steps=steps(n, batch, 2))


@pytest.mark.parametrize("per_example", [True, False],
                         ids=["per_example_loss", "batch_mean_loss"])
def test_siamese_contrastive_without_batch_norm(per_example):
    # B=32 cut into 3 micro-batches of 11: one padding row (weight 0) in every large
    # batch. The example's loss returns one value per batch, a mean over the rows: it
    # runs on micro-batches of real rows only, weighed by rows, and is exact (no warning).
    n, batch, micro = 64, 32, 12
    x1, x2, labels = pairs(n)
    reference, candidate = twins(lambda: siamese(batch_norm=False, per_example=per_example))
    expected, got = fit_both(reference, candidate, [x1, x2], labels, batch_size=batch,
                             micro_batch_size=micro, epochs=2)
    assert_same_training(reference, candidate, expected, got, rtol=ADAM_RTOL,
                         steps=steps(n, batch, 2))


# siamese_network.py: (anchor, positive, negative) images through one embedding network
# (ResNet50 and Dense layers there; a small CNN here), a DistanceLayer returning the two
# squared distances, and SiameseModel, whose train_step takes the gradient of the
# per-triplet loss vector max(ap - an + margin, 0) (tape.gradient sums it), with
# Adam(1e-4) on batches of 32 triplets from a tf.data pipeline that yields the three
# images as one tuple.
class DistanceLayer(layers.Layer):
    def call(self, anchor, positive, negative):
        ap_distance = ops.sum(ops.square(anchor - positive), -1)
        an_distance = ops.sum(ops.square(anchor - negative), -1)
        return (ap_distance, an_distance)


class SiameseModel(keras.Model):
    def __init__(self, siamese_network, margin=0.5):
        super().__init__()
        self.siamese_network = siamese_network
        self.margin = margin
        self.loss_tracker = keras.metrics.Mean(name="loss")

    def call(self, inputs):
        return self.siamese_network(inputs)

    def train_step(self, data):
        with tf.GradientTape() as tape:
            loss = self._compute_loss(data)
        gradients = tape.gradient(loss, self.siamese_network.trainable_weights)
        self.optimizer.apply_gradients(
            zip(gradients, self.siamese_network.trainable_weights, strict=True))
        self.loss_tracker.update_state(loss)
        return {"loss": self.loss_tracker.result()}

    def test_step(self, data):
        loss = self._compute_loss(data)
        self.loss_tracker.update_state(loss)
        return {"loss": self.loss_tracker.result()}

    def _compute_loss(self, data):
        ap_distance, an_distance = self.siamese_network(data)
        return ops.maximum(ap_distance - an_distance + self.margin, 0.0)

    @property
    def metrics(self):
        return [self.loss_tracker]


def siamese_triplets():
    side = 12
    base = keras.Sequential([keras.Input((side, side, 3)),
                             layers.Conv2D(4, 3, activation="relu"), layers.Flatten(),
                             # Both distances cancel a bias that shifts the three
                             # embeddings alike: the last one, and a relu unit's that is
                             # active on every image (many, on images this uniform). Its
                             # gradient is then rounding noise, which Adam scales to full
                             # steps of either sign: model.fit itself moved 0.08-0.18 on
                             # such a bias when the rows of each batch were reordered.
                             # So tanh here, and no last bias.
                             layers.Dense(16, activation="tanh"),
                             layers.Dense(8, use_bias=False)])
    anchor, positive, negative = (layers.Input((side, side, 3), name=name)
                                  for name in ("anchor", "positive", "negative"))
    distances = DistanceLayer()(base(anchor), base(positive), base(negative))
    network = keras.Model(inputs=[anchor, positive, negative], outputs=distances)
    model = SiameseModel(network)
    model.compile(optimizer=keras.optimizers.Adam(0.01))
    return model


def test_siamese_triplet_step_on_the_loss_vector():
    # tape.gradient of a vector is the gradient of its sum: model.fit's step is the sum
    # over the batch's triplets, not their mean. Weighed as a mean (n / B), the update
    # was 1/k of model.fit's (0.25 at k = 4), silently. 80 triplets in batches of 32:
    # 32, 32 and a short 16, cut into micro-batches of at most 10.
    n, batch, micro = 80, 32, 10
    rng = np.random.default_rng(0)
    triplets = tuple(rng.uniform(0, 1, size=(n, 12, 12, 3)).astype("float32")
                     for _ in range(3))
    train = tf.data.Dataset.from_tensor_slices(triplets).batch(batch)
    val = tf.data.Dataset.from_tensor_slices(tuple(t[:40] for t in triplets)).batch(batch)
    reference, candidate = twins(siamese_triplets, build=lambda model: model(
        tuple(t[:2] for t in triplets)))
    expected, got = fit_both(reference, candidate, train, batch_size=batch,
                             micro_batch_size=micro, epochs=2, validation_data=val)
    assert set(expected) == {"loss", "val_loss"}
    assert_same_training(reference, candidate, expected, got, rtol=ADAM_RTOL,
                         steps=steps(n, batch, 2))
