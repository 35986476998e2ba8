"""Models with their own ``train_step`` (Keras's guide): the step runs per micro-batch,
its one ``apply_gradients`` is caught and applied once per large batch. Reference:
``model.fit`` at the same large batch. Refusals come before anything changes. (The Keras
VAE example, graph and XLA, is in ``tests/scenarios/examples/test_custom.py``.)
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from _custom_steps import B, M, N, assert_same_as_fit, classifier
from common import GuideStep, update_metrics

import autosplit
from autosplit.errors import UnsupportedModelError


@pytest.mark.slow
def test_guide_train_step_with_compiled_loss_and_metrics_equals_model_fit():
    r = np.random.default_rng(1)
    x = r.normal(size=(N, 6)).astype("float32")
    y = (x[:, 0] > 0).astype("int32") + (x[:, 1] > 1)
    reference, candidate = classifier(), classifier()
    candidate.set_weights(reference.get_weights())
    expected = reference.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0)
    got = autosplit.fit_large_batch(candidate, x, y, batch_size=B, micro_batch_size=M,
                                    epochs=2, shuffle=False, verbose=0)
    assert_same_as_fit(reference, candidate, expected, got, rtol=1e-5)


class Subclassed(keras.Model):
    """No Input: the step's first call builds it. Its loss comes either from
    compute_loss or from the compiled loss object called directly (``self.loss(y, p)``,
    as keras-io's DDIM does), so Keras never builds the compiled loss."""

    def __init__(self, direct, **kwargs):
        super().__init__(**kwargs)
        self.direct = direct
        self.hidden, self.out = keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)
        self.tracker = keras.metrics.Mean(name="mse")

    def call(self, x):
        return self.out(self.hidden(x))

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.loss(y, y_pred) if self.direct else self.compute_loss(y=y, y_pred=y_pred)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)  # the Keras 3 guide's form
        self.tracker.update_state(loss)
        return {"mse": self.tracker.result()}

    @property
    def metrics(self):
        return [self.tracker]


@pytest.mark.parametrize("direct", [False, True])
def test_a_subclassed_model_built_by_its_own_step_equals_model_fit(direct):
    # Before, its unbuilt compiled loss stopped fit_large_batch with a RuntimeError
    # blaming the Keras version, and its gradients had no variables to go to.
    r = np.random.default_rng(3)
    x, y = r.normal(size=(N, 4)).astype("float32"), r.normal(size=(N, 1)).astype("float32")

    def make():
        keras.utils.set_random_seed(5)
        model = Subclassed(direct)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=keras.losses.MeanSquaredError())
        return model

    reference, candidate = make(), make()
    expected = reference.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0)
    got = autosplit.fit_large_batch(candidate, x, y, batch_size=B, micro_batch_size=M,
                                    epochs=2, shuffle=False, verbose=0)
    assert int(candidate.optimizer.iterations) == int(reference.optimizer.iterations) == 4
    assert_same_as_fit(reference, candidate, expected, got, rtol=1e-5)


class TwoApplies(keras.Model):
    def train_step(self, data):
        x, y = data
        for _ in range(2):
            with tf.GradientTape() as tape:
                loss = keras.ops.mean(keras.ops.square(self(x) - y))
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply_gradients(zip(grads, self.trainable_variables, strict=True))
        return {"loss": loss}


class TwoOptimizers(keras.Model):
    """A GAN-like step: a second optimizer of its own next to model.optimizer."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.other = keras.optimizers.SGD(0.1)

    def train_step(self, data):
        x, y = data
        with tf.GradientTape(persistent=True) as tape:
            loss = keras.ops.mean(keras.ops.square(self(x) - y))
        first, rest = self.trainable_variables[:1], self.trainable_variables[1:]
        self.optimizer.apply_gradients(zip(tape.gradient(loss, first), first, strict=True))
        self.other.apply_gradients(zip(tape.gradient(loss, rest), rest, strict=True))
        return {"loss": loss}


class TwoOptimizersApply(TwoOptimizers):
    """The same with Keras 3's ``optimizer.apply(grads, variables)``: before, the second
    optimizer's apply went through, once per micro-batch (8 steps for 2 large batches)."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape(persistent=True) as tape:
            loss = keras.ops.mean(keras.ops.square(self(x) - y))
        first, rest = self.trainable_variables[:1], self.trainable_variables[1:]
        self.optimizer.apply(tape.gradient(loss, first), first)
        self.other.apply(tape.gradient(loss, rest), rest)
        return {"loss": loss}


class OnlyOtherOptimizers(TwoOptimizers):
    """Two optimizers of its own, model.optimizer never applied (before: refused as a step
    that applies nothing, not naming the optimizers it does apply)."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = keras.ops.mean(keras.ops.square(self(x) - y))
        self.other.apply(tape.gradient(loss, self.trainable_variables), self.trainable_variables)
        return {"loss": loss}


@pytest.mark.parametrize(("cls", "message"), [(TwoApplies, "more than once"),
                                              (TwoOptimizers, "another optimizer"),
                                              (TwoOptimizersApply, "another optimizer"),
                                              (OnlyOtherOptimizers, "another optimizer")])
def test_steps_without_an_exact_split_are_refused_before_anything_changes(cls, message):
    inputs = keras.Input((4,))
    model = cls(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer=keras.optimizers.SGD(0.1))
    r = np.random.default_rng(2)
    x, y = r.normal(size=(40, 4)).astype("float32"), r.normal(size=(40, 1)).astype("float32")
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(UnsupportedModelError, match=message) as refused:
        autosplit.fit_large_batch(model, x, y, batch_size=20, micro_batch_size=8, verbose=0)
    # Our refusal says why; the note on cutting rows (for a step that fails on a
    # micro-batch) is not added to it (before: a GAN's refusal blamed the row cut).
    assert not getattr(refused.value, "__notes__", None)
    for a, b in zip(before, model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    assert int(model.optimizer.iterations) == 0
    # The patches are gone: plain Keras trains the same model afterwards.
    model.fit(x, y, batch_size=20, verbose=0) if cls is TwoApplies else None


def test_a_custom_step_without_an_optimizer_is_refused_with_the_reason():
    class GAN(keras.Model):
        def compile(self, d_optimizer, g_optimizer):
            super().compile()
            self.d_optimizer, self.g_optimizer = d_optimizer, g_optimizer

        def train_step(self, data):
            return {}

    inputs = keras.Input((4,))
    model = GAN(inputs, keras.layers.Dense(1)(inputs))
    model.compile(keras.optimizers.Adam(), keras.optimizers.Adam())
    with pytest.raises(UnsupportedModelError, match="GAN"):
        autosplit.fit_large_batch(model, np.zeros((8, 4), "float32"), batch_size=8,
                                  micro_batch_size=4, verbose=0)


class FlipAtTest(keras.Model):
    """Only test_step is its own (test-time augmentation: the mean of x and -x)."""

    def test_step(self, data):
        x, y = data
        y_pred = (self(x, training=False) + self(-x, training=False)) / 2
        loss = self.compute_loss(y=y, y_pred=y_pred)
        return self.compute_metrics(x, y, y_pred, sample_weight=None) | {"loss": loss}


class OwnTestStep(GuideStep):
    """A train_step and a test_step of its own, keras-io's masked autoencoder's form: the
    test step updates the loss tracker with its scalar loss and returns the trackers'
    results and the loss tensor itself."""

    def test_step(self, data):
        x, y = data
        y_pred = self(x, training=False)
        loss = self.compute_loss(y=y, y_pred=y_pred)
        return {"probe_loss": loss} | update_metrics(self, loss, y, y_pred)


class ValidationHooks(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.events = []

    def on_test_begin(self, logs=None):
        self.events.append("begin")

    def on_test_batch_begin(self, batch, logs=None):
        self.events.append(f"batch {batch}")

    def on_test_end(self, logs=None):
        self.events.append(f"end {sorted(logs)}")


@pytest.mark.slow
@pytest.mark.parametrize("cls", [GuideStep, FlipAtTest, OwnTestStep])
@pytest.mark.parametrize("how", ["validation_data", "validation_split", "dataset"])
def test_validation_runs_the_model_s_own_test_step_as_model_fit_does(cls, how):
    # model.fit validates with the model's test_step (Keras's default one calls a custom
    # compute_loss and reports the step's own trackers). autosplit once refused these
    # (before that, it ran the compiled loss and metrics and logged other val_ values);
    # now it runs that step on each micro-batch of real rows, scalar tracker updates
    # weighed by rows. Validation batches of 20 rows each (m = 8: micro-batches of 7
    # and 6), so Keras's unweighted mean over batches is the mean over rows.
    inputs = keras.Input((6,))

    def make():
        keras.utils.set_random_seed(3)
        model = cls(inputs, keras.layers.Dense(3)(
            keras.layers.Dense(12, activation="relu")(inputs)))
        model.compile(optimizer=keras.optimizers.SGD(0.1), metrics=["accuracy"],
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    r = np.random.default_rng(4)
    x, y = r.normal(size=(N + 40, 6)).astype("float32"), r.integers(0, 3, N + 40)
    if how == "validation_split":
        data, extra = (x, y), {"validation_split": 0.25}  # 40 rows: two batches of 20
    elif how == "dataset":
        # Batches of B: a loss tensor the step returns is, in model.fit, the last input
        # batch's; autosplit's is the last validation batch of `validation_batch_size`,
        # else B, rows (docs/fit.md).
        validation = tf.data.Dataset.from_tensor_slices((x[N:], y[N:])).batch(B)
        data, extra = (x[:N], y[:N]), {"validation_data": validation}
    else:
        data, extra = (x[:N], y[:N]), {"validation_data": (x[N:], y[N:]),
                                       "validation_batch_size": 20}
    reference, candidate = make(), make()
    batch = {} if how == "dataset" else {"validation_batch_size": 20}
    heard, hooks = ValidationHooks(), ValidationHooks()
    expected = reference.fit(*data, batch_size=B, epochs=2, shuffle=False, verbose=0,
                             callbacks=[heard], **(extra | batch))
    got = autosplit.fit_large_batch(candidate, *data, batch_size=B, micro_batch_size=8,
                                    epochs=2, shuffle=False, verbose=0, callbacks=[hooks],
                                    **(extra | batch))
    assert any(name.startswith("val_") for name in got.history)
    assert_same_as_fit(reference, candidate, expected, got, rtol=1e-5)
    assert hooks.events == heard.events
