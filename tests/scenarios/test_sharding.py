"""Two workers on localhost, each reading only its share of four record files: tf.data
sharded as model.fit shards it (FILE, DATA, OFF, AUTO), and tf.distribute inputs
(``experimental_distribute_dataset``, ``distribute_datasets_from_function``); rows read
per worker counted, weights compared with single-device steps on the union of what
TensorFlow's own distributed iterator hands the two workers in each step."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tensorflow as tf
from common import TESTS, local_workers, relative_error, saved_steps

pytestmark = pytest.mark.slow

FILE_ROWS = (25, 25, 25, 23)  # 98 rows; worker 0 reads files 0 and 2, worker 1 files 1 and 3
TOTAL = sum(FILE_ROWS)


def write_records(directory):
    """Four record files of (x, y, w) rows, and every row in file order."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(TOTAL, 12)).astype("float32")
    y = rng.integers(0, 5, size=TOTAL).astype("int32")
    w = rng.uniform(0.1, 2.0, size=TOTAL).astype("float32")
    start = 0
    for index, rows in enumerate(FILE_ROWS):
        with tf.io.TFRecordWriter(str(directory / f"part-{index}.tfrecord")) as writer:
            for i in range(start, start + rows):
                features = {"x": tf.train.Feature(float_list=tf.train.FloatList(value=x[i])),
                            "y": tf.train.Feature(int64_list=tf.train.Int64List(value=[y[i]])),
                            "w": tf.train.Feature(float_list=tf.train.FloatList(value=[w[i]]))}
                example = tf.train.Example(features=tf.train.Features(feature=features))
                writer.write(example.SerializeToString())
        start += rows
    return x, y, w


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    """Both workers' reports and the path prefix of their saved arrays."""
    tmp = tmp_path_factory.mktemp("sharding")
    records = tmp / "records"
    records.mkdir()
    rows = write_records(records)
    codes = local_workers(lambda index: [str(TESTS / "sharding_child.py"), str(records),
                                         str(tmp / f"worker{index}")], tmp)
    assert codes == [0, 0], (tmp / "worker0.stderr").read_text()[-3000:]
    reports = [json.loads((tmp / f"worker{i}.json").read_text()) for i in range(2)]
    return reports, [tmp / f"worker{i}" for i in range(2)], rows


def tf_steps(prefix, run):
    """The (x, y, w) batches TensorFlow's iterator gave one worker, step by step."""
    return saved_steps(f"{prefix}.{run}.batches.npz")


def reference(optimizer, global_batches, epochs=2):
    """Single-device model.fit, one step per global batch: its weights, iterations and
    logs."""
    from strategy_child import OPTIMIZERS, make

    signature = (tf.TensorSpec([None, 12], tf.float32), tf.TensorSpec([None], tf.int32),
                 tf.TensorSpec([None], tf.float32))
    batches = tf.data.Dataset.from_generator(lambda: iter(global_batches),
                                             output_signature=signature).apply(
        tf.data.experimental.assert_cardinality(len(global_batches)))
    with tf.distribute.OneDeviceStrategy("/cpu:0").scope():
        model = make(OPTIMIZERS[optimizer])
    history = model.fit(batches, epochs=epochs, shuffle=False, verbose=0)
    return model.get_weights(), int(model.optimizer.iterations.numpy()), history.history


def unions(prefixes, run):
    """Each step's global batch: worker 0's rows, then worker 1's (none once its data
    ended)."""
    per_worker = [tf_steps(prefix, run) for prefix in prefixes]
    assert len(per_worker[0]) == len(per_worker[1])
    return [tuple(np.concatenate([a[i], b[i]]) for i in range(3))
            for a, b in zip(*per_worker, strict=True)]


def whole(rows, batch_size):
    """Every row in file order, in global batches: what one device trains on."""
    return [tuple(part[i:i + batch_size] for part in rows) for i in range(0, TOTAL,
                                                                           batch_size)]


def weights(prefix, run):
    saved = np.load(f"{prefix}.{run}.npz")
    return [saved[f"arr_{i}"] for i in range(len(saved.files))]


def check_run(workers_, run, optimizer, batches, rtol):
    reports, prefixes, _ = workers_
    expected, iterations, logs = reference(optimizer, batches)
    errors = []
    for report, prefix in zip(reports, prefixes, strict=True):
        result = report["runs"][run]
        assert result["iterations"] == iterations, (run, result)
        errors.append(relative_error(expected, weights(prefix, run)))
        for key, values in logs.items():
            np.testing.assert_allclose(result["logs"][key], values, rtol=rtol, atol=1e-6)
    assert max(errors) <= rtol, (run, errors)
    print(f"{run}: weights {max(errors):.1e} from single-device steps on the same global "
          f"batches, {iterations} iterations")
    return expected


def test_file_sharding_reads_each_workers_files_and_trains_as_model_fit_would(workers):
    reports, prefixes, _ = workers
    reads = [r["runs"]["file"]["reads_per_epoch"] for r in reports]
    assert reads == [50, 48], reads  # files 0, 2 and 1, 3: about 1/W each, not W/W
    steps = unions(prefixes, "file")
    # B = 24: each worker's files batched by 24, cut by TensorFlow into per-worker
    # batches of 12; worker 0 has one more (2 rows) than worker 1.
    assert [len(s[0]) for s in steps] == [24, 24, 24, 24, 2], [len(s[0]) for s in steps]
    expected = check_run(workers, "file", "sgd", steps, 1e-5)
    # Read whole, each worker keeping its share of the whole (OFF, all there was before):
    # other global batches, other weights.
    whole_read = relative_error(expected, weights(prefixes[0], "off"))
    print(f"file: read whole instead, the weights differ by {whole_read:.1e}")
    assert whole_read > 1e-3, whole_read
    # AUTO finds the files, as model.fit's does, and an experimental_distribute_dataset
    # of the same dataset is read alike.
    assert [r["runs"]["auto"]["reads_per_epoch"] for r in reports] == reads
    assert [r["runs"]["distributed"]["reads_per_epoch"] for r in reports] == reads
    check_run(workers, "auto", "sgd", steps, 1e-5)
    check_run(workers, "distributed", "sgd", steps, 1e-5)
    # micro_batch_size="auto": the lockstep search on the workers' own shares.
    assert all(1 <= r["runs"]["searched"]["micro_batch_size"] <= 12 for r in reports)
    check_run(workers, "searched", "sgd", steps, 1e-5)
    # Batched by 10, trained at batch_size=24: as model.fit would shard it batched by 24.
    assert [r["runs"]["rebatched"]["reads_per_epoch"] for r in reports] == reads
    check_run(workers, "rebatched", "sgd", steps, 1e-5)


def test_even_shares_train_as_kerass_own_step_under_the_strategy(workers):
    """Batches of 24 alone (drop_remainder): every step's shares are 12 and 12 rows, and
    autosplit trains what Keras's own train_step under the strategy trains, step by
    step over TensorFlow's iterator (model.fit's loop, were its logs' reduce not to
    fail); on uneven shares Keras weighs each replica's mean alike, autosplit each row."""
    _, prefixes, _ = workers
    steps = unions(prefixes, "even")
    assert [len(s[0]) for s in steps] == [24] * 4
    expected = check_run(workers, "even", "sgd", steps, 1e-5)
    keras = [weights(prefix, "even.keras") for prefix in prefixes]
    for own in keras:
        assert relative_error(own, weights(prefixes[0], "even")) <= 1e-5
        assert relative_error(expected, own) <= 1e-5
    print(f"even: Keras's own step under the strategy, "
          f"{relative_error(keras[0], weights(prefixes[0], 'even')):.1e} away")
    # A last step of 10 + 8 rows: Keras averages the two replicas' means, autosplit the
    # 18 rows, as one device does on them.
    apart = relative_error(weights(prefixes[0], "function.keras"),
                           weights(prefixes[0], "function"))
    print(f"function: Keras's own step under the strategy, {apart:.1e} away")
    assert apart > 1e-4, apart


def test_data_sharding_reads_everything_and_keeps_a_share_as_tensorflow_does(workers):
    reports, prefixes, rows = workers
    assert [r["runs"]["data"]["reads_per_epoch"] for r in reports] == [TOTAL, TOTAL]
    steps = unions(prefixes, "data")
    for got, expected in zip(steps, whole(rows, 24), strict=True):
        np.testing.assert_array_equal(got[0], expected[0])  # each global batch in order
    check_run(workers, "data", "sgd", steps, 1e-5)


def test_off_reads_everything_and_keeps_a_share(workers):
    reports, _, rows = workers
    assert [r["runs"]["off"]["reads_per_epoch"] for r in reports] == [TOTAL, TOTAL]
    check_run(workers, "off", "sgd", whole(rows, 24), 1e-5)


def test_distribute_datasets_from_function_reads_its_own_files(workers):
    reports, prefixes, _ = workers
    assert [r["runs"]["function"]["reads_per_epoch"] for r in reports] == [50, 48]
    steps = unions(prefixes, "function")
    assert [len(s[0]) for s in steps] == [40, 40, 18], [len(s[0]) for s in steps]
    check_run(workers, "function", "adam", steps, 1e-4)


def test_keras_model_fit_fails_under_two_workers(workers):
    """Keras 3.15's own model.fit under a 2-worker MultiWorkerMirroredStrategy fails at
    its first step (tensorflow#72388): the day it trains, compare it with autosplit
    directly."""
    reports, _, _ = workers
    for report in reports:
        failed = report["model_fit_error"]
        assert failed is not None, "model.fit trains now: compare it with autosplit"
        # A strategy.reduce of the batch's per-replica values, made into a tensor.
        assert failed["error"].startswith("ValueError: Attempt to convert a value "
                                          "(PerReplica:"), failed
        assert "tensorflow/python/distribute/cross_device_ops.py:reduce" in failed["frames"]


def test_one_large_batch_all_reduces_a_fixed_few_times_and_never_in_its_loop(workers):
    """Per large batch, whatever W and the micro-batches: the agreement (an ok flag and
    the rows), then in the apply the scalar loss sums, the gradients (one pack) and, to
    log them, each metric's total and count (loss and accuracy here); none in the loop."""
    reports, _, _ = workers
    for report in reports:
        counts = report["collectives"]
        assert counts == {"loop": 0, "agreement": 1, "apply": 1 + 1 + 2 * 2}, counts
