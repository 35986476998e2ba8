"""The host pipeline of micro-batches: balanced splits, the padding it marks, shuffles and
seeds per epoch, each worker's and replica's share of the rows."""

from __future__ import annotations

import itertools

import keras
import numpy as np
import pytest
import tensorflow as tf
from _inputs import B, Batches, M, N, data
from common import assert_weights_close

import autosplit
from autosplit.data.cutters import elements_per_batch
from autosplit.data.inputs import get_input
from autosplit.data.pipeline import MicroBatches
from autosplit.data.split import balanced_sizes, piece_pattern, split_batch


@pytest.mark.parametrize(("batch", "bound", "rows", "k", "padding"), [
    (250, 64, 63, 4, 2), (4096, 3000, 2048, 2, 0), (4096, 256, 256, 16, 0),
    (10, 3, 3, 4, 2), (7, 100, 7, 1, 0), (12, 1, 1, 12, 0), (50, 16, 13, 4, 2)])
def test_balanced_split(batch, bound, rows, k, padding):
    split = split_batch(batch, bound)
    assert (split.micro_batch_size, split.accumulation_steps, split.padded_rows) == (
        rows, k, padding)
    assert split.padded_rows < split.accumulation_steps or split.padded_rows == 0
    assert sum(balanced_sizes(batch, k)) == batch
    assert max(balanced_sizes(batch, k)) == rows


def test_pipeline_cuts_balanced_micro_batches_and_marks_the_padding():
    x, y, w = data(250)
    pipeline = MicroBatches(get_input(x, y, w, shuffle=False), 250, 63)
    elements = list(pipeline.dataset())
    assert len(elements) == 4 == pipeline.elements(0)
    valid = [e[3].numpy() for e in elements]
    assert [int(v.sum()) for v in valid] == [63, 63, 62, 62]
    assert all(e[0].shape == (63, 6) for e in elements)
    rows = np.concatenate([e[0].numpy()[v > 0] for e, v in zip(elements, valid, strict=True)])
    np.testing.assert_array_equal(rows, x)  # every row once, in order


@pytest.mark.parametrize("rows, batch, bound, source", [
    (256, 64, 16, "arrays"), (256, 64, 20, "arrays"),  # 4 pieces of 16
    (250, 50, 25, "arrays"),
    (256, 64, 24, "arrays"),  # pieces of 22, 21, 21: two padded
    (250, 64, 16, "arrays"),  # a short last batch
    (256, 64, 16, "examples"), (250, 64, 16, "examples"),
    (256, 64, 16, "batched"), (256, 64, 16, "unknown")])
def test_a_pipeline_is_all_real_exactly_when_no_element_holds_padding(rows, batch, bound,
                                                                         source):
    # The train step drops no padding before the metrics where all_real says none
    # comes: it must never say so of a pipeline that yields a padding row.
    x, y, w = data(rows)
    examples = tf.data.Dataset.from_tensor_slices((x, y, w))
    adapter = {"arrays": lambda: get_input(x, y, w, shuffle=False),
               "examples": lambda: get_input(examples),
               "batched": lambda: get_input(examples.batch(32)),
               "unknown": lambda: get_input(examples.filter(lambda *_: True))}[source]()
    pipeline = MicroBatches(adapter, batch, split_batch(batch, bound).micro_batch_size)
    padded = [int((e[3].numpy() == 0).sum()) for e in pipeline.dataset()]
    assert sum(padded) == len(padded) * pipeline.rows - rows  # the elements' real rows
    if source == "unknown":
        assert not pipeline.all_real()  # the input does not tell its length
    else:
        assert pipeline.all_real() == (sum(padded) == 0), padded
    if pipeline.all_real():
        # Whole elements are not padded at all (no branch in the element map): each one
        # holds the next rows of the input, every row once, in order.
        np.testing.assert_array_equal(
            np.concatenate([e[0].numpy() for e in pipeline.dataset()]), x)
        assert not branches(pipeline.dataset())
    elif source != "arrays":  # an array input's row numbers are padded branch-free
        assert branches(pipeline.dataset())


def branches(ds):
    """The ``tf.cond`` ops of the element map of a ``MicroBatches`` dataset (its last map)."""
    while not hasattr(ds, "_map_func"):
        ds = ds._input_dataset
    return [op for op in ds._map_func.function.graph.get_operations()
            if op.type in ("If", "StatelessIf")]


def row_ids_per_large_batch(pipeline, **kwargs):
    """One epoch of ``pipeline`` whose x is the row number: each large batch's rows."""
    elements = iter(pipeline.dataset(**kwargs))
    epoch = next_epoch(pipeline, elements)
    assert next(elements, None) is None
    return epoch


def next_epoch(pipeline, elements):
    """The next epoch's rows from ``elements``, an iterator of ``pipeline``, per large batch."""
    epoch = []
    for step in range(pipeline.steps()):
        pieces = itertools.islice(elements, pipeline.elements(step))
        epoch.append(np.concatenate([e[0].numpy()[e[3].numpy() > 0, 0] for e in pieces]))
    return [batch.astype(int) for batch in epoch]


def test_shuffle_batch_shuffles_within_each_large_batch_only():
    ids = np.arange(N, dtype="float32")[:, None]
    pipeline = MicroBatches(get_input(ids, np.zeros(N), shuffle="batch"), B, M)
    unshuffled = [list(range(i, min(i + B, N))) for i in range(0, N, B)]
    first, second = row_ids_per_large_batch(pipeline), row_ids_per_large_batch(pipeline)
    # Every row once per epoch, in the large batch it has unshuffled...
    assert [sorted(b) for b in first] == [sorted(b) for b in second] == unshuffled
    # ... in an order that is not the unshuffled one, and new each epoch.
    assert any(list(b) != u for b, u in zip(first, unshuffled, strict=True))
    assert any((a != b).any() for a, b in zip(first, second, strict=True))
    # A shared seed (every worker of a multi-worker job) gives one order, still batch-wise.
    seeded = [row_ids_per_large_batch(pipeline, shuffle_seed=5) for _ in range(2)]
    assert all((a == b).all() for a, b in zip(*seeded, strict=True))
    assert [sorted(b) for b in seeded[0]] == unshuffled


def test_only_a_kind_with_epoch_hooks_needs_an_iterator_per_epoch():
    # fit repeats one iterator only where the adapter's epoch hooks do nothing.
    x, y, w = data(40)
    assert not get_input(x, y, w, shuffle=True).epoch_hooks
    assert not get_input(tf.data.Dataset.from_tensor_slices((x, y)), shuffle=False).epoch_hooks
    assert get_input(Batches(x, y, w, 10), shuffle=False).epoch_hooks


def test_only_a_pipeline_of_autosplit_s_own_stages_skips_the_graph_rewrites():
    # tf.data's rewrites serialize the graph, captured arrays included, when the first
    # iterator is made (arrays.ArrayInput.graph_rewrites); the arrays pipeline is all
    # autosplit's and skips them. A dataset's own stages keep what tf.data does to them.
    x, y, w = data(40)
    for given, rewrites in ((get_input(x, y, w, shuffle=True), False),
                            (get_input(tf.data.Dataset.from_tensor_slices((x, y)),
                                       shuffle=False), None)):
        for repeat in (False, True):
            options = MicroBatches(given, 8, 4).dataset(repeat=repeat).options()
            assert options.experimental_optimization.apply_default_optimizations is rewrites


def test_the_element_map_runs_in_parallel_only_where_tf_data_autotunes():
    # As tf.data's map_parallelization rewrite does (and arrays have it off): on a GPU
    # host (autotune on) the gathers overlap; without autotuning (the CPU, every probe
    # trial) AUTOTUNE would hold up to 16 elements in flight in the step's own memory.
    x, y, w = data(40)
    for autotune in (False, True):
        ds = MicroBatches(get_input(x, y, w, shuffle=False), 8, 4).dataset(autotune=autotune)
        stages = []
        while ds is not None:
            stages.append(type(ds).__name__)
            ds = getattr(ds, "_input_dataset", None)
        assert ("_ParallelMapDataset" in stages) == autotune, stages


@pytest.mark.parametrize("shuffle", [False, True, "batch"])
def test_the_repeated_pipeline_reads_each_epoch_as_a_fresh_iterator_would(shuffle):
    # fit reads every epoch from one iterator of dataset(repeat=True) where the epoch's
    # elements are known: each epoch must hold every row once, cut at the same large
    # batches (a short last batch never borrows from the next epoch), reshuffled.
    ids = np.arange(N, dtype="float32")[:, None]
    pipeline = MicroBatches(get_input(ids, np.zeros(N), shuffle=shuffle), B, M)
    elements = iter(pipeline.dataset(repeat=True))
    epochs = [next_epoch(pipeline, elements) for _ in range(3)]
    fresh = row_ids_per_large_batch(pipeline)
    for epoch in epochs:
        assert [len(b) for b in epoch] == [len(b) for b in fresh]
        assert sorted(np.concatenate(epoch)) == list(range(N))
        if shuffle == "batch":
            assert [sorted(b) for b in epoch] == [sorted(b) for b in fresh]
    if shuffle:
        assert any((a != b).any() for a, b in zip(epochs[0], epochs[1], strict=True))
    else:
        assert all((a == b).all() for e in epochs for a, b in zip(e, fresh, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("shuffle", [True, "batch"])
def test_a_seeded_epoch_has_one_order_whichever_pipeline_reads_it(shuffle):
    # fit orders each epoch of arrays by (seed, epoch) alone. After an out-of-memory
    # recovery it builds the pipeline again at a smaller size; from the next epoch on
    # that pipeline must give the order the first one would have (a rebuilt stateful
    # shuffle began a new sequence: 2.8e-3 apart in the weights after 3 epochs).
    ids = np.arange(N, dtype="float32")[:, None]
    adapter = get_input(ids, np.zeros(N), shuffle=shuffle)
    first = MicroBatches(adapter, B, M)
    elements = iter(first.dataset(repeat=True, shuffle_seed=5))
    repeated = [next_epoch(first, elements) for _ in range(3)]
    single = [row_ids_per_large_batch(first, shuffle_seed=5, epoch=e) for e in range(3)]
    smaller = MicroBatches(adapter, B, 10)
    later = iter(smaller.dataset(repeat=True, shuffle_seed=5, epoch=1))
    rebuilt = [next_epoch(smaller, later) for _ in range(2)]
    for a, b in zip(repeated, single, strict=True):
        assert all((x == y).all() for x, y in zip(a, b, strict=True))
    for a, b in zip(repeated[1:], rebuilt, strict=True):
        assert all((x == y).all() for x, y in zip(a, b, strict=True))
    for epoch in repeated:
        assert sorted(np.concatenate(epoch)) == list(range(N))
    # A new order every epoch, and another seed gives another one.
    assert any((a != b).any() for a, b in zip(repeated[0], repeated[1], strict=True))
    other = row_ids_per_large_batch(first, shuffle_seed=6)
    assert any((a != b).any() for a, b in zip(repeated[0], other, strict=True))


def test_a_seed_leaves_the_order_of_an_input_that_keeps_its_own():
    # A dataset's order is its own (model.fit does not shuffle one): no seed changes it.
    ds = tf.data.Dataset.from_tensor_slices((np.arange(N, dtype="float32")[:, None],
                                             np.zeros(N)))
    pipeline = MicroBatches(get_input(ds), B, M)
    assert not pipeline.adapter.shuffles
    plain = row_ids_per_large_batch(pipeline)
    assert [list(b) for b in plain] == [list(range(i, min(i + B, N))) for i in range(0, N, B)]
    seeded = row_ids_per_large_batch(pipeline, shuffle_seed=5, epoch=2)
    assert all((a == b).all() for a, b in zip(plain, seeded, strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("pipeline", ["shuffle", "random_map"])
def test_a_pipeline_that_draws_random_numbers_is_not_read_ahead(pipeline):
    # keras-io mixup's form: shuffle(n, seed).batch(B). Its batches' row counts are known
    # at run time only, and a first batch read to check them made an iterator more,
    # which moved the seeded shuffle on: the first epoch saw another order than
    # model.fit's (0.20 relative off). A seeded random map draws per iterator as well.
    r = np.random.default_rng(0)
    x, y = r.normal(size=(90, 4)).astype("float32"), r.normal(size=(90, 1)).astype("float32")

    def data():
        ds = tf.data.Dataset.from_tensor_slices((x, y))
        if pipeline == "shuffle":
            return ds.shuffle(90, seed=5).batch(32)
        return ds.batch(32).map(lambda a, b: (a + tf.random.uniform(tf.shape(a), seed=3), b))

    def make():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        return model

    reference, candidate = make(), make()
    tf.random.set_seed(1)
    expected = reference.fit(data(), epochs=1, shuffle=False, verbose=0).history
    tf.random.set_seed(1)
    got = autosplit.fit_large_batch(candidate, data(), batch_size=32, micro_batch_size=7,
                                    verbose=0).history
    assert_weights_close(reference.get_weights(), candidate.get_weights(), rtol=1e-5)
    np.testing.assert_allclose(got["loss"], expected["loss"], rtol=1e-5)


def test_worker_shares_and_local_replicas_cover_every_row_once():
    for workers in (1, 2, 4):
        seen = []
        for worker in range(workers):
            pattern = piece_pattern(96, 5, workers=workers, worker=worker, local_replicas=2)
            assert sum(p.rows for p in pattern) == 96
            assert max(p.rows for p in pattern) <= 5
            start = 0
            for p in pattern:
                if p.keep:
                    seen += list(range(start, start + p.rows))
                start += p.rows
            kept = sum(p.keep for p in pattern)
            assert kept % 2 == 0  # every local replica gets the same number of pieces
            assert elements_per_batch(pattern, 96, 2) == kept // 2
        assert sorted(seen) == list(range(96))
