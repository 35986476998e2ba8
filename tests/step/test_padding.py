"""``check_padding``: whether a model ignores padding, found on a few real rows through
the step it trains with, the model left as it was found."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from _sequences import VOCAB, dataset, features, model_of, reads_padding, sequences

import autosplit
from autosplit.data.inputs import get_input
from autosplit.data.pipeline import MicroBatches
from autosplit.step.padding import check_padding
from autosplit.step.train_step import build_for

pytestmark = pytest.mark.slow  # every test trains models on sequences (2-26 s on 2 cores)


def test_the_check_finds_what_reads_padding_and_leaves_the_model_as_it_was():
    seqs = sequences(32)
    for make, data, expected in (
            (lambda: model_of("gru"), dataset(seqs, "gru"), True),
            (reads_padding, features(seqs), False)):
        model = make()
        adapter = get_input(data)
        spec = MicroBatches(adapter, 16, 8).element_spec()
        build_for(model, spec)
        before = [v.numpy().copy() for v in model.variables + model.optimizer.variables]
        found = check_padding(model, adapter.sample(16), spec[:3], adapter.lengths())
        assert found.ignores_padding is expected, found
        after = [v.numpy() for v in model.variables + model.optimizer.variables]
        for b, a in zip(before, after, strict=True):
            np.testing.assert_array_equal(b, a)


def test_dropout_does_not_hide_that_a_model_ignores_padding():
    # The check's two steps run with dropout still; training keeps its dropout.
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((None,), dtype="int32"),
                              keras.layers.Embedding(VOCAB, 8, mask_zero=True),
                              keras.layers.Dropout(0.5), keras.layers.GRU(8, dropout=0.3),
                              keras.layers.Dense(1)])
    model.compile("sgd", keras.losses.BinaryCrossentropy(from_logits=True))
    history = autosplit.fit_large_batch(model, dataset(sequences(64), "gru").padded_batch(16),
                                        batch_size=32, micro_batch_size=8, verbose=0)
    assert history.autosplit.padding.startswith("by length")
    assert model.layers[1].rate == 0.5
