"""Custom ``train_step``s as the TensorFlow and Keras guides write them: each either trains
and logs as ``model.fit`` does on the large batch, or is refused before anything changes.

The step's loss is read term by term (``autosplit.keras_hooks.target``): sums add up over
the micro-batches, means weigh by rows, ratios of sums (masked and weighted means) weigh
by their own divisor and divide once; a term that mixes the batch's rows, or a transform
of the gradients before the apply, is refused. Reference: ``model.fit`` at the same large
batch, B = 64 cut 22 + 21 + 21 (micro_batch_size=24).
"""

from __future__ import annotations

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from common import relative_error
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import autosplit
from autosplit.errors import UnsupportedModelError

N, B, M, T = 128, 64, 24, 9


LOSSES = {
    # The tf.distribute guide: a sum over rows divided by the global batch.
    "compute_average_loss_global": lambda m, tok, mask, p, y: tf.nn.compute_average_loss(
        tf.reduce_mean(tok, 1), global_batch_size=B),
    "compute_average_loss": lambda m, tok, mask, p, y: tf.nn.compute_average_loss(
        tf.reduce_mean(tok, 1)),
    # The distributed-training tutorial's loss with its regularisation.
    "tutorial_with_regularization": lambda m, tok, mask, p, y: tf.nn.compute_average_loss(
        tf.reduce_mean(tok, 1), global_batch_size=B) + tf.nn.scale_regularization_loss(
        tf.add_n(m.losses)),
    "sum": lambda m, tok, mask, p, y: tf.reduce_sum(tok),
    "keras_sum_reduction": lambda m, tok, mask, p, y: keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction="sum")(y, p),
    "boolean_mask_mean": lambda m, tok, mask, p, y: tf.reduce_mean(tf.boolean_mask(tok, mask > 0)),
    "masked_mean": lambda m, tok, mask, p, y: tf.math.divide_no_nan(
        tf.reduce_sum(tok * mask), tf.reduce_sum(mask)),
    "weighted_mean": lambda m, tok, mask, p, y: tf.reduce_sum(tok * (mask + 0.5)) / tf.reduce_sum(
        mask + 0.5),
    "mean_plus_sum": lambda m, tok, mask, p, y: tf.reduce_mean(tok) + 1e-3 * tf.reduce_sum(
        tf.abs(p)),
    "sum_over_a_constant": lambda m, tok, mask, p, y: tf.reduce_sum(tok * mask) / (B * T),
    "masked_mean_plus_penalty": lambda m, tok, mask, p, y: tf.math.divide_no_nan(
        tf.reduce_sum(tok * mask), tf.reduce_sum(mask)) + tf.add_n(m.losses),
}

REFUSED = {
    "hard_example_mining": (lambda m, tok, mask, p, y: tf.reduce_mean(
        tf.math.top_k(tf.reduce_mean(tok, 1), k=8).values), "mixes the batch's rows"),
    "sorted_rows": (lambda m, tok, mask, p, y: tf.reduce_sum(
        tf.sort(tf.reduce_mean(tok, 1))[:8]), "mixes the batch's rows"),
    "batch_maximum": (lambda m, tok, mask, p, y: tf.reduce_max(tok), "maximum or minimum"),
    "normalised_by_the_predictions": (lambda m, tok, mask, p, y: tf.reduce_sum(tok) / tf.reduce_sum(
        tf.abs(p)), "value the model computes"),
}

CLIPS = {
    "clip_by_global_norm": lambda g: tf.clip_by_global_norm(g, 0.05)[0],
    "clip_by_norm": lambda g: [tf.clip_by_norm(t, 0.05) for t in g],
    "clip_by_value": lambda g: [tf.clip_by_value(t, -0.01, 0.01) for t in g],
}


class Step(keras.Model):
    """A sequence tagger whose own step computes ``loss_fn`` over per-token losses, with
    a padding mask read from the inputs; it returns the loss and the worst row's loss."""

    loss_fn = staticmethod(LOSSES["sum"])
    clip = None
    tracker = None  # a keras.metrics.Mean updated with the loss, as the guides' steps do

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            logits = self(x, training=True)
            losses = keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
            mask = tf.cast(x[:, :, 0] > -0.5, tf.float32)  # (n, T): the "real tokens"
            loss = self.loss_fn(self, losses, mask, logits, y)
        grads = tape.gradient(loss, self.trainable_variables)
        if self.clip is not None:
            grads = self.clip(grads)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables, strict=True))
        logs = {"step_loss": loss, "worst": tf.reduce_max(tf.reduce_mean(losses, 1))}
        if self.tracker is not None:
            self.tracker.update_state(loss)
            logs["tracked"] = self.tracker.result()
        return logs


def make(loss_fn, clip=None, tracked=False):
    keras.utils.set_random_seed(3)
    inputs = keras.Input((T, 4))
    hidden = keras.layers.Dense(16, activation="relu",
                                kernel_regularizer=keras.regularizers.L2(1e-3))(inputs)
    model = Step(inputs, keras.layers.Dense(5)(hidden))
    model.loss_fn, model.clip = staticmethod(loss_fn), clip
    if tracked:
        model.tracker = keras.metrics.Mean("tracked")
    model.compile(optimizer=keras.optimizers.SGD(0.1))
    return model


def data():
    r = np.random.default_rng(0)
    return r.normal(size=(N, T, 4)).astype("float32"), r.integers(0, 5, size=(N, T))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LOSSES))
def test_a_step_s_loss_trains_and_logs_as_model_fit(name):
    x, y = data()
    reference, candidate = make(LOSSES[name]), make(LOSSES[name])
    expected = reference.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = autosplit.fit_large_batch(candidate, x, y, batch_size=B, micro_batch_size=M,
                                        epochs=2, shuffle=False, verbose=0)
    assert relative_error(reference.get_weights(), candidate.get_weights()) <= 1e-5
    assert int(candidate.optimizer.iterations) == int(reference.optimizer.iterations) == 4
    assert not [w for w in seen if "returns step_loss" in str(w.message)]
    # The last large batch's: a sum, a mean, a ratio, a maximum, and a sum of terms
    # that combine differently (a mean beside a sum or a penalty), part by part.
    for log in ("step_loss", "worst"):
        np.testing.assert_allclose(got.history[log], expected.history[log], rtol=1e-5,
                                   err_msg=log)


# A tracker's update adds up to one update with the large batch's value: a sum, a mean,
# a penalty, and sums of them, weighed part by part; a ratio of sums (a masked or
# weighted mean) by putting the tracker back and updating it with the value so far.
@pytest.mark.slow
@pytest.mark.parametrize("name", ["sum", "compute_average_loss", "mean_plus_sum",
                                  "tutorial_with_regularization", "sum_over_a_constant",
                                  "masked_mean", "boolean_mask_mean", "weighted_mean",
                                  "masked_mean_plus_penalty"])
def test_a_tracker_updated_with_the_loss_holds_model_fit_s_mean(name):
    x, y = data()
    reference, candidate = make(LOSSES[name], tracked=True), make(LOSSES[name], tracked=True)
    expected = reference.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # exact, so nothing to warn of
        got = autosplit.fit_large_batch(candidate, x, y, batch_size=B, micro_batch_size=M,
                                        epochs=2, shuffle=False, verbose=0)
    np.testing.assert_allclose(got.history["tracked"], expected.history["tracked"], rtol=1e-5)


def _refused(model, match):
    x, y = data()
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(UnsupportedModelError, match=match):
        autosplit.fit_large_batch(model, x, y, batch_size=B, micro_batch_size=M, verbose=0)
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights(), strict=True))
    assert int(model.optimizer.iterations) == 0


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_loss_that_needs_the_whole_batch_is_refused_before_anything_changes(name):
    loss_fn, match = REFUSED[name]
    _refused(make(loss_fn), match)


@pytest.mark.parametrize("name", sorted(CLIPS))
def test_a_gradient_transform_in_the_step_is_refused_with_the_optimizer_s_own(name):
    _refused(make(LOSSES["masked_mean"], CLIPS[name]), "global_clipnorm")


@pytest.mark.slow
def test_the_optimizer_s_own_clipping_acts_once_on_the_large_batch():
    # What the refusal advises: global_clipnorm on the optimizer, as model.fit applies it.
    x, y = data()
    reference, candidate = make(LOSSES["masked_mean"]), make(LOSSES["masked_mean"])
    for model in (reference, candidate):
        model.compile(optimizer=keras.optimizers.SGD(0.1, global_clipnorm=0.05))
    reference.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
    autosplit.fit_large_batch(candidate, x, y, batch_size=B, micro_batch_size=M, epochs=1,
                              shuffle=False, verbose=0)
    assert relative_error(reference.get_weights(), candidate.get_weights()) <= 1e-5


@pytest.mark.slow
def test_gradients_scaled_by_a_constant_or_added_up_before_the_apply_train_as_model_fit():
    x, y = data()

    def halved(grads):
        return [0.5 * g + 0.25 * g for g in grads]

    reference, candidate = make(LOSSES["mean_plus_sum"], halved), make(
        LOSSES["mean_plus_sum"], halved)
    reference.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
    autosplit.fit_large_batch(candidate, x, y, batch_size=B, micro_batch_size=M, epochs=1,
                              shuffle=False, verbose=0)
    assert relative_error(reference.get_weights(), candidate.get_weights()) <= 1e-5


# ---------------------------------------------------------------- generated steps

PARTS = {**LOSSES, **{name: fn for name, (fn, _) in REFUSED.items()},
         "penalty": lambda m, tok, mask, p, y: tf.add_n(m.losses)}
TRANSFORMS = {None: None, "scaled": lambda g: [0.5 * t for t in g], **CLIPS}
TRIED: dict[str, int] = {"trained": 0, "refused": 0}  # -s and a print show the split


@pytest.mark.slow
@settings(max_examples=16, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(parts=st.lists(st.tuples(st.sampled_from(sorted(PARTS)),
                                st.sampled_from([1.0, -0.5, 2.0])), min_size=1, max_size=3),
       transform=st.sampled_from(list(TRANSFORMS)))
def test_a_generated_step_trains_as_model_fit_or_is_refused_before_anything_changes(
        parts, transform):
    # Never a third outcome: a step that trains differs from model.fit by rounding only.
    def loss_fn(m, tok, mask, p, y):
        return tf.add_n([c * PARTS[name](m, tok, mask, p, y) for name, c in parts])

    x, y = data()
    candidate = make(loss_fn, TRANSFORMS[transform])
    before = [w.copy() for w in candidate.get_weights()]
    try:
        got = autosplit.fit_large_batch(candidate, x, y, batch_size=B, micro_batch_size=M,
                                        epochs=1, shuffle=False, verbose=0)
    except UnsupportedModelError:
        TRIED["refused"] += 1
        assert all(np.array_equal(a, b)
                   for a, b in zip(before, candidate.get_weights(), strict=True))
        assert int(candidate.optimizer.iterations) == 0
        return
    TRIED["trained"] += 1
    reference = make(loss_fn, TRANSFORMS[transform])
    expected = reference.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
    assert relative_error(reference.get_weights(), candidate.get_weights()) <= 1e-5
    assert int(candidate.optimizer.iterations) == int(reference.optimizer.iterations)
    for log in ("step_loss", "worst"):  # every part of a trained step's loss combines
        np.testing.assert_allclose(got.history[log], expected.history[log],
                                   rtol=1e-5, atol=1e-6, err_msg=log)


class Scheduled(Step):
    """Logs the step count and a scheduled learning rate before and after its apply."""

    def train_step(self, data):
        before = {"lr_before": self.optimizer.learning_rate,
                  "count_before": tf.cast(self.optimizer.iterations, tf.float32)}
        logs = super().train_step(data)
        return {**logs, **before, "lr_after": self.optimizer.learning_rate,
                "count_after": tf.cast(self.optimizer.iterations, tf.float32)}


@pytest.mark.slow
def test_what_a_step_reads_after_its_apply_is_read_after_the_one_real_apply():
    x, y = data()
    models = []
    for _ in range(2):
        keras.utils.set_random_seed(3)
        inputs = keras.Input((T, 4))
        model = Scheduled(inputs, keras.layers.Dense(5)(inputs))
        model.loss_fn = staticmethod(LOSSES["masked_mean"])
        model.compile(optimizer=keras.optimizers.SGD(
            keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=1, decay_rate=0.5)))
        models.append(model)
    reference, candidate = models
    expected = reference.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0)
    got = autosplit.fit_large_batch(candidate, x, y, batch_size=B, micro_batch_size=M,
                                    epochs=2, shuffle=False, verbose=0)
    assert expected.history["count_after"] == [2.0, 4.0]
    np.testing.assert_allclose(expected.history["lr_after"], [0.025, 0.00625])  # a step on
    for log in ("lr_before", "count_before", "lr_after", "count_after", "step_loss"):
        np.testing.assert_allclose(got.history[log], expected.history[log], rtol=1e-6,
                                   err_msg=log)
    assert relative_error(reference.get_weights(), candidate.get_weights()) <= 1e-5


class GradientNorm(Step):
    """Logs norms of its gradients, which only the large batch's summed gradient has."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            logits = self(x, training=True)
            loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
                y, logits, from_logits=True))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables, strict=True))
        return {"loss": loss, "gradient_norm": tf.linalg.global_norm(grads),
                "kernel_norm": tf.norm(grads[0])}


@pytest.mark.slow
def test_a_norm_of_the_gradients_is_the_large_batch_s():
    # global_norm of the gradients the step applies, and tf.norm of one of them: the
    # norm of the summed gradients, as model.fit logs it, not a mean of the
    # micro-batches' norms.
    x, y = data()
    reference, candidate = (_gradient_norm_model() for _ in range(2))
    expected = reference.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = autosplit.fit_large_batch(candidate, x, y, batch_size=B, micro_batch_size=M,
                                        epochs=2, shuffle=False, verbose=0)
    for log in ("loss", "gradient_norm", "kernel_norm"):
        np.testing.assert_allclose(got.history[log], expected.history[log], rtol=1e-5,
                                   err_msg=log)
    assert relative_error(reference.get_weights(), candidate.get_weights()) <= 1e-5


def _gradient_norm_model():
    keras.utils.set_random_seed(3)
    inputs = keras.Input((T, 4))
    model = GradientNorm(inputs, keras.layers.Dense(5)(inputs))
    model.compile(optimizer=keras.optimizers.SGD(0.1))
    return model
