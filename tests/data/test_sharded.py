"""Sharded and tf.distribute inputs in one process (``autosplit.data.sharded``): each
step's share cut into micro-batches and ended by a marker, the inputs accepted or
refused, and arrays gathered only for this worker's rows. Two real workers train in
tests/scenarios/test_sharding.py."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from autosplit.data.inputs import get_input
from autosplit.data.layout import ALONE, Layout
from autosplit.data.markers import Ends, is_end_marker, is_header
from autosplit.data.pipeline import MicroBatches
from autosplit.data.sequences.cut import Cut
from autosplit.data.sharded import SHARE_ELEMENTS, ShardedInput, sharded_input, shards_by_length
from autosplit.errors import DatasetError


@pytest.fixture(scope="module")
def strategy():
    return tf.distribute.MirroredStrategy(["/cpu:0"])


def rows(n):
    x = np.arange(n, dtype="float32")[:, None] * np.ones((1, 3), "float32")
    return x, np.arange(n, dtype="int32")


def by_function(strategy, n, batch_size):
    return strategy.distribute_datasets_from_function(
        lambda context: tf.data.Dataset.from_tensor_slices(rows(n)).batch(
            context.get_per_replica_batch_size(batch_size)))


def large_batches(pipeline):
    """Each large batch's real rows (by x's first column), split at the markers."""
    batches, current = [], []
    for x, _, _, valid in pipeline.dataset():
        if bool(is_end_marker((x, valid))):
            batches.append(current)
            current = []
        else:
            current.append([int(v) for v, ok in zip(x[:, 0], valid, strict=True) if ok])
    assert current == []  # every large batch ends at its marker
    return batches


def test_each_share_is_cut_into_micro_batches_then_marked(strategy):
    adapter = get_input(by_function(strategy, 11, 8))
    assert isinstance(adapter, ShardedInput) and adapter.rows is None
    pipeline = MicroBatches(adapter, 8, 3, ALONE)
    assert pipeline.ends() == Ends("marker") and pipeline.steps() is None
    assert pipeline.per_batch == SHARE_ELEMENTS  # the loop stops at each share's marker
    assert large_batches(pipeline) == [[[0, 1, 2], [3, 4, 5], [6, 7]], [[8, 9, 10]]]


def test_a_distributed_dataset_is_read_as_its_worker_would(strategy):
    ds = tf.data.Dataset.from_tensor_slices(rows(10)).batch(4)
    adapter = get_input(strategy.experimental_distribute_dataset(ds))
    assert adapter.kind == "strategy.experimental_distribute_dataset(...)"
    pipeline = MicroBatches(adapter, 4, 4, ALONE)
    assert large_batches(pipeline) == [[[0, 1, 2, 3]], [[4, 5, 6, 7]], [[8, 9]]]


def test_distributed_inputs_are_refused_with_what_they_cannot_hold(strategy):
    dist = by_function(strategy, 8, 4)
    with pytest.raises(DatasetError, match=r"Expected no `y` when `x` is a tf\.distribute"):
        get_input(dist, np.zeros(8))
    triples = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((*rows(8), rows(8)[1], rows(8)[1])).batch(4))
    with pytest.raises(DatasetError, match=r"Expected the .* elements to be \(x, y\)"):
        get_input(triples)
    with pytest.raises(DatasetError, match="either `class_weight` or sample weights"):
        get_input(strategy.experimental_distribute_dataset(
            tf.data.Dataset.from_tensor_slices((*rows(8), np.ones(8, "float32"))).batch(4)),
            class_weight={0: 2.0})


def test_a_dataset_stays_as_it_is_for_one_worker_or_when_read_whole(strategy):
    ds = tf.data.Dataset.from_tensor_slices(rows(8)).batch(4)
    adapter = get_input(ds)
    assert sharded_input(adapter, strategy, ALONE, 4) is adapter
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    whole = get_input(ds.with_options(options))
    two = Layout(workers=2, worker=1, local_replicas=1, replicas=2)
    assert sharded_input(whole, strategy, two, 4) is whole
    arrays = get_input(*rows(8), shuffle=False)
    assert sharded_input(arrays, strategy, two, 4) is arrays
    # Sequences of varying length padded to the large batch's longest row (no cut, or
    # "longest": a model that reads its padding) are read whole; cut by length, sharded.
    sequences = tf.data.Dataset.from_generator(
        lambda: ((np.ones(n, "float32"), n) for n in range(1, 9)),
        output_signature=(tf.TensorSpec([None], tf.float32), tf.TensorSpec([], tf.int32)))
    varying = get_input(sequences)
    assert sharded_input(varying, strategy, two, 4) is varying
    padded = get_input(sequences.padded_batch(4))
    assert sharded_input(padded, strategy, two, 4) is padded
    longest = Cut("longest", lengths=padded.lengths())
    assert sharded_input(padded, strategy, two, 4, cut=longest) is padded
    by_length = sharded_input(padded, strategy, two, 4,
                              cut=Cut("length", lengths=padded.lengths()))
    assert isinstance(by_length, ShardedInput) and by_length.rows_vary
    assert by_length.lengths() == padded.lengths()
    # a worker of two local replicas shards them too (joined per step: SharesByLength)
    two_local = Layout(workers=2, worker=1, local_replicas=2, replicas=4)
    assert shards_by_length(padded, two_local)


@pytest.mark.parametrize("tokens", [None, 40])
def test_a_share_of_sequences_comes_as_its_header_then_pieces_cut_by_length(strategy, tokens):
    """Each share (a per-replica batch, padded as TensorFlow hands it): a header that
    holds its longest row, its rows sorted and cut, each piece padded to its own longest,
    then an end. Every real row comes once; the length factor is the share's length over the
    piece's, which the workers' agreement then brings to the large batch's."""
    lengths = [3, 17, 5, 9, 2, 11, 4, 8, 6, 1, 7, 12, 10, 2]
    examples = tf.data.Dataset.from_generator(
        lambda: ((np.arange(1, n + 1, dtype="int32"), np.float32(n)) for n in lengths),
        output_signature=(tf.TensorSpec([None], tf.int32), tf.TensorSpec([], tf.float32)))
    whole = get_input(examples.padded_batch(8))
    adapter = ShardedInput(strategy.experimental_distribute_dataset(examples.padded_batch(8)),
                           "test", lengths=whole.lengths())
    cut = Cut("tokens" if tokens else "length", lengths=whole.lengths(), tokens=tokens,
              outputs=(0,))
    pipeline = MicroBatches(adapter, 16, 3, Layout(workers=2, worker=0, local_replicas=1,
                                                   replicas=2), cut=cut)
    assert pipeline.ends().headers
    shares, current, longest = [], None, 0
    for x, y, _, valid in pipeline.dataset(autotune=False):
        if bool(is_header((valid,))):
            assert current is None  # a header opens each share, after the last one's end
            longest, current = int(x.length_factor[0, 0]), []
            continue
        assert current is not None
        if bool(is_end_marker((valid,))):
            shares.append(current)
            current = None
            continue
        real = [int(n) for n, ok in zip(y, valid, strict=True) if ok > 0]
        assert x.inputs.shape[1] == max(real)  # padded to its own longest row
        np.testing.assert_allclose(x.length_factor[:, 0], longest / max(real))
        if tokens:
            assert x.inputs.shape[0] * x.inputs.shape[1] <= tokens
        current.append(sorted(real))
    assert current is None
    # Each share's rows once, each piece a run of them sorted (in tokens, the longest
    # piece may come first: token_pieces' order)
    for share, rows in zip(shares, (lengths[:8], lengths[8:]), strict=True):
        assert [n for piece in sorted(share) for n in piece] == sorted(rows), share


@pytest.mark.parametrize("worker", [0, 1])
def test_arrays_gather_only_this_workers_rows(worker):
    """Each worker's pipeline gathers its own rows of every large batch from the arrays
    (the others' row numbers are dropped before any data is copied)."""
    x, y = rows(20)
    gathered = []
    adapter = get_input(x, y, shuffle=False)
    materialize = adapter.materialize

    def counting(numbers):
        tf.py_function(lambda n: gathered.extend(n.numpy().tolist()) or 0, [numbers], tf.int32)
        return materialize(numbers)

    adapter.materialize = counting  # type: ignore[method-assign]
    where = Layout(workers=2, worker=worker, local_replicas=1, replicas=2)
    for _ in MicroBatches(adapter, 8, 3, where).dataset(autotune=False):
        pass
    # Rows [4w, 4w + 4) of each large batch of 8; the short last one (16-19) holds
    # worker 0's share alone.
    share = [r for r in range(20) if (r % 8) // 4 == worker]
    assert sorted(set(gathered)) == share


def test_class_weight_weighs_a_distributed_inputs_rows(strategy):
    adapter = get_input(by_function(strategy, 6, 6), class_weight={0: 3.0, 2: 0.5})
    weights = [w.numpy().tolist() for _, _, w, valid in MicroBatches(
        adapter, 6, 6, ALONE).dataset() if valid.numpy().any()]
    assert weights == [[3.0, 1.0, 0.5, 1.0, 1.0, 1.0]]  # labels 0..5


def test_several_workers_take_tokens_where_each_reads_its_own_share(strategy):
    from autosplit.step.cut_choice import tokens_refused

    sequences = tf.data.Dataset.from_generator(
        lambda: ((np.ones(n, "float32"), n) for n in range(1, 9)),
        output_signature=(tf.TensorSpec([None], tf.float32), tf.TensorSpec([], tf.int32)))
    two = Layout(workers=2, worker=0, local_replicas=1, replicas=2)
    two_local = Layout(workers=2, worker=0, local_replicas=2, replicas=4)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    for adapter, where, shared in [(get_input(sequences), two, True),
                                   (get_input(sequences.padded_batch(4)), two, True),
                                   (get_input(sequences.with_options(options)), two, False),
                                   (get_input(sequences), two_local, True)]:
        refused = tokens_refused(where, False, False, shards_by_length(adapter, where))
        assert (refused is None) == shared, (adapter.kind, where, refused)
        if refused:
            assert refused.startswith("2 workers that each read the whole input"), refused
