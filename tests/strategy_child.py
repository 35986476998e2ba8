"""Distribution-strategy scenarios, each in its own process (devices are fixed at start).

``python tests/strategy_child.py mirrored OUT.json``: MirroredStrategy over two logical
CPU devices; ``scope``, on the same devices: autosplit called inside ``strategy.scope()``;
``mixed``, on the same devices: ``mixed_float16``'s overflows against model.fit's.
``python tests/strategy_child.py worker OUT.json`` with ``TF_CONFIG`` set: one worker of
a MultiWorkerMirroredStrategy run on localhost.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

# Run as a script, the scenario is argv[1]; imported (the tests borrow demo_mlp and
# demo_data), there is none and no device is configured.
SCENARIO = sys.argv[1] if __name__ == "__main__" else None
if SCENARIO in ("mirrored", "scope", "mixed"):  # before anything initialises the devices
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402
from common import labelled, relative_error  # noqa: E402

import autosplit  # noqa: E402
from autosplit.data.inputs import get_input  # noqa: E402
from autosplit.data.layout import Layout  # noqa: E402
from autosplit.data.pipeline import MicroBatches  # noqa: E402
from autosplit.data.split import split_batch  # noqa: E402
from autosplit.step.train_step import step_for  # noqa: E402
from autosplit.testing import traced_graph  # noqa: E402


def make(optimizer):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((12,)),
        keras.layers.Dense(32, activation="tanh",
                           kernel_regularizer=keras.regularizers.L2(1e-2)),
        keras.layers.Dense(5),
    ])
    model.compile(optimizer=optimizer(),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


OPTIMIZERS = {"sgd": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
              "adam": lambda: keras.optimizers.Adam(1e-2)}


def data(n=100, seed=0):
    r = np.random.default_rng(seed)
    return (r.normal(size=(n, 12)).astype("float32"), r.integers(0, 5, size=(n,)).astype("int32"),
            r.uniform(0.1, 2.0, size=(n,)).astype("float32"))


def reference_weights(optimizer, batch, epochs):
    """Single-device, full-batch plain Keras: the reference."""
    x, y, w = data()
    with tf.distribute.OneDeviceStrategy("/cpu:0").scope():
        model = make(OPTIMIZERS[optimizer])
    model.fit(x, y, sample_weight=w, batch_size=batch, epochs=epochs, shuffle=False, verbose=0)
    return model.get_weights()


def count_all_reduces(graph_def) -> dict:
    ops = ("CollectiveReduce", "CollectiveReduceV2", "NcclAllReduce", "CollectiveAllReduce")
    found = {"main": 0, "loop_body": 0}
    for node in graph_def.node:
        if any(op in node.op for op in ops):
            found["main"] += 1
    for function in graph_def.library.function:
        n = sum(1 for node in function.node_def if any(op in node.op for op in ops))
        key = "loop_body" if "while_body" in function.signature.name else "main"
        found[key] += n
    return found


def mirrored(out):
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    report = {"replicas": strategy.num_replicas_in_sync, "errors": {}}
    x, y, w = data()
    for optimizer in OPTIMIZERS:
        with strategy.scope():
            model = make(OPTIMIZERS[optimizer])
        history = autosplit.fit_large_batch(model, (x, y, w), batch_size=40, micro_batch_size=6,
                                            epochs=2, shuffle=False, verbose=0)
        expected = reference_weights(optimizer, 40, 2)
        report[optimizer] = relative_error(expected, model.get_weights())
        report[f"{optimizer}_iterations"] = int(model.optimizer.iterations.numpy())
        report[f"{optimizer}_info"] = {k: getattr(history.autosplit, k) for k in
                                       ("micro_batch_size", "accumulation_steps")}
    # A batched dataset of unknown length (a filter hides it): one iterator for both
    # epochs, each epoch ending at a marker that the local replicas' loop (run_local,
    # then the apply) stops at; B = 40 ends an epoch on a short batch, B = 50 on a whole
    # one (the marker is read after it).
    batched = tf.data.Dataset.from_tensor_slices((x, y, w)).batch(7).filter(lambda *e: True)
    for batch in (40, 50):
        with strategy.scope():
            model = make(OPTIMIZERS["sgd"])
        autosplit.fit_large_batch(model, batched, batch_size=batch, micro_batch_size=6,
                                  epochs=2, verbose=0)
        report[f"batched_{batch}"] = relative_error(reference_weights("sgd", batch, 2),
                                                    model.get_weights())
        report[f"batched_{batch}_iterations"] = int(model.optimizer.iterations.numpy())
    # tf.distribute inputs: each step two per-replica batches in turn, cut into pieces.
    for name, distributed in distributed_inputs(strategy, (x, y, w), 40).items():
        with strategy.scope():
            model = make(OPTIMIZERS["sgd"])
        autosplit.fit_large_batch(model, distributed, batch_size=40, micro_batch_size=6,
                                  epochs=2, verbose=0)
        report[name] = relative_error(reference_weights("sgd", 40, 2), model.get_weights())
    # The automatic search on two local replicas: trials run in lockstep, one size.
    with strategy.scope():
        model = make(OPTIMIZERS["sgd"])
    history = autosplit.fit_large_batch(model, (x, y, w), batch_size=40, cache=False,
                                        verbose=0)
    report["auto_micro_batch_size"] = history.autosplit.micro_batch_size
    # All-reduces in the traced graph: the same for k = 2 and k = 10, none in the loop.
    for micro in (10, 2):
        with strategy.scope():
            model = make(OPTIMIZERS["sgd"])
        split = split_batch(40 // 2, micro)
        pipeline = MicroBatches(get_input(x, y, w, shuffle=False), 40, split.micro_batch_size,
                                Layout(workers=1, worker=0, local_replicas=2, replicas=2))
        step = step_for(model, pipeline)
        graph = traced_graph(step, iter(pipeline.dataset())).as_graph_def()
        report[f"all_reduces_k{split.accumulation_steps}"] = count_all_reduces(graph)
        report["trainable_variables"] = len(model.trainable_variables)
    report["bn_synchronized"] = synchronized_batch_norm(strategy, x, y)
    report["pairs"] = pairs_on_replicas(strategy)
    with strategy.scope():
        model = make(OPTIMIZERS["sgd"])
    try:
        autosplit.fit_large_batch(model, (x, y, w), batch_size=41, micro_batch_size=6,
                                  verbose=0)
    except autosplit.BatchSizeError as exc:
        report["errors"]["indivisible"] = str(exc)
    out.write(json.dumps(report))


def pairs_on_replicas(strategy):
    """Pairs of two lengths on two replicas, cut by length in each, and the report of
    the padding fed comes back."""
    r = np.random.default_rng(0)
    rows = [(r.integers(1, 20, int(n)).astype("int32"),
             r.integers(1, 20, int(n) + int(r.integers(1, 4))).astype("int32"))
            for n in r.integers(2, 12, 64)]
    ids = tf.TensorSpec([None], tf.int32)

    def examples():
        return tf.data.Dataset.from_generator(
            lambda: (((s, t[:-1]), t[1:]) for s, t in rows),
            output_signature=((ids, ids), ids)).apply(
                tf.data.experimental.assert_cardinality(len(rows)))

    def make():
        keras.utils.set_random_seed(0)
        source, target = keras.Input((None,), dtype="int32"), keras.Input((None,), dtype="int32")
        _, state = keras.layers.GRU(8, return_state=True)(
            keras.layers.Embedding(20, 8, mask_zero=True)(source))
        decoded = keras.layers.GRU(8, return_sequences=True)(
            keras.layers.Embedding(20, 8, mask_zero=True)(target), initial_state=state)
        model = keras.Model([source, target], keras.layers.Dense(20)(decoded))
        model.compile(keras.optimizers.SGD(0.5),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    reference = make()
    reference.fit(examples().padded_batch(32), epochs=2, verbose=0)
    with strategy.scope():
        model = make()
    history = autosplit.fit_large_batch(model, examples().padded_batch(8), batch_size=32,
                                        micro_batch_size=6, epochs=2, verbose=0)
    return {"error": relative_error(reference.get_weights(), model.get_weights()),
            "padding": history.autosplit.padding,
            "padding_share": history.autosplit.cut.padding_share}


def mixed(out):
    """mixed_float16 on two replicas: each replica's float16 gradients of its half of the
    large batch overflow where model.fit's, under the same strategy, do: the same loss
    scale after every large batch, the same iterations, one decision for both."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    r = np.random.default_rng(0)
    report = {}
    for name, y_mean in (("overflows", 2.0), ("small", 0.1)):
        x = r.normal(3 if name == "overflows" else 0.1, 1, (512, 8)).astype("float32")
        y = r.normal(y_mean, 1, (512, 1)).astype("float32")
        seen = {}
        for way in ("model_fit", "autosplit"):
            with strategy.scope():
                keras.utils.set_random_seed(0)
                model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4),
                                          keras.layers.Dense(1, dtype="float32")])
                model.compile(keras.optimizers.SGD(1e-4), "mse")
            steps: list = []
            track = keras.callbacks.LambdaCallback(
                on_train_batch_end=lambda b, logs, m=model, seen=steps: seen.append((
                    float(m.optimizer.dynamic_scale.numpy()),
                    int(m.optimizer.iterations.numpy()))))
            if way == "model_fit":
                model.fit(x, y, batch_size=128, epochs=2, shuffle=False, verbose=0,
                          callbacks=[track])
            else:
                autosplit.fit_large_batch(model, x, y, batch_size=128, micro_batch_size=16,
                                          epochs=2, shuffle=False, verbose=0, callbacks=[track])
            seen[way] = (steps, model.get_weights())
        report[name] = {"model_fit": seen["model_fit"][0], "autosplit": seen["autosplit"][0],
                        "error": relative_error(seen["model_fit"][1], seen["autosplit"][1])}
    out.write(json.dumps(report))


def distributed_inputs(strategy, rows, batch_size):
    """The same rows as strategy.experimental_distribute_dataset and
    strategy.distribute_datasets_from_function make them."""
    def fn(context):
        return tf.data.Dataset.from_tensor_slices(rows).batch(
            context.get_per_replica_batch_size(batch_size))

    batched = tf.data.Dataset.from_tensor_slices(rows).batch(batch_size)
    return {"distributed_dataset": strategy.experimental_distribute_dataset(batched),
            "from_function": strategy.distribute_datasets_from_function(fn)}


def inside_scope(out):
    """fit_large_batch (with validation data), probe, check and accumulate_gradients
    (eager and in a tf.function) called inside ``strategy.scope()``, as users indent a
    whole script under it, against the same calls outside: per strategy, the weights'
    and the gradients' relative errors, whether the logs, the probed size and the check
    agree, and the variable the caller's scope creates after the calls."""
    x, y, w = data()
    strategies = {"mirrored": tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]),
                  "one_device": tf.distribute.OneDeviceStrategy("/cpu:0"),
                  "default": tf.distribute.get_strategy()}
    report = {}
    for name, strategy in strategies.items():
        runs = []
        for inside in (False, True):
            with strategy.scope():
                model = make(OPTIMIZERS["adam"])
            with strategy.scope() if inside else contextlib.nullcontext():
                history = autosplit.fit_large_batch(
                    model, (x, y, w), batch_size=40, micro_batch_size=6, epochs=2,
                    shuffle=False, verbose=0, validation_data=(x[:30], y[:30]))
                probed = autosplit.probe(model, x, y, batch_size=40, cache=False)
                checked = autosplit.check(model, x[:40], y[:40], micro_batch_size=6)
                grads = autosplit.accumulate_gradients(
                    model, x[:40], y[:40], micro_batch_size=6).gradients
                traced = tf.function(lambda m: autosplit.accumulate_gradients(
                    m, x[:40], y[:40], micro_batch_size=6).gradients)(model)
                created = tf.Variable(0.0)
            runs.append((model.get_weights(), history.history, probed.micro_batch_size,
                         type(created).__name__, checked.exact, grads + traced))
        (outside, logs, size, _, exact, grads), (weights, logs_in, size_in, created_in,
                                                 exact_in, grads_in) = runs
        report[name] = {
            "error": relative_error(outside, weights),
            "logs_error": max(abs(a - b) for key in logs
                              for a, b in zip(logs[key], logs_in[key], strict=True)),
            "log_keys": sorted(logs_in), "sizes": [size, size_in], "created": created_in,
            "check_exact": [exact, exact_in],
            "gradients_error": relative_error([g.numpy() for g in grads],
                                              [g.numpy() for g in grads_in]),
            "iterations": int(model.optimizer.iterations.numpy())}
    out.write(json.dumps(report))


def synchronized_batch_norm(strategy, x, y):
    """BatchNormalization(synchronized=True) on the raw inputs, across two replicas: the
    moving statistics pooled over every micro-batch of both equal the single-device
    full batch's (relative error, largest over mean and variance)."""
    def make_bn():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((12,)),
                                  keras.layers.BatchNormalization(synchronized=True,
                                                                  momentum=0.9),
                                  keras.layers.Dense(5)])
        model.compile(optimizer=keras.optimizers.SGD(0.05),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    shifted = 3.0 + 2.0 * x
    with tf.distribute.OneDeviceStrategy("/cpu:0").scope():
        reference = make_bn()
    reference.fit(shifted, y, batch_size=40, epochs=1, shuffle=False, verbose=0)
    with strategy.scope():
        model = make_bn()
    autosplit.fit_large_batch(model, shifted, y, batch_size=40, micro_batch_size=6,
                              shuffle=False, verbose=0)
    moving = [v.numpy() for v in model.layers[0].non_trainable_weights]
    expected = [v.numpy() for v in reference.layers[0].non_trainable_weights]
    return relative_error(expected, moving)


def worker(out):
    options = tf.distribute.experimental.CommunicationOptions(
        timeout_seconds=float(os.environ.get("AUTOSPLIT_TEST_COLLECTIVE_TIMEOUT", "60")))
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    x, y, w = data()
    with strategy.scope():
        model = make(OPTIMIZERS["adam"])
    die_after = int(os.environ.get("AUTOSPLIT_TEST_DIE_AFTER", "-1"))

    class Die(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == die_after:
                os._exit(17)  # a worker that dies mid-run

    report = {}
    if os.environ.get("AUTOSPLIT_TEST_AUTO"):
        # The automatic search in lockstep: accepted, and then training is exact.
        with strategy.scope():
            auto = make(OPTIMIZERS["adam"])
        history = autosplit.fit_large_batch(auto, (x, y, w), batch_size=40, epochs=2,
                                            shuffle=False, verbose=0, cache=False)
        report["auto"] = {k: getattr(history.autosplit, k) for k in
                          ("micro_batch_size", "micro_batch_reason", "workers")}
        report["auto_error"] = relative_error(reference_weights("adam", 40, 2),
                                              auto.get_weights())
        # Shuffled: one large batch of all 100 rows per epoch, so any order gives the
        # full-batch step, but only if both workers cut the same permutation.
        with strategy.scope():
            shuffled = make(OPTIMIZERS["adam"])
        # Seeded differently, as two processes are when nobody seeds them.
        tf.random.set_seed(1000 + json.loads(os.environ["TF_CONFIG"])["task"]["index"])
        autosplit.fit_large_batch(shuffled, (x, y, w), batch_size=100, micro_batch_size=6,
                                  epochs=2, shuffle=True, verbose=0)
        report["shuffled_error"] = relative_error(reference_weights("adam", 100, 2),
                                                  shuffled.get_weights())
    try:
        autosplit.fit_large_batch(model, (x, y, w), batch_size=40, micro_batch_size=6,
                                  epochs=2, shuffle=False, verbose=0, callbacks=[Die()])
        report["adam"] = relative_error(reference_weights("adam", 40, 2), model.get_weights())
        report["iterations"] = int(model.optimizer.iterations.numpy())
    except Exception as exc:  # reported to the parent, which checks the type and text
        report["error"] = f"{type(exc).__name__}: {exc}"[:2000]
    out.write(json.dumps(report))


def demo_mlp():
    """Wide and shallow: a micro-batch's activations (2048 floats a row) dwarf the largest
    weight (1 MiB), so the holes they leave in the capped allocator always fit the
    apply's all-reduce buffers, and only the micro-batch loop can run out of memory."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((128,)), keras.layers.Dense(2048, activation="relu"),
                              keras.layers.Dense(10)])
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def demo_data(n=8192):
    return labelled(n, 128, 10)


def capped_worker(out):
    """One worker of two on localhost, each under its own real cap (worker 0's smaller).

    AUTOSPLIT_TEST_MICRO: a fixed micro-batch (rows per replica), or "auto".
    """
    options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=120.0)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    micro = os.environ["AUTOSPLIT_TEST_MICRO"]
    x, y = demo_data()
    with strategy.scope():
        model = demo_mlp()
    report = {}
    try:
        history = autosplit.fit_large_batch(
            model, x, y, batch_size=4096, micro_batch_size=micro if micro == "auto" else
            int(micro), shuffle=False, verbose=0, cache=False)
        report["autosplit"] = {k: v for k, v in history.autosplit.to_dict().items()
                              if k != "probe"}
        report["iterations"] = int(model.optimizer.iterations.numpy())
        np.savez(out.name + ".npz", *model.get_weights())
    except Exception as exc:  # reported to the parent, which checks the type and text
        report["error"] = f"{type(exc).__name__}: {exc}"[:3000]
    out.write(json.dumps(report))


if __name__ == "__main__":
    with open(sys.argv[2], "w") as handle:
        {"mirrored": mirrored, "scope": inside_scope, "worker": worker,
         "capped_worker": capped_worker, "mixed": mixed}[SCENARIO](handle)
