"""Rows a map pads to one fixed length (``tf.pad(x, ...)[:n]``, as keras-io's
``audio/transformer_asr`` pads its spectrograms), whose length TensorFlow's shapes leave
unknown: their trailing zeros are data, never taken for a ``padded_batch``'s padding
without the check of padding's evidence."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from common import assert_within_reorder_noise, relative_error

import autosplit
from autosplit.errors import UnsupportedModelError

N, B, M, FRAMES, LENGTH = 64, 32, 12, 6, 8


def _frames():
    rng = np.random.default_rng(0)
    return (rng.normal(size=(N, FRAMES, 2)).astype("float32"),
            rng.normal(size=(N, 1)).astype("float32"))


def _padded_to_a_fixed_length():
    x, y = _frames()
    ds = tf.data.Dataset.from_generator(lambda: iter(zip(x, y, strict=True)), output_signature=(
        tf.TensorSpec((None, 2), tf.float32), tf.TensorSpec((1,), tf.float32)))
    ds = ds.apply(tf.data.experimental.assert_cardinality(N))
    return ds.map(lambda a, b: (tf.pad(a, [[0, LENGTH], [0, 0]])[:LENGTH], b)).batch(B)


def _pooled(jit_compile=False):
    """A mean over every frame, the padding's too: it reads its padding."""
    keras.utils.set_random_seed(1)
    inputs = keras.Input((None, 2))
    hidden = keras.layers.Dense(4, activation="relu")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(1)(
        keras.layers.GlobalAveragePooling1D()(hidden)))
    model.compile(keras.optimizers.SGD(0.1), "mse", jit_compile=jit_compile)
    return model


def test_the_dataset_leaves_its_fixed_length_unknown():
    # The premise: the map's length is None in the element spec, 8 in every batch.
    spec = _padded_to_a_fixed_length().element_spec[0]
    assert spec.shape.as_list() == [None, None, 2]
    assert {int(x.shape[1]) for x, _ in _padded_to_a_fixed_length()} == {LENGTH}


@pytest.mark.slow
@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
def test_a_fixed_length_is_fed_whole_to_a_model_that_reads_its_padding(jit_compile):
    # autosplit took the length axis for a padded_batch's and cut each large batch to
    # its longest row without its trailing zeros (6 of 8 frames): the weights ended
    # 5.35e-1 from model.fit's, with no warning.
    reference, model = _pooled(jit_compile), _pooled(jit_compile)
    expected = reference.fit(_padded_to_a_fixed_length(), epochs=2, shuffle=False, verbose=0)
    got = autosplit.fit_large_batch(model, _padded_to_a_fixed_length(), batch_size=B,
                                    micro_batch_size=M, epochs=2, shuffle=False, verbose=0)
    assert got.autosplit.padding.startswith("to the large batch's longest row")
    assert int(model.optimizer.iterations) == 4
    assert relative_error(reference.get_weights(), model.get_weights()) <= 1e-5
    np.testing.assert_allclose(got.history["loss"], expected.history["loss"], rtol=1e-5)


@pytest.mark.slow
def test_a_fixed_length_read_as_padding_is_refused_in_tokens_before_anything_changes():
    # In tokens a large batch's rows are cut by length, which needs a model that
    # ignores its padding: this one reads it, so a budget is refused, typed.
    model = _pooled()
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(UnsupportedModelError, match=r"micro_batch_tokens=64.*does not ignore"):
        autosplit.fit_large_batch(model, _padded_to_a_fixed_length(), batch_size=B,
                                  micro_batch_tokens=64, verbose=0)
    assert int(model.optimizer.iterations) == 0
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights(), strict=True))


VOCAB, TOKENS = 40, 24


def _language_model(jit_compile=False):
    """Next-token logits per token, its padding weighed 0 by ``sample_weight``:
    ``sum_over_batch_size`` divides by every cell, the padded ones too."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((None,), dtype="int32")
    hidden = keras.layers.Embedding(VOCAB, 8)(inputs)
    model = keras.Model(inputs, keras.layers.Dense(VOCAB)(
        keras.layers.Dense(8, activation="relu")(hidden)))
    model.compile(keras.optimizers.SGD(0.5), keras.losses.SparseCategoricalCrossentropy(
        from_logits=True), jit_compile=jit_compile)
    return model


def _sentences_padded_to_a_fixed_length(reverse=False):
    rng = np.random.default_rng(3)
    seqs = [rng.integers(1, VOCAB, int(n)).astype("int32")
            for n in np.clip(rng.lognormal(np.log(8), 0.5, 128).astype(int), 3, 17)]
    if reverse:  # each large batch's rows in the other order: the summation's noise
        seqs = [s for start in range(0, len(seqs), B) for s in seqs[start:start + B][::-1]]

    def fixed(t):
        return tf.pad(t, [[0, TOKENS]])[:TOKENS]

    ds = tf.data.Dataset.from_generator(
        lambda: ((s[:-1], s[1:], np.ones(len(s) - 1, "float32")) for s in seqs),
        output_signature=(tf.TensorSpec([None], tf.int32), tf.TensorSpec([None], tf.int32),
                          tf.TensorSpec([None], tf.float32)))
    return ds.map(lambda x, y, w: (fixed(x), fixed(y), fixed(w))).batch(B)


@pytest.mark.slow
@pytest.mark.parametrize("options", [{}, {"micro_batch_tokens": 120}, {"jit_compile": True}],
                         ids=["rows", "tokens", "xla"])
def test_a_fixed_length_cut_by_length_counts_its_every_cell_as_model_fit(options):
    # The model ignores its padding (the check's evidence), so each micro-batch is cut to
    # its rows' lengths without their trailing zeros. Its denominators still count the
    # large batch's cells at the fixed length (24), as model.fit's do: the cut took the
    # longest row without its trailing zeros (16) for the large batch's length.
    jit = options.pop("jit_compile", False)
    reference, reordered, model = (_language_model(jit) for _ in range(3))
    expected = reference.fit(_sentences_padded_to_a_fixed_length(), epochs=2, verbose=0)
    reordered.fit(_sentences_padded_to_a_fixed_length(reverse=True), epochs=2, verbose=0)
    if "micro_batch_tokens" not in options:
        options["micro_batch_size"] = M
    got = autosplit.fit_large_batch(model, _sentences_padded_to_a_fixed_length(),
                                    batch_size=B, epochs=2, verbose=0, **options)
    assert got.autosplit.padding.startswith("by length"), got.autosplit.padding
    assert int(model.optimizer.iterations) == 8
    assert_within_reorder_noise(reference, reordered, model.get_weights())
    np.testing.assert_allclose(got.history["loss"], expected.history["loss"], rtol=1e-5)
