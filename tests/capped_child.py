"""Child-process scenarios run under a real TensorFlow memory cap (capped BFC allocator).

Started by ``autosplit.capped.run_capped(["tests/capped_child.py", SCENARIO, DIR], cap)``;
each scenario hands its report back with ``autosplit.capped.write_result`` and may leave
files (weights) in DIR.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import math
import os
import sys
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf
from common import labelled, relative_error

import autosplit
from autosplit.capped import write_result
from autosplit.memory.peak_meter import PeakMeter
from autosplit.testing import train_on_large_batch


def demo_mlp(optimizer):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((128,)),
        keras.layers.Dense(1024, activation="relu"),
        keras.layers.Dense(1024, activation="relu"),
        keras.layers.Dense(10),
    ])
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def data(n):
    return labelled(n, 128, 10)


def probe_then_check(folder):
    """Probe under the cap; train at m; try 2m (or the next size up)."""
    x, y = data(4096)
    model = demo_mlp(keras.optimizers.Adam(1e-3))
    result = autosplit.probe(model, x, y, batch_size=4096, cache=False)
    report = {"result": result.to_dict()}
    m = result.micro_batch_size
    before = [w.copy() for w in model.get_weights()]
    opt_before = [np.array(v.numpy(), copy=True) for v in model.optimizer.variables]
    report["weights_unchanged"] = all(
        np.array_equal(a, b) for a, b in zip(before, model.get_weights(), strict=True))
    report["optimizer_unchanged"] = int(model.optimizer.iterations) == 0 and all(
        np.array_equal(a, v.numpy()) for a, v in zip(opt_before, model.optimizer.variables,
                                                      strict=True))
    train_on_large_batch(model, x, y, micro_batch_size=m)
    report["chosen_trained"] = True
    # At least twice the rows: half as many micro-batches (a balanced split of 4096 rows
    # runs ceil(4096 / k) rows each, so 2m itself may not be a size that exists).
    bigger = math.ceil(4096 / max(1, result.accumulation_steps // 2))
    report["bigger"] = bigger
    # In a child process (autosplit.search.isolation): with oneDNN on, a kernel that
    # runs out of memory may end its process instead of raising.
    from autosplit.search.isolation import IsolatedTrials

    held = tf.config.experimental.get_memory_info("CPU:0")["current"]
    with IsolatedTrials(model, (x[:4096], y[:4096], None), 4096, budget=2**62,
                        held_bytes=held, jit_compile=False, step_held=True) as trials:
        report["bigger_fits"] = not trials.trial(bigger).oom
    write_result(report)


def recover_from_real_oom(folder):
    """A fixed micro-batch too large for the cap: recover and finish exactly."""
    x, y = data(8192)
    model = demo_mlp(keras.optimizers.SGD(0.05))
    history = autosplit.fit_large_batch(model, x, y, batch_size=4096, micro_batch_size=4096,
                                        epochs=1, shuffle=False, verbose=0)
    np.savez(os.path.join(folder, "weights.npz"), *model.get_weights())
    write_result({"autosplit": history.autosplit.to_dict(),
                  "iterations": int(model.optimizer.iterations)})


def nothing_fits(folder):
    """A budget of what the model holds plus 1 MiB: not even one example fits."""
    x, y = data(256)
    model = demo_mlp(keras.optimizers.Adam(1e-3))
    autosplit.keras_hooks.internals.symbolic_build(model, (x[:8], y[:8], None))
    before = [w.copy() for w in model.get_weights()]
    held = tf.config.experimental.get_memory_info("CPU:0")["current"]
    report = {}
    try:
        autosplit.probe(model, x, y, batch_size=256, memory_limit=held + 2**20, headroom=0.0,
                        cache=False)
        report["error"] = None
    except autosplit.NothingFitsError as exc:
        report.update(error=type(exc).__name__, message=str(exc),
                      budget_bytes=exc.budget_bytes)
    report["weights_unchanged"] = all(
        np.array_equal(a, b) for a, b in zip(before, model.get_weights(), strict=True))
    write_result(report)


def input_kinds(folder):
    """Probe on arrays (what `autosplit probe` does), then train at its choice from each
    input kind: the answer holds for all of them, because none holds a large batch."""
    x, y = data(8192)
    model = demo_mlp(keras.optimizers.Adam(1e-3))
    result = autosplit.probe(model, x, y, batch_size=4096, cache=False)
    m = result.micro_batch_size
    report = {"micro_batch_size": m, "budget_bytes": result.budget_bytes, "kinds": {}}
    sources = {"arrays": lambda: dict(x=x, y=y),
               "examples": lambda: dict(x=tf.data.Dataset.from_tensor_slices((x, y))),
               "batched": lambda: dict(x=tf.data.Dataset.from_tensor_slices((x, y)).batch(100))}
    meter = PeakMeter("CPU:0")
    for kind, source in sources.items():
        try:
            meter.reset()
            history = autosplit.fit_large_batch(model, batch_size=4096, micro_batch_size=m,
                                                on_oom="raise", verbose=0, **source())
            report["kinds"][kind] = {"trained": True, "peak_bytes": meter.peak_bytes(),
                                     "micro_batch_size": history.autosplit.micro_batch_size}
        except tf.errors.ResourceExhaustedError as exc:
            report["kinds"][kind] = {"trained": False, "error": str(exc)[:300]}
    write_result(report)


def wide_cnn():
    """The convolutions, pooling and batch normalization whose oneDNN kernels end the
    process when an allocation fails under the cap. The convolution before the batch
    normalization has no bias, as such blocks are written: the normalization subtracts
    the batch's mean, so that bias's gradient nearly cancels and rounding moves it most
    (the same run twice moved it 2e-5 to 5e-5 relative, oneDNN on; every other weight
    less than 2e-6)."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((32, 32, 3)),
        keras.layers.Conv2D(128, 3, padding="same", activation="relu", use_bias=False),
        keras.layers.BatchNormalization(),
        keras.layers.Conv2D(128, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(128, 3, padding="same", activation="relu"),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(10),
    ])
    model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def cnn_under_the_cap(folder):
    """oneDNN on (the default): a trial whose kernel crashes costs that trial; the probe
    ends with a size that trains; a given size too large for the cap starts smaller."""
    from autosplit.keras_hooks.internals import onednn_enabled
    from autosplit.search.isolation import IsolatedTrials, kernels_may_crash

    rng = np.random.default_rng(0)
    x = rng.normal(size=(1024, 32, 32, 3)).astype("float32")
    y = rng.integers(0, 10, size=(1024,)).astype("int32")
    model = wide_cnn()
    autosplit.keras_hooks.internals.symbolic_build(model, (x[:8], y[:8], None))
    before = [w.copy() for w in model.get_weights()]
    report = {"onednn": onednn_enabled(), "may_crash": kernels_may_crash()}
    held = tf.config.experimental.get_memory_info("CPU:0")["current"]
    with IsolatedTrials(model, (x[:512], y[:512], None), 512, budget=2**40, held_bytes=held,
                        jit_compile=False) as trials:
        report["direct"] = [dataclasses.asdict(trials.trial(m)) for m in (512, 16)]
    result = autosplit.probe(model, x, y, batch_size=512, cache=False)
    report["probe"] = result.to_dict()
    report["unchanged"] = all(
        np.array_equal(a, b) for a, b in zip(before, model.get_weights(), strict=True))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = autosplit.fit_large_batch(model, x, y, batch_size=512, micro_batch_size=512,
                                            shuffle=False, verbose=0)
    report["warnings"] = [str(w.message) for w in caught if "trial step" in str(w.message)]
    report["fit"] = history.autosplit.to_dict()
    report["iterations"] = int(model.optimizer.iterations)
    # The reference's own check runs a trial in a child that holds what this process
    # holds: with the trained model and its step still here, it can shrink the size
    # again, and BatchNormalization's statistics per micro-batch then differ. So the
    # trained model goes first, its weights kept.
    trained, size = model.get_weights(), history.autosplit.micro_batch_size
    del model, history
    gc.collect()
    reference = wide_cnn()
    autosplit.keras_hooks.internals.symbolic_build(reference, (x[:8], y[:8], None))
    reference.set_weights(before)
    again = autosplit.fit_large_batch(reference, x, y, batch_size=512, micro_batch_size=size,
                                      shuffle=False, verbose=0)
    report["reference_sizes"] = (again.autosplit.micro_batch_size,
                                 len(again.autosplit.oom_recoveries))
    report["error"] = relative_error(reference.get_weights(), trained)
    write_result(report)


def tokens_under_the_cap(folder, jit_compile=False):
    """A causal attention LM over heavy-tailed lengths, whose whole large batch at its
    longest rows does not fit the cap: the probe finds a token budget by trials under
    it, and training runs in micro-batches of that budget (under XLA with
    ``jit_compile``, as a GPU's compile() resolves "auto"). The model as built and the
    rows are saved, for model.fit's reference in the parent."""
    vocab, width = 64, 32
    r = np.random.default_rng(0)
    lengths = np.clip(r.lognormal(np.log(40), 0.8, 512), 4, 256).astype(int)
    seqs = [r.integers(1, vocab, n).astype("int32") for n in lengths]
    keras.utils.set_random_seed(0)
    tokens = keras.Input((None,), dtype="int32")
    embedded = keras.layers.Embedding(vocab, width)(tokens)
    attended = keras.layers.MultiHeadAttention(4, width // 4)(embedded, embedded,
                                                              use_causal_mask=True)
    hidden = keras.layers.Add()([embedded, attended])
    model = keras.Model(tokens, keras.layers.Dense(vocab)(hidden))
    model.compile(keras.optimizers.SGD(0.1),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=jit_compile)
    model.save(os.path.join(folder, "initial.keras"))
    np.savez(os.path.join(folder, "rows.npz"), *seqs)
    data = tf.data.Dataset.from_generator(
        lambda: ((s[:-1], s[1:], np.ones(len(s) - 1, "float32")) for s in seqs),
        output_signature=(tf.TensorSpec([None], tf.int32), tf.TensorSpec([None], tf.int32),
                          tf.TensorSpec([None], tf.float32)))
    meter = PeakMeter()
    peaks = []

    class Peaks(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            meter.reset()

        def on_epoch_end(self, epoch, logs=None):
            peaks.append(meter.peak_bytes())

    history = autosplit.fit_large_batch(model, data.padded_batch(32), batch_size=256,
                                        epochs=2, verbose=0, cache=False, callbacks=[Peaks()])
    np.savez(os.path.join(folder, "weights.npz"), *model.get_weights())
    write_result({"autosplit": history.autosplit.to_dict(), "loss": history.history["loss"],
                  "iterations": int(model.optimizer.iterations), "peaks": peaks})


def dual_encoder(optimizer):
    """Two towers of 1024 units whose embeddings meet in an in-batch softmax."""
    keras.utils.set_random_seed(0)
    inputs = [keras.Input((128,)), keras.Input((128,))]
    towers = [keras.layers.Dense(32)(keras.layers.Dense(1024, activation="relu")(t))
              for t in inputs]
    model = keras.Model(inputs, keras.layers.Concatenate()(towers))

    def in_batch_softmax(y_true, y_pred):  # on cosines: no weight's gradient cancels
        a, b = (tf.math.l2_normalize(t, axis=1) for t in (y_pred[:, :32], y_pred[:, 32:]))
        logits = tf.matmul(a, b, transpose_b=True) * 10.0
        return keras.losses.sparse_categorical_crossentropy(
            tf.range(tf.shape(logits)[0]), logits, from_logits=True)

    model.compile(optimizer=optimizer, loss=in_batch_softmax)
    return model


def pairs(n):
    x, _ = labelled(n, 128, 10)
    return [x, x[::-1].copy()], np.zeros((n, 1), "float32")


def whole_batch_under_the_cap(folder, micro_batch_size="auto"):
    """A loss over the whole batch under the cap: the probe's trials run its whole
    large batch (``"auto"``), or a micro-batch too large recovers (an int)."""
    x, y = pairs(2048)
    model = dual_encoder(keras.optimizers.SGD(0.05))
    history = autosplit.fit_large_batch(model, x, y, batch_size=1024,
                                        micro_batch_size=micro_batch_size, epochs=1,
                                        shuffle=False, verbose=0, cache=False)
    np.savez(os.path.join(folder, "weights.npz"), *model.get_weights())
    write_result({"autosplit": history.autosplit.to_dict(), "loss": history.history["loss"],
                  "iterations": int(model.optimizer.iterations)})


if __name__ == "__main__":
    scenarios = {"probe": probe_then_check, "recover": recover_from_real_oom,
                 "nothing": nothing_fits, "kinds": input_kinds, "cnn": cnn_under_the_cap,
                 "tokens": tokens_under_the_cap,
                 "tokens_xla": functools.partial(tokens_under_the_cap, jit_compile=True),
                 "whole_batch": whole_batch_under_the_cap,
                 "whole_batch_recover": functools.partial(whole_batch_under_the_cap,
                                                          micro_batch_size=1024),
                 "whole_batch_reference": functools.partial(whole_batch_under_the_cap,
                                                            micro_batch_size=256)}
    scenarios[sys.argv[1]](sys.argv[2] if len(sys.argv) > 2 else ".")
