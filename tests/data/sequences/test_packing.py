"""How a large batch's sorted rows are cut under a token budget: the least work, checked
against every way of cutting a small batch, and the fullest, which the probe's trials
run."""

import functools
import itertools

import numpy as np
import pytest
import tensorflow as tf

from autosplit.data.sequences.packing import STEP_COST, token_pieces


@functools.cache
def _traced(tokens, cap, packing):
    # as the pipeline runs it: in a graph (run eagerly, 1,000 loop turns take seconds)
    return tf.function(lambda lengths: token_pieces(lengths, tokens, cap, packing)[:2])


def _pieces(lengths, tokens, cap=None, packing="least_work"):
    lengths = tf.constant(lengths, tf.int64, shape=[len(lengths)])
    starts, ends = _traced(tokens, cap, packing)(lengths)
    starts, ends = starts.numpy().tolist(), ends.numpy().tolist()
    assert (starts[-1], ends[-1]) == (len(lengths), len(lengths))  # the large batch's end
    return list(zip(starts[:-1], ends[:-1], strict=True))


def _work(lengths, pieces, tokens):
    return sum((b - a) * lengths[b - 1] + int(tokens * STEP_COST) for a, b in pieces)


def _least_work_by_hand(lengths, tokens, cap):
    """The least work over every set of boundaries that keeps each piece in the budget."""
    n, best = len(lengths), None
    for count in range(n):
        for cuts in itertools.combinations(range(1, n), count):
            bounds = [0, *cuts, n]
            pieces = list(itertools.pairwise(bounds))
            if all(b - a == 1 or ((b - a) * lengths[b - 1] <= tokens
                                  and (cap is None or b - a <= cap)) for a, b in pieces):
                work = _work(lengths, pieces, tokens)
                best = work if best is None else min(best, work)
    return best


def _check_cover(pieces, n, lengths, tokens, cap):
    # every row once; each piece within the budget (or a single row) and the cap
    assert sorted(r for a, b in pieces for r in range(a, b)) == list(range(n))
    for a, b in pieces:
        assert b - a >= 1 and (cap is None or b - a <= cap)
        assert b - a == 1 or (b - a) * lengths[b - 1] <= tokens


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("cap", [None, 3])
def test_the_least_work_cut_is_the_best_of_every_cut(seed, cap):
    r = np.random.default_rng(seed)
    lengths = sorted(r.integers(1, 40, 9).tolist())
    tokens = int(r.integers(40, 120))
    pieces = _pieces(lengths, tokens, cap)
    _check_cover(pieces, len(lengths), lengths, tokens, cap)
    assert _work(lengths, pieces, tokens) == _least_work_by_hand(lengths, tokens, cap)


@pytest.mark.parametrize("packing", ["least_work", "fullest"])
def test_the_longest_piece_comes_first_then_the_shortest(packing):
    lengths = sorted(np.random.default_rng(0).integers(2, 60, 200).tolist())
    pieces = _pieces(lengths, 240, packing=packing)
    _check_cover(pieces, 200, lengths, 240, None)
    assert pieces[0][1] == 200 and pieces[1][0] == 0
    assert [a for a, _ in pieces[1:]] == sorted(a for a, _ in pieces[1:])


def test_the_fullest_cut_fills_each_piece_from_the_longest_down():
    lengths = [3, 3, 4, 5, 8, 10, 10, 20, 20, 30]
    assert _pieces(lengths, 60, packing="fullest") == [(8, 10), (0, 5), (5, 8)]


@functools.cache
def _corpus(n, seed=0):
    # lognormal lengths as in benchmarks/sequences.py: median 44, longest 625
    drawn = np.random.default_rng(seed).lognormal(np.log(44), 0.77, n)
    return sorted(np.clip(drawn, 2, 625).astype(int).tolist())


def test_on_a_heavy_tailed_batch_the_least_work_cut_feeds_far_less_padding():
    lengths, tokens = _corpus(256), 32 * 625

    def padding(pieces):
        return 1 - sum(lengths) / sum((b - a) * lengths[b - 1] for a, b in pieces)

    least, fullest = _pieces(lengths, tokens), _pieces(lengths, tokens, packing="fullest")
    assert _work(lengths, least, tokens) < _work(lengths, fullest, tokens)
    assert padding(least) < 0.75 * padding(fullest)


def test_a_large_batch_past_the_boundaries_it_weighs_is_cut_in_blocks_within_the_budget():
    # 20,000 rows: boundaries every 20 rows from the longest, each block within budget
    lengths, tokens = _corpus(20_000), 32 * 625
    pieces = _pieces(lengths, tokens)
    _check_cover(pieces, len(lengths), lengths, tokens, None)
    assert all((20_000 - b) % 20 == 0 for _, b in pieces)


def test_an_empty_large_batch_has_its_end_alone():
    assert _pieces([], 100) == [] and _pieces([], 100, packing="fullest") == []


# A pair's two lengths (a source's and a target's): a piece costs its rows times the sum
# of its longest source and its longest target, which need not be its last row's.

def _pair_pieces(pairs, tokens, cap=None, packing="least_work"):
    lengths = tf.constant(pairs, tf.int64, shape=[len(pairs), 2])
    starts, ends = _traced(tokens, cap, packing)(lengths)
    return list(zip(starts.numpy().tolist()[:-1], ends.numpy().tolist()[:-1], strict=True))


def _pair_cells(pairs, a, b):
    return (b - a) * (max(s for s, _ in pairs[a:b]) + max(t for _, t in pairs[a:b]))


def _pairs(seed, n=9):
    r = np.random.default_rng(seed)
    source = r.integers(1, 30, n)
    target = np.clip(source + r.integers(-8, 9, n), 1, None)
    return sorted(zip(source.tolist(), target.tolist(), strict=True), key=sum)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("cap", [None, 3])
def test_with_two_lengths_the_least_work_cut_is_the_best_of_every_cut(seed, cap):
    pairs, n = _pairs(seed), 9
    tokens = int(np.random.default_rng(seed).integers(60, 200))
    step = int(tokens * STEP_COST)

    def fits(a, b):
        return b - a == 1 or (_pair_cells(pairs, a, b) <= tokens and (cap is None or b - a <= cap))

    cuts = [list(itertools.pairwise([0, *inner, n])) for count in range(n)
            for inner in itertools.combinations(range(1, n), count)]
    best = min(sum(_pair_cells(pairs, a, b) + step for a, b in pieces) for pieces in cuts
               if all(fits(a, b) for a, b in pieces))
    pieces = _pair_pieces(pairs, tokens, cap)
    assert sorted(r for a, b in pieces for r in range(a, b)) == list(range(n))
    assert all(fits(a, b) for a, b in pieces)
    assert sum(_pair_cells(pairs, a, b) + step for a, b in pieces) == best


def test_with_two_lengths_the_fullest_cut_holds_as_many_rows_as_fit():
    pairs = _pairs(0, 60)
    pieces = _pair_pieces(pairs, 150, packing="fullest")
    assert sorted(r for a, b in pieces for r in range(a, b)) == list(range(60))
    for a, b in pieces:
        assert b - a == 1 or _pair_cells(pairs, a, b) <= 150
        assert a == 0 or _pair_cells(pairs, a - 1, b) > 150  # one more row would not fit
