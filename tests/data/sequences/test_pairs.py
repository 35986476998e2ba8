"""Examples of several lengths: translation pairs, whose source and target each have a
length of their own, cut by length in each of them (each part of a micro-batch padded to
its own longest row), and every step exactly model.fit's on the large batch.

The reference is model.fit on ``padded_batch(B)`` of the same pairs, each weight judged
against 3x the reference's own movement when each large batch's rows come reversed,
where that is larger than the tolerance (``tests/data/_sequences.py``).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from _pairs import examples, large_batch_padding, pairs, pairs_train_as_model_fit
from _sequences import VOCAB, B
from common import tensor_relative_error

import autosplit
from autosplit.data.inputs import get_input
from autosplit.data.layout import ALONE
from autosplit.data.markers import is_end_marker
from autosplit.data.pipeline import MicroBatches
from autosplit.step.cut_choice import choose_cut

pytestmark = pytest.mark.slow  # every test trains encoder-decoders (3-20 s on 2 cores)

TOKENS = 360  # 3 pairs of the longest (60 + 60), 60 of the shortest


@pytest.mark.parametrize("kind, optimizer", [("gru", "sgd"), ("gru", "adam"),
                                             ("transformer", "sgd"), ("transformer", "adam")])
def test_a_pair_is_cut_by_length_in_each_of_its_lengths_and_trains_as_model_fit(
        kind, optimizer):
    # The GRU's loss is a mean over the target's unmasked tokens; the Transformer's is
    # divided by every target cell (sum_over_batch_size over a sample_weight mask), which
    # each micro-batch counts the large batch's target length (its length factor).
    data = pairs()
    got = pairs_train_as_model_fit(kind, data=data, optimizer=optimizer)
    assert got.autosplit.padding.startswith("by length: 2 lengths per example"), \
        got.autosplit.padding
    full = large_batch_padding(examples(data, kind).padded_batch(B))
    assert got.autosplit.cut.padding_share <= full / 2, (got.autosplit.cut, full)


def test_the_source_and_the_target_of_each_micro_batch_are_padded_to_their_own_longest():
    data = pairs()
    adapter = get_input(examples(data, "gru").padded_batch(32))
    lengths = adapter.lengths()
    assert lengths.number == 2 and lengths.groups == (0, 1, 1)  # target in and out: one
    pipeline = MicroBatches(adapter, B, 16, cut=choose_cut_for(adapter))
    rows = []
    for x, target_out, _, _ in pipeline.dataset():
        source, target = (t.numpy() for t in x.inputs)
        assert target_out.shape == target.shape
        for part in (source, target):
            assert part.shape[1] == max(len(np.trim_zeros(r, "b")) for r in part)
        rows += [(tuple(np.trim_zeros(s, "b")), tuple(np.trim_zeros(t, "b")))
                 for s, t in zip(source, target, strict=True)]
    assert sorted(rows) == sorted((tuple(s), tuple(t[:-1])) for s, t in data)


def choose_cut_for(adapter):
    from _pairs import gru_seq2seq

    return choose_cut(gru_seq2seq(), adapter, B, ALONE, by_length=None, jit=False)


def test_micro_batches_of_a_token_budget_count_both_lengths_and_train_as_model_fit():
    # A pair costs a micro-batch its source's and its target's padded cells; the budget
    # holds their sum, and short pairs come many to a micro-batch.
    data = pairs()
    got = pairs_train_as_model_fit("gru", data=data, micro_batch_tokens=TOKENS)
    assert got.autosplit.tokens == TOKENS
    assert got.autosplit.padding.endswith(f"micro-batches of up to {TOKENS} tokens")
    adapter = get_input(examples(data, "gru").padded_batch(32))
    cut = choose_cut_for(adapter).in_tokens(TOKENS)
    seen = 0
    for x, _, _, valid in MicroBatches(adapter, B, B, cut=cut).dataset():
        if bool(is_end_marker((valid,))):
            continue
        source, target = x.inputs
        cells = source.shape[0] * (source.shape[1] + target.shape[1])
        assert source.shape[0] == 1 or cells <= TOKENS, (source.shape, target.shape)
        seen += source.shape[0]
    assert seen == len(data)


def test_a_ragged_pair_of_numpy_examples_is_cut_as_its_dataset():
    # Lists of arrays of their own lengths, one per example, for both parts.
    data = pairs()
    sources = [s for s, _ in data]
    targets_in = [t[:-1] for _, t in data]
    targets_out = tf.ragged.constant([t[1:] for _, t in data])
    got = pairs_train_as_model_fit(
        "gru", (tf.ragged.constant(sources), tf.ragged.constant(targets_in)), data=data,
        y=targets_out, shuffle=False)
    assert got.autosplit.padding.startswith("by length: 2 lengths per example")


def test_under_xla_each_length_is_rounded_up_to_its_bucket_and_trains_as_model_fit():
    # XLA compiles a program per shape: each of a pair's lengths is rounded up to its
    # bucket on its own (even past the large batch's), a bounded set of programs. The
    # loss is divided by every target cell: each micro-batch counts the large batch's
    # target length, by its length factor.
    r = np.random.default_rng(3)
    data = [(r.integers(1, VOCAB, int(n)).astype("int32"),
             r.integers(1, VOCAB, int(n) + 1 + int(r.integers(0, 4))).astype("int32"))
            for n in np.clip(r.lognormal(np.log(6), 0.5, 128), 2, 20)]

    def make():
        keras.utils.set_random_seed(0)
        source = keras.Input((None,), dtype="int32", name="source")
        target = keras.Input((None,), dtype="int32", name="target")
        pooled = keras.layers.GlobalAveragePooling1D()(
            keras.layers.Embedding(VOCAB, 8, mask_zero=True)(source))
        hidden = keras.layers.Embedding(VOCAB, 8)(target) + keras.ops.expand_dims(pooled, 1)
        model = keras.Model({"source": source, "target": target},
                            keras.layers.Dense(VOCAB)(hidden))
        model.compile(keras.optimizers.SGD(0.5),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      weighted_metrics=["accuracy"], jit_compile=True)
        return model

    reference, model = make(), make()
    expected = reference.fit(examples(data, "transformer").padded_batch(B), epochs=2, verbose=0)
    got = autosplit.fit_large_batch(model, examples(data, "transformer").padded_batch(32),
                                    batch_size=B, micro_batch_size=16, epochs=2, verbose=0)
    assert got.autosplit.padding.startswith("by length (under XLA each length rounded up to a "
                                            "bucket: 8, 16, 24,"), got.autosplit
    assert "2 lengths per example" in got.autosplit.padding
    # sources up to 20 and targets up to 24 take buckets 8, 16, 24 each: at most 9 shapes
    assert 1 <= got.autosplit.programs <= 9
    assert int(model.optimizer.iterations) == 4
    for e, a in zip(reference.get_weights(), model.get_weights(), strict=True):
        assert tensor_relative_error(e, a) <= 1e-5
    for name, values in expected.history.items():
        np.testing.assert_allclose(got.history[name], values, rtol=1e-5, err_msg=name)
