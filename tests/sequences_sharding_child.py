"""One worker of two on localhost (``TF_CONFIG``) training a per-token language model on
record files of token ids of varying length, as a user would:
``python tests/sequences_sharding_child.py RECORDS_DIR OUT [oom | local]``; ``local``: on
two local replicas (:func:`two_local_replicas`), a few of the runs.

Per run it saves the weights (``OUT.<run>.npz``) and, once, the padded batches
TensorFlow's own distributed iterator hands this worker step by step from
``padded_batch(B)`` (``OUT.batches.npz``: this worker's share of each large batch). In
``OUT.json``: per run the rows its pipeline parsed per epoch, ``iterations``, the logs
and how ``FitReport`` says the batch was cut; then translation pairs, which the helper
of ``tests/data/test_pairs.py`` checks against model.fit in the worker itself.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "data", "sequences"))
import _pairs
from _sequences import model_of

import autosplit

B, EPOCHS = 24, 2
# run -> (the user's batches: None for examples, options)
RUNS = {"rows": (None, {"micro_batch_size": 4}),
        "tokens": (None, {"micro_batch_tokens": 60}),
        "batched": (10, {"micro_batch_size": 4}),
        "auto": (None, {"micro_batch_tokens": "auto"}),  # the probe's budget, in lockstep
        "xla": (None, {"micro_batch_tokens": 60, "jit_compile": True}),
        "mixed": (None, {"micro_batch_tokens": 60})}  # under mixed_float16
LOCAL_RUNS = ("rows", "tokens", "xla", "mixed")  # on two local replicas per worker


def two_local_replicas():
    """Two logical CPUs in this worker and a MultiWorkerMirroredStrategy replica on each,
    as on a worker of two GPUs. TensorFlow places one replica on a worker without GPUs
    (``CollectiveAllReduceExtended._initialize_local_devices``: one CPU device), so its
    device list is replaced, before any strategy is made; the devices, the collectives
    across the four replicas and the distributed iterator are TensorFlow's own."""
    from tensorflow.python.distribute import collective_all_reduce_strategy as collective

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

    def two_cpus(self, cluster_resolver, worker_device):
        return tuple(f"{worker_device}/device:CPU:{i}" for i in range(2)), "CPU"

    collective.CollectiveAllReduceExtended._initialize_local_devices = two_cpus


class Reads(keras.callbacks.Callback):
    """Rows this worker's pipeline parsed in each epoch: a map that counts each record."""

    def __init__(self) -> None:
        super().__init__()
        self.count, self.per_epoch, self._start = 0, [], 0

    def parse(self, record):
        def bump(n):
            self.count += int(n)
            return n

        ids = tf.sparse.to_dense(tf.io.parse_single_example(
            record, {"ids": tf.io.VarLenFeature(tf.int64)})["ids"])
        ids = tf.cast(ids, tf.int32)
        with tf.control_dependencies([tf.py_function(bump, [tf.constant(1)], tf.int32)]):
            return tf.identity(ids[:-1]), ids[1:], tf.ones(tf.shape(ids[1:]), tf.float32)

    def on_epoch_begin(self, epoch, logs=None):
        self._start = self.count

    def on_epoch_end(self, epoch, logs=None):
        self.per_epoch.append(self.count - self._start)


def examples(records, reads):
    """What users write: the files read and parsed, one example of varying length each."""
    names = sorted(os.path.join(records, name) for name in os.listdir(records))
    return tf.data.TFRecordDataset(names).map(reads.parse)


def tf_batches(strategy, records, out):
    """This worker's share of every step, as TensorFlow's iterator hands it from
    ``padded_batch(B)``: what each worker of model.fit would train on."""
    x = strategy.experimental_distribute_dataset(examples(records, Reads()).padded_batch(B))
    arrays = {}
    for step, element in enumerate(x):
        for part, value in enumerate(element):
            arrays[f"{step}_{part}"] = joined(strategy.experimental_local_results(value))
    np.savez(f"{out}.batches.npz", **arrays)


def joined(parts):
    """The local replicas' batches of one step as one, padded with zeros to the longest."""
    arrays = [part.numpy() for part in parts]
    most = np.max([a.shape for a in arrays], axis=0)
    return np.concatenate([np.pad(a, [(0, 0)] + [(0, m - n) for m, n in zip(
        most[1:], a.shape[1:], strict=True)]) for a in arrays])


def train(strategy, records, run, out):
    batched, options = RUNS[run]
    keras.mixed_precision.set_global_policy("mixed_float16" if run == "mixed" else "float32")
    try:
        with strategy.scope():
            model = model_of("lm_sample_weight", jit_compile=options.get("jit_compile", False))
        reads = Reads()
        x = examples(records, reads)
        if batched:
            x = x.padded_batch(batched)
        history = autosplit.fit_large_batch(model, x, batch_size=B, epochs=EPOCHS, verbose=0,
                                            cache=False, callbacks=[reads], **options)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    scale = getattr(model.optimizer, "dynamic_scale", None)
    np.savez(f"{out}.{run}.npz", *model.get_weights())
    return {"reads_per_epoch": reads.per_epoch,
            "iterations": int(model.optimizer.iterations.numpy()),
            "logs": history.history, "padding": history.autosplit.padding,
            "input": history.autosplit.input, "tokens": history.autosplit.tokens,
            "programs": history.autosplit.programs,
            "padding_share": history.autosplit.cut.padding_share,
            "loss_scale": None if scale is None else float(scale.numpy())}


def oom(records, out):
    """Only the run under a cap (worker 1's, set by the parent): the language model
    behind ``HungryRows``, whose micro-batch with the marked row runs out of memory on
    this worker; in ``OUT.json`` its report, with the recoveries."""
    options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=120.0)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    tf_batches(strategy, records, out)
    with strategy.scope():
        model = model_of("lm_hungry")
    reads = Reads()
    report = {}
    try:
        history = autosplit.fit_large_batch(model, examples(records, reads), batch_size=B,
                                            epochs=EPOCHS, verbose=0, cache=False,
                                            callbacks=[reads], micro_batch_tokens=60)
        report = {"reads_per_epoch": reads.per_epoch, "logs": history.history,
                  "iterations": int(model.optimizer.iterations.numpy()),
                  "padding": history.autosplit.padding, "tokens": history.autosplit.tokens,
                  "recoveries": [dataclasses.asdict(r) for r in history.autosplit.oom_recoveries]}
        np.savez(f"{out}.oom.npz", *model.get_weights())
    except Exception as exc:  # reported to the parent, which checks the type and text
        report["error"] = f"{type(exc).__name__}: {exc}"[:3000]
    with open(f"{out}.json", "w") as handle:
        handle.write(json.dumps(report))


def main(records, out, local=False):
    if local:
        two_local_replicas()
    options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=60.0)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    assert strategy.num_replicas_in_sync == (4 if local else 2), strategy.num_replicas_in_sync
    tf_batches(strategy, records, out)
    report = {run: train(strategy, records, run, out) for run in (LOCAL_RUNS if local else RUNS)}
    # Translation pairs of two lengths from a generator (no files: AUTO shards by DATA,
    # each worker reading every row and keeping its half of each large batch); the
    # helper asserts they train as single-device model.fit on padded_batch(B).
    for kind, optimizer, given in (("gru", "adam", {"micro_batch_size": 8}),
                                   ("transformer", "sgd", {"micro_batch_tokens": 360})):
        got = _pairs.pairs_train_as_model_fit(kind, optimizer=optimizer, strategy=strategy, **given)
        full = _pairs.large_batch_padding(_pairs.examples(_pairs.pairs(), kind)
                                          .padded_batch(_pairs.B))
        report[f"pairs_{kind}"] = {"padding": got.autosplit.padding,
                                   "input": got.autosplit.input, "full": full,
                                   "padding_share": got.autosplit.cut.padding_share}
    with open(f"{out}.json", "w") as handle:
        handle.write(json.dumps(report))


if __name__ == "__main__":
    if sys.argv[3:] == ["oom"]:
        oom(sys.argv[1], sys.argv[2])
    else:
        main(sys.argv[1], sys.argv[2], local=sys.argv[3:] == ["local"])
