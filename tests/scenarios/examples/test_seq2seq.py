"""keras_hub's BartSeq2SeqLM, built small from BartBackbone (no preset: nothing is
downloaded), on pairs of their own lengths: its encoder's token ids and padding mask
share one length, its decoder's ids, padding mask, targets and weights another. Cut by
length in each, it trains as model.fit trains on padded_batch(B) of the same pairs.

Dropout is 0: its masks depend on how a batch is cut. The attention key biases have a
gradient that cancels (rounding noise), so each weight is judged against 3x the
reference's own movement when each large batch's rows come reversed, where that is
larger than the tolerance.
"""

from __future__ import annotations

import math

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf
from common import assert_within_reorder_noise, tensor_relative_error

import autosplit

N, B, M, VOCAB = 128, 64, 16, 50
SIGNATURE = ({"encoder_token_ids": tf.TensorSpec([None], tf.int32),
              "encoder_padding_mask": tf.TensorSpec([None], tf.bool),
              "decoder_token_ids": tf.TensorSpec([None], tf.int32),
              "decoder_padding_mask": tf.TensorSpec([None], tf.bool)},
             tf.TensorSpec([None], tf.int32), tf.TensorSpec([None], tf.float32))


def pairs(n=N, seed=0):
    """Source and target of correlated lengths, as a parallel corpus's: the source
    lognormal (median 10, 3 to 40 tokens), the target 0.8-1.3 times as long and drawn
    from the source's tokens, and 1 more for its start token."""
    r = np.random.default_rng(seed)
    found = []
    for _ in range(n):
        source_length = int(np.clip(round(r.lognormal(np.log(10), 0.5)), 3, 40))
        target_length = int(np.clip(round(source_length * r.uniform(0.8, 1.3)), 3, 40))
        source = r.integers(1, VOCAB, source_length).astype("int32")
        found.append((source, source[np.arange(target_length + 1) % source_length] % 49 + 1))
    return found


def examples(data):
    def rows():
        for source, target in data:
            yield ({"encoder_token_ids": source,
                    "encoder_padding_mask": np.ones(len(source), bool),
                    "decoder_token_ids": target[:-1],
                    "decoder_padding_mask": np.ones(len(target) - 1, bool)},
                   target[1:], np.ones(len(target) - 1, "float32"))

    return tf.data.Dataset.from_generator(rows, output_signature=SIGNATURE).apply(
        tf.data.experimental.assert_cardinality(len(data)))


def bart():
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.BartBackbone(
        vocabulary_size=VOCAB, num_layers=1, num_heads=2, hidden_dim=16, intermediate_dim=32,
        dropout=0.0, max_sequence_length=64)
    model = keras_hub.models.BartSeq2SeqLM(backbone=backbone, preprocessor=None, compile=False)
    model.compile(keras.optimizers.SGD(0.5),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  weighted_metrics=["sparse_categorical_accuracy"], jit_compile=False)
    return model


@pytest.mark.slow
def test_bart_on_pairs_of_their_own_lengths_is_cut_in_each_and_trains_as_model_fit():
    data = pairs()
    reference, reordered, model = bart(), bart(), bart()
    expected = reference.fit(examples(data).padded_batch(B), epochs=2, verbose=0)
    reordered.fit(examples([row for start in range(0, N, B)
                            for row in reversed(data[start:start + B])]).padded_batch(B),
                  epochs=2, verbose=0)
    got = autosplit.fit_large_batch(model, examples(data).padded_batch(32), batch_size=B,
                                    micro_batch_size=M, epochs=2, verbose=0)
    assert got.autosplit.padding.startswith("by length: 2 lengths per example"), \
        got.autosplit.padding
    assert_within_reorder_noise(reference, reordered, model.get_weights())
    assert max(tensor_relative_error(e, a) for v, e, a in zip(
        reference.weights, reference.get_weights(), model.get_weights(), strict=True)
        if "key" not in v.path or "bias" not in v.path) <= 1e-5
    assert int(model.optimizer.iterations) == 2 * math.ceil(N / B)
    for name, values in expected.history.items():
        np.testing.assert_allclose(got.history[name], values, rtol=1e-5, err_msg=name)
    # The padding fed, against padding every part to its large batch's longest row.
    real = cells = 0
    for x, *_ in examples(data).padded_batch(B):
        for name in ("encoder_token_ids", "decoder_token_ids"):
            held = x[name].numpy() != 0
            real += int(held.sum())
            cells += held.size
    assert got.autosplit.cut.padding_share <= (1 - real / cells) / 2, got.autosplit.cut
