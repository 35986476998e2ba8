"""The pieces of a large batch sorted by length (``sequences.pieces.sorted_pieces``), read
off the pipeline: which rows each micro-batch takes, how long it is padded, on one
replica and on two, in rows, in tokens and under XLA's buckets."""

from __future__ import annotations

import numpy as np
import pytest
from _sequences import B, cut_by_length, dataset, sequences

from autosplit.data.inputs import get_input
from autosplit.data.layout import Layout
from autosplit.data.markers import is_end_marker
from autosplit.data.pipeline import MicroBatches
from autosplit.data.sequences.buckets import TOKEN_BUCKETS
from autosplit.data.sequences.cut import Cut
from autosplit.data.sequences.packing import rows_within

# 4 rows of the longest (60), 80 of the shortest (3; 30 in XLA's bucket of 8)
TOKENS = 240
TWO = Layout(workers=1, worker=0, local_replicas=2, replicas=2)


@pytest.mark.parametrize("cap", [None, 12])
def test_each_micro_batch_holds_at_most_the_budget_and_every_row_once(cap):
    # A micro-batch holds at most budget // its longest row (at least
    # one row, at most the rows given); an element with no row ends each large batch.
    seqs = sequences(150)
    rows = cap or B
    adapter = get_input(dataset(seqs, "gru").padded_batch(16))
    cut = MicroBatches(adapter, B, rows, cut=cut_by_length(adapter, tokens=TOKENS))
    large, seen, counts = [], [], []
    for x, _, _, valid in cut.dataset():
        if bool(is_end_marker((valid,))):
            large.append(sorted(seen))
            counts.append(len(seen))
            seen = []
            continue
        tokens = x.inputs.numpy()
        assert valid.numpy().all()  # no padding rows: their count is the piece's own
        assert len(tokens) <= rows
        assert len(tokens) == 1 or tokens.size <= TOKENS
        longest = max(len(np.trim_zeros(t, "b")) for t in tokens)
        assert tokens.shape[1] == longest  # padded to its own longest row
        factors = x.length_factor.numpy()
        np.testing.assert_allclose(factors, factors[:1].repeat(len(tokens), 0))
        seen += [tuple(np.trim_zeros(t, "b")) for t in tokens]
    assert counts == [64, 64, 22] and not seen
    for index, rows_seen in enumerate(large):
        assert rows_seen == sorted(tuple(s) for s in seqs[index * B:(index + 1) * B])


def test_each_micro_batch_takes_a_bucket_and_one_of_two_row_counts_and_every_row_once():
    seqs = sequences(150)
    adapter = get_input(dataset(seqs, "gru").padded_batch(16))
    pipeline = MicroBatches(adapter, B, B,
                            cut=cut_by_length(adapter, buckets=True, tokens=TOKENS))
    assert not pipeline.all_real()  # copies of a row pad a micro-batch to its shape
    seen, shapes, met = [], set(), 0
    for x, _, _, valid in pipeline.dataset():
        if bool(is_end_marker((valid,))):
            continue
        tokens, valid = x.inputs.numpy(), valid.numpy()
        length = tokens.shape[1]
        most = int(rows_within(TOKENS, length, B))
        real = tokens[valid > 0]
        # A large batch's longest piece comes first: its bucket, or the longest row met
        # so far where the bucket would pass it.
        met = max(met, *(len(np.trim_zeros(t, "b")) for t in real))
        assert length in TOKEN_BUCKETS or length == met, (length, met)
        assert len(tokens) in (most, (most + 1) // 2)
        assert valid[:len(real)].all() and (tokens[len(real):] == real[-1]).all()
        assert max(len(np.trim_zeros(t, "b")) for t in real) <= length
        seen += [tuple(np.trim_zeros(t, "b")) for t in real]
        shapes.add(tokens.shape)
    assert sorted(seen) == sorted(tuple(s) for s in seqs)
    assert len(shapes) <= Cut("tokens", buckets=True, tokens=TOKENS).programs(60)


@pytest.mark.parametrize("tokens", [None, 4096])
def test_a_bucket_never_reaches_past_the_longest_row_met_so_far(tokens):
    # Two large batches: the first's longest row 300 (its bucket 384, in tokens 416),
    # the second's 500 (600, 672). A model with a table of 512 positions takes 500.
    r = np.random.default_rng(0)
    seqs = [r.integers(1, 50, n).astype("int32") for n in
            [300, 30, 40, 290, 20, 10, 60, 70, 500, 35, 45, 480, 25, 15, 65, 75]]
    adapter = get_input(dataset(seqs, "gru").padded_batch(8))
    pipeline = MicroBatches(adapter, 8, 4, cut=cut_by_length(adapter, buckets=True,
                                                             tokens=tokens))
    longest = [int(x.inputs.shape[1]) for x, *_ in pipeline.dataset() if x.inputs.shape[0]]
    assert max(longest[:len(longest) // 2]) == 300 and max(longest) == 500, longest


@pytest.mark.parametrize("tokens", [None, 160])
def test_each_replica_takes_a_row_of_every_two_sorted_rows_padded_to_their_longest(tokens):
    # 185 rows: the last large batch has 57, one replica a row short (a copy, valid 0).
    seqs = sequences(185)
    adapter = get_input(dataset(seqs, "gru").padded_batch(16))
    cut = cut_by_length(adapter, tokens=tokens, replicas=2)
    rows = []
    for x, _, _, valid in MicroBatches(adapter, B, 8, TWO, cut=cut).dataset():
        if is_end_marker((valid,)):
            continue
        ids, valid = x.inputs.numpy(), valid.numpy()
        assert ids.shape[0] == 2 and ids.shape[1] <= (8 if tokens is None else 160)
        real = [np.trim_zeros(r, "b") for r in ids[valid > 0]]
        assert ids.shape[2] == max(len(r) for r in real)  # the run's longest, no more
        if tokens is not None:
            assert ids.shape[1] == 1 or ids.shape[1] * ids.shape[2] <= tokens
        rows += [tuple(r) for r in real]
    assert sorted(rows) == sorted(tuple(s) for s in seqs)  # every row once, copies 0
