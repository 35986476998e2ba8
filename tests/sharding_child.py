"""One worker of two on localhost (``TF_CONFIG``) training on record files, each run as
a user would: ``python tests/sharding_child.py RECORDS_DIR OUT``.

Per run it saves the weights (``OUT.<run>.npz``), the batches TensorFlow's own
distributed iterator hands this worker, step by step (``OUT.<run>.batches.npz``: what
``model.fit`` would train this worker on), and in ``OUT.json`` the rows its pipeline read
per epoch, ``iterations``, the logs, and ``model.fit``'s own outcome under the strategy.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf
from strategy_child import OPTIMIZERS, count_all_reduces, make

import autosplit
from autosplit.data.inputs import get_input
from autosplit.data.layout import layout
from autosplit.data.pipeline import MicroBatches
from autosplit.data.sharded import sharded_input
from autosplit.step.loop import Pull
from autosplit.step.train_step import step_for

FEATURES = {"x": tf.io.FixedLenFeature([12], tf.float32),
            "y": tf.io.FixedLenFeature([], tf.int64),
            "w": tf.io.FixedLenFeature([], tf.float32)}
POLICIES = {"file": tf.data.experimental.AutoShardPolicy.FILE,
            "data": tf.data.experimental.AutoShardPolicy.DATA,
            "off": tf.data.experimental.AutoShardPolicy.OFF,
            "auto": tf.data.experimental.AutoShardPolicy.AUTO}
EPOCHS = 2
# run -> (how the input is made, its policy or None, batch_size, optimizer, micro-batch)
RUNS = {"file": ("dataset", "file", 24, "sgd", 5), "data": ("dataset", "data", 24, "sgd", 5),
        "off": ("dataset", "off", 24, "sgd", 5), "auto": ("dataset", "auto", 24, "sgd", 5),
        "searched": ("dataset", "file", 24, "sgd", "auto"),
        "rebatched": ("dataset", "file", 10, "sgd", 5),  # trained at batch_size=24
        "even": ("even", "file", 24, "sgd", 5),  # batches of 24 alone: even shares
        "distributed": ("distributed", "file", 24, "sgd", 5),
        "function": ("function", None, 40, "adam", 5)}


class Reads:
    """Rows this worker's pipelines parsed: a map that counts each record it parses."""

    def __init__(self) -> None:
        self.count = 0

    def parse(self, record):
        def bump(n):
            self.count += int(n)
            return n

        parsed = tf.io.parse_single_example(record, FEATURES)
        tick = tf.py_function(bump, [tf.constant(1, tf.int64)], tf.int64)
        with tf.control_dependencies([tick]):
            return tf.identity(parsed["x"]), tf.cast(parsed["y"], tf.int32), parsed["w"]


def files(records):
    return sorted(os.path.join(records, name) for name in os.listdir(records))


def dataset(records, reads, policy, batch_size, drop_remainder=False):
    """What users write: the files, read and parsed, batched by the global batch."""
    ds = tf.data.TFRecordDataset(files(records)).map(reads.parse).batch(
        batch_size, drop_remainder=drop_remainder)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = POLICIES[policy]
    return ds.with_options(options)


def by_function(records, reads, batch_size):
    """Each worker builds only its own pipeline from its InputContext."""
    def fn(context):
        names = tf.data.Dataset.from_tensor_slices(files(records)).shard(
            context.num_input_pipelines, context.input_pipeline_id)
        ds = names.interleave(tf.data.TFRecordDataset, cycle_length=1)
        return ds.map(reads.parse).batch(context.get_per_replica_batch_size(batch_size))
    return fn


def make_input(strategy, records, reads, run):
    how, policy, batch_size, *_ = RUNS[run]
    if how == "function":
        return strategy.distribute_datasets_from_function(by_function(records, reads,
                                                                      batch_size))
    ds = dataset(records, reads, policy, batch_size, drop_remainder=how == "even")
    return strategy.experimental_distribute_dataset(ds) if how == "distributed" else ds


def tf_batches(strategy, records, run, out):
    """The batches TensorFlow's distributed iterator gives this worker, one per step:
    what model.fit trains this worker on (an empty one once its data ended)."""
    x = make_input(strategy, records, Reads(), run)
    if isinstance(x, tf.data.Dataset):
        x = strategy.experimental_distribute_dataset(x)
    steps = []
    for element in x:
        local = [strategy.experimental_local_results(part)[0].numpy() for part in element]
        steps.append(local)
    arrays = {f"{s}_{p}": part for s, local in enumerate(steps) for p, part in
              enumerate(local)}
    np.savez(f"{out}.{run}.batches.npz", **arrays)
    return len(steps)


def train(strategy, records, run, out):
    _, _, batch_size, optimizer, micro = RUNS[run]
    with strategy.scope():
        model = make(OPTIMIZERS[optimizer])
    reads = Reads()
    x = make_input(strategy, records, reads, run)
    history = autosplit.fit_large_batch(model, x, batch_size=24 if run == "rebatched" else
                                        batch_size, micro_batch_size=micro,
                                        epochs=EPOCHS, verbose=0, cache=False)
    np.savez(f"{out}.{run}.npz", *model.get_weights())
    return {"reads_per_epoch": reads.count / EPOCHS,
            "iterations": int(model.optimizer.iterations.numpy()),
            "logs": history.history, "micro_batch_size": history.autosplit.micro_batch_size}


def collectives(strategy, records):
    """Collective all-reduce ops in the three compiled functions a worker calls for each
    large batch (the local loop, the agreement, the apply), as training traced them."""
    with strategy.scope():
        model = make(OPTIMIZERS["sgd"])
    autosplit.fit_large_batch(model, dataset(records, Reads(), "file", 24), batch_size=24,
                              micro_batch_size=5, verbose=0)
    where = layout(strategy)
    adapter = sharded_input(get_input(dataset(records, Reads(), "file", 24)), strategy,
                            where, 24)
    pipeline = MicroBatches(adapter, 24, 5, where)
    step = step_for(model, pipeline)  # the step training built, kept on the model
    iterator = iter(pipeline.dataset())
    functions = {
        "loop": (step._function("local", step._local, how=Pull("marker")),
                 (iterator, tf.constant(1, tf.int32))),
        "agreement": (step._function("agree", step.update.replicas.vote),
                      (tf.constant(0.0), tf.constant(1.0))),
        "apply": (step._function("finish", step.update.apply), ())}
    return {name: sum(count_all_reduces(fn.get_concrete_function(*args).graph.as_graph_def())
                      .values()) for name, (fn, args) in functions.items()}


def keras_steps(strategy, records, run, out):
    """Keras's own train_step in a plain loop over TensorFlow's distributed iterator:
    what model.fit would train, were its reduce of the logs not to fail."""
    _, _, _, optimizer, _ = RUNS[run]
    with strategy.scope():
        model = make(OPTIMIZERS[optimizer])
    x = make_input(strategy, records, Reads(), run)
    if isinstance(x, tf.data.Dataset):
        x = strategy.experimental_distribute_dataset(x)

    @tf.function
    def step(batch):
        strategy.run(model.train_step, args=(batch,))

    for _ in range(EPOCHS):
        for batch in x:
            step(batch)
    np.savez(f"{out}.{run}.keras.npz", *model.get_weights())


def keras_fit(strategy, records):
    """Keras's own model.fit on the FILE-sharded dataset under the same strategy."""
    with strategy.scope():
        model = make(OPTIMIZERS["sgd"])
    keras.config.disable_traceback_filtering()  # the frames say where it fails
    try:
        model.fit(dataset(records, Reads(), "file", 24), epochs=1, verbose=0)
    except Exception as exc:  # reported to the parent, which checks the type and text
        where = traceback.extract_tb(exc.__traceback__)
        frames = [f"{f.filename.rsplit('site-packages/', 1)[-1]}:{f.name}" for f in where]
        return {"error": f"{type(exc).__name__}: {exc}"[:200] + " ... " + str(exc)[-200:],
                "frames": frames[-12:]}
    return None


def main(records, out):
    options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=60.0)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    report = {"runs": {}, "tf_steps": {}}
    for run in RUNS:
        if run != "rebatched":  # its global batches are the file run's
            report["tf_steps"][run] = tf_batches(strategy, records, run, out)
        report["runs"][run] = train(strategy, records, run, out)
    for run in ("even", "function"):  # not "file": Keras's step fails on an empty batch
        keras_steps(strategy, records, run, out)
    report["collectives"] = collectives(strategy, records)
    report["model_fit_error"] = keras_fit(strategy, records)
    with open(f"{out}.json", "w") as handle:
        handle.write(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
