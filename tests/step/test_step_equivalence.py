"""The split step equals the full-batch step (the reference), case by case.

Weights after 3 large-batch steps on fresh random data, within 1e-5 relative for SGD
and 1e-4 for the Adam family (float32 summation order alone moves Adam by ~2e-5).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from common import assert_weights_close, dense_reference_step, twin

from autosplit import accumulate_gradients
from autosplit.testing import train_on_large_batch

SGD_TOL, ADAM_TOL = 1e-5, 1e-4
rng = np.random.default_rng


def mlp(optimizer, *, loss=None, regularize=False, activity=False, metrics=("accuracy",),
        jit_compile=False):
    def make():
        reg = keras.regularizers.L2(1e-2) if regularize else None
        act = keras.regularizers.L1(1e-3) if activity else None
        model = keras.Sequential([
            keras.Input((12,)),
            keras.layers.Dense(32, activation="tanh", kernel_regularizer=reg,
                               activity_regularizer=act),
            keras.layers.Dense(5, kernel_regularizer=reg),
        ])
        model.compile(optimizer=optimizer(),
                      loss=loss or keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=list(metrics), jit_compile=jit_compile)
        return model
    return make


def mlp_data(batch, seed, weights=False):
    r = rng(seed)
    x = r.normal(size=(batch, 12)).astype("float32")
    y = r.integers(0, 5, size=(batch,)).astype("int32")
    w = r.uniform(0.1, 2.0, size=(batch,)).astype("float32") if weights else None
    return x, y, w


def cnn(optimizer):
    def make():
        model = keras.Sequential([
            keras.Input((10, 10, 2)),
            keras.layers.Conv2D(6, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Conv2D(8, 3, activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(4),
        ])
        model.compile(optimizer=optimizer(),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model
    return make


def cnn_data(batch, seed, weights=False):
    r = rng(seed)
    x = r.normal(size=(batch, 10, 10, 2)).astype("float32")
    y = r.integers(0, 4, size=(batch,)).astype("int32")
    return x, y, None


VOCAB, LENGTH = 30, 9


def masked_tagger(optimizer):
    """Embedding(mask_zero) -> per-token Dense: the loss averages over unmasked tokens."""
    def make():
        model = keras.Sequential([
            keras.Input((LENGTH,), dtype="int32"),
            keras.layers.Embedding(VOCAB, 8, mask_zero=True),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(6),
        ])
        model.compile(optimizer=optimizer(),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
        return model
    return make


def masked_data(batch, seed, weights=False):
    r = rng(seed)
    lengths = r.integers(1, LENGTH + 1, size=batch)  # very different token counts per row
    x = r.integers(1, VOCAB, size=(batch, LENGTH)).astype("int32")
    x[np.arange(LENGTH)[None, :] >= lengths[:, None]] = 0
    y = r.integers(0, 6, size=(batch, LENGTH)).astype("int32")
    # Per-token weights: Keras refuses a (B,) weight against (B, T) token losses.
    w = r.uniform(0.1, 2.0, size=(batch, LENGTH)).astype("float32") if weights else None
    return x, y, w


def run_case(make_model, data, batch, micro, *, tol, weights=False, dense_reference=False,
             jit_compile=None, run_eagerly=None):
    batches = [data(batch, seed, weights) for seed in range(3)]
    x0, y0, w0 = batches[0]
    sample = (x0[:micro], y0[:micro], None if w0 is None else w0[:micro])
    reference, candidate = twin(make_model, sample)
    step = None
    for x, y, w in batches:
        if dense_reference:
            ref_loss = dense_reference_step(reference, x, y, w)
        else:
            ref_loss = reference.train_on_batch(x, y, sample_weight=w, return_dict=True)["loss"]
        reference.reset_metrics()
        candidate.reset_metrics()
        logs, step = train_on_large_batch(candidate, x, y, w, micro_batch_size=micro,
                                          jit_compile=jit_compile, run_eagerly=run_eagerly)
        np.testing.assert_allclose(float(logs["loss"]), ref_loss, rtol=tol * 10)
    assert_weights_close(reference.get_weights(), candidate.get_weights(), tol)
    assert int(candidate.optimizer.iterations) == 3
    return reference, candidate, step


def sgd():
    return keras.optimizers.SGD(0.1)


def momentum_clip():
    # clipnorm high enough that most steps are not clipped: a clipped step would hide
    # a gradient off by a constant factor.
    return keras.optimizers.SGD(0.05, momentum=0.9, global_clipnorm=1.5)


def adam():
    return keras.optimizers.Adam(1e-2)


def adamw():
    return keras.optimizers.AdamW(1e-2, weight_decay=0.05)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("batch", "micro"),
    [(64, 16), (50, 16), (37, 37), (37, 100), (12, 1), (50, 7)],
    ids=["divides", "remainder", "k=1", "m>B", "m=1", "m=7"],
)
def test_mlp_sgd_with_sample_weights(batch, micro):
    run_case(mlp(sgd, regularize=True), mlp_data, batch, micro, tol=SGD_TOL, weights=True)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", [adam, adamw, momentum_clip],
                         ids=["adam", "adamw", "sgd-momentum-clipnorm"])
def test_mlp_optimizers(optimizer):
    tol = SGD_TOL if optimizer is momentum_clip else ADAM_TOL
    run_case(mlp(optimizer), mlp_data, 50, 16, tol=tol)


@pytest.mark.slow
def test_clipnorm_is_on_the_large_batch_gradient():
    """With a clip that does bind, the clipped norm is that of the whole-batch gradient."""
    run_case(mlp(lambda: keras.optimizers.SGD(0.1, global_clipnorm=0.05)), mlp_data, 48, 16,
             tol=SGD_TOL)


@pytest.mark.slow
def test_small_cnn_adam():
    run_case(cnn(adam), cnn_data, 30, 8, tol=ADAM_TOL)


@pytest.mark.slow
@pytest.mark.parametrize("weights", [False, True], ids=["tokens", "tokens+weights"])
def test_masked_token_loss_divides_by_unmasked_tokens_of_the_whole_batch(weights):
    run_case(masked_tagger(adam), masked_data, 40, 6, tol=ADAM_TOL, weights=weights,
             dense_reference=True)


@pytest.mark.slow
def test_masked_token_loss_sgd_matches_plain_keras():
    # SGD applies an IndexedSlices gradient exactly as its dense form: plain Keras is
    # the reference here, with no densifying.
    run_case(masked_tagger(sgd), masked_data, 40, 6, tol=SGD_TOL)


@pytest.mark.slow
def test_mean_with_sample_weight_reduction():
    loss = keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction="mean_with_sample_weight")
    run_case(mlp(sgd, loss=loss), mlp_data, 50, 16, tol=SGD_TOL, weights=True)


@pytest.mark.slow
def test_sum_reduction():
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
    run_case(mlp(lambda: keras.optimizers.SGD(1e-3), loss=loss), mlp_data, 50, 16,
             tol=SGD_TOL, weights=True)


@pytest.mark.slow
def test_activity_regularizer_is_a_per_example_mean():
    run_case(mlp(sgd, activity=True, regularize=True), mlp_data, 64, 16, tol=SGD_TOL)


@pytest.mark.slow
def test_weight_regularizer_counted_once_with_padding():
    """50 = 3*16 + 2: the last micro-batch is padded; L2 must still count once."""
    _, candidate, _ = run_case(mlp(sgd, regularize=True), mlp_data, 50, 16, tol=SGD_TOL)
    assert candidate.losses  # the model does carry regularization losses


@pytest.mark.slow
def test_multi_output_with_loss_weights():
    def make():
        inputs = keras.Input((6,))
        hidden = keras.layers.Dense(16, activation="relu")(inputs)
        reg = keras.layers.Dense(2, name="reg")(hidden)
        cls = keras.layers.Dense(3, name="cls")(hidden)
        model = keras.Model(inputs, {"reg": reg, "cls": cls})
        model.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss={"reg": "mse", "cls": keras.losses.SparseCategoricalCrossentropy(
                from_logits=True)},
            loss_weights={"reg": 0.3, "cls": 1.7},
        )
        return model

    def data(batch, seed, weights=False):
        r = rng(seed)
        x = r.normal(size=(batch, 6)).astype("float32")
        y = {"reg": r.normal(size=(batch, 2)).astype("float32"),
             "cls": r.integers(0, 3, size=(batch,)).astype("int32")}
        return x, y, None

    batches = [data(22, s) for s in range(3)]
    reference, candidate = twin(make, (batches[0][0][:5],
                                       {k: v[:5] for k, v in batches[0][1].items()}, None))
    for x, y, _ in batches:
        ref_logs = reference.train_on_batch(x, y, return_dict=True)
        candidate.reset_metrics()  # train_on_batch logs one batch, not a running mean
        logs, _ = train_on_large_batch(candidate, x, y, micro_batch_size=5)
        # Per-output losses are logged as model.fit logs them (unweighted, per output).
        for name in ("reg_loss", "cls_loss", "loss"):
            np.testing.assert_allclose(logs[name], ref_logs[name], rtol=1e-5)
    assert_weights_close(reference.get_weights(), candidate.get_weights(), SGD_TOL)


@pytest.mark.slow
def test_embedding_adam_uses_the_dense_gradient():
    """Keras's Adam sums squared duplicates of a sparse gradient; autosplit's is dense."""
    run_case(masked_tagger(adam), masked_data, 32, 8, tol=ADAM_TOL, dense_reference=True)


@pytest.mark.slow
def test_xla_matches():
    run_case(mlp(adam, jit_compile=True), mlp_data, 50, 16, tol=ADAM_TOL, weights=True,
             jit_compile=True)


@pytest.mark.slow
def test_run_eagerly_matches():
    run_case(mlp(sgd), mlp_data, 50, 16, tol=SGD_TOL, run_eagerly=True)


@pytest.mark.slow
def test_metrics_exclude_padding_rows():
    batch, micro = 50, 16
    x, y, w = mlp_data(batch, 0, weights=True)
    reference, candidate = twin(mlp(sgd, metrics=("accuracy",)), (x[:micro], y[:micro], None))
    # The last large batch of an epoch: 23 real rows of a batch of 50.
    real = 23
    ref_logs = reference.train_on_batch(x[:real], y[:real], sample_weight=w[:real],
                                        return_dict=True)
    logs, _ = train_on_large_batch(candidate, x[:real], y[:real], w[:real],
                                   micro_batch_size=micro, batch_size=batch)
    np.testing.assert_allclose(float(logs["accuracy"]), ref_logs["accuracy"], rtol=1e-6)
    np.testing.assert_allclose(float(logs["loss"]), ref_logs["loss"], rtol=1e-5)
    assert_weights_close(reference.get_weights(), candidate.get_weights(), SGD_TOL)


def test_hand_computed_mean_of_four_gradients():
    """loss_i = -y_i * w * x_i with x = 1: gradients -1, -2, -3, -4 average to -2.5."""
    model = keras.Sequential([keras.Input((1,)),
                              keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")])
    model.compile(optimizer=keras.optimizers.SGD(1.0),
                  loss=lambda y_true, y_pred: -y_true[:, 0] * y_pred[:, 0])
    x = np.ones((4, 1), "float32")
    y = np.array([[1.0], [2.0], [3.0], [4.0]], "float32")
    loss, grads = tf.function(
        lambda x, y: accumulate_gradients(model, x, y, micro_batch_size=1))(x, y)
    np.testing.assert_allclose(grads[0].numpy(), [[-2.5]], rtol=1e-7)
    np.testing.assert_allclose(float(loss), 0.0, atol=1e-7)  # w = 0
    train_on_large_batch(model, x, y, micro_batch_size=1)
    np.testing.assert_allclose(model.get_weights()[0], [[2.5]], rtol=1e-7)


@pytest.mark.slow
def test_accumulate_gradients_in_a_custom_loop_equals_the_full_batch_gradient():
    make = mlp(sgd, regularize=True)
    x, y, w = mlp_data(45, 3, weights=True)
    model = make()
    model.build((None, 12))

    @tf.function
    def split_grads(x, y, w):
        return accumulate_gradients(model, x, y, w, micro_batch_size=8)

    loss, grads = split_grads(x, y, w)
    with tf.GradientTape() as tape:
        full = model.compute_loss(x, y, model(x, training=True), w)
    expected = tape.gradient(full, model.trainable_variables)
    np.testing.assert_allclose(float(loss), float(full), rtol=1e-6)
    for e, g in zip(expected, grads, strict=True):
        np.testing.assert_allclose(g.numpy(), e.numpy(), rtol=1e-5, atol=1e-7)
    # The caller applies them with any optimizer, once.
    before = int(model.optimizer.iterations)
    keras.optimizers.SGD(0.1).apply_gradients(zip(grads, model.trainable_variables, strict=True))
    assert int(model.optimizer.iterations) == before
