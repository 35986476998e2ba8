"""Vision examples from keras.io, shrunk, trained with model.fit and with fit_large_batch.

- mnist_convnet.py: a small convnet.
- image_classification_with_vision_transformer.py: a ViT with its augmentation inside the
  model (random layers: not exact by nature), and the same ViT without augmentation.
- guides/transfer_learning.py: a frozen base with BatchNormalization, a new head, then
  fine-tuning: ``base.trainable = True``, a second ``compile(Adam(1e-5))``, fit again.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
from _compare import (
    ADAM_RTOL,
    assert_exact,
    assert_runs,
    assert_same_training,
    fit_both,
    steps,
    twins,
)
from keras import layers, ops

import autosplit


def images(n, shape, classes, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.uniform(0, 1, size=(n, *shape)).astype("float32"),
            rng.integers(0, classes, size=(n,)).astype("int32"))


# mnist_convnet.py: 28x28 digits, one-hot labels, Adam, batch 128 (here 60 split by 25).
def test_mnist_convnet():
    num_classes, n, batch, micro = 10, 120, 60, 25
    x, labels = images(n, (28, 28, 1), num_classes)
    y = keras.utils.to_categorical(labels, num_classes)

    def make():
        model = keras.Sequential([
            keras.Input(shape=(28, 28, 1)),
            layers.Conv2D(8, kernel_size=(3, 3), activation="relu"),
            layers.MaxPooling2D(pool_size=(2, 2)),
            layers.Conv2D(16, kernel_size=(3, 3), activation="relu"),
            layers.MaxPooling2D(pool_size=(2, 2)),
            layers.Flatten(),
            layers.Dropout(0.0),  # 0.5 in the example
            layers.Dense(num_classes, activation="softmax"),
        ])
        model.compile(loss="categorical_crossentropy", optimizer="adam",
                      metrics=["accuracy"])
        return model

    assert_exact(make, x, y, n=n, batch_size=batch, micro_batch_size=micro,
                 rtol=ADAM_RTOL)


# image_classification_with_vision_transformer.py: CIFAR-100 at 32x32 resized to 72, 6x6
# patches, 8 transformer blocks; here 32x32 resized to 24, 6x6 patches (16), 1 block.
IMAGE_SIZE, PATCH_SIZE, PROJECTION_DIM, NUM_HEADS = 24, 6, 16, 2
NUM_PATCHES = (IMAGE_SIZE // PATCH_SIZE) ** 2


class Patches(layers.Layer):
    def __init__(self, patch_size):
        super().__init__()
        self.patch_size = patch_size

    def call(self, images):
        input_shape = ops.shape(images)
        batch_size = input_shape[0]
        height, width, channels = input_shape[1], input_shape[2], input_shape[3]
        num_patches_h = height // self.patch_size
        num_patches_w = width // self.patch_size
        patches = keras.ops.image.extract_patches(images, size=self.patch_size)
        return ops.reshape(patches, (batch_size, num_patches_h * num_patches_w,
                                     self.patch_size * self.patch_size * channels))


class PatchEncoder(layers.Layer):
    def __init__(self, num_patches, projection_dim):
        super().__init__()
        self.num_patches = num_patches
        self.projection = layers.Dense(units=projection_dim)
        self.position_embedding = layers.Embedding(input_dim=num_patches,
                                                   output_dim=projection_dim)

    def call(self, patch):
        positions = ops.expand_dims(ops.arange(start=0, stop=self.num_patches, step=1), axis=0)
        return self.projection(patch) + self.position_embedding(positions)


def mlp(x, hidden_units, dropout_rate):
    for units in hidden_units:
        x = layers.Dense(units, activation=keras.activations.gelu)(x)
        x = layers.Dropout(dropout_rate)(x)
    return x


def vision_transformer(x_train, augment, num_classes=10):
    if augment:
        data_augmentation = keras.Sequential([
            layers.Normalization(),
            layers.Resizing(IMAGE_SIZE, IMAGE_SIZE),
            layers.RandomFlip("horizontal"),
            layers.RandomRotation(factor=0.02),
            layers.RandomZoom(height_factor=0.2, width_factor=0.2),
        ], name="data_augmentation")
    else:
        data_augmentation = keras.Sequential([
            layers.Normalization(), layers.Resizing(IMAGE_SIZE, IMAGE_SIZE)],
            name="data_preprocessing")
    data_augmentation.layers[0].adapt(x_train)
    inputs = keras.Input(shape=x_train.shape[1:])
    augmented = data_augmentation(inputs)
    encoded_patches = PatchEncoder(NUM_PATCHES, PROJECTION_DIM)(Patches(PATCH_SIZE)(augmented))
    for _ in range(1):
        x1 = layers.LayerNormalization(epsilon=1e-6)(encoded_patches)
        # use_bias=False: the key projection's bias has a zero gradient (softmax ignores
        # it), and Adam turns that zero's rounding noise into full-size steps, differently
        # for any two summation orders (model.fit's own included).
        attention_output = layers.MultiHeadAttention(
            num_heads=NUM_HEADS, key_dim=PROJECTION_DIM, dropout=0.0, use_bias=False)(x1, x1)
        x2 = layers.Add()([attention_output, encoded_patches])
        x3 = layers.LayerNormalization(epsilon=1e-6)(x2)
        x3 = mlp(x3, hidden_units=[PROJECTION_DIM * 2, PROJECTION_DIM], dropout_rate=0.0)
        encoded_patches = layers.Add()([x3, x2])
    representation = layers.LayerNormalization(epsilon=1e-6)(encoded_patches)
    representation = layers.Flatten()(representation)
    representation = layers.Dropout(0.0)(representation)
    features = mlp(representation, hidden_units=[32, 16], dropout_rate=0.0)
    logits = layers.Dense(num_classes)(features)
    model = keras.Model(inputs=inputs, outputs=logits)
    model.compile(
        optimizer=keras.optimizers.AdamW(learning_rate=0.001, weight_decay=0.0001),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy"),
                 keras.metrics.SparseTopKCategoricalAccuracy(5, name="top-5-accuracy")])
    return model


@pytest.mark.slow
def test_vision_transformer_with_augmentation_in_the_model_runs():
    # RandomFlip/RandomRotation/RandomZoom draw per micro-batch: equal in distribution
    # only, so this checks that it trains, not that it equals model.fit.
    n, batch, micro = 80, 40, 15
    x, y = images(n, (32, 32, 3), 10)
    model = vision_transformer(x, augment=True)
    history = autosplit.fit_large_batch(model, x, y, batch_size=batch, micro_batch_size=micro,
                                        epochs=2, shuffle=False, verbose=0).history
    assert_runs(model, history, steps=steps(n, batch, 2))
    assert set(history) == {"loss", "accuracy", "top-5-accuracy"}


@pytest.mark.slow
def test_vision_transformer_without_augmentation_equals_model_fit():
    n, batch, micro = 80, 40, 15
    x, y = images(n, (32, 32, 3), 10)
    reference, candidate = twins(lambda: vision_transformer(x, augment=False))
    expected, got = fit_both(reference, candidate, x, y, batch_size=batch,
                             micro_batch_size=micro, epochs=2)
    assert_same_training(reference, candidate, expected, got, rtol=ADAM_RTOL,
                         steps=steps(n, batch, 2))


# guides/transfer_learning.py: Xception (BatchNormalization inside) frozen, called with
# training=False, a new head trained with Adam(), then the base unfrozen and the whole
# model recompiled with Adam(1e-5) and trained again. The guide keeps BatchNormalization in
# inference mode while fine-tuning by calling the base with training=False; in Keras 3 a
# functional model passes its own training flag down to nested layers, so model.fit would
# update the moving statistics (ghost batch norm under a split: not exact). The
# BatchNormalization layers stay frozen instead, which Keras 3 runs in inference mode:
# both phases are then exact.
def base_with_batch_norm():
    inputs = keras.Input((24, 24, 3))
    x = layers.Conv2D(8, 3, strides=2, use_bias=False)(inputs)
    x = layers.BatchNormalization()(x)
    x = layers.Activation("relu")(x)
    x = layers.SeparableConv2D(16, 3, padding="same", use_bias=False)(x)
    x = layers.BatchNormalization()(x)
    x = layers.Activation("relu")(x)
    return keras.Model(inputs, x, name="base")


def transfer_model():
    base_model = base_with_batch_norm()
    base_model.trainable = False
    inputs = keras.Input(shape=(24, 24, 3))
    scale_layer = keras.layers.Rescaling(scale=1 / 127.5, offset=-1)
    x = scale_layer(inputs)
    x = base_model(x, training=False)
    x = keras.layers.GlobalAveragePooling2D()(x)
    x = keras.layers.Dropout(0.0)(x)  # 0.2 in the guide
    outputs = keras.layers.Dense(1)(x)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.Adam(),
                  loss=keras.losses.BinaryCrossentropy(from_logits=True),
                  metrics=[keras.metrics.BinaryAccuracy()])
    return model


def fine_tune(model):
    base = model.get_layer("base")
    base.trainable = True
    for layer in base.layers:
        if isinstance(layer, layers.BatchNormalization):
            layer.trainable = False
    model.compile(optimizer=keras.optimizers.Adam(1e-5),
                  loss=keras.losses.BinaryCrossentropy(from_logits=True),
                  metrics=[keras.metrics.BinaryAccuracy()])


def test_transfer_learning_then_fine_tuning_after_recompile():
    n, batch, micro = 90, 45, 20
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 255, size=(n, 24, 24, 3)).astype("float32")
    y = rng.integers(0, 2, size=(n, 1)).astype("float32")
    reference, candidate = twins(transfer_model)
    # The frozen base's BatchNormalization statistics: non-trivial, as after pretraining.
    base = reference.get_layer("base")
    weights = [w + rng.uniform(0.1, 0.5, size=w.shape).astype("float32")
               for w in base.get_weights()]
    for model in (reference, candidate):
        model.get_layer("base").set_weights(weights)
    expected, got = fit_both(reference, candidate, x, y, batch_size=batch,
                             micro_batch_size=micro, epochs=2)
    assert_same_training(reference, candidate, expected, got, rtol=ADAM_RTOL,
                         steps=steps(n, batch, 2))
    head = len(reference.trainable_weights)
    for model in (reference, candidate):
        fine_tune(model)
    assert len(reference.trainable_weights) > head
    expected, got = fit_both(reference, candidate, x, y, batch_size=batch,
                             micro_batch_size=micro, epochs=1)
    assert_same_training(reference, candidate, expected, got, rtol=ADAM_RTOL,
                         steps=steps(n, batch, 1))
    # The moving statistics never moved: inference mode in both phases.
    np.testing.assert_array_equal(candidate.get_layer("base").get_weights()[2], weights[2])
