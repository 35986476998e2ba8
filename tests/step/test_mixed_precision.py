"""Mixed precision: one loss scale per large batch, one finite check, one skip."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from common import (
    assert_weights_close,
    assert_within_reorder_noise,
    relative_error,
    tensor_relative_error,
    twin,
    update_metrics,
)

import autosplit
from autosplit.testing import train_on_large_batch

pytestmark = pytest.mark.slow  # each case trains a model under mixed precision

# After 3 Adam steps; bfloat16 keeps 8 bits of mantissa (2**-8 = 3.9e-3 per rounding).
TOLERANCE = {"mixed_float16": 2e-3, "mixed_bfloat16": 6e-2}


@pytest.fixture(params=["mixed_float16", "mixed_bfloat16"])
def policy(request):
    keras.mixed_precision.set_global_policy(request.param)
    yield request.param
    keras.mixed_precision.set_global_policy("float32")


def make():
    model = keras.Sequential([
        keras.Input((12,)),
        keras.layers.Dense(32, activation="tanh"),
        keras.layers.Dense(5, dtype="float32"),
    ])
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def data(seed, batch=50):
    r = np.random.default_rng(seed)
    return (r.normal(size=(batch, 12)).astype("float32"),
            r.integers(0, 5, size=(batch,)).astype("int32"))


def test_split_equals_full_batch_within_dtype_tolerance(policy):
    x0, y0 = data(0)
    reference, candidate = twin(make, (x0[:16], y0[:16], None))
    if policy == "mixed_float16":
        assert isinstance(candidate.optimizer, keras.optimizers.LossScaleOptimizer)
    for seed in range(3):
        x, y = data(seed)
        reference.train_on_batch(x, y)
        train_on_large_batch(candidate, x, y, micro_batch_size=16)
    assert_weights_close(reference.get_weights(), candidate.get_weights(), TOLERANCE[policy])
    assert int(candidate.optimizer.iterations) == 3


def test_overflow_in_one_micro_batch_skips_the_whole_step_once():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        x, y = data(0)
        reference, candidate = twin(make, (x[:16], y[:16], None))
        train_on_large_batch(candidate, x, y, micro_batch_size=16)
        reference.train_on_batch(x, y)
        before = [w.copy() for w in candidate.get_weights()]
        scale = float(candidate.optimizer.dynamic_scale)
        iterations = int(candidate.optimizer.iterations)
        bad = x.copy()
        bad[40, 0] = 1e6  # inf in float16, only in micro-batch 4 of 4 (rows 39-50)
        train_on_large_batch(candidate, bad, y, micro_batch_size=16)
        assert all(np.array_equal(a, b) for a, b in
                   zip(before, candidate.get_weights(), strict=True))
        assert float(candidate.optimizer.dynamic_scale) == scale / 2  # lowered once
        assert int(candidate.optimizer.iterations) == iterations  # no update counted
        reference.train_on_batch(bad, y)  # plain Keras does the same on the full batch
        assert float(reference.optimizer.dynamic_scale) == scale / 2
        # The next good batch trains normally, in line with the reference.
        train_on_large_batch(candidate, x, y, micro_batch_size=16)
        reference.train_on_batch(x, y)
        assert_weights_close(reference.get_weights(), candidate.get_weights(), 2e-3)
    finally:
        keras.mixed_precision.set_global_policy("float32")


class _Steps(keras.callbacks.Callback):
    """(loss scale, iterations) after every batch: the path a loss scale takes."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_batch_end(self, batch, logs=None):
        optimizer = self.model.optimizer
        self.seen.append((float(optimizer.dynamic_scale), int(optimizer.iterations)))


def _as_model_fit(make, x, y, *, batch=64, micro=16, epochs=2):
    """model.fit and fit_large_batch from the same weights: their (scale, iterations)
    after every large batch, and the largest relative difference of their weights."""
    reference, candidate = make(), make()
    candidate.set_weights(reference.get_weights())
    expected, got = _Steps(), _Steps()
    reference.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0,
                  callbacks=[expected])
    autosplit.fit_large_batch(candidate, x, y, batch_size=batch, micro_batch_size=micro,
                              epochs=epochs, shuffle=False, verbose=0, callbacks=[got])
    return expected.seen, got.seen, relative_error(reference.get_weights(),
                                                   candidate.get_weights())


def _two_dense(step=keras.Model):
    """The shape that overflows in float16 at 64 rows and not at 16: a float16 Dense
    before a float32 one, MSE, a small SGD step."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    outputs = keras.layers.Dense(1, dtype="float32")(keras.layers.Dense(4)(inputs))
    model = step(inputs, outputs)
    model.compile(keras.optimizers.SGD(1e-4), "mse")
    return model


@pytest.fixture
def float16():
    keras.mixed_precision.set_global_policy("mixed_float16")
    yield
    keras.mixed_precision.set_global_policy("float32")


@pytest.mark.parametrize("x_mean, y_mean", [(3, 2), (1, 2), (1, 1), (0.1, 0.1), (3, 20)])
def test_a_large_batch_overflows_where_model_fit_s_full_batch_does(float16, x_mean, y_mean):
    # The full batch's float16 gradient of the first Dense sums 64 rows and overflows
    # where each micro-batch's 16 rows need not. The large batch is skipped, its scale
    # halved, as model.fit's: the same loss scale after every large batch, the same
    # iterations; from a few skips (small data, the first scale) to most (y ~ N(20, 1)).
    r = np.random.default_rng(0)
    x = r.normal(x_mean, 1, (512, 8)).astype("float32")
    y = r.normal(y_mean, 1, (512, 1)).astype("float32")
    expected, got, error = _as_model_fit(_two_dense, x, y)
    assert got == expected
    assert 0 < 16 - expected[-1][1] < 16  # 2 epochs of 8 large batches: some skipped
    assert error <= TOLERANCE["mixed_float16"], error


class ScaledStep(keras.Model):
    """A step that scales its loss as Keras's own does (``optimizer.scale_loss``)."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(y=y, y_pred=self(x, training=True))
            scaled = self.optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables, strict=True))
        return update_metrics(self, loss, y, None)


class UnscaledStep(keras.Model):
    """The Keras guide's step, which does not scale its loss (Keras unscales it all the
    same: a step's float16 gradients overflow only where they are large already)."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(y=y, y_pred=self(x, training=True))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables, strict=True))
        return update_metrics(self, loss, y, None)


@pytest.mark.parametrize("step", [ScaledStep, UnscaledStep])
def test_a_step_of_its_own_overflows_where_model_fit_s_does(float16, step):
    r = np.random.default_rng(0)
    x = r.normal(1, 1, (512, 8)).astype("float32")
    if step is ScaledStep:
        y = r.normal(2, 1, (512, 1)).astype("float32")
    else:  # unscaled: every other large batch's targets large enough to overflow at 64 rows
        y = r.normal(0, 1, (512, 1)).astype("float32") + np.repeat(
            [70000.0, 20000.0] * 4, 64)[:, None].astype("float32")
    expected, got, error = _as_model_fit(lambda: _two_dense(step), x, y)
    assert got == expected
    assert expected[-1][1] < 16  # some large batch was skipped
    assert error <= TOLERANCE["mixed_float16"], error


def _cnn():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((12, 12, 3)), keras.layers.Conv2D(8, 3, activation="relu"),
        keras.layers.MaxPooling2D(), keras.layers.Conv2D(8, 3, activation="relu"),
        keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(4, dtype="float32")])
    model.compile(keras.optimizers.Adam(1e-2),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _transformer_block():
    keras.utils.set_random_seed(0)
    tokens = keras.Input((10,), dtype="int32")
    embedded = keras.layers.Embedding(30, 16)(tokens)
    attended = keras.layers.MultiHeadAttention(2, 8, use_bias=False)(embedded, embedded)
    hidden = keras.layers.LayerNormalization()(keras.layers.Add()([embedded, attended]))
    hidden = keras.layers.Dense(32, activation="relu")(hidden)
    pooled = keras.layers.GlobalAveragePooling1D()(keras.layers.Dense(16)(hidden))
    model = keras.Model(tokens, keras.layers.Dense(4, dtype="float32")(pooled))
    # SGD: Adam's step is as large for a gradient that cancels to rounding noise (the
    # biases before the pooling, whose rows' terms cancel) as for any other, and under
    # bfloat16's 8 bits that noise moves model.fit's own weights by 0.18 when its rows
    # come in another order.
    model.compile(keras.optimizers.SGD(0.1),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.mark.parametrize("make", [_cnn, _transformer_block], ids=["cnn", "transformer"])
def test_mixed_bfloat16_has_no_loss_scale_and_trains_as_model_fit(make):
    # bfloat16 keeps float32's range: no loss scale, nothing to overflow. Its 8 bits of
    # mantissa round a float16 layer's gradient sum (the full batch's once, the split's
    # per micro-batch), so each weight is judged within the mixed tolerance (3e-2), or
    # 3x model.fit's own movement when each large batch's rows come reversed where that
    # is larger: the Transformer's biases before its pooling get terms that cancel, and
    # move model.fit's weights by up to 0.1 in another order.
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        r = np.random.default_rng(0)
        x = (r.normal(size=(256, 12, 12, 3)).astype("float32") if make is _cnn
             else r.integers(0, 30, (256, 10)).astype("int32"))
        y = r.integers(0, 4, 256).astype("int32")
        reversed_rows = np.concatenate([np.arange(a, a + 64)[::-1] for a in range(0, 256, 64)])
        reference, reordered, candidate = make(), make(), make()
        assert not isinstance(candidate.optimizer, keras.optimizers.LossScaleOptimizer)
        reference.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
        reordered.fit(x[reversed_rows], y[reversed_rows], batch_size=64, epochs=2,
                      shuffle=False, verbose=0)
        autosplit.fit_large_batch(candidate, x, y, batch_size=64, micro_batch_size=16,
                                  epochs=2, shuffle=False, verbose=0)
        assert int(candidate.optimizer.iterations) == 8
        assert_within_reorder_noise(reference, reordered, candidate.get_weights(), 3e-2)
    finally:
        keras.mixed_precision.set_global_policy("float32")


def test_check_reports_float16_gradients_near_overflow_and_float16_rounding(float16):
    # 64 rows of N(3, 1) take the first Dense's float16 gradient past float16's range at
    # the loss scale 32768; inputs and targets 100 times smaller keep it far below. A
    # split differs by float16's rounding, which check names, not a layer mixing rows.
    r = np.random.default_rng(0)
    near = autosplit.check(_two_dense(), r.normal(3, 1, (64, 8)).astype("float32"),
                           r.normal(2, 1, (64, 1)).astype("float32"), micro_batch_size=16)
    assert near.float16.startswith("past overflow: ") and "dense" in near.float16
    assert "at the loss scale 32768" in near.float16 and "float16" in near.format()
    far = autosplit.check(_two_dense(), r.normal(0, 0.01, (64, 8)).astype("float32"),
                          r.normal(0, 0.01, (64, 1)).astype("float32"), micro_batch_size=16)
    assert far.float16 is None
    for report in (near, far):
        assert report.exact or [c.class_name for c in report.culprits] == ["mixed_float16"]
        assert report.hint is None


class _TokensAndPositions(keras.layers.Layer):
    """keras-io's token and position embedding: the positions looked up at fixed
    indices, so their gradient sums every row in float16, as a bias's does."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.tokens = keras.layers.Embedding(20, 4)
        self.positions = keras.layers.Embedding(6, 4)

    def call(self, x):
        return self.tokens(x) + self.positions(keras.ops.arange(0, 6))


def _positions():
    keras.utils.set_random_seed(0)
    tokens = keras.Input((6,), dtype="int32")
    hidden = keras.layers.Flatten()(_TokensAndPositions()(tokens))
    model = keras.Model(tokens, keras.layers.Dense(1, dtype="float32")(hidden))
    model.compile(keras.optimizers.SGD(1e-4), "mse")
    return model


def _masked_tokens():
    """A per-token loss under a Keras mask: a mean over the unmasked tokens, a ratio."""
    keras.utils.set_random_seed(0)
    tokens = keras.Input((10,), dtype="int32")
    hidden = keras.layers.Dense(32, activation="relu")(
        keras.layers.Embedding(30, 16, mask_zero=True)(tokens))
    model = keras.Model(tokens, keras.layers.Dense(30, dtype="float32")(hidden))
    model.compile(keras.optimizers.SGD(1e-2),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.mark.parametrize("make", [_positions, _masked_tokens], ids=["positions", "masked"])
def test_position_embeddings_and_masked_token_means_overflow_as_model_fit_s(float16, make):
    # A position embedding's sparse gradient is a float16 sum over every row; a masked
    # mean's micro-batch, differentiated whole, overflowed where the full batch's mean
    # did not (its float16 gradients as many times larger as it has tokens).
    r = np.random.default_rng(0)
    if make is _positions:
        x = r.integers(0, 20, (512, 6)).astype("int32")
        y = r.normal(5, 1, (512, 1)).astype("float32")
    else:
        x = r.integers(1, 30, (512, 10)).astype("int32")
        x[:, 7:] = 0
        y = r.integers(0, 30, (512, 10)).astype("int32")
    expected, got, error = _as_model_fit(make, x, y)
    assert got == expected
    if make is _positions:
        assert error <= TOLERANCE["mixed_float16"], error
    else:  # a bias whose gradient's terms cancel: judged against float16's own rounding
        _within_float16_noise(make, x, y)


def _within_float16_noise(make, x, y):
    """Each weight of fit_large_batch within the mixed tolerance of model.fit's, or 3x
    what float16 itself moves model.fit's (mixed_float16 against float32, from the same
    weights) where that is larger: a float16 sum whose terms cancel (the hidden layer's
    bias under a softmax) rounds to a few bits of what remains, the split's partial sums
    and the full batch's alike."""
    reference, candidate = make(), make()
    start = [w.copy() for w in reference.get_weights()]
    candidate.set_weights(start)
    reference.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
    autosplit.fit_large_batch(candidate, x, y, batch_size=64, micro_batch_size=16, epochs=2,
                              shuffle=False, verbose=0)
    keras.mixed_precision.set_global_policy("float32")
    try:
        exact = make()
        exact.set_weights(start)
        exact.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
    finally:
        keras.mixed_precision.set_global_policy("mixed_float16")
    for variable, e, a, f in zip(reference.weights, reference.get_weights(),
                                 candidate.get_weights(), exact.get_weights(), strict=True):
        bound = max(TOLERANCE["mixed_float16"], 3 * tensor_relative_error(e, f))
        assert tensor_relative_error(e, a) <= bound, (variable.path, bound)


def test_recurrent_layers_in_float16_are_named_in_a_warning(float16):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5, 3)), keras.layers.LSTM(4),
                              keras.layers.Dense(1, dtype="float32")])
    model.compile(keras.optimizers.SGD(1e-3), "mse")
    x = np.random.default_rng(0).normal(size=(32, 5, 3)).astype("float32")
    with pytest.warns(UserWarning, match=r"recurrent layers \(lstm.*\) compute in float16"):
        autosplit.fit_large_batch(model, x, x[:, 0, :1], batch_size=32, micro_batch_size=8,
                                  verbose=0)
