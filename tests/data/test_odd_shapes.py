"""Inputs of odd shapes: each is cut by length, padded to its large batch's longest row as
model.fit pads it, or refused with a typed error that says why, before the first step;
never an error raised inside the pipeline mid-training.

The reference is model.fit on ``padded_batch(B)`` of the same examples (of a known length:
model.fit counts one more iteration per epoch on data of unknown length).
"""

from __future__ import annotations

import math

import keras
import numpy as np
import pytest
import tensorflow as tf
from _sequences import VOCAB, B, M, sequences
from common import assert_within_reorder_noise

import autosplit
from autosplit.data.inputs import get_input
from autosplit.data.layout import ALONE
from autosplit.data.pipeline import MicroBatches
from autosplit.errors import UnsupportedModelError
from autosplit.step.cut_choice import choose_cut

pytestmark = pytest.mark.slow  # every test trains a model on sequences (3-10 s on 2 cores)

N = 160


def _dataset(rows, spec):
    return tf.data.Dataset.from_generator(lambda: iter(rows), output_signature=spec).apply(
        tf.data.experimental.assert_cardinality(len(rows)))


def _trains_as_model_fit(make, rows, spec, *, epochs=2, **options):
    """fit_large_batch on padded batches of 16 of ``rows`` equals model.fit on
    padded_batch(B): weights within 1e-5 (or 3x the reference's own movement when each
    large batch comes reversed), iterations and logs. Returns the history."""
    reference, reordered, model = make(), make(), make()
    expected = reference.fit(_dataset(rows, spec).padded_batch(B), epochs=epochs, verbose=0)
    reversed_rows = [r for start in range(0, len(rows), B)
                     for r in reversed(rows[start:start + B])]
    reordered.fit(_dataset(reversed_rows, spec).padded_batch(B), epochs=epochs, verbose=0)
    got = autosplit.fit_large_batch(model, _dataset(rows, spec).padded_batch(16),
                                    batch_size=B, micro_batch_size=M, epochs=epochs,
                                    verbose=0, **options)
    assert_within_reorder_noise(reference, reordered, model.get_weights())
    assert int(model.optimizer.iterations) == epochs * math.ceil(len(rows) / B)
    for name, values in expected.history.items():
        np.testing.assert_allclose(got.history[name], values, rtol=1e-5, err_msg=name)
    return got


def _compiled(inputs, outputs):
    model = keras.Model(inputs, outputs)
    model.compile(keras.optimizers.SGD(0.5), keras.losses.BinaryCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def test_ids_and_their_padding_mask_vary_together_beside_a_part_of_one_shape():
    # The mask is an input of its own, the fixed part a vector per example: one length.
    seqs = sequences(N)
    rows = [({"ids": s, "mask": np.ones(len(s), bool), "extra": np.full(4, s[0] % 3, "float32")},
             np.float32(s.sum() % 2)) for s in seqs]
    spec = ({"ids": tf.TensorSpec([None], tf.int32), "mask": tf.TensorSpec([None], tf.bool),
             "extra": tf.TensorSpec([4], tf.float32)}, tf.TensorSpec([], tf.float32))

    def make():
        keras.utils.set_random_seed(0)
        ids = keras.Input((None,), dtype="int32", name="ids")
        mask = keras.Input((None,), dtype="bool", name="mask")
        extra = keras.Input((4,), name="extra")
        hidden = keras.layers.GRU(8)(keras.layers.Embedding(VOCAB, 8)(ids), mask=mask)
        joined = keras.layers.Concatenate()([hidden, keras.layers.Dense(4)(extra)])
        return _compiled({"ids": ids, "mask": mask, "extra": extra},
                         keras.layers.Dense(1)(joined))

    got = _trains_as_model_fit(make, rows, spec)
    assert got.autosplit.padding.startswith("by length: the model ignores padding"), \
        got.autosplit.padding


def test_nested_dicts_of_a_source_with_its_mask_and_a_target():
    seqs, others = sequences(N), sequences(N, seed=1)
    rows = [({"encoder": {"ids": s, "mask": np.ones(len(s), bool)}, "decoder": {"ids": t}},
             np.float32((s.sum() + t.sum()) % 2)) for s, t in zip(seqs, others, strict=True)]
    spec = ({"encoder": {"ids": tf.TensorSpec([None], tf.int32),
                         "mask": tf.TensorSpec([None], tf.bool)},
             "decoder": {"ids": tf.TensorSpec([None], tf.int32)}}, tf.TensorSpec([], tf.float32))

    def make():
        keras.utils.set_random_seed(0)
        source = keras.Input((None,), dtype="int32")
        mask = keras.Input((None,), dtype="bool")
        target = keras.Input((None,), dtype="int32")
        encoded = keras.layers.GRU(8)(keras.layers.Embedding(VOCAB, 8)(source), mask=mask)
        decoded = keras.layers.GRU(8)(keras.layers.Embedding(VOCAB, 8, mask_zero=True)(target))
        joined = keras.layers.Concatenate()([encoded, decoded])
        return _compiled({"encoder": {"ids": source, "mask": mask}, "decoder": {"ids": target}},
                         keras.layers.Dense(1)(joined))

    got = _trains_as_model_fit(make, rows, spec)
    assert got.autosplit.padding.startswith("by length: 2 lengths per example"), \
        got.autosplit.padding


def test_a_length_on_the_second_axis_of_one_input_and_on_the_third_of_another():
    # Token ids (rows, length) beside a signal of 3 channels first (rows, 3, length'):
    # each cut along its own axis.
    seqs, others = sequences(N), sequences(N, seed=2)
    rows = [((s, np.stack([t, t % 5, t % 3]).astype("float32")), np.float32(s[0] % 2))
            for s, t in zip(seqs, others, strict=True)]
    spec = ((tf.TensorSpec([None], tf.int32), tf.TensorSpec([3, None], tf.float32)),
            tf.TensorSpec([], tf.float32))

    def make():
        keras.utils.set_random_seed(0)
        tokens = keras.Input((None,), dtype="int32")
        signal = keras.Input((3, None))
        read = keras.layers.GRU(8)(keras.layers.Embedding(VOCAB, 8, mask_zero=True)(tokens))
        heard = keras.layers.GRU(8)(keras.layers.Masking()(keras.layers.Permute((2, 1))(signal)))
        return _compiled([tokens, signal], keras.layers.Dense(1)(
            keras.layers.Concatenate()([read, heard])))

    got = _trains_as_model_fit(make, rows, spec)
    assert got.autosplit.padding.startswith("by length: 2 lengths per example"), \
        got.autosplit.padding
    adapter = get_input(_dataset(rows, spec).padded_batch(16))
    cut = choose_cut(make(), adapter, B, ALONE, by_length=True, jit=False)
    assert cut.lengths.axes[:2] == (1, 2)
    for x, _, _, _ in MicroBatches(adapter, B, M, cut=cut).dataset():
        tokens, signal = (t.numpy() for t in x.inputs)
        assert tokens.shape[1] == max(len(np.trim_zeros(r, "b")) for r in tokens)
        assert signal.shape[2] == max(len(np.trim_zeros(r.any(axis=0), "b")) for r in signal)


def _images(n=N):
    r = np.random.default_rng(0)
    return [(r.normal(size=(int(r.integers(4, 12)), int(r.integers(4, 12)), 1)).astype(
        "float32"), np.float32(i % 2)) for i in range(n)]


def _image_model():
    keras.utils.set_random_seed(0)
    images = keras.Input((None, None, 1))
    pooled = keras.layers.GlobalAveragePooling2D()(keras.layers.Conv2D(4, 3)(images))
    return _compiled(images, keras.layers.Dense(1)(pooled))


def test_a_part_that_varies_along_two_axes_is_padded_as_model_fit_pads_it_and_says_why():
    # Images of varying height and width: no one length to cut by, so each micro-batch
    # is padded to its large batch's largest image, as padded_batch(B) pads it (a mean
    # over the image reads the padding: only that is exact).
    spec = (tf.TensorSpec([None, None, 1], tf.float32), tf.TensorSpec([], tf.float32))
    got = _trains_as_model_fit(_image_model, _images(), spec)
    assert got.autosplit.padding == ("to the large batch's longest row: its inputs cannot be "
                                     "cut by length (x varies in length along 2 axes (1, 2))")


def test_asking_for_a_cut_by_length_or_tokens_of_what_cannot_be_cut_says_why_first():
    spec = (tf.TensorSpec([None, None, 1], tf.float32), tf.TensorSpec([], tf.float32))
    model = _image_model()
    before = [w.copy() for w in model.get_weights()]
    for asked in ({"by_length": True}, {"micro_batch_tokens": 512}):
        with pytest.raises(UnsupportedModelError, match=r"varies in length along 2 axes"):
            autosplit.fit_large_batch(model, _dataset(_images(32), spec).padded_batch(16),
                                      batch_size=B, micro_batch_size=M, verbose=0, **asked)
    for b, a in zip(before, model.get_weights(), strict=True):
        np.testing.assert_array_equal(b, a)
    assert int(model.optimizer.iterations) == 0


def test_a_generator_of_padded_pair_batches_is_cut_in_each_length_read_off_its_first_batches():
    # A generator is read once: the lengths an example has are read off the batches
    # Keras's adapter peeked at, never off batches that training then misses.
    seqs, others = sequences(N), sequences(N, seed=3)

    def batches():
        for start in range(0, N, 16):
            part = list(zip(seqs[start:start + 16], others[start:start + 16], strict=True))
            yield ((keras.utils.pad_sequences([s for s, _ in part], padding="post"),
                    keras.utils.pad_sequences([t for _, t in part], padding="post")),
                   np.array([s[0] % 2 for s, _ in part], "float32"))

    def make():
        keras.utils.set_random_seed(0)
        source = keras.Input((None,), dtype="int32")
        target = keras.Input((None,), dtype="int32")
        parts = [keras.layers.GRU(8)(keras.layers.Embedding(VOCAB, 8, mask_zero=True)(t))
                 for t in (source, target)]
        return _compiled([source, target], keras.layers.Dense(1)(
            keras.layers.Concatenate()(parts)))

    rows = [((s, t), np.float32(s[0] % 2)) for s, t in zip(seqs, others, strict=True)]
    spec = ((tf.TensorSpec([None], tf.int32), tf.TensorSpec([None], tf.int32)),
            tf.TensorSpec([], tf.float32))
    reference, model = make(), make()
    reference.fit(_dataset(rows, spec).padded_batch(B), epochs=1, verbose=0)
    got = autosplit.fit_large_batch(model, batches(), batch_size=B, micro_batch_size=M,
                                    verbose=0)
    assert got.autosplit.padding.startswith("by length: 2 lengths per example"), \
        got.autosplit.padding
    assert int(model.optimizer.iterations) == math.ceil(N / B)
    for e, a in zip(reference.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=1e-6)
