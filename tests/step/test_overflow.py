"""An overflow decided as the full batch decides it: which gradients the full batch sums
in float16, and where such a sum rounds to inf."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from autosplit.keras_hooks.traced import summed_in_float16
from autosplit.step.overflow import HALF_OVERFLOW, overflowed, poisoned


@pytest.fixture
def float16():
    keras.mixed_precision.set_global_policy("mixed_float16")
    yield
    keras.mixed_precision.set_global_policy("float32")


def test_a_float16_layer_s_gradients_are_summed_in_float16_and_no_other(float16):
    keras.utils.set_random_seed(0)
    tokens = keras.Input((5,), dtype="int32")
    hidden = keras.layers.Flatten()(keras.layers.Embedding(10, 3)(tokens))
    hidden = keras.layers.BatchNormalization()(keras.layers.Dense(4)(hidden))
    model = keras.Model(tokens, keras.layers.Dense(1, dtype="float32")(hidden))

    @tf.function(input_signature=[tf.TensorSpec([None, 5], tf.int32)])
    def found(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        return {v.path: summed_in_float16(g) for v, g in zip(
            model.trainable_variables, grads, strict=True)}

    half = {}
    tf.function(lambda x: half.update(found.python_function(x)) or 0).get_concrete_function(
        tf.TensorSpec([None, 5], tf.int32))  # read while tracing: python values
    assert {path.split("/")[0] + "/" + path.split("/")[-1]: value for path, value in
            half.items()} == {
        "embedding/embeddings": False,  # sparse: per occurrence, never summed over rows
        "dense/kernel": True, "dense/bias": True,  # a float16 MatMul, BiasAddGrad
        "batch_normalization/gamma": False, "batch_normalization/beta": False,
        "dense_1/kernel": False, "dense_1/bias": False}  # dtype="float32"


def test_a_summed_gradient_overflows_from_where_float16_rounds_to_inf():
    assert float(tf.cast(tf.constant(HALF_OVERFLOW - 0.5), tf.float16)) == 65504.0
    assert np.isinf(float(tf.cast(tf.constant(HALF_OVERFLOW), tf.float16)))
    below, at = tf.constant([HALF_OVERFLOW - 1.0]), tf.constant([-HALF_OVERFLOW])
    assert not bool(overflowed([below, None], (True, True)))
    assert bool(overflowed([below, at], (True, True)))
    assert overflowed([below, at], (False, False)) is None  # nothing float16: no check
    made = poisoned([below, None], tf.constant(True))
    assert np.isinf(made[0].numpy()).all() and made[1] is None
    assert poisoned([below], tf.constant(False))[0].numpy() == below.numpy()


def _decisions(full, part, exact_of, targets):
    """Per target: (the exact sum, whether the full batch's float16 op overflows, whether
    the split's float32 sum of 16-row float16 micro-batches does)."""
    found = []
    for target in targets:
        whole, summed, exact = full(target), None, exact_of(target)
        summed = sum(tf.cast(part(target, a, a + 16), tf.float32) for a in range(0, 256, 16))
        found.append((exact, not bool(tf.reduce_all(tf.math.is_finite(whole))),
                      bool(overflowed([summed], (True,)))))
    return found


@pytest.mark.slow  # 250 float16 sums, full and split (1.4 s on 2 cores)
def test_the_split_decides_as_the_full_batch_but_next_to_the_boundary():
    # The full batch's float16 MatMul and BiasAddGrad round their exact sum once (on
    # these kernels), so they overflow from an exact sum of 65520 on; the split adds its
    # micro-batches' float16 results in float32, each rounded within half its float16
    # step (2**-11 of it): their sum within 2**-11 of 65520 = 32 of the exact one. Every
    # decision agrees farther than that from the boundary; measured, they differ within
    # about 2 of it.
    r = np.random.default_rng(0)
    x = tf.constant(r.normal(3, 1, (256, 8)), tf.float16)
    dy = r.normal(1, 1, (256, 4))
    peak = np.abs(x.numpy().astype(np.float64).T @ dy).max()
    column = np.abs(dy[:, :1].sum())

    def grown(target, scale):
        return tf.constant(dy * target / scale, tf.float16)

    def exact_matmul(target):
        return np.abs(x.numpy().astype(np.float64).T @ grown(target, peak).numpy()).max()

    targets = np.linspace(65400, 65650, 126)
    found = _decisions(
        lambda t: tf.matmul(x, grown(t, peak), transpose_a=True),
        lambda t, a, b: tf.matmul(x[a:b], grown(t, peak)[a:b], transpose_a=True),
        exact_matmul, targets)
    found += _decisions(
        lambda t: tf.raw_ops.BiasAddGrad(out_backprop=grown(t, column)[:, :1]),
        lambda t, a, b: tf.raw_ops.BiasAddGrad(out_backprop=grown(t, column)[a:b, :1]),
        lambda t: abs(grown(t, column)[:, 0].numpy().astype(np.float64).sum()), targets)
    assert any(whole for _, whole, _ in found) and not all(whole for _, whole, _ in found)
    differ = [exact for exact, whole, split in found if whole != split]
    assert all(abs(e - HALF_OVERFLOW) < HALF_OVERFLOW * 2**-11 for e in differ), differ
