"""Custom ``train_step``s that keep state of their own (an EMA, TensorFlow variables,
counting trackers, averaged logs) or read positions along the rows: trained as
``model.fit`` trains them, or refused with the reason."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from _custom_steps import B, M, N, assert_same_as_fit

import autosplit
from autosplit.errors import UnsupportedModelError


class WithEma(keras.Model):
    """keras-io's DDIM pattern, shrunk: BatchNormalization and a seeded noise draw in the
    step (state the layers and the generator keep: allowed), a loss tracker, and, with
    ``ema``, the step's own moving average of the weights (refused: per micro-batch it
    ran k times per large batch against weights not yet updated, 0.62 apart)."""

    def __init__(self, ema, **kwargs):
        super().__init__(**kwargs)
        self.ema = ema
        self.net = keras.Sequential([keras.layers.Dense(8), keras.layers.BatchNormalization(),
                                     keras.layers.Dense(1)])
        self.shadow = keras.Sequential([keras.layers.Dense(8), keras.layers.BatchNormalization(),
                                        keras.layers.Dense(1)], name="shadow")
        self.noise = keras.random.SeedGenerator(3)
        self.tracker = keras.metrics.Mean(name="loss")

    def call(self, x):
        return self.net(x)

    @property
    def metrics(self):
        return [self.tracker]

    def train_step(self, data):
        x, y = data
        x = x + 0.01 * keras.random.normal(keras.ops.shape(x), seed=self.noise)
        with tf.GradientTape() as tape:
            loss = keras.ops.mean(keras.ops.square(self.net(x, training=True) - y))
        variables = self.net.trainable_variables
        self.optimizer.apply(tape.gradient(loss, variables), variables)
        if self.ema:
            for w, s in zip(self.net.weights, self.shadow.weights, strict=True):
                s.assign(0.9 * s + 0.1 * w)
        self.tracker.update_state(loss)
        return {"loss": self.tracker.result()}


@pytest.mark.slow
@pytest.mark.parametrize("ema", [False, True])
def test_a_step_that_keeps_state_of_its_own_is_refused_and_layer_state_is_not(ema):
    r = np.random.default_rng(6)
    x, y = r.normal(size=(N, 4)).astype("float32"), r.normal(size=(N, 1)).astype("float32")
    model = WithEma(ema)
    model.shadow.build((None, 4))
    model.compile(optimizer=keras.optimizers.SGD(0.05))
    if not ema:
        with pytest.warns(UserWarning, match="BatchNormalization layers in training mode"):
            history = autosplit.fit_large_batch(model, x, y, batch_size=B, micro_batch_size=M,
                                                verbose=0)
        assert int(model.optimizer.iterations) == 2 and np.isfinite(history.history["loss"][0])
        return
    with pytest.raises(UnsupportedModelError, match=r"assigns shadow/.* itself"):
        autosplit.fit_large_batch(model, x, y, batch_size=B, micro_batch_size=M, verbose=0)
    assert int(model.optimizer.iterations) == 0


class RatioStep(keras.Model):
    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = keras.ops.mean((self(x) - y) ** 2)
        self.optimizer.apply(tape.gradient(loss, self.trainable_variables),
                             self.trainable_variables)
        return {"ratio": keras.ops.sum(y) / keras.ops.sum(x[:, 0])}


def test_a_nan_in_one_large_batch_s_averaged_log_does_not_carry_into_the_next():
    # The running mean of a returned tensor restarts with each large batch: a NaN in
    # the first one (0 / 0) stayed NaN in every later log (NaN + (t - NaN) * 1).
    r = np.random.default_rng(0)
    x, y = r.random((96, 4)).astype("float32"), r.random((96, 1)).astype("float32")
    x[:32, 0], y[:32] = 0.0, 0.0
    inputs = keras.Input((4,))
    model = RatioStep(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer=keras.optimizers.SGD(0.1))
    seen = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: seen.append(logs["ratio"]))
    autosplit.fit_large_batch(model, x, y, batch_size=32, micro_batch_size=16, epochs=2,
                              shuffle=False, verbose=0, callbacks=[record])
    assert np.isnan(seen[0]) and np.isnan(seen[3])
    assert np.isfinite([seen[1], seen[2], seen[4], seen[5]]).all()


@pytest.mark.parametrize("kind", ["tf.Variable", "value"])
def test_state_kept_in_tensorflow_s_own_variables_is_refused_too(kind):
    # A tf.Variable the step holds, or a Keras variable's `.value`, assigned outside
    # Keras's assign: accepted before, the average ended 0.3-0.4 off model.fit's.
    class Averaged(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(1)
            self.average = (tf.Variable(tf.zeros((4, 1)), trainable=False) if kind == "tf.Variable"
                            else self.add_weight(shape=(4, 1), initializer="zeros",
                                                 trainable=False))

        def call(self, x):
            return self.dense(x)

        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                loss = keras.ops.mean((self(x) - y) ** 2)
            variables = self.dense.trainable_variables
            self.optimizer.apply(tape.gradient(loss, variables), variables)
            new = 0.9 * self.average + 0.1 * self.dense.kernel
            (self.average if kind == "tf.Variable" else self.average.value).assign(new)
            return {"loss": loss}

    r = np.random.default_rng(9)
    x, y = r.normal(size=(N, 4)).astype("float32"), r.normal(size=(N, 1)).astype("float32")
    model = Averaged()
    model.compile(optimizer=keras.optimizers.SGD(0.1))
    with pytest.raises(UnsupportedModelError, match=r"assigns .* itself"):
        autosplit.fit_large_batch(model, x, y, batch_size=B, micro_batch_size=M, verbose=0)


class Counting(keras.Model):
    """Trackers of counts, as keras-io's WGAN programs keep ``images_seen`` and
    ``critic_steps`` (``keras.metrics.Sum``): the rows seen, the steps taken, and the
    mean rows per step."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.seen = keras.metrics.Sum(name="seen")
        self.steps = keras.metrics.Sum(name="steps")
        self.rows_per_step = keras.metrics.Mean(name="rows_per_step")

    @property
    def metrics(self):
        return [self.loss_tracker, self.seen, self.steps, self.rows_per_step]

    def _track(self, x, loss):
        rows = keras.ops.shape(x)[0]
        self.loss_tracker.update_state(loss)
        self.seen.update_state(rows)
        self.steps.update_state(1.0)
        self.rows_per_step.update_state(rows)
        return {m.name: m.result() for m in self.metrics}

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = keras.ops.mean(keras.ops.square(self(x, training=True) - y))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables, strict=True))
        return self._track(x, loss)

    def test_step(self, data):
        x, y = data
        return self._track(x, keras.ops.mean(keras.ops.square(self(x) - y)))


@pytest.mark.slow
def test_trackers_of_counts_count_the_large_batch_as_model_fit_does():
    # A count of the batch's rows is a sum over its micro-batches, not a mean: weighed
    # n / B like a loss, `seen` ended at 13.4 where model.fit's was 40. A constant per
    # step (`steps`) is still weighed n / B: one per large batch. 40 rows at B = 20,
    # m = 8 (micro-batches of 7, 7 and 6).
    r = np.random.default_rng(3)
    x, y = r.normal(size=(40, 4)).astype("float32"), r.normal(size=(40, 1)).astype("float32")

    def make():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((4,))
        model = Counting(inputs, keras.layers.Dense(1)(inputs))
        model.compile(optimizer=keras.optimizers.SGD(0.1))
        return model

    reference, candidate = make(), make()
    expected = reference.fit(x, y, batch_size=20, epochs=2, shuffle=False, verbose=0,
                             validation_data=(x, y))
    got = autosplit.fit_large_batch(candidate, x, y, batch_size=20, micro_batch_size=8,
                                    epochs=2, shuffle=False, verbose=0,
                                    validation_data=(x, y))
    assert expected.history["seen"] == [40.0, 40.0]
    assert expected.history["val_seen"] == [40.0, 40.0]
    assert_same_as_fit(reference, candidate, expected, got, rtol=1e-5)


class AnchorsAndPositives(keras.Model):
    """keras-io metric learning: each batch is (2, classes, features), anchors at data[0]
    and positives at data[1]; the step reads positions along the batch axis."""

    def train_step(self, data):
        anchors, positives = data[0], data[1]
        with tf.GradientTape() as tape:
            similarity = keras.ops.matmul(self(anchors), keras.ops.transpose(self(positives)))
            loss = keras.ops.mean(keras.ops.square(similarity))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables, strict=True))
        return {"loss": loss}


def test_a_step_that_reads_positions_along_the_rows_is_refused_typed():
    inputs = keras.Input((6,))
    model = AnchorsAndPositives(inputs, keras.layers.Dense(4)(inputs))
    model.compile(optimizer=keras.optimizers.SGD(0.1))
    pairs = np.random.default_rng(0).normal(size=(2, 5, 6)).astype("float32")
    data = tf.data.Dataset.from_tensors(pairs).repeat(4)  # batches of (2, 5, 6)
    with pytest.raises(UnsupportedModelError, match="out of bounds") as info:
        autosplit.fit_large_batch(model, data, batch_size=2, micro_batch_size=1, verbose=0)
    assert "every input cut along its first axis" in str(info.value)
    assert isinstance(info.value.__cause__, ValueError)  # the model's own, kept
    assert int(model.optimizer.iterations) == 0
