"""Every input structure ``model.fit`` accepts (lists, tuples, dicts, nested), on every
input path, equal to ``model.fit``; and inputs whose parts do not share a row count are
refused before anything runs.
"""

from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from common import relative_error

import autosplit
from autosplit.errors import DatasetError

N, B, M = 90, 45, 20  # 3 micro-batches of 15


def two_inputs(same_shape: bool):
    a = keras.Input((5,), name="a")
    b = keras.Input((5,) if same_shape else (3, 4), name="b")
    hb = b if same_shape else keras.layers.Flatten()(b)
    h = keras.layers.Concatenate()([keras.layers.Dense(6)(a), keras.layers.Dense(6)(hb)])
    model = keras.Model([a, b], keras.layers.Dense(3)(h))
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def data(same_shape: bool, n=N):
    r = np.random.default_rng(0)
    xa = r.normal(size=(n, 5)).astype("float32")
    xb = r.normal(size=(n, 5) if same_shape else (n, 3, 4)).astype("float32")
    return xa, xb, r.integers(0, 3, size=(n,)).astype("int32")


class Batches(keras.utils.PyDataset):
    def __init__(self, xa, xb, y, size):
        super().__init__()
        self.xa, self.xb, self.y, self.size = xa, xb, y, size

    def __len__(self):
        return len(self.y) // self.size

    def __getitem__(self, i):
        s = slice(i * self.size, (i + 1) * self.size)
        return (self.xa[s], self.xb[s]), self.y[s]  # model.fit refuses a list here


def feeds(kind, xa, xb, y):
    """(positional args of model.fit, of fit_large_batch) for one input kind."""
    if kind == "list":
        return ([xa, xb], y), ([xa, xb], y)
    if kind == "dict":
        return ({"a": xa, "b": xb}, y), ({"a": xa, "b": xb}, y)
    if kind == "dataset":
        ds = tf.data.Dataset.from_tensor_slices(((xa, xb), y))
        return (ds.batch(B),), (ds,)
    if kind == "pydataset":
        return (Batches(xa, xb, y, B),), (Batches(xa, xb, y, 15),)

    def generator(size, kind):
        for i in range(0, N, size):
            yield kind([xa[i:i + size], xb[i:i + size]]), y[i:i + size]
    # model.fit refuses a generator that yields a list of inputs; autosplit takes it.
    return (generator(B, tuple),), (generator(15, list),)


@pytest.mark.slow
@pytest.mark.parametrize("same_shape", [True, False], ids=["same-shape", "other-shape"])
@pytest.mark.parametrize("kind", ["list", "dict", "dataset", "pydataset", "generator"])
def test_multi_input_structures_equal_model_fit(kind, same_shape):
    xa, xb, y = data(same_shape)
    reference, candidate = two_inputs(same_shape), two_inputs(same_shape)
    candidate.set_weights(reference.get_weights())
    ref_args, args = feeds(kind, xa, xb, y)
    batch = {} if kind in ("dataset", "pydataset", "generator") else {"batch_size": B}
    with warnings.catch_warnings():
        # model.fit warns that a generator "ran out of data" at the end of its one epoch
        # (it learns the steps only then): the reference's quirk, not what is compared.
        warnings.simplefilter("ignore")
        expected = reference.fit(*ref_args, shuffle=False, verbose=0, **batch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = autosplit.fit_large_batch(candidate, *args, batch_size=B, micro_batch_size=M,
                                        shuffle=False, verbose=0)
    assert not [w for w in caught if "ran out of data" in str(w.message)]
    assert relative_error(reference.get_weights(), candidate.get_weights()) <= 1e-5
    for name, values in expected.history.items():
        np.testing.assert_allclose(got.history[name], values, rtol=1e-5, err_msg=name)


@pytest.mark.slow
def test_list_targets_and_weights_of_a_multi_output_model():
    inputs = keras.Input((5,))
    h = keras.layers.Dense(8, activation="relu")(inputs)
    model_fn = lambda: keras.Model(inputs, [keras.layers.Dense(1)(h),  # noqa: E731
                                            keras.layers.Dense(2)(h)])
    reference = model_fn()
    candidate = keras.models.clone_model(reference)
    candidate.set_weights(reference.get_weights())
    for model in (reference, candidate):
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss=["mse", "mae"],
                      loss_weights=[1.0, 0.3])
    r = np.random.default_rng(2)
    x = r.normal(size=(N, 5)).astype("float32")
    ys = [r.normal(size=(N, 1)).astype("float32"), r.normal(size=(N, 2)).astype("float32")]
    w = r.uniform(0.5, 1.5, size=(N,)).astype("float32")
    expected = reference.fit(x, ys, sample_weight=[w, w], batch_size=B, shuffle=False,
                             verbose=0)
    got = autosplit.fit_large_batch(candidate, x, ys, sample_weight=[w, w], batch_size=B,
                                    micro_batch_size=M, shuffle=False, verbose=0)
    assert relative_error(reference.get_weights(), candidate.get_weights()) <= 1e-5
    np.testing.assert_allclose(got.history["loss"], expected.history["loss"], rtol=1e-5)


def graph_batches():
    """Batches in which atoms, bonds and labels have different numbers of rows (a merged
    molecular graph, as in the Keras MPNN example)."""
    for _ in range(3):
        yield (np.ones((11, 4), "float32"), np.ones((20, 2), "float32")), np.ones((3, 1))


@pytest.mark.parametrize("kind", ["dataset", "generator"])
def test_parts_without_a_shared_row_count_are_refused(kind):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    before = [w.copy() for w in model.get_weights()]
    if kind == "dataset":
        def merged(_):
            return (tf.ones((11, 4)), tf.ones((20, 2))), tf.ones((3, 1))
        data = tf.data.Dataset.range(3).batch(1).map(merged)
    else:
        data = graph_batches()
    with pytest.raises(DatasetError, match="same number of rows") as info:
        autosplit.fit_large_batch(model, data, batch_size=4, micro_batch_size=2, verbose=0)
    assert "11" in str(info.value) and "20" in str(info.value) and "3" in str(info.value)
    for a, b in zip(before, model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_a_later_batch_without_a_shared_row_count_stops_training():
    # The first batch is checked before anything changes (above); a later one is
    # refused by the pipeline's rebatch, which checks every batch, with tf.data's error.
    def later_batch_differs(index):
        return tf.ones((4, 4)), tf.ones((4 - tf.cast(index[0] > 0, tf.int32), 1))

    data = tf.data.Dataset.range(8).batch(4).map(later_batch_differs)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(tf.errors.InvalidArgumentError, match="same batch size"):
        autosplit.fit_large_batch(model, data, batch_size=8, micro_batch_size=2, verbose=0)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["arrays", "dataset"])
def test_a_loss_on_some_outputs_only_takes_one_target_per_loss(kind):
    # keras-io's miniature GPT: outputs [logits, hidden], loss=[fn, None], one target.
    # Keras matches the target to the output with a loss; autosplit packed it against
    # every output and stopped ("Too few leaves for PyTreeSpec").
    def make():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((4,))
        hidden = keras.layers.Dense(8)(inputs)
        model = keras.Model(inputs, [keras.layers.Dense(1, name="out")(hidden), hidden])
        model.compile(keras.optimizers.SGD(0.05), loss=["mse", None], metrics=[["mae"], None])
        return model

    r = np.random.default_rng(0)
    x = r.normal(size=(N, 4)).astype("float32")
    y = x.sum(1, keepdims=True)
    data = ((x, y) if kind == "arrays"
            else (tf.data.Dataset.from_tensor_slices((x, y)).batch(10),))
    reference, candidate = make(), make()
    expected = reference.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0,
                             validation_data=(x[:30], y[:30]))
    got = autosplit.fit_large_batch(candidate, *data, batch_size=B, micro_batch_size=M,
                                    epochs=2, shuffle=False, verbose=0,
                                    validation_data=(x[:30], y[:30]))
    assert relative_error(reference.get_weights(), candidate.get_weights()) < 1e-5
    assert set(got.history) == set(expected.history)
    for name, values in expected.history.items():
        np.testing.assert_allclose(got.history[name], values, rtol=1e-5, err_msg=name)
