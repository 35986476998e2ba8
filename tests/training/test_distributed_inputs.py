"""A ``tf.distribute`` input trained in one process (a one-device MirroredStrategy): each
step is what the per-worker pipeline yields, as in model.fit. Two workers train in
tests/scenarios/test_sharding.py."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import tensorflow as tf
from common import relative_error

import autosplit
from autosplit.errors import DatasetError
from autosplit.step.replicas import row_count


def data(n=20):
    r = np.random.default_rng(0)
    return (r.normal(size=(n, 12)).astype("float32"), r.integers(0, 5, size=n).astype("int32"))


def make():
    from strategy_child import OPTIMIZERS
    from strategy_child import make as make_model

    return make_model(OPTIMIZERS["sgd"])


@pytest.fixture(scope="module")
def strategy():
    return tf.distribute.MirroredStrategy(["/cpu:0"])


def model_and_input(strategy, batch, repeat=False):
    """A model made in the strategy's scope, and a from-function input of batches of
    ``batch`` rows of :func:`data` (repeated with ``repeat``)."""
    x, y = data()
    with strategy.scope():
        model = make()

    def per_worker(context):
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
        return ds.repeat() if repeat else ds

    return model, strategy.distribute_datasets_from_function(per_worker)


def unchanged(model, before):
    return all(np.array_equal(a, b) for a, b in zip(before, model.get_weights(), strict=True))


@pytest.mark.slow
def test_each_step_is_the_pipelines_batch_cut_into_micro_batches(strategy):
    """Per-replica batches of 8 with batch_size=8: a step trains on 8 rows, cut into
    micro-batches of 3, as model.fit trains on the pipeline's batches."""
    model, built = model_and_input(strategy, 8)
    history = autosplit.fit_large_batch(model, built, batch_size=8, micro_batch_size=3,
                                        epochs=2, verbose=0)
    x, y = data()
    reference = make()
    expected = reference.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 6  # 8 + 8 + 4 rows, twice
    assert relative_error(reference.get_weights(), model.get_weights()) <= 1e-5
    np.testing.assert_allclose(history.history["loss"], expected.history["loss"], rtol=1e-5)


def test_a_step_of_more_rows_than_batch_size_is_refused_before_its_apply(strategy):
    # batch_size is the call's promise: pipelines that batch 8 rows under batch_size=4
    # would train a batch twice as large, silently.
    model, built = model_and_input(strategy, 8)
    before = model.get_weights()
    with pytest.raises(autosplit.BatchSizeError, match="at most batch_size=4 rows"):
        autosplit.fit_large_batch(model, built, batch_size=4, micro_batch_size=3, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 0 and unchanged(model, before)


def test_the_agreements_row_count_is_a_whole_number_of_rows():
    # Six replicas (3 local on each of 2 workers) each add float32(1000 / 6): summed in
    # float32 that is 1000.00006, which refused a large batch of exactly 1000 rows.
    share = np.float32(500 / 3)
    total = functools.reduce(lambda a, b: np.float32(a + b), [share] * 6)
    assert float(total) > 1000 and row_count(float(total)) == 1000
    assert row_count(float("-inf")) == float("-inf")  # a worker that gave up


def test_a_repeated_distributed_input_needs_steps_per_epoch(strategy):
    model, built = model_and_input(strategy, 8, repeat=True)
    with pytest.raises(autosplit.ArgumentError, match="Expected `steps_per_epoch`"):
        autosplit.fit_large_batch(model, built, batch_size=8, verbose=0)


def test_distributed_validation_data_is_refused_before_training(strategy):
    x, y = data()
    with strategy.scope():
        model = make()
    before = model.get_weights()
    validation = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(4))
    with pytest.raises(DatasetError, match="Expected `validation_data` to be arrays"):
        autosplit.fit_large_batch(model, x, y, batch_size=4, validation_data=validation,
                                  verbose=0)
    assert unchanged(model, before)


@pytest.mark.slow
def test_steps_per_epoch_reads_on_as_model_fit_does(strategy):
    model, built = model_and_input(strategy, 8)
    autosplit.fit_large_batch(model, built, batch_size=8, micro_batch_size=3, epochs=3,
                              steps_per_epoch=2, verbose=0)
    reference = make()
    reference.fit(tf.data.Dataset.from_tensor_slices(data()).batch(8), epochs=3,
                  steps_per_epoch=2, shuffle=False, verbose=0)
    assert (int(model.optimizer.iterations.numpy())
            == int(reference.optimizer.iterations.numpy()))
    assert relative_error(reference.get_weights(), model.get_weights()) <= 1e-5


def test_validation_split_of_a_distributed_input_is_refused_before_training(strategy):
    model, built = model_and_input(strategy, 8)
    before = model.get_weights()
    with pytest.raises(DatasetError, match="Expected arrays with `validation_split`"):
        autosplit.fit_large_batch(model, built, batch_size=8, validation_split=0.25, verbose=0)
    assert unchanged(model, before)
