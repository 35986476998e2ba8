"""``choose_cut``: how a run cuts each large batch, decided once before its first step,
every refusal raised there before anything changes."""

from __future__ import annotations

import numpy as np
import pytest
from _sequences import B, M, features, model_of, reads_padding, sequences

import autosplit
from autosplit.errors import DatasetError, UnsupportedModelError


@pytest.mark.slow
def test_by_length_true_refuses_a_model_that_reads_its_padding_and_changes_nothing():
    model = reads_padding()
    before = [w.copy() for w in (model.build((None, None, 3)) or model.get_weights())]
    with pytest.raises(UnsupportedModelError, match=r"by_length=True.*does not ignore padding"
                       r".*by_length='auto'"):
        autosplit.fit_large_batch(model, features(sequences()).padded_batch(16),
                                  batch_size=B, micro_batch_size=M, by_length=True, verbose=0)
    for b, a in zip(before, model.get_weights(), strict=True):
        np.testing.assert_array_equal(b, a)
    assert int(model.optimizer.iterations) == 0


@pytest.mark.slow
def test_by_length_asks_for_rows_that_vary_and_a_valid_choice():
    x, y = np.ones((8, 5), "int32"), np.zeros(8, "float32")  # no row padded
    with pytest.raises(DatasetError, match="vary in length with by_length=True"):
        autosplit.fit_large_batch(model_of("gru"), x, y, batch_size=4, micro_batch_size=2,
                                  by_length=True, verbose=0)
    with pytest.raises(ValueError, match=r"`by_length`.*'auto', True, False.*'yes'"):
        autosplit.fit_large_batch(model_of("gru"), x, y, batch_size=4, by_length="yes")


@pytest.mark.parametrize(("workers", "jit", "averages", "sharded", "refused"), [
    (1, False, False, False, None),
    (1, True, False, False, None),  # XLA pads a micro-batch's rows with weightless copies
    (1, True, True, False, "jit_compile with a model that averages"),
    (2, False, False, True, None),  # each worker its own share
    (2, False, False, False, "2 workers that each read the whole input")])
def test_tokens_are_refused_where_rows_cannot_vary_per_micro_batch(workers, jit, averages,
                                                                   sharded, refused):
    from autosplit.data.layout import Layout
    from autosplit.step.cut_choice import tokens_refused

    where = Layout(workers=workers, worker=0, local_replicas=1, replicas=workers)
    found = tokens_refused(where, jit, averages, sharded)
    assert found is None if refused is None else found.startswith(refused)
