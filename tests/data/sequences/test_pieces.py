"""The pieces of a large batch sorted by length (``sequences.pieces.sorted_pieces``), read
off the pipeline: which rows each micro-batch takes, how long it is padded, on one
replica and on two, in rows, in tokens and under XLA's buckets."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from _sequences import B, cut_by_length, dataset, sequences

from autosplit.data.inputs import get_input
from autosplit.data.layout import Layout
from autosplit.data.markers import is_end_marker
from autosplit.data.pipeline import MicroBatches
from autosplit.data.sequences.buckets import TOKEN_BUCKETS
from autosplit.data.sequences.cut import Cut
from autosplit.data.sequences.length_factor import own_shape
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


def _pieces(pipeline, replicas=1):
    """Each micro-step's pieces, as each replica computes it (``own_shape``), each an
    (ids, valid) pair; None for a large batch's end (in tokens)."""
    steps = []
    for element in pipeline.dataset():
        if is_end_marker((element[3],)):
            steps.append(None)
            continue
        parts = [element] if replicas == 1 else [own_shape(tuple(
            tf.nest.map_structure(lambda t, r=r: t[r], element)), pipeline.cut.lengths,
            rows_vary=pipeline.element_rows is None)
            for r in range(replicas)]
        steps.append([(x.inputs.numpy(), valid.numpy()) for x, _, _, valid in parts])
    return steps


def _key(piece):
    return piece[0].shape, piece[0].tobytes(), piece[1].tobytes()


@pytest.mark.parametrize("tokens", [None, 160])
def test_two_replicas_take_one_devices_pieces_two_at_a_time_each_of_its_own_shape(tokens):
    # 185 rows: the last large batch has 57. Each micro-step gives each replica one of
    # the pieces one device cuts at the same m (or budget), padded to its own longest
    # row, the two neighbours in length; a step short of a piece takes a filler: one
    # row (in rows, copies of it) that weighs nothing.
    seqs = sequences(185)
    adapter = get_input(dataset(seqs, "gru").padded_batch(16))
    one = _pieces(MicroBatches(adapter, B, 8, cut=cut_by_length(adapter, tokens=tokens)))
    two = _pieces(MicroBatches(adapter, B, 8, TWO, cut=cut_by_length(adapter, tokens=tokens,
                                                                      replicas=2)), 2)
    assert one.count(None) == two.count(None) == (0 if tokens is None else 3)
    expected = []  # one device's pieces, in the pairs each micro-step should hold
    batches, batch = [], []
    for step in one + ([None] if tokens is None else []):
        if step is None:
            batches.append(batch)
            batch = []
        else:
            batch.append(step[0])
    for batch in batches:
        # token_pieces' order is the longest, the shortest, then short to long; the
        # pairs are taken from the longest down, and come in that order
        ranked = batch if tokens is None else [batch[0], *batch[:0:-1]]
        pairs = [ranked[i:i + 2] for i in range(0, len(ranked), 2)]
        if tokens is not None:
            pairs = [pairs[0], *pairs[:0:-1]]
        expected += [[_key(p) for p in pair] for pair in pairs]
    got = [[_key(p) for p in step if p[1].any()] for step in two if step is not None]
    assert got == expected
    fillers = [p for step in two if step is not None for p in step if not p[1].any()]
    assert len(fillers) == sum(len(pair) == 1 for pair in expected)
    assert all((ids == ids[:1]).all() and (1 if tokens else 8) == len(ids) for ids, _ in fillers)
