"""Models with their own ``train_step`` on sequences: cut by length where the check of
padding, run through that step, finds it ignores padding, and padded to the large batch's
longest row, with a note that says why, where it does not; exactly model.fit's either way.

The reference is model.fit on ``padded_batch(B)`` of the same rows (of a known length:
model.fit counts one more iteration per epoch on data of unknown length).
"""

from __future__ import annotations

import keras
import pytest
import tensorflow as tf
from _pairs import large_batch_padding
from _sequences import VOCAB, B, M, examples, sequences
from common import GuideStep, assert_within_reorder_noise

import autosplit

pytestmark = pytest.mark.slow  # every test trains a model on sequences (3-10 s on 2 cores)


def _dataset(seqs, kind):
    rows, spec = examples(seqs, kind)
    return tf.data.Dataset.from_generator(rows, output_signature=spec).apply(
        tf.data.experimental.assert_cardinality(len(seqs)))


def guide_gru():
    """The Keras guide's train_step (``common.GuideStep``) on a masked GRU classifier."""
    keras.utils.set_random_seed(0)
    tokens = keras.Input((None,), dtype="int32")
    hidden = keras.layers.GRU(16)(keras.layers.Embedding(VOCAB, 16, mask_zero=True)(tokens))
    model = GuideStep(tokens, keras.layers.Dense(1)(hidden))
    model.compile(keras.optimizers.SGD(0.5), keras.losses.BinaryCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


class TokenMeanStep(keras.Model):
    """A language model's own step: the cross-entropy of its real tokens, divided by their
    count (or, with ``cells``, by every cell of the batch, padding included), and a
    tracker of that loss."""

    def __init__(self, *args, cells=False, **kwargs):
        super().__init__(*args, **kwargs)
        self.cells = cells
        self.tracker = keras.metrics.Mean(name="loss")

    @property
    def metrics(self):
        return [self.tracker]

    def train_step(self, data):
        x, y = data[0], data[1]
        mask = tf.cast(tf.not_equal(y, 0), tf.float32)
        with tf.GradientTape() as tape:
            logits = self(x, training=True)
            each = keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
            count = tf.cast(tf.size(mask), tf.float32) if self.cells else tf.reduce_sum(mask)
            loss = tf.reduce_sum(each * mask) / count
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables, strict=True))
        self.tracker.update_state(loss)
        return {"loss": self.tracker.result()}


def token_mean_lm(cells=False):
    keras.utils.set_random_seed(0)
    tokens = keras.Input((None,), dtype="int32")
    hidden = keras.layers.Dense(16, activation="relu")(keras.layers.Embedding(VOCAB, 16)(tokens))
    model = TokenMeanStep(tokens, keras.layers.Dense(VOCAB)(hidden), cells=cells)
    model.compile(keras.optimizers.SGD(0.5))
    return model


def _trains_as_model_fit(make, kind, *, epochs=2):
    seqs = sequences()
    reference, reordered, model = make(), make(), make()
    expected = reference.fit(_dataset(seqs, kind).padded_batch(B), epochs=epochs, verbose=0)
    reversed_seqs = [s for start in range(0, len(seqs), B)
                     for s in reversed(seqs[start:start + B])]
    reordered.fit(_dataset(reversed_seqs, kind).padded_batch(B), epochs=epochs, verbose=0)
    got = autosplit.fit_large_batch(model, _dataset(seqs, kind).padded_batch(16), batch_size=B,
                                    micro_batch_size=M, epochs=epochs, verbose=0)
    assert_within_reorder_noise(reference, reordered, model.get_weights())
    assert int(model.optimizer.iterations) == int(reference.optimizer.iterations)
    for name, values in expected.history.items():
        assert got.history[name] == pytest.approx(values, rel=1e-5), name
    return got, large_batch_padding(_dataset(seqs, kind).padded_batch(B))


@pytest.mark.parametrize("make, kind", [(guide_gru, "gru"),
                                        (token_mean_lm, "lm_keras_mask")],
                         ids=["guide_step_masked_gru", "tokens_over_their_count"])
def test_a_step_of_its_own_that_ignores_padding_is_cut_by_length(make, kind):
    got, full = _trains_as_model_fit(make, kind)
    assert got.autosplit.padding.startswith(
        "by length: the model ignores padding (its own train_step gives the same"), \
        got.autosplit.padding
    assert got.autosplit.cut.padding_share <= full / 2, (got.autosplit.cut, full)


def test_a_step_of_its_own_that_divides_by_every_cell_is_padded_to_the_longest_row_and_says_so():
    # Its mean counts the padding: a micro-batch padded less than its large batch would
    # weigh its tokens more. The note names what the check saw change.
    got, _ = _trains_as_model_fit(lambda: token_mean_lm(cells=True), "lm_keras_mask")
    assert got.autosplit.padding.startswith(
        "to the large batch's longest row: the model does not ignore padding: its "), \
        got.autosplit.padding
