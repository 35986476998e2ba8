"""fit_large_batch logs as model.fit logs: per-output losses, metrics over the rows
model.fit gives them, validation scored in its own batches. Each test runs plain
``model.fit`` with the same large batch as reference."""

from __future__ import annotations

import math

import keras
import numpy as np
import pytest
import tensorflow as tf
from _parity import B, M, data, mlp, pair
from common import assert_weights_close

import autosplit


def multi_output():
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(16, activation="relu")(inputs)
    model = keras.Model(inputs, {"a": keras.layers.Dense(3, name="a")(hidden),
                                 "b": keras.layers.Dense(2, name="b")(hidden)})
    model.compile(optimizer=keras.optimizers.SGD(0.05),
                  loss={"a": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                        "b": "mse"},
                  loss_weights={"a": 1.0, "b": 0.5}, metrics={"a": ["accuracy"]})
    return model


def exact_validation(model, x, targets):
    """The validation logs as exact means over the examples: Keras's evaluate with equal
    batches (it averages its per-output losses over batches unweighted)."""
    return model.evaluate(x, targets, batch_size=20, verbose=0, return_dict=True)


@pytest.mark.slow
def test_per_output_and_validation_logs_equal_model_fit():
    x, y = data()
    targets = {"a": y, "b": np.stack([x[:, 2], x[:, 3]], axis=1)}
    val = (x[:60], {"a": y[:60], "b": targets["b"][:60]})
    reference, candidate = pair(multi_output)
    expected = reference.fit(x, targets, batch_size=B, epochs=2, shuffle=False,
                             verbose=0).history
    history = autosplit.fit_large_batch(candidate, x, targets, batch_size=B,
                                        micro_batch_size=M, epochs=2, shuffle=False,
                                        validation_data=val, verbose=0).history
    assert set(history) == set(expected) | {f"val_{name}" for name in expected}
    for name in ("a_loss", "b_loss", "val_a_loss", "val_b_loss"):
        assert min(history[name]) > 0.0
    for name, values in expected.items():  # every training log, per output included
        np.testing.assert_allclose(history[name], values, rtol=1e-5, err_msg=name)
    assert_weights_close(reference.get_weights(), candidate.get_weights(), 1e-5)
    exact = exact_validation(reference, *val)
    for name, value in exact.items():  # the last epoch's validation, same weights
        np.testing.assert_allclose(history[f"val_{name}"][-1], value, rtol=1e-5, err_msg=name)


@pytest.mark.slow
def test_validation_split_steps_and_batch_size_as_in_model_fit():
    x, y = data()
    reference, candidate = pair(mlp)
    expected = reference.fit(x, y, batch_size=B, epochs=2, validation_split=0.25,
                             shuffle=False, verbose=0).history
    history = autosplit.fit_large_batch(candidate, x, y, batch_size=B, micro_batch_size=M,
                                        epochs=2, validation_split=0.25, shuffle=False,
                                        verbose=0).history
    for name, values in expected.items():  # the 50 validation rows: one batch in Keras
        np.testing.assert_allclose(history[name], values, rtol=1e-5, err_msg=name)
    assert int(candidate.optimizer.iterations) == 2 * math.ceil(150 / B)
    # validation_steps batches of validation_batch_size: the first 2 * 7 rows.
    history = autosplit.fit_large_batch(candidate, x, y, batch_size=B, micro_batch_size=M,
                                        validation_data=(x[:60], y[:60]), validation_steps=2,
                                        validation_batch_size=7, verbose=0).history
    first = candidate.evaluate(x[:14], y[:14], batch_size=14, verbose=0, return_dict=True)
    for name, value in first.items():
        np.testing.assert_allclose(history[f"val_{name}"][-1], value, rtol=1e-5)


class CategoricalTruePositives(keras.metrics.Metric):
    """The custom metric of Keras's guide "Training & evaluation with the built-in
    methods", as written: it multiplies its values by any sample_weight it is given."""

    def __init__(self, name="categorical_true_positives", **kwargs):
        super().__init__(name=name, **kwargs)
        self.true_positives = self.add_variable(shape=(), name="ctp", initializer="zeros")

    def update_state(self, y_true, y_pred, sample_weight=None):
        y_pred = keras.ops.reshape(keras.ops.argmax(y_pred, axis=1), (-1, 1))
        values = keras.ops.cast(
            keras.ops.cast(y_true, "int32") == keras.ops.cast(y_pred, "int32"), "float32")
        if sample_weight is not None:
            values = keras.ops.multiply(values, keras.ops.cast(sample_weight, "float32"))
        self.true_positives.assign_add(keras.ops.sum(values))

    def result(self):
        # The guide returns the variable itself; model.fit's training log then holds
        # that variable, which its validation resets and refills before the History
        # reads it (the training log shows the validation count). A copy is read here.
        return keras.ops.convert_to_tensor(self.true_positives) * 1.0

    def reset_state(self):
        self.true_positives.assign(0.0)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["custom_metric", "mean_iou"])
def test_metrics_see_the_rows_model_fit_gives_them(case):
    # Metrics were given the padding mask as a sample_weight that model.fit never
    # passes: the guide's CategoricalTruePositives counted m times (1850 against 74)
    # and MeanIoU on per-pixel targets raised (it broadcasts a weight of shape (m,)
    # against m*H*W pixels). They now see a micro-batch's real rows alone, unweighted.
    # m = 7 does not divide B = 25: every large batch ends in a padded micro-batch.
    r = np.random.default_rng(5)
    if case == "custom_metric":
        x, y = r.normal(size=(100, 4)).astype("float32"), r.integers(0, 3, size=(100, 1))
        shape, metric = (4,), CategoricalTruePositives

        def head(inputs):
            return keras.layers.Dense(3, activation="softmax")(inputs)
    else:
        x = r.random((100, 8, 8, 3)).astype("float32")
        y = r.integers(0, 3, size=(100, 8, 8, 1)).astype("uint8")
        shape = (8, 8, 3)

        def metric():
            return keras.metrics.MeanIoU(num_classes=3, sparse_y_pred=False, name="iou")

        def head(inputs):
            return keras.layers.Conv2D(3, 3, padding="same", activation="softmax")(inputs)

    def make():
        keras.utils.set_random_seed(0)
        inputs = keras.Input(shape)
        model = keras.Model(inputs, head(inputs))
        model.compile(keras.optimizers.SGD(0.5), "sparse_categorical_crossentropy",
                      metrics=[metric()])
        return model

    reference, candidate = make(), make()
    candidate.set_weights(reference.get_weights())
    validation = (x[75:], y[75:])
    expected = reference.fit(x[:75], y[:75], batch_size=25, epochs=2, shuffle=False,
                             verbose=0, validation_data=validation)
    got = autosplit.fit_large_batch(candidate, x[:75], y[:75], batch_size=25,
                                    micro_batch_size=7, epochs=2, shuffle=False, verbose=0,
                                    validation_data=validation)
    assert set(got.history) == set(expected.history)
    for name, values in expected.history.items():
        np.testing.assert_allclose(got.history[name], values, rtol=1e-5, err_msg=name)
    assert_weights_close(reference.get_weights(), candidate.get_weights(), 1e-5)


@pytest.mark.slow
def test_validation_split_reads_a_tuple_x_as_without_it():
    # The tuple form (x, y, w) is split as its three parts; a tuple x next to a
    # sample_weight= is not that form, as get_input reads it: before, the split read
    # (x, y) from it and dropped the weights silently (without the split: refused).
    x, y = data()
    w = np.random.default_rng(4).uniform(size=len(x)).astype("float32")
    reference, candidate = pair(mlp)
    expected = reference.fit(x, y, sample_weight=w, batch_size=B, validation_split=0.25,
                             shuffle=False, verbose=0).history
    history = autosplit.fit_large_batch(candidate, (x, y, w), batch_size=B,
                                        micro_batch_size=M, validation_split=0.25,
                                        shuffle=False, verbose=0).history
    for name, values in expected.items():
        np.testing.assert_allclose(history[name], values, rtol=1e-5, err_msg=name)
    for split in ({}, {"validation_split": 0.25}):
        with pytest.raises(autosplit.DatasetError, match="Expected targets `y`"):
            autosplit.fit_large_batch(candidate, (x, y), sample_weight=w, batch_size=B,
                                      micro_batch_size=M, verbose=0, **split)


def tokens(n, seed):
    """Sequences of 1 to 8 tokens padded with 0, the short ones first: validation
    batches hold very different numbers of real tokens."""
    r = np.random.default_rng(seed)
    lengths = np.sort(r.integers(1, 9, size=n))
    x = np.zeros((n, 8), "int32")
    for i, length in enumerate(lengths):
        x[i, :length] = r.integers(1, 20, size=length)
    return x, np.where(x > 0, x % 4 + 1, 0).astype("int32")


def tagger(loss):
    """A token tagger compiled with ``loss``: "mean" (Keras's default reduction),
    "sum" (``reduction="sum"``, with a learning rate scaled down to match),
    "masked tokens" (``ignore_class=0``) or "weighted mean"
    (``mean_with_sample_weight``)."""
    reduction = {"sum": "sum", "weighted mean": "mean_with_sample_weight"}.get(
        loss, "sum_over_batch_size")
    model = keras.Sequential([keras.Input((8,), dtype="int32"),
                              keras.layers.Embedding(20, 8), keras.layers.Dense(5)])
    model.compile(optimizer=keras.optimizers.SGD(0.05 / (B * 8 if loss == "sum" else 1)),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True, reduction=reduction,
                      ignore_class=0 if loss == "masked tokens" else None))
    return model


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["masked tokens", "sum", "weighted mean"])
@pytest.mark.parametrize("val_rows", [100, 90])  # two equal batches; a short last one
def test_val_loss_is_model_fit_s_mean_of_batch_losses(loss, val_rows):
    # model.fit's val_loss is each validation batch's loss, averaged by rows. A loss
    # divided by what is not a count of rows (unmasked tokens, weights) or by nothing
    # (reduction="sum") has a mean over batches that is not its value over the whole
    # set; before, val_loss was that value: masked tokens 0.07 to 0.13 relative off,
    # a summed loss twice model.fit's.
    x, y = tokens(200, 0)
    vx, vy = tokens(val_rows, 1)
    weights = np.linspace(0.1, 2.0, val_rows * 8).reshape(val_rows, 8).astype("float32")
    val = (vx, vy, weights * (vx > 0)) if loss == "weighted mean" else (vx, vy)
    reference, candidate = tagger(loss), tagger(loss)
    for model in (reference, candidate):
        model.build((None, 8))
    candidate.set_weights(reference.get_weights())
    expected = reference.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0,
                             validation_data=val).history
    got = autosplit.fit_large_batch(candidate, x, y, batch_size=B, micro_batch_size=M + 3,
                                    epochs=2, shuffle=False, verbose=0,
                                    validation_data=val).history
    assert_weights_close(reference.get_weights(), candidate.get_weights(), 1e-5)
    np.testing.assert_allclose(got["loss"], expected["loss"], rtol=1e-5)
    np.testing.assert_allclose(got["val_loss"], expected["val_loss"], rtol=1e-5)


class _TestBatches(keras.callbacks.Callback):
    """The validation batches a callback hears, and their logged loss."""

    def __init__(self):
        super().__init__()
        self.heard = []

    def on_test_batch_end(self, batch, logs=None):
        self.heard.append((batch, round(float(logs["loss"]), 4)))


@pytest.mark.slow
@pytest.mark.parametrize(("loss", "listens"), [
    ("sum", None), ("masked tokens", None), ("mean", "subclass"), ("mean", "lambda")])
def test_a_batched_validation_dataset_is_scored_in_its_own_batches(loss, listens):
    # model.fit scores each batch of a batched validation dataset as it comes. Cut into
    # validation batches of B rows across them, a summed loss read 77.3 where model.fit
    # reads 49.0 (.batch(32), B = 64), and a callback heard 2 batches where model.fit
    # calls it 4 times. 100 rows in batches of 30: three whole ones and a short one. A
    # LambdaCallback's hook is an attribute of the instance: it was not heard at all.
    x, y = tokens(200, 0)
    vx, vy = tokens(100, 1)

    def validation():  # a preprocessing map after the batch, as image pipelines have
        return tf.data.Dataset.from_tensor_slices((vx, vy)).batch(30).map(
            lambda a, b: (a, b)).prefetch(2)

    reference, candidate = tagger(loss), tagger(loss)
    for model in (reference, candidate):
        model.build((None, 8))
    candidate.set_weights(reference.get_weights())
    heard = {name: _TestBatches() for name in ("reference", "candidate")}

    def listening(name):
        if listens == "lambda":
            return [keras.callbacks.LambdaCallback(
                on_test_batch_end=heard[name].on_test_batch_end)]
        return [heard[name]] if listens else []

    expected = reference.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0,
                             validation_data=validation(),
                             callbacks=listening("reference")).history
    got = autosplit.fit_large_batch(candidate, x, y, batch_size=B, micro_batch_size=M + 3,
                                    epochs=2, shuffle=False, verbose=0,
                                    validation_data=validation(),
                                    callbacks=listening("candidate")).history
    assert_weights_close(reference.get_weights(), candidate.get_weights(), 1e-5)
    np.testing.assert_allclose(got["val_loss"], expected["val_loss"], rtol=1e-5)
    assert len(heard["reference"].heard) == (8 if listens else 0)
    assert heard["candidate"].heard == heard["reference"].heard
