"""What a tf.data pipeline tells of a pass before it is read: its rows and its batches'
rows, each either what iterating it finds or None."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf


def _examples(n=100):
    return tf.data.Dataset.from_tensor_slices(np.arange(n * 2, dtype="float32").reshape(n, 2))


PIPELINES = {  # name: (pipeline, counted rows, batch rows); None: not told
    "batch": (lambda: _examples().batch(16), 100, 16),
    "drop_remainder": (lambda: _examples().batch(16, drop_remainder=True), 96, 16),
    "prefetched, cached, options": (lambda: _examples().batch(16).cache().prefetch(2)
                                    .with_options(tf.data.Options()), 100, 16),
    "repeat then batch": (lambda: _examples().repeat(2).batch(16), 200, 16),
    "take then batch": (lambda: _examples().take(30).batch(16), 30, 16),
    "shuffled examples": (lambda: _examples().shuffle(100, seed=1).batch(16), 100, 16),
    "shuffled batches": (lambda: _examples().batch(16).shuffle(10, seed=1), 100, None),
    "batch of batches": (lambda: _examples().batch(4).batch(8), 25, 8),
    "cardinality asserted": (lambda: _examples().batch(16).apply(
        tf.data.experimental.assert_cardinality(7)), 100, 16),
    "batch then repeat": (lambda: _examples().batch(16).repeat(2), None, None),
    "batch then take": (lambda: _examples().batch(16).take(3), None, 16),
    "unbatched, batched again": (lambda: _examples().batch(10).unbatch().batch(16), None, 16),
    "filter then batch": (lambda: _examples().filter(lambda e: e[0] < 100).batch(16), None,
                          16),
    "a map keeping rows": (lambda: _examples().batch(16).map(lambda e: e * 2), None, 16),
    "a map cutting rows": (lambda: _examples().batch(16).map(lambda e: e[:8]), None, None),
    "a random map": (lambda: _examples().batch(16).map(
        lambda e: e + tf.random.uniform(tf.shape(e))), None, None),
    "from_tensors": (lambda: tf.data.Dataset.from_tensors(np.zeros((100, 2), "float32")),
                     100, 100),
    "from_tensors, a map cutting rows": (lambda: tf.data.Dataset.from_tensors(
        np.zeros((100, 2), "float32")).map(lambda e: e[:10]), None, None),
    "padded_batch": (lambda: _examples().padded_batch(16), 100, 16),
    "zip of batched views": (lambda: tf.data.Dataset.zip(
        (_examples().batch(16), _examples().map(lambda e: -e).batch(16))).prefetch(2), 100, 16),
    "zip of batches that differ": (lambda: tf.data.Dataset.zip(
        (_examples().batch(16), _examples().batch(20))), None, None),
}


@pytest.mark.parametrize("name", list(PIPELINES))
def test_counted_rows_and_batch_rows_are_a_real_pass_s_or_none(name):
    # What a pass holds decides every epoch boundary (counted_rows) and the validation
    # batches (batch_rows): each is either what iterating the pipeline finds, or None.
    from autosplit.data.datasets import batch_rows, counted_rows

    pipeline, rows, size = PIPELINES[name]
    batches = [int(tf.nest.flatten(b)[0].shape[0]) for b in pipeline()]
    assert counted_rows(pipeline()) == rows
    assert batch_rows(pipeline()) == size
    if rows is not None:
        assert sum(batches) == rows
    if size is not None:
        assert set(batches[:-1]) <= {size} and batches[-1] <= size


def test_a_cache_file_is_not_counted_through(tmp_path):
    # A cache file replays what it was written from: a stale one holds other rows
    # (150 here, behind a pipeline of 100), which a count would have cut short.
    path = str(tmp_path / "cache")
    list(_examples(150).batch(16).cache(path))
    stale = _examples(100).batch(16).cache(path)
    assert sum(int(b.shape[0]) for b in stale) == 150
    from autosplit.data.datasets import batch_rows, counted_rows

    assert counted_rows(stale) is None and batch_rows(stale) is None


def test_a_part_of_unknown_rank_is_refused_before_anything_runs():
    from autosplit.data.inputs import get_input
    from autosplit.errors import DatasetError

    ds = tf.data.Dataset.from_generator(
        lambda: ((np.ones(3, "float32"), np.float32(1)) for _ in range(8)),
        output_signature=(tf.TensorSpec(None, tf.float32), tf.TensorSpec([], tf.float32)))
    with pytest.raises(DatasetError, match=r"known rank.*Received: x: TensorSpec\(shape=<unknown>"):
        get_input(ds.batch(4))
