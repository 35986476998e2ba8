"""Mixed precision: one loss scale per large batch, one finite check, one skip."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from common import assert_weights_close, twin

from autosplit.testing import train_on_large_batch

pytestmark = pytest.mark.slow  # each case trains a model under mixed precision

# After 3 Adam steps; bfloat16 keeps 8 bits of mantissa (2**-8 = 3.9e-3 per rounding).
TOLERANCE = {"mixed_float16": 2e-3, "mixed_bfloat16": 6e-2}


@pytest.fixture(params=["mixed_float16", "mixed_bfloat16"])
def policy(request):
    keras.mixed_precision.set_global_policy(request.param)
    yield request.param
    keras.mixed_precision.set_global_policy("float32")


def make():
    model = keras.Sequential([
        keras.Input((12,)),
        keras.layers.Dense(32, activation="tanh"),
        keras.layers.Dense(5, dtype="float32"),
    ])
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def data(seed, batch=50):
    r = np.random.default_rng(seed)
    return (r.normal(size=(batch, 12)).astype("float32"),
            r.integers(0, 5, size=(batch,)).astype("int32"))


def test_split_equals_full_batch_within_dtype_tolerance(policy):
    x0, y0 = data(0)
    reference, candidate = twin(make, (x0[:16], y0[:16], None))
    if policy == "mixed_float16":
        assert isinstance(candidate.optimizer, keras.optimizers.LossScaleOptimizer)
    for seed in range(3):
        x, y = data(seed)
        reference.train_on_batch(x, y)
        train_on_large_batch(candidate, x, y, micro_batch_size=16)
    assert_weights_close(reference.get_weights(), candidate.get_weights(), TOLERANCE[policy])
    assert int(candidate.optimizer.iterations) == 3


def test_overflow_in_one_micro_batch_skips_the_whole_step_once():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        x, y = data(0)
        reference, candidate = twin(make, (x[:16], y[:16], None))
        train_on_large_batch(candidate, x, y, micro_batch_size=16)
        reference.train_on_batch(x, y)
        before = [w.copy() for w in candidate.get_weights()]
        scale = float(candidate.optimizer.dynamic_scale)
        iterations = int(candidate.optimizer.iterations)
        bad = x.copy()
        bad[40, 0] = 1e6  # inf in float16, only in micro-batch 4 of 4 (rows 39-50)
        train_on_large_batch(candidate, bad, y, micro_batch_size=16)
        assert all(np.array_equal(a, b) for a, b in
                   zip(before, candidate.get_weights(), strict=True))
        assert float(candidate.optimizer.dynamic_scale) == scale / 2  # lowered once
        assert int(candidate.optimizer.iterations) == iterations  # no update counted
        reference.train_on_batch(bad, y)  # plain Keras does the same on the full batch
        assert float(reference.optimizer.dynamic_scale) == scale / 2
        # The next good batch trains normally, in line with the reference.
        train_on_large_batch(candidate, x, y, micro_batch_size=16)
        reference.train_on_batch(x, y)
        assert_weights_close(reference.get_weights(), candidate.get_weights(), 2e-3)
    finally:
        keras.mixed_precision.set_global_policy("float32")
