"""The losses custom ``train_step``s compute and return (a distiller's, a compiled loss
that sums or divides by the weights, a reconstruction without targets, targets the step
makes itself): each trains and logs as ``model.fit`` does on the large batch."""

from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from _custom_steps import B, M, N, assert_same_as_fit
from common import GuideStep, relative_error

import autosplit


class Distiller(keras.Model):
    """keras-io's knowledge distillation, shrunk: the step returns its two loss tensors
    as they are, next to the compiled metrics' results."""

    def __init__(self, student, teacher):
        super().__init__()
        self.student, self.teacher = student, teacher

    def call(self, x):
        return self.student(x)

    def train_step(self, data):
        x, y = data
        teacher = self.teacher(x, training=False)
        with tf.GradientTape() as tape:
            student = self.student(x, training=True)
            student_loss = keras.losses.sparse_categorical_crossentropy(
                y, student, from_logits=True)
            student_loss = keras.ops.mean(student_loss)
            distillation_loss = keras.losses.KLDivergence()(
                tf.nn.softmax(teacher / 3.0, axis=1), tf.nn.softmax(student / 3.0, axis=1)) * 9.0
            loss = 0.1 * student_loss + 0.9 * distillation_loss
        grads = tape.gradient(loss, self.student.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.student.trainable_variables, strict=True))
        results = dict(self.compute_metrics(x, y, student, sample_weight=None))
        results.update(student_loss=student_loss, distillation_loss=distillation_loss)
        return results


@pytest.mark.slow
@pytest.mark.parametrize("m", [8, 22])
def test_loss_tensors_a_step_returns_are_the_large_batch_s_as_in_model_fit(m):
    # Returned as they are, they were the last micro-batch's: student_loss 2.39 / 2.25 at
    # m = 8 against model.fit's 2.32 / 2.27. Averaged over the large batch by rows, they
    # are the whole batch's (each is a mean over its rows), at any m.
    r = np.random.default_rng(7)
    x, y = r.normal(size=(128, 6)).astype("float32"), r.integers(0, 3, 128)

    def make():
        keras.utils.set_random_seed(0)
        teacher = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
        student = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                                    keras.layers.Dense(3)])
        model = Distiller(student, teacher)
        model.compile(optimizer=keras.optimizers.SGD(0.1),
                      metrics=[keras.metrics.SparseCategoricalAccuracy()])
        return model

    reference, candidate = make(), make()
    expected = reference.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
    got = autosplit.fit_large_batch(candidate, x, y, batch_size=64, micro_batch_size=m,
                                    epochs=2, shuffle=False, verbose=0)
    assert_same_as_fit(reference, candidate, expected, got, rtol=1e-5)


@pytest.mark.parametrize(("reduction", "weighted"), [("sum", False), ("sum", True),
                                                      ("mean_with_sample_weight", True)])
def test_a_compiled_loss_that_sums_or_divides_by_the_weights_trains_as_model_fit(
        reduction, weighted):
    # The step's loss is read term by term: a sum adds up over the micro-batches, a mean
    # over the sample weights is a ratio divided once by the large batch's weights.
    # (Weighed as a mean, reduction="sum" ended 2.6 apart from model.fit.)
    r = np.random.default_rng(8)
    x, y = r.normal(size=(N, 6)).astype("float32"), r.integers(0, 3, N)
    weights = r.uniform(0.5, 2.0, N).astype("float32") if weighted else None

    def make():
        inputs = keras.Input((6,))
        model = GuideStep(inputs, keras.layers.Dense(3)(inputs))
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss=keras.losses.
                      SparseCategoricalCrossentropy(from_logits=True, reduction=reduction))
        return model

    reference, candidate = make(), make()
    candidate.set_weights(reference.get_weights())
    expected = reference.fit(x, y, sample_weight=weights, batch_size=B, epochs=2,
                             shuffle=False, verbose=0)
    # With mean_with_sample_weight the step's loss tracker is given the ratio itself
    # (metric.update_state(loss)): it is updated once per micro-batch with the large
    # batch's ratio so far, from where the large batch found it, with no warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = autosplit.fit_large_batch(candidate, x, y, sample_weight=weights, batch_size=B,
                                        micro_batch_size=M, epochs=2, shuffle=False, verbose=0)
    assert_same_as_fit(reference, candidate, expected, got, rtol=1e-5)


class MeanAndPerRow(keras.Model):
    """One variable's gradient from a mean and from a per-example vector (which
    tape.gradient sums): a micro-batch's share is n / B for one and 1 for the other."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape(persistent=True) as tape:
            errors = keras.ops.squeeze(keras.ops.square(self(x) - y), -1)
            mean = keras.ops.mean(errors)
        grads = [a + b for a, b in zip(tape.gradient(mean, self.trainable_variables),
                                       tape.gradient(errors, self.trainable_variables),
                                       strict=True)]
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables, strict=True))
        return {"loss": mean}


def test_a_variable_differentiated_as_a_mean_and_per_row_trains_as_model_fit():
    # Two gradients of one variable, added up before the apply: each is answered in
    # its own group (n / B for the mean, 1 for the per-row vector tape.gradient sums).
    r = np.random.default_rng(2)
    x, y = r.normal(size=(40, 4)).astype("float32"), r.normal(size=(40, 1)).astype("float32")

    def make():
        inputs = keras.Input((4,))
        model = MeanAndPerRow(inputs, keras.layers.Dense(1)(inputs))
        model.compile(optimizer=keras.optimizers.SGD(0.01))
        return model

    reference, candidate = make(), make()
    candidate.set_weights(reference.get_weights())
    reference.fit(x, y, batch_size=20, epochs=2, shuffle=False, verbose=0)
    autosplit.fit_large_batch(candidate, x, y, batch_size=20, micro_batch_size=8, epochs=2,
                              shuffle=False, verbose=0)
    assert relative_error(reference.get_weights(), candidate.get_weights()) <= 1e-5


@pytest.mark.filterwarnings("ignore:`build\\(\\)` was called on layer")  # Keras's, unused layer
def test_a_vector_log_and_an_unused_batch_norm_layer_run_as_in_model_fit():
    # Two crashes of older code a review found: float() on a vector a step returns, and
    # the pooled statistics of a BatchNormalization layer the model never calls (unbuilt).
    class VectorLog(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense, self.unused = keras.layers.Dense(1), keras.layers.BatchNormalization()

        def call(self, x):
            return self.dense(x)

        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                errors = (self(x) - y) ** 2
                loss = keras.ops.mean(errors)
            self.optimizer.apply(tape.gradient(loss, self.trainable_variables),
                                 self.trainable_variables)
            return {"per_feature": keras.ops.mean(x, axis=0)}

    r = np.random.default_rng(10)
    x, y = r.normal(size=(N, 4)).astype("float32"), r.normal(size=(N, 1)).astype("float32")
    model = VectorLog()
    model.compile(optimizer=keras.optimizers.SGD(0.1))
    history = autosplit.fit_large_batch(model, x, y, batch_size=B, micro_batch_size=M,
                                        verbose=0)
    assert np.shape(history.history["per_feature"][0]) == (4,)
    assert int(model.optimizer.iterations) == 2


class Reconstruct(keras.Model):
    """An autoencoder's own steps on x alone (RealNVP's and the VAE's form): no targets."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(3)
        self.tracker = keras.metrics.Mean(name="loss")

    @property
    def metrics(self):
        return [self.tracker]

    def call(self, x):
        return self.dense(x)

    def train_step(self, x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(self(x) - x))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables, strict=True))
        self.tracker.update_state(loss)
        return {"loss": self.tracker.result()}

    def test_step(self, x):
        self.tracker.update_state(tf.reduce_mean(tf.square(self(x) - x)))
        return {"loss": self.tracker.result()}


@pytest.mark.slow
def test_validation_split_of_inputs_alone_as_model_fit():
    # model.fit splits x alone when there are no targets; autosplit refused ("Expected
    # arrays with validation_split") though x was an array.
    x = np.random.default_rng(0).normal(size=(80, 3)).astype("float32")

    def make():
        keras.utils.set_random_seed(0)
        model = Reconstruct()
        model.compile(optimizer=keras.optimizers.SGD(0.1))
        return model

    reference, candidate = make(), make()
    expected = reference.fit(x, batch_size=16, epochs=2, validation_split=0.2, shuffle=False,
                             verbose=0)
    got = autosplit.fit_large_batch(candidate, x, batch_size=16, micro_batch_size=8, epochs=2,
                                    validation_split=0.2, shuffle=False, verbose=0)
    assert_same_as_fit(reference, candidate, expected, got, rtol=1e-5)


class OwnTargets(keras.Model):
    """keras-io's masked autoencoder's form: a step on x alone that feeds the compiled
    loss and metrics targets of its own."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(3)

    def call(self, x):
        return self.dense(x)

    def train_step(self, x):
        with tf.GradientTape() as tape:
            y_pred = self(x)
            loss = self.compute_loss(y=x, y_pred=y_pred)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables, strict=True))
        return self.compute_metrics(x, x, y_pred, sample_weight=None)


@pytest.mark.slow
@pytest.mark.parametrize("called_first", [False, True])
def test_a_step_feeding_its_own_targets_runs_whether_or_not_the_model_was_called(called_first):
    # Called before fitting (model.summary(), loading weights), the model was built, and
    # autosplit built its compiled metrics symbolically on the input's y = None:
    # "None values not supported". model.fit leaves them to the step's first call.
    x = np.random.default_rng(0).normal(size=(64, 3)).astype("float32")

    def make():
        keras.utils.set_random_seed(0)
        model = OwnTargets()
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=["mae"])
        if called_first:
            model(x[:2])
        return model

    reference, candidate = make(), make()
    expected = reference.fit(x, batch_size=16, epochs=2, shuffle=False, verbose=0)
    got = autosplit.fit_large_batch(candidate, x, batch_size=16, micro_batch_size=8, epochs=2,
                                    shuffle=False, verbose=0)
    assert_same_as_fit(reference, candidate, expected, got, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("regularizer", ["kernel", "activity"])
def test_the_guide_s_step_with_a_regularised_model_equals_model_fit(regularizer):
    # Keras's compute_loss stacks the compiled loss and the model's penalties and sums
    # the stack: a mean plus terms of the whole batch, not a sum over the rows. Taken
    # for one (keras-io's trainer pattern), the update was k times model.fit's.
    def make():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((6,))
        penalty = {f"{regularizer}_regularizer": keras.regularizers.l2(1e-2)}
        hidden = keras.layers.Dense(12, activation="relu", **penalty)(inputs)
        model = GuideStep(inputs, keras.layers.Dense(3)(hidden))
        model.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
        return model

    r = np.random.default_rng(1)
    x = r.normal(size=(N, 6)).astype("float32")
    y = (x[:, 0] > 0).astype("int32") + (x[:, 1] > 1)
    reference, candidate = make(), make()
    expected = reference.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0)
    got = autosplit.fit_large_batch(candidate, x, y, batch_size=B, micro_batch_size=M,
                                    epochs=2, shuffle=False, verbose=0)
    assert_same_as_fit(reference, candidate, expected, got, rtol=1e-5)
