"""The gradient noise scale (McCandlish et al. 2018) from the micro-batches: against a
closed form, against the paper's estimators computed by hand from each micro-batch's own
gradient, and where it must be absent; it changes no weight."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf
from _noise import fitted_noise_scale, line, regression
from common import child_env

import autosplit
from autosplit.data.split import balanced_sizes, split_batch

# ---------------------------------------------------------------- a closed form


@pytest.mark.parametrize("noise", [0.5, 3.0])
@pytest.mark.parametrize("micro_batch_size,batch_size", [(64, 256), (40, 250)])
def test_the_estimate_falls_within_10_percent_of_the_closed_form(noise, micro_batch_size,
                                                                 batch_size):
    # 120 large batches at one w (learning rate 0); 250 = 7 micro-batches of 36 or 35 rows.
    x, y, exact = regression(batch_size * 120, noise)
    got = fitted_noise_scale(line(), x, y, batch_size, micro_batch_size)
    assert abs(got - exact) <= 0.1 * exact, (got, exact)


@pytest.mark.slow
def test_your_own_loop_gets_the_same_estimate_from_accumulate_gradients():
    x, y, exact = regression(256 * 120, 3.0)
    model = line()
    step = tf.function(lambda x, y: autosplit.accumulate_gradients(
        model, x, y, micro_batch_size=64, noise_scale=True).noise)
    parts = np.array([[float(t) for t in step(x[i:i + 256], y[i:i + 256])]
                      for i in range(0, len(x), 256)])
    noise, signal, batch, counted = parts.sum(axis=0)
    assert counted == 120 and batch == 256 * 120
    assert abs(noise / signal - exact) <= 0.1 * exact
    # the same large batches, the same figure as fit_large_batch's
    np.testing.assert_allclose(fitted_noise_scale(line(), x, y, 256, 64), noise / signal,
                               rtol=1e-4)


def test_identical_rows_have_no_noise():
    x, y, _ = regression(1, 0.0)
    x, y = np.repeat(x, 256 * 20, axis=0), np.repeat(y, 256 * 20, axis=0)
    got = fitted_noise_scale(line(), x, y, 256, 64)
    assert abs(got) < 1e-3, got  # rows: a noise scale of 0.001 of one row


def test_one_micro_batch_per_large_batch_has_no_estimate_and_says_why():
    x, y, _ = regression(512, 1.0)
    history = autosplit.fit_large_batch(line(), x, y, batch_size=256, micro_batch_size=256,
                                        verbose=0, noise_scale=True)
    assert "gradient_noise_scale" not in history.history
    report = history.autosplit.gradient_noise_scale
    assert report.value is None and "one micro-batch per large batch" in report.absent
    assert report.advice.startswith("No gradient noise scale: one micro-batch")
    assert autosplit.accumulate_gradients(line(), x[:256], y[:256], micro_batch_size=256,
                                          noise_scale=True).noise.counted == 0


def test_by_default_it_is_absent_and_says_how_to_ask_for_it():
    x, y, _ = regression(512, 1.0)
    history = autosplit.fit_large_batch(line(), x, y, batch_size=256, micro_batch_size=64,
                                        verbose=0)
    assert "gradient_noise_scale" not in history.history
    assert "pass noise_scale=True" in history.autosplit.gradient_noise_scale.absent
    assert autosplit.accumulate_gradients(line(), x, y, micro_batch_size=64).noise is None
    with pytest.raises(autosplit.ArgumentError, match="noise_scale"):
        autosplit.fit_large_batch(line(), x, y, batch_size=256, noise_scale=1)


# ---------------------------------------------------------------- the estimators by hand


def _flat(gradients) -> np.ndarray:
    return np.concatenate([np.ravel(tf.convert_to_tensor(g).numpy()).astype("float64")
                           for g in gradients])


def by_hand(model: keras.Model, loss_of, parts, sizes) -> tuple[float, float]:
    """McCandlish et al.'s estimators from each micro-batch's own loss (a mean over its
    own examples, regularisers included): ``parts`` the micro-batches' inputs, ``sizes``
    their examples; the large batch's gradient from all of them at once."""
    def gradient(*batch):
        with tf.GradientTape() as tape:
            loss = loss_of(*batch) + tf.add_n(model.losses or [tf.constant(0.0)])
        return _flat(tape.gradient(loss, model.trainable_variables))

    small = [gradient(*part) for part in parts]
    whole = gradient(*[np.concatenate(column) for column in zip(*parts, strict=True)])
    n, k = float(sum(sizes)), len(parts)
    mean_small = sum(size / n * g @ g for size, g in zip(sizes, small, strict=True))
    big = whole @ whole
    return n * (mean_small - big) / (k - 1), (k * big - mean_small) / (k - 1)


def rows_model() -> keras.Model:
    model = keras.Sequential([
        keras.Input((5,)), keras.layers.Dense(7, activation="tanh",
                                              kernel_regularizer=keras.regularizers.L2(0.05)),
        keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    return model


def test_in_rows_it_is_the_estimators_computed_by_hand():
    # 50 rows in micro-batches of 13, 13, 12 and 12, a weight regulariser counted once.
    rng = np.random.default_rng(3)
    x = rng.normal(size=(50, 5)).astype("float32")
    y = rng.normal(size=(50, 2)).astype("float32")
    model = rows_model()
    model.build((None, 5))
    split = split_batch(50, 16)
    sizes = balanced_sizes(50, split.accumulation_steps)
    ends = np.cumsum([0, *sizes])
    parts = [(x[a:b], y[a:b]) for a, b in itertools.pairwise(ends)]

    def mse(x, y):
        return tf.reduce_mean(tf.square(model(x) - y))

    noise, signal = by_hand(model, mse, parts, sizes)
    got = autosplit.accumulate_gradients(model, x, y, micro_batch_size=16,
                                         noise_scale=True).noise
    assert float(got.counted) == 1 and float(got.batch) == 50
    np.testing.assert_allclose([float(got.noise), float(got.signal)], [noise, signal],
                               rtol=1e-4)
    fitted = fitted_noise_scale(model, x, y, 50, 16)
    np.testing.assert_allclose(fitted, noise / signal, rtol=1e-4)


def test_in_tokens_it_counts_the_tokens_a_mask_keeps():
    # A per-token loss over a Keras mask: each micro-batch's own loss is a mean over its
    # unmasked tokens, and the noise scale counts tokens.
    rng = np.random.default_rng(4)
    lengths = rng.integers(1, 9, size=40)
    tokens = np.zeros((40, 8), "int32")
    for row, length in enumerate(lengths):
        tokens[row, :length] = rng.integers(1, 20, size=length)
    targets = rng.integers(0, 5, size=(40, 8)).astype("int32")
    model = keras.Sequential([keras.Input((8,), dtype="int32"),
                              keras.layers.Embedding(20, 6, mask_zero=True),
                              keras.layers.Dense(5)])
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss=keras.losses.
                  SparseCategoricalCrossentropy(from_logits=True))
    sizes = balanced_sizes(40, split_batch(40, 12).accumulation_steps)
    ends = np.cumsum([0, *sizes])
    parts = [(tokens[a:b], targets[a:b]) for a, b in itertools.pairwise(ends)]

    def masked_mean(x, y):
        per_token = keras.losses.sparse_categorical_crossentropy(y, model(x), from_logits=True)
        mask = tf.cast(x > 0, tf.float32)
        return tf.reduce_sum(per_token * mask) / tf.reduce_sum(mask)

    counts = [int((part[0] > 0).sum()) for part in parts]
    noise, signal = by_hand(model, masked_mean, parts, counts)
    got = autosplit.accumulate_gradients(model, tokens, targets, micro_batch_size=12,
                                         noise_scale=True).noise
    assert float(got.batch) == lengths.sum()
    np.testing.assert_allclose([float(got.noise), float(got.signal)], [noise, signal],
                               rtol=1e-4)
    history = autosplit.fit_large_batch(model, tokens, targets, batch_size=40,
                                        micro_batch_size=12, shuffle=False, verbose=0,
                                        by_length=False, noise_scale=True)
    np.testing.assert_allclose(history.history["gradient_noise_scale"], [noise / signal],
                               rtol=1e-4)
    assert history.autosplit.gradient_noise_scale.unit == "tokens"
    assert history.autosplit.gradient_noise_scale.batch == lengths.sum()


# ---------------------------------------------------------------- scaled, compiled, skipped


def test_the_gradients_are_unscaled_by_the_loss_scale():
    x, y, _ = regression(256, 3.0)
    model = line()
    plain = autosplit.accumulate_gradients(model, x, y, micro_batch_size=64,
                                           noise_scale=True).noise
    scaled = autosplit.accumulate_gradients(model, x, y, micro_batch_size=64,
                                            loss_scale=1024.0, noise_scale=True).noise
    np.testing.assert_allclose([float(t) for t in scaled], [float(t) for t in plain], rtol=1e-5)
    # Gradients that overflow give no estimate (the step skips the large batch).
    inf = autosplit.accumulate_gradients(model, x, y, micro_batch_size=64,
                                         loss_scale=float("inf"), noise_scale=True).noise
    assert [float(t) for t in inf] == [0.0, 0.0, 0.0, 0.0]


def test_under_xla_it_is_the_same_estimate():
    x, y, _exact = regression(256 * 40, 3.0)
    plain = fitted_noise_scale(line(), x, y, 256, 64)
    model = line()
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse", jit_compile=True)
    np.testing.assert_allclose(fitted_noise_scale(model, x, y, 256, 64), plain, rtol=1e-4)


def test_under_mixed_float16_it_falls_within_10_percent_of_the_closed_form():
    x, y, exact = regression(256 * 120, 3.0)
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = line()
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    got = fitted_noise_scale(model, x, y, 256, 64)
    assert abs(got - exact) <= 0.1 * exact, (got, exact)


@pytest.mark.parametrize("jit_compile", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_it_changes_no_weight(jit_compile):
    # Adam and a regulariser, over batches that do not divide: bitwise the same weights.
    rng = np.random.default_rng(5)
    x = rng.normal(size=(230, 5)).astype("float32")
    y = rng.normal(size=(230, 2)).astype("float32")
    weights = []
    for noise_scale in (True, False):
        keras.utils.set_random_seed(1)
        model = rows_model()
        model.compile(optimizer="adam", loss="mse", jit_compile=jit_compile)
        autosplit.fit_large_batch(model, x, y, batch_size=64, micro_batch_size=20, epochs=2,
                                  verbose=0, noise_scale=noise_scale, shuffle=False)
        weights.append(model.get_weights())
    for on, off in zip(*weights, strict=True):
        assert np.array_equal(on, off)


# ---------------------------------------------------------------- what the user reads


def test_the_report_and_the_sentence_say_what_the_model_predicts(capsys):
    x, y, _exact = regression(256 * 20, 0.5)  # B_simple about 9.6 rows: B = 256 is far
    history = autosplit.fit_large_batch(line(), x, y, batch_size=256, micro_batch_size=64,
                                        epochs=2, shuffle=False, verbose=2, noise_scale=True)
    report = history.autosplit.gradient_noise_scale
    assert report.by_epoch == tuple(history.history["gradient_noise_scale"])
    assert report.value == report.by_epoch[-1] and report.unit == "rows" and report.far
    # the two epochs pooled: the ratio of their means
    noise, signal = np.mean(report.noise_by_epoch), np.mean(report.signal_by_epoch)
    np.testing.assert_allclose(report.smoothed, noise / signal, rtol=1e-6)
    assert report.advice.startswith("B = 256 is ") and "B = 128 would need about" in report.advice
    assert f"autosplit: {report.advice}" in capsys.readouterr().out
    assert json.loads(json.dumps(history.autosplit.to_dict()))["gradient_noise_scale"][
        "unit"] == "rows"


def test_a_loss_over_the_whole_batch_has_no_estimate_and_says_why():
    from _whole_batch import dual_encoder, pairs

    x, y = pairs()
    history = autosplit.fit_large_batch(dual_encoder(), x, y, batch_size=64,
                                        micro_batch_size=16, verbose=0, noise_scale=True)
    assert "gradient_noise_scale" not in history.history
    assert "the loss is over the whole batch" in history.autosplit.gradient_noise_scale.absent


@pytest.mark.slow
def test_on_two_replicas_each_estimates_before_the_all_reduce():
    run = subprocess.run([sys.executable, str(Path(__file__).with_name("noise_child.py"))],
                         env=child_env(PYTHONPATH=os.pathsep.join(
                             [child_env()["PYTHONPATH"], str(Path(__file__).parent)])),
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    for case in ("float32", "mixed_float16"):
        got, exact = found[case]
        assert abs(got - exact) <= 0.1 * exact, found
    assert found["same_weights"], found
