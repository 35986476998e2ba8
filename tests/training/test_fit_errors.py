"""fit_large_batch on bad input: typed errors that say what was expected, raised before
anything changes."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from _fit import data, make_mlp
from common import assert_weights_close

import autosplit
from autosplit.errors import (
    ArgumentError,
    BatchSizeError,
    DatasetError,
    MemoryLimitError,
    ModelNotReadyError,
    UnsupportedModelError,
)


@pytest.mark.parametrize("value", [0, -4, 2.5, "64", None, True, np.float32(8)])
@pytest.mark.parametrize("name", ["batch_size", "micro_batch_size"])
def test_bad_sizes(name, value):
    model = make_mlp()
    model.build((None, 6))
    before = [w.copy() for w in model.get_weights()]
    kwargs = {"batch_size": 64, "micro_batch_size": 16, name: value}
    with pytest.raises(BatchSizeError, match=rf"Expected `{name}` to be a positive integer"):
        autosplit.fit_large_batch(model, data(), verbose=0, **kwargs)
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights(), strict=True))


def test_numpy_integer_sizes_are_accepted():
    x, y = data(40)
    h = autosplit.fit_large_batch(make_mlp(), (x, y), batch_size=np.int64(20),
                                  micro_batch_size=np.int32(10), verbose=0)
    assert h.autosplit.accumulation_steps == 2


def test_micro_batch_at_least_batch_means_no_split():
    x, y = data(40)
    h = autosplit.fit_large_batch(make_mlp(), (x, y), batch_size=20, micro_batch_size=500,
                                  verbose=0)
    assert h.autosplit.accumulation_steps == 1 and h.autosplit.micro_batch_size == 20


def test_uncompiled_model():
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
    with pytest.raises(ModelNotReadyError, match=r"model\.compile"):
        autosplit.fit_large_batch(model, data(), batch_size=8, micro_batch_size=4)


def test_model_without_loss():
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
    model.compile(optimizer="sgd")
    with pytest.raises(ModelNotReadyError, match="loss"):
        autosplit.fit_large_batch(model, data(), batch_size=8, micro_batch_size=4)


def test_not_a_model():
    with pytest.raises(ModelNotReadyError, match="Received: model="):
        autosplit.fit_large_batch("resnet", data(), batch_size=8, micro_batch_size=4)


def test_model_without_trainable_weights():
    model = make_mlp()
    for layer in model.layers:
        layer.trainable = False
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ModelNotReadyError, match="trainable"):
        autosplit.fit_large_batch(model, data(), batch_size=8, micro_batch_size=4, verbose=0)


def test_custom_train_step_calling_keras_own_equals_model_fit():
    class Custom(keras.Model):
        def train_step(self, data):
            return super().train_step(data)

    def make():
        inputs = keras.Input((6,))
        model = Custom(inputs, keras.layers.Dense(3)(inputs))
        model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
        return model

    x = np.random.default_rng(0).normal(size=(40, 6)).astype("float32")
    y = np.random.default_rng(1).normal(size=(40, 3)).astype("float32")
    reference, model = make(), make()
    model.set_weights(reference.get_weights())
    expected = reference.fit(x, y, batch_size=20, shuffle=False, verbose=0)
    got = autosplit.fit_large_batch(model, x, y, batch_size=20, micro_batch_size=8,
                                    shuffle=False, verbose=0)
    assert_weights_close(reference.get_weights(), model.get_weights(), 1e-5)
    for name, values in expected.history.items():
        np.testing.assert_allclose(got.history[name], values, rtol=1e-5, err_msg=name)


class FixedBatchReshape(keras.layers.Layer):
    """keras-io's Switch Transformer: a reshape to a fixed batch_size * tokens."""

    def call(self, x):
        return keras.ops.reshape(x, (16 * 3, 2))


def test_a_model_that_fixes_the_batch_size_is_refused_typed_with_its_own_error_as_cause():
    inputs = keras.Input((3, 2))
    hidden = FixedBatchReshape()(keras.layers.Dense(2)(inputs))
    outputs = keras.layers.Dense(1)(keras.layers.Reshape((3 * 2,))(
        keras.ops.reshape(hidden, (16, 3, 2))))
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="sgd", loss="mse")
    r = np.random.default_rng(0)
    x, y = r.normal(size=(32, 3, 2)).astype("float32"), r.normal(size=(32, 1)).astype("float32")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)  # model.fit at its batch size: fine
    before = [w.copy() for w in model.get_weights()]
    # The model's own ValueError came out with a note attached: `except
    # autosplit.UnsupportedModelError` missed it.
    with pytest.raises(UnsupportedModelError, match="reshape") as info:
        autosplit.fit_large_batch(model, x, y, batch_size=16, micro_batch_size=6, verbose=0)
    message = str(info.value)
    assert "micro-batches of 6 rows (batch_size=16)" in message
    assert "ops.shape(x)[0]" in message and "__cause__" in message
    assert isinstance(info.value.__cause__, ValueError)
    assert "reshape" in str(info.value.__cause__)
    assert int(model.optimizer.iterations) == 2  # model.fit's two steps, none of ours
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights(), strict=True))


def test_unreduced_loss_is_refused():
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
    model.compile(optimizer="sgd", loss=keras.losses.MeanSquaredError(reduction="none"))
    x = np.zeros((8, 6), "float32")
    with pytest.raises(UnsupportedModelError, match="reduction"):
        autosplit.fit_large_batch(model, (x, x[:, :3]), batch_size=8, micro_batch_size=4,
                                  verbose=0)


@pytest.mark.slow
def test_batched_dataset_is_rebatched_not_refused():
    """A pipeline ending in .batch(n), whatever n, trains exactly like its examples."""
    x, y = data(230)
    examples = tf.data.Dataset.from_tensor_slices((x, y))
    reference = make_mlp()
    reference.build((None, 6))
    initial = reference.get_weights()
    autosplit.fit_large_batch(reference, examples, batch_size=64, micro_batch_size=16,
                              epochs=2, verbose=0)
    for batched in (examples.batch(32), examples.batch(7).map(lambda a, b: (a, b))):
        model = make_mlp()
        model.build((None, 6))
        model.set_weights(initial)
        history = autosplit.fit_large_batch(model, batched, batch_size=64, micro_batch_size=16,
                                            epochs=2, verbose=0)
        assert history.autosplit.input == "batched tf.data.Dataset"
        assert int(model.optimizer.iterations) == 8
        assert_weights_close(reference.get_weights(), model.get_weights(), 1e-5)


@pytest.mark.parametrize(("bad", "message"), [
    # x alone is how models whose loss is added in call() are fed; with a compiled
    # loss it lacks the targets.
    (lambda x, y: tf.data.Dataset.from_tensor_slices(x), "Expected targets `y`"),
    (lambda x, y: tf.data.Dataset.from_tensor_slices({"x": x, "y": y}), "Expected targets"),
    (lambda x, y: tf.data.Dataset.from_tensor_slices((x, y, y, y)),
     r"\(x, y\), \(x, y, sample_weight\) or x alone"),
], ids=["x-only", "dict", "four-items"])
def test_dataset_elements_must_be_x_y_w(bad, message):
    x, y = data(40)
    with pytest.raises(DatasetError, match=message):
        autosplit.fit_large_batch(make_mlp(), bad(x, y), batch_size=16, micro_batch_size=4)


def test_empty_dataset():
    x, y = data(40)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).take(0)
    with pytest.raises(DatasetError, match="non-empty"):
        autosplit.fit_large_batch(make_mlp(), ds, batch_size=16, micro_batch_size=4)
    with pytest.raises(DatasetError, match="non-empty"):
        autosplit.fit_large_batch(make_mlp(), (x[:0], y[:0]), batch_size=16, micro_batch_size=4)


def test_mismatched_array_lengths():
    x, y = data(40)
    with pytest.raises(DatasetError, match="same number of rows"):
        autosplit.fit_large_batch(make_mlp(), (x, y[:39]), batch_size=16, micro_batch_size=4)


def test_not_data_at_all():
    with pytest.raises(DatasetError, match=r"Expected `x` to be arrays or a dataset"):
        autosplit.fit_large_batch(make_mlp(), "data.csv", batch_size=16, micro_batch_size=4)


def test_errors_are_builtin_subclasses():
    assert issubclass(ArgumentError, ValueError)
    assert issubclass(BatchSizeError, ValueError)
    assert issubclass(DatasetError, ValueError)
    assert issubclass(MemoryLimitError, ValueError)
    assert issubclass(ModelNotReadyError, ValueError)
    assert issubclass(UnsupportedModelError, TypeError)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"verbose": 3}, "Expected `verbose` to be 'auto', 0, 1 or 2"),
    ({"on_oom": "ignore"}, "Expected `on_oom` to be one of"),
    ({"shuffle": "yes"}, "Expected `shuffle` to be True, False or 'batch'. Received: "
                         "shuffle='yes'"),
    ({"jit_compile": "xla"}, "Expected `jit_compile` to be None, True or False"),
    ({"validation_split": 1.0}, r"Expected `validation_split` to be a number in \[0, 1\)"),
    ({"epochs": 0}, r"Expected `epochs` to be a positive integer. Received: epochs=0 "
                    r"\(type int\). Pass a whole number such as epochs=1"),
    ({"epochs": 2.0}, "Expected `epochs` to be a positive integer"),
    ({"validation_freq": 0}, "Expected `validation_freq` to be a positive integer"),
    ({"steps_per_epoch": -1}, "Expected `steps_per_epoch` to be a positive integer"),
    ({"validation_steps": True}, "Expected `validation_steps` to be a positive integer"),
    ({"initial_epoch": -1, "epochs": 3}, r"Expected `initial_epoch` to be an int >= 0 "
                                         r"\(epochs=3\). Received: initial_epoch=-1"),
    ({"y": 64}, "Expected targets as the third argument"),
])
def test_bad_arguments_raise_argument_error(kwargs, message):
    """Epochs, steps and choices are not batch sizes: ArgumentError, still a ValueError."""
    model = make_mlp()
    model.build((None, 6))
    before = [w.copy() for w in model.get_weights()]
    x, y = data(16)
    kwargs = {"y": y, **kwargs}
    with pytest.raises(ArgumentError, match=message) as info:
        autosplit.fit_large_batch(model, x, batch_size=8, micro_batch_size=4, **kwargs)
    assert isinstance(info.value, ValueError) and not isinstance(info.value, BatchSizeError)
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights(), strict=True))


@pytest.mark.parametrize("headroom", [1.0, -0.1, "0.1", True])
def test_bad_headroom_is_a_memory_limit_error_in_fit_and_probe(headroom):
    x, y = data(16)
    match = r"Expected `headroom` to be a fraction in \[0, 1\)"
    with pytest.raises(MemoryLimitError, match=match):
        autosplit.fit_large_batch(make_mlp(), x, y, batch_size=8, headroom=headroom)
    with pytest.raises(MemoryLimitError, match=match):
        autosplit.probe(make_mlp(), x, y, batch_size=8, headroom=headroom)
