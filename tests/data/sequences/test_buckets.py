"""XLA's buckets of length: each length rounded up to the next bucket, a bounded number
of them, and the sentence ``FitReport.padding`` says them with."""

from __future__ import annotations

import itertools

import numpy as np
import tensorflow as tf

from autosplit.data.sequences.buckets import (
    LENGTH_BUCKETS,
    TOKEN_BUCKETS,
    bucket_up,
    buckets_to,
    described,
    round_up,
)


def test_buckets_grow_geometrically_on_multiples_of_8():
    assert LENGTH_BUCKETS[:8] == (8, 16, 24, 32, 40, 56, 72, 96)
    assert TOKEN_BUCKETS[:8] == (8, 16, 32, 56, 96, 160, 256, 416)
    for buckets, growth in ((LENGTH_BUCKETS, 1.25), (TOKEN_BUCKETS, 1.6)):
        assert all(b % 8 == 0 for b in buckets)
        assert all(b >= a * growth for a, b in itertools.pairwise(buckets))


def test_a_length_rounds_up_to_its_bucket_as_an_int_and_as_a_tensor():
    lengths = [1, 8, 9, 57, 96, 2**25]
    expected = [8, 8, 16, 72, 96, 2**25]  # past the last bucket: itself
    assert [bucket_up(n) for n in lengths] == expected
    assert bucket_up(tf.constant([lengths], tf.int64)).numpy().tolist() == [expected]
    assert bucket_up(np.int64(33), tokens=True) == 56


def test_the_buckets_a_length_may_take_are_counted():
    assert buckets_to(512) == 16 and buckets_to(512, tokens=True) == 9
    assert buckets_to(1) == 1 and buckets_to(0) == 1
    assert round_up(13, 8) == 16 and round_up(16, 8) == 16


def test_the_buckets_are_said_as_the_report_says_them():
    assert described(tokens=True) == (
        "under XLA each length rounded up to a bucket: 8, 16, 32, 56, 96, 160, ... each "
        "1.6x; rows to what the budget holds there, or half")
