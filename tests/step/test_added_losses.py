"""Models whose loss comes from ``add_loss`` in ``call()`` (the Keras endpoint-layer
pattern): compiled with no ``loss=``, targets passed as inputs, exact under an uneven
split, padding rows never inside a layer's own mean. Reference: ``model.fit``.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from common import relative_error

import autosplit
from autosplit.errors import DatasetError, ModelNotReadyError

N, B, M = 200, 100, 40  # 3 micro-batches of 34: 2 padding rows in the last


class Endpoint(keras.layers.Layer):
    """Computes the loss from targets and predictions and adds it (per-example mean)."""

    def call(self, targets, logits):
        loss = keras.losses.sparse_categorical_crossentropy(targets, logits, from_logits=True)
        self.add_loss(keras.ops.mean(loss))
        return keras.ops.softmax(logits)


def endpoint_model():
    features = keras.Input((6,), name="features")
    targets = keras.Input((), dtype="int32", name="targets")
    logits = keras.layers.Dense(3)(keras.layers.Dense(12, activation="tanh")(features))
    model = keras.Model({"features": features, "targets": targets},
                        Endpoint()(targets, logits))
    model.compile(optimizer=keras.optimizers.Adam(0.01))  # no loss=: add_loss only
    return model


def data(n=N, seed=0):
    r = np.random.default_rng(seed)
    x = r.normal(size=(n, 6)).astype("float32")
    return {"features": x, "targets": (x[:, 0] > 0).astype("int32") + (x[:, 1] > 1)}


def twins(make):
    reference, candidate = make(), make()
    candidate.set_weights(reference.get_weights())
    return reference, candidate


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["arrays", "dataset"])
def test_endpoint_layer_model_equals_model_fit(kind):
    inputs, val = data(), data(60, seed=1)
    reference, candidate = twins(endpoint_model)
    if kind == "arrays":
        ref_args, args = (inputs,), (inputs,)
    else:
        ds = tf.data.Dataset.from_tensor_slices(inputs)
        ref_args, args = (ds.batch(B),), (ds,)
    expected = reference.fit(*ref_args, batch_size=None if kind == "dataset" else B,
                             epochs=2, shuffle=False, verbose=0, validation_data=(val,))
    with pytest.warns(UserWarning, match="adds losses in call"):
        got = autosplit.fit_large_batch(candidate, *args, batch_size=B, micro_batch_size=M,
                                        epochs=2, shuffle=False, verbose=0,
                                        validation_data=(val,))
    assert got.autosplit.padded_rows == 2
    assert relative_error(reference.get_weights(), candidate.get_weights()) <= 1e-4
    assert relative_error([v.numpy() for v in reference.optimizer.variables],
                          [v.numpy() for v in candidate.optimizer.variables]) <= 1e-4
    for name in ("loss", "val_loss"):
        np.testing.assert_allclose(got.history[name], expected.history[name], rtol=1e-4,
                                   err_msg=name)


class SummedEndpoint(keras.layers.Layer):
    """keras-io's CTC endpoint (captcha_ocr, handwriting_recognition): add_loss of one
    value per example, shape (batch, 1), which Keras sums; or ops.sum of them."""

    def __init__(self, vector, **kwargs):
        super().__init__(**kwargs)
        self.vector = vector

    def call(self, targets, logits):
        loss = keras.losses.sparse_categorical_crossentropy(targets, logits, from_logits=True)
        self.add_loss(keras.ops.expand_dims(loss, -1) if self.vector else keras.ops.sum(loss))
        return keras.ops.softmax(logits)


@pytest.mark.slow
@pytest.mark.parametrize("vector", [True, False], ids=["per_example_vector", "ops_sum"])
def test_an_added_loss_summed_over_the_rows_equals_model_fit(vector):
    # A sum over the rows: each micro-batch's sum counts whole. Before, the vector
    # crashed in the graph ("Shapes must be equal rank"), also at m = B, and ops.sum was
    # weighed as a mean: k times too small.
    def make():
        keras.utils.set_random_seed(0)
        features = keras.Input((6,), name="features")
        targets = keras.Input((), dtype="int32", name="targets")
        logits = keras.layers.Dense(3)(keras.layers.Dense(12, activation="tanh")(features))
        model = keras.Model({"features": features, "targets": targets},
                            SummedEndpoint(vector)(targets, logits))
        model.compile(optimizer=keras.optimizers.SGD(0.002))
        return model

    inputs, val = data(230), data(60, seed=1)  # large batches of 100, 100 and 30 rows
    reference, candidate = twins(make)
    expected = reference.fit(inputs, batch_size=B, epochs=2, shuffle=False, verbose=0,
                             validation_data=(val,), validation_batch_size=40)
    got = autosplit.fit_large_batch(candidate, inputs, batch_size=B, micro_batch_size=M,
                                    epochs=2, shuffle=False, verbose=0,
                                    validation_data=(val,), validation_batch_size=40)
    assert relative_error(reference.get_weights(), candidate.get_weights()) <= 1e-5
    assert int(candidate.optimizer.iterations) == int(reference.optimizer.iterations) == 6
    for name in ("loss", "val_loss"):
        np.testing.assert_allclose(got.history[name], expected.history[name], rtol=1e-5,
                                   err_msg=name)


class TrainingOnlyPenalty(keras.layers.Layer):
    def call(self, h, training=None):
        if training:
            self.add_loss(0.01 * keras.ops.mean(keras.ops.square(h)))
        return h


class PerRowPenalty(keras.layers.Layer):
    def call(self, h):
        self.add_loss(0.1 * keras.ops.sum(keras.ops.square(h), axis=1))  # Keras sums it
        return h


class PerUnitPenalty(keras.layers.Layer):
    def call(self, h):
        self.add_loss(0.1 * keras.ops.mean(keras.ops.square(h), axis=0))  # one per unit
        return h


@pytest.mark.slow
@pytest.mark.parametrize("layers", ["training_only_then_per_row", "per_unit_as_many_as_m"])
def test_added_losses_are_told_apart_by_what_they_are_not_where_they_stand(layers):
    # Validation matched the losses of a training-mode trace by position, so behind a
    # penalty added only in training a per-row loss was read as a mean (val_loss 3.31
    # against model.fit's 9.85); and a vector of one value per unit, 16 units at m = 16,
    # was read as one per row and counted whole per micro-batch (k times too large).
    def make():
        keras.utils.set_random_seed(1)
        inputs = keras.Input((4,))
        hidden = keras.layers.Dense(16)(inputs)
        if layers == "training_only_then_per_row":
            hidden = PerRowPenalty()(TrainingOnlyPenalty()(hidden))
        else:
            hidden = PerUnitPenalty()(hidden)
        model = keras.Model(inputs, keras.layers.Dense(1)(hidden))
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
        return model

    r = np.random.default_rng(0)
    x, y = r.normal(size=(128, 4)).astype("float32"), r.normal(size=(128, 1)).astype("float32")
    val = (r.normal(size=(64, 4)).astype("float32"), r.normal(size=(64, 1)).astype("float32"))
    reference, candidate = twins(make)
    expected = reference.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0,
                             validation_data=val)
    got = autosplit.fit_large_batch(candidate, x, y, batch_size=64, micro_batch_size=16,
                                    epochs=2, shuffle=False, verbose=0, validation_data=val)
    assert relative_error(reference.get_weights(), candidate.get_weights()) <= 1e-5
    for name in ("loss", "val_loss"):
        np.testing.assert_allclose(got.history[name], expected.history[name], rtol=1e-5,
                                   err_msg=name)


@pytest.mark.slow
def test_added_loss_next_to_a_compiled_loss_under_xla():
    """A per-example-mean added loss plus a compiled one, jit-compiled: the short
    micro-batch without its padding is a second compiled shape."""
    class Penalty(keras.layers.Layer):
        def call(self, h):
            self.add_loss(0.1 * keras.ops.mean(keras.ops.square(h)))
            return h

    def make():
        inputs = keras.Input((6,))
        h = Penalty()(keras.layers.Dense(8, activation="relu")(inputs))
        model = keras.Model(inputs, keras.layers.Dense(1)(h))
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", jit_compile=True)
        return model

    r = np.random.default_rng(3)
    x = r.normal(size=(N, 6)).astype("float32")
    y = r.normal(size=(N, 1)).astype("float32")
    reference, candidate = twins(make)
    expected = reference.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    with pytest.warns(UserWarning, match="adds losses in call"):
        got = autosplit.fit_large_batch(candidate, x, y, batch_size=B, micro_batch_size=M,
                                        shuffle=False, verbose=0)
    assert relative_error(reference.get_weights(), candidate.get_weights()) <= 1e-5
    np.testing.assert_allclose(got.history["loss"], expected.history["loss"], rtol=1e-5)


def test_no_loss_at_all_is_refused_before_anything_changes():
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
    model.compile(optimizer="sgd")
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(ModelNotReadyError, match="add_loss"):
        autosplit.fit_large_batch(model, data()["features"], np.zeros(N), batch_size=B,
                                  micro_batch_size=M, verbose=0)
    for a, b in zip(before, model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_compiled_loss_without_targets_is_refused():
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(DatasetError, match="targets"):
        autosplit.fit_large_batch(model, data()["features"], batch_size=B,
                                  micro_batch_size=M, verbose=0)
