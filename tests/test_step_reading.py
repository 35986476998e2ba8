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
        return {"step_loss": loss, "worst": tf.reduce_max(tf.reduce_mean(losses, 1))}


def make(loss_fn, clip=None):
    keras.utils.set_random_seed(3)
    inputs = keras.Input((T, 4))
    hidden = keras.layers.Dense(16, activation="relu",
                                kernel_regularizer=keras.regularizers.L2(1e-3))(inputs)
    model = Step(inputs, keras.layers.Dense(5)(hidden))
    model.loss_fn, model.clip = staticmethod(loss_fn), clip
    model.compile(optimizer=keras.optimizers.SGD(0.1))
    return model


def data():
    r = np.random.default_rng(0)
    return r.normal(size=(N, T, 4)).astype("float32"), r.integers(0, 5, size=(N, T))


# Losses of terms that combine differently (a sum beside a mean or a penalty): they
# train exactly, but their value as a log is combined by rows, and a warning says so.
MIXED_LOGS = {"mean_plus_sum", "tutorial_with_regularization"}


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
    named = [w for w in seen if "returns step_loss" in str(w.message)]
    assert bool(named) == (name in MIXED_LOGS)
    logs = ("worst",) if name in MIXED_LOGS else ("step_loss", "worst")
    for log in logs:  # the last large batch's: a sum, a mean, a ratio, a maximum
        np.testing.assert_allclose(got.history[log], expected.history[log], rtol=1e-5,
                                   err_msg=log)


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
        autosplit.fit_large_batch(candidate, x, y, batch_size=B, micro_batch_size=M,
                                  epochs=1, shuffle=False, verbose=0)
    except UnsupportedModelError:
        TRIED["refused"] += 1
        assert all(np.array_equal(a, b)
                   for a, b in zip(before, candidate.get_weights(), strict=True))
        assert int(candidate.optimizer.iterations) == 0
        return
    TRIED["trained"] += 1
    reference = make(loss_fn, TRANSFORMS[transform])
    reference.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
    assert relative_error(reference.get_weights(), candidate.get_weights()) <= 1e-5
    assert int(candidate.optimizer.iterations) == int(reference.optimizer.iterations)
