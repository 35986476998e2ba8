"""Streaming: micro-batches gathered from the arrays inside the loop, never the whole
large batch; exact like the materialised split."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import assert_weights_close, twin

import autosplit
from autosplit import TrainStep, split_batch
from autosplit.errors import DatasetError
from autosplit.memory import capped_cpu_env

HERE = Path(__file__).parent


def make():
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu",
                              kernel_regularizer=keras.regularizers.L2(1e-2)),
                              keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def data(n=230):
    r = np.random.default_rng(0)
    return (r.normal(size=(n, 6)).astype("float32"), r.integers(0, 3, size=(n,)).astype("int32"),
            r.uniform(0.1, 2.0, size=(n,)).astype("float32"))


def test_streamed_step_equals_the_full_batch_step():
    x, y, w = data(100)
    reference, candidate = twin(make, (x[:8], y[:8], None))
    source = tuple(tf.constant(a) for a in (x, y, w))
    step = TrainStep(candidate, split_batch(50, 16), source=source)
    for rows, n in ((np.arange(50), 50), (np.arange(50, 100), 50), (np.arange(37), 37)):
        padded = np.concatenate([rows, rows[: 50 - len(rows)]]).astype("int64")
        reference.train_on_batch(x[rows], y[rows], sample_weight=w[rows])
        step(tf.constant(padded), None, None, tf.constant(n))
    assert_weights_close(reference.get_weights(), candidate.get_weights(), 1e-5)
    assert int(candidate.optimizer.iterations) == 3


def test_fit_streaming_equals_model_fit():
    x, y, w = data(230)
    reference, candidate = twin(make, (x[:8], y[:8], None))
    reference.fit(x, y, sample_weight=w, batch_size=64, epochs=2, shuffle=False, verbose=0)
    history = autosplit.fit_large_batch(candidate, (x, y, w), batch_size=64, micro_batch_size=16,
                                        epochs=2, shuffle=False, streaming=True, verbose=0)
    assert history.autosplit["streaming"] is True
    assert history.autosplit["traces"] == 1
    assert_weights_close(reference.get_weights(), candidate.get_weights(), 1e-5)


def test_streaming_needs_arrays():
    x, y, _ = data(40)
    ds = tf.data.Dataset.from_tensor_slices((x, y))
    with pytest.raises(DatasetError, match="streaming"):
        autosplit.fit_large_batch(make(), ds, batch_size=16, micro_batch_size=4, streaming=True)
    with pytest.raises(ValueError, match="streaming"):
        autosplit.fit_large_batch(make(), (x, y), batch_size=16, micro_batch_size=4,
                                  streaming="yes")


def test_auto_streams_only_when_the_batch_would_crowd_the_budget():
    from autosplit.data import LargeBatches
    from autosplit.probe import should_stream

    x, y, _ = data(40)
    batches = LargeBatches((x, y), 16)
    assert not should_stream(batches)  # 16 rows of 6 floats: nothing to save
    assert should_stream(batches, memory_limit=batches.batch_bytes() * 2)
    ds = LargeBatches(tf.data.Dataset.from_tensor_slices((x, y)), 16)
    assert not should_stream(ds, memory_limit=1024)  # datasets cannot stream


@pytest.mark.slow
def test_only_streaming_fits_under_the_budget(tmp_path):
    out = tmp_path / "stream.json"
    env = capped_cpu_env(512 * 2**20)
    env["PYTHONPATH"] = f"{HERE.parent}:{HERE}"
    done = subprocess.run([sys.executable, str(HERE / "capped_child.py"), "stream", str(out)],
                          env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["materialised"] == "NothingFitsError", report
    assert report["auto_streaming"] is True
    assert report["trained_iterations"] == 2
    assert report["peak_bytes"] <= report["budget_bytes"]
