"""Rows of varying length padded per large batch, as ``padded_batch`` pads them: every
micro-batch to its large batch's longest row; ragged parts refused up front."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from _inputs import B, make
from common import assert_weights_close, relative_error

import autosplit
from autosplit.errors import DatasetError


def test_ragged_parts_are_refused_up_front():
    # The pipeline pads micro-batches of dense tensors; a ragged_batch failed inside it
    # with a TypeError from tf.ensure_shape.
    sequences = tf.data.Dataset.range(1, 41).map(
        lambda i: (tf.fill([tf.cast(i % 5 + 1, tf.int32)], i), i % 3))
    with pytest.raises(DatasetError, match=r"dense tensors.*RaggedTensorSpec.*padded_batch"):
        autosplit.fit_large_batch(make(), sequences.ragged_batch(8), batch_size=16,
                                  micro_batch_size=8, verbose=0)


@pytest.mark.slow
def test_variable_length_examples_are_padded_per_large_batch_as_padded_batch_pads():
    # Examples of varying length (from_generator, unbatched): autosplit pads them itself,
    # each large batch to its longest row, so that a model that reads its padding (a
    # pooling without a mask) trains as model.fit on padded_batch(B) of the same examples.
    # from_generator is a flat_map over from_tensors of an id: that from_tensors once made
    # its examples look like batches.
    def examples():
        rng = np.random.default_rng(0)
        for i in range(40):
            yield rng.normal(size=(rng.integers(3, 9),)).astype("float32"), np.int32(i % 3)

    dataset = tf.data.Dataset.from_generator(examples, output_signature=(
        tf.TensorSpec([None], tf.float32), tf.TensorSpec([], tf.int32)))

    def make():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((None,)), keras.layers.Reshape((-1, 1)),
                                  keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(3)])
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True))
        return model

    reference, candidate = make(), make()
    expected = reference.fit(dataset.padded_batch(16), epochs=2, verbose=0)
    got = autosplit.fit_large_batch(candidate, dataset, batch_size=16, micro_batch_size=6,
                                    epochs=2, verbose=0)
    assert int(candidate.optimizer.iterations) == 6
    assert_weights_close(reference.get_weights(), candidate.get_weights(), 1e-5)
    np.testing.assert_allclose(got.history["loss"], expected.history["loss"], rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["list", "object_array", "ragged"])
def test_sequences_given_as_a_list_or_ragged_are_padded_per_large_batch(kind):
    # model.fit takes such sequences only padded; autosplit pads each large batch to its
    # longest row: the reference is model.fit on padded_batch(B) of the same examples.
    r = np.random.default_rng(1)
    seqs = [r.integers(1, 30, r.integers(2, 25)).astype("int32") for _ in range(100)]
    labels = np.array([s[0] % 2 for s in seqs], "float32")
    x = {"list": lambda: seqs, "object_array": lambda: np.array([*seqs, [1]], object)[:-1],
         "ragged": lambda: tf.ragged.constant(seqs)}[kind]()
    padded = tf.data.Dataset.from_generator(
        lambda: zip(seqs, labels, strict=True), output_signature=(
            tf.TensorSpec([None], tf.int32), tf.TensorSpec([], tf.float32))).padded_batch(32)
    reference, reordered, candidate = _per_token(True), _per_token(True), _per_token(True)
    for net in (reference, reordered, candidate):
        net.compile(keras.optimizers.SGD(0.5), keras.losses.BinaryCrossentropy(from_logits=True))
    expected = reference.fit(padded, epochs=2, verbose=0)
    got = autosplit.fit_large_batch(candidate, x, labels, batch_size=32, micro_batch_size=12,
                                    epochs=2, shuffle=False, verbose=0)
    assert int(candidate.optimizer.iterations) == 8
    # The padding token's embedding row gathers every padded position's gradient (see
    # above): bounded by 3x what reversing each large batch's rows moves model.fit.
    reordered.fit(padded.map(lambda x, y: (x[::-1], y[::-1])), epochs=2, verbose=0)
    noise = relative_error(reference.get_weights(), reordered.get_weights())
    assert_weights_close(reference.get_weights(), candidate.get_weights(), max(1e-5, 3 * noise))
    np.testing.assert_allclose(got.history["loss"], expected.history["loss"], rtol=1e-5)


@pytest.mark.slow
def test_the_probe_runs_its_trials_on_variable_length_examples_padded():
    # The probe's sample of such rows is padded to its longest (adapter.sample), as the
    # pipeline pads a large batch; its trials run, and training starts at the size found.
    r = np.random.default_rng(2)
    seqs = [r.normal(size=int(r.integers(3, 30))).astype("float32") for _ in range(48)]
    labels = np.array([i % 3 for i in range(48)], "int32")
    model = keras.Sequential([keras.Input((None,)), keras.layers.Reshape((-1, 1)),
                              keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(3)])
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(
        from_logits=True))
    before = [w.copy() for w in model.get_weights()]
    result = autosplit.probe(model, seqs, labels, batch_size=16, cache=False)
    assert 1 <= result.micro_batch_size <= 16 and result.trials
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights(), strict=True))
    history = autosplit.fit_large_batch(model, seqs, labels, batch_size=16, verbose=0)
    assert history.autosplit.micro_batch_size == result.micro_batch_size
    assert int(model.optimizer.iterations) == 3


@pytest.mark.slow
@pytest.mark.parametrize("m", [22, 64])
def test_padded_batches_of_varying_length_are_cut_across_their_batches(m):
    # A padded_batch of sequences of varying length: each input batch is padded to its
    # own longest sequence. Dataset.rebatch stopped with "source and dst shapes are not
    # compatible" when a micro-batch spanned two batches of different lengths; such
    # pieces are now padded together (zeros, as padded_batch pads). With the padding
    # masked (mask_zero), equal to model.fit on the same rows in batches of B.
    r = np.random.default_rng(0)
    seqs = [r.integers(1, 30, r.integers(3, 20)).astype("int32") for _ in range(150)]
    labels = np.array([s.sum() % 2 for s in seqs], "float32")

    def dataset(batch):
        return tf.data.Dataset.from_generator(
            lambda: zip(seqs, labels, strict=True), output_signature=(
                tf.TensorSpec([None], tf.int32), tf.TensorSpec([], tf.float32))
        ).padded_batch(batch)

    def model():
        keras.utils.set_random_seed(0)
        net = keras.Sequential([keras.Input((None,), dtype="int32"),
                                keras.layers.Embedding(30, 8, mask_zero=True),
                                keras.layers.GRU(8), keras.layers.Dense(1)])
        net.compile(keras.optimizers.SGD(0.5), keras.losses.BinaryCrossentropy(from_logits=True))
        return net

    reference, candidate = model(), model()
    expected = reference.fit(dataset(B), epochs=2, verbose=0)
    got = autosplit.fit_large_batch(candidate, dataset(16), batch_size=B, micro_batch_size=m,
                                    epochs=2, verbose=0)
    assert_weights_close(reference.get_weights(), candidate.get_weights(), 1e-5)
    np.testing.assert_allclose(got.history["loss"], expected.history["loss"], rtol=1e-5)


def _per_token(pooled):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((None,), dtype="int32")
    hidden = keras.layers.Embedding(30, 8)(inputs)  # no mask: padding is read
    if pooled:  # one value per sequence, a mean over its padding too
        return keras.Model(inputs, keras.layers.Dense(1)(
            keras.layers.GlobalAveragePooling1D()(hidden)))
    return keras.Model(inputs, keras.layers.Dense(30)(hidden))  # one value per token


@pytest.mark.slow
@pytest.mark.parametrize("pooled", [False, True], ids=["sample_weight_mask", "no_mask"])
def test_every_micro_batch_is_padded_to_its_large_batch_s_longest_row(pooled):
    # Keras's sum_over_batch_size over per-token losses masked by sample_weight divides
    # by the large batch's rows x its longest row, and a model without a mask reads the
    # padding: both equal model.fit on padded_batch(B) only when each micro-batch is
    # padded as the large batch is (padded to its own longest row, the embedding trained
    # 3.4e-2 and 5.4e-2 relative off). The input comes in padded batches of 16 rows,
    # four to a large batch.
    r = np.random.default_rng(0)
    seqs = [r.integers(1, 30, int(np.clip(r.lognormal(np.log(10), 0.6), 3, 60)))
            .astype("int32") for _ in range(150)]

    def dataset(batch):
        def rows():
            for s in seqs:
                if pooled:
                    yield s, np.float32(s.sum() % 2)
                else:
                    yield s[:-1], s[1:], np.ones(len(s) - 1, "float32")
        spec = ((tf.TensorSpec([None], tf.int32), tf.TensorSpec([], tf.float32)) if pooled
                else (tf.TensorSpec([None], tf.int32), tf.TensorSpec([None], tf.int32),
                      tf.TensorSpec([None], tf.float32)))
        ds = tf.data.Dataset.from_generator(rows, output_signature=spec)
        # batch B in one pass, so that model.fit's large batches are the same rows
        return ds.padded_batch(B) if batch == B else ds.padded_batch(batch)

    def model():
        net = _per_token(pooled)
        net.compile(keras.optimizers.SGD(0.5), keras.losses.BinaryCrossentropy(
            from_logits=True) if pooled else keras.losses.SparseCategoricalCrossentropy(
            from_logits=True))
        return net

    reference, candidate = model(), model()
    expected = reference.fit(dataset(B), epochs=2, verbose=0)
    got = autosplit.fit_large_batch(candidate, dataset(B // 4), batch_size=B,
                                    micro_batch_size=B // 3, epochs=2, verbose=0)
    bound = 1e-5
    if pooled:
        # The padding token's embedding row gathers the gradient of every padded
        # position, a long sum whose order moves it: model.fit itself, each large
        # batch's rows reversed, moved the embedding 1.5e-5 (autosplit 1.7e-5).
        reordered = model()
        reordered.fit(dataset(B).map(lambda x, y: (x[::-1], y[::-1])), epochs=2, verbose=0)
        noise = relative_error(reference.get_weights(), reordered.get_weights())
        bound = max(bound, 3 * noise)
    assert_weights_close(reference.get_weights(), candidate.get_weights(), bound)
    np.testing.assert_allclose(got.history["loss"], expected.history["loss"], rtol=1e-5)
