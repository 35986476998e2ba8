"""``cut_stats``: what ``FitReport.cut`` reads of a pipeline of sequences, counted by hand
on a small one."""

from __future__ import annotations

import numpy as np
import tensorflow as tf
from _sequences import cut_by_length

from autosplit.data.inputs import get_input
from autosplit.data.pipeline import MicroBatches
from autosplit.data.sequences.cut import Cut
from autosplit.data.sequences.stats import CutStats, cut_stats

# 8 rows of lengths 1..8, in two large batches of 4
SEQUENCES = [np.arange(1, n + 1, dtype="int32") for n in (1, 8, 2, 7, 3, 6, 4, 5)]


def _input():
    return get_input(tf.data.Dataset.from_generator(
        lambda: ((s, np.float32(0)) for s in SEQUENCES),
        output_signature=(tf.TensorSpec([None], tf.int32), tf.TensorSpec([], tf.float32))))


def test_padded_to_the_longest_row_each_large_batch_feeds_its_longest_times_its_rows():
    adapter = _input()
    stats = cut_stats(MicroBatches(adapter, 4, 2, cut=Cut("longest", adapter.lengths())))
    # lengths 1, 8, 2, 7 padded to 8 and 3, 6, 4, 5 to 6: 18 + 18 real of 32 + 24 cells
    assert stats == CutStats(large_batches=2, micro_batches=2.0,
                             padding_share=1 - 36 / 56, tokens=36)


def test_cut_by_length_each_micro_batch_feeds_its_own_longest_times_its_rows():
    adapter = _input()
    stats = cut_stats(MicroBatches(adapter, 4, 2, cut=cut_by_length(adapter)))
    # sorted (1, 2 | 7, 8) and (3, 4 | 5, 6): 2*2 + 2*8 + 2*4 + 2*6 = 40 cells
    assert stats == CutStats(large_batches=2, micro_batches=2.0,
                             padding_share=1 - 36 / 40, tokens=36)


def test_an_input_read_once_or_of_one_shape_has_no_stats():
    x = np.ones((8, 3), "float32")
    assert cut_stats(MicroBatches(get_input(x, x[:, 0]), 4, 2)) is None
    generator = get_input((s[None], np.zeros(1, "float32")) for s in SEQUENCES)
    assert cut_stats(MicroBatches(generator, 4, 2)) is None
