"""OOM during training: restore, shrink, redo the same batch; exact afterwards."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from conftest import assert_weights_close, twin
from test_probe import run_child

import autosplit
from autosplit.testing import inject_oom


def make():
    import keras

    # No Dropout: its masks depend on how a batch is cut, so a run that changed its
    # micro-batch cannot match one that did not.
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def data(n=256):
    rng = np.random.default_rng(0)
    return (rng.normal(size=(n, 6)).astype("float32"),
            rng.integers(0, 3, size=(n,)).astype("int32"))


def test_injected_oom_redoes_the_same_batch_exactly():
    x, y = data()
    reference, candidate = twin(make, (x[:8], y[:8], None))
    ref_history = autosplit.fit_large_batch(reference, (x, y), batch_size=64,
                                            micro_batch_size=32, shuffle=False, verbose=0)
    with pytest.warns(UserWarning, match="redoing the same batch"), \
            inject_oom(at_steps={2}) as raised:
        history = autosplit.fit_large_batch(candidate, (x, y), batch_size=64,
                                            micro_batch_size=32, shuffle=False, verbose=0)
    assert raised == [(2, 32)]
    info = history.autosplit
    assert info["oom_recoveries"] == [{"step": 2, "failed": 32, "retry": 16}]
    assert info["micro_batch_size"] == 16 and info["accumulation_steps"] == 4
    assert int(candidate.optimizer.iterations) == 4
    assert_weights_close(reference.get_weights(), candidate.get_weights(), 1e-5)
    np.testing.assert_allclose(history.history["accuracy"], ref_history.history["accuracy"])


def test_on_oom_raise():
    x, y = data()
    with inject_oom(at_steps={0}), pytest.raises(tf.errors.ResourceExhaustedError):
        autosplit.fit_large_batch(make(), (x, y), batch_size=64, micro_batch_size=32,
                                  on_oom="raise", verbose=0)


def test_failed_attempt_leaves_metrics_and_state_untouched():
    """A real failure part-way through the loop: restore() undoes what it changed."""
    x, y = data(64)
    model = make()
    autosplit._keras.build_model(model, (x[:8], y[:8], None))
    step = autosplit.TrainStep(model, autosplit.split_batch(64, 16))
    step(tf.constant(x), tf.constant(y), None, tf.constant(64))
    saved = [np.array(v.numpy(), copy=True) for v in step.guard.variables]
    weights = [w.copy() for w in model.get_weights()]
    iterations = int(model.optimizer.iterations)
    bad_y = y.copy()
    bad_y[40] = 99  # an out-of-range label fails in micro-batch 3 of 4
    with pytest.raises(tf.errors.InvalidArgumentError):
        step(tf.constant(x), tf.constant(bad_y), None, tf.constant(64))
    step.restore()
    assert int(model.optimizer.iterations) == iterations
    assert all(np.array_equal(a, b) for a, b in zip(weights, model.get_weights(), strict=True))
    assert all(np.array_equal(a, v.numpy())
               for a, v in zip(saved, step.guard.variables, strict=True))


@pytest.mark.slow
def test_real_oom_under_a_cap_recovers_to_the_weights_of_an_uninterrupted_run(tmp_path):
    import keras

    report, out = run_child("recover", tmp_path, 72)
    info = report["autosplit"]
    assert info["oom_recoveries"] and info["oom_recoveries"][0]["failed"] == 4096
    assert info["micro_batch_size"] < 4096
    assert report["iterations"] == 2
    # The uninterrupted run, here without a cap, from the same seed and data.
    from capped_child import data as child_data
    from capped_child import demo_mlp

    x, y = child_data(8192)
    model = demo_mlp(keras.optimizers.SGD(0.05))
    autosplit.fit_large_batch(model, (x, y), batch_size=4096, micro_batch_size=1024,
                              shuffle=False, verbose=0)
    saved = np.load(str(out) + ".npz")
    assert_weights_close(model.get_weights(), [saved[f"arr_{i}"] for i in range(len(saved))],
                         1e-5)
