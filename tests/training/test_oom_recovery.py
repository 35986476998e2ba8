"""OOM during training: restore, shrink, redo the same batch; exact afterwards."""

from __future__ import annotations

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf
from common import assert_weights_close, classifier, labelled, run_child, twin

import autosplit
from autosplit import OomRecovery
from autosplit.testing import inject_oom, train_on_large_batch


def make():
    # No Dropout: its masks depend on how a batch is cut, so a run that changed its
    # micro-batch cannot match one that did not.
    return classifier(6, 16, 3, keras.optimizers.SGD(0.1, momentum=0.9))


def data(n=256):
    return labelled(n, 6, 3)


@pytest.mark.slow
def test_injected_oom_redoes_the_same_batch_exactly():
    x, y = data()
    reference, candidate = twin(make, (x[:8], y[:8], None))
    ref_history = autosplit.fit_large_batch(reference, (x, y), batch_size=64,
                                            micro_batch_size=32, shuffle=False, verbose=0)
    with pytest.warns(UserWarning, match="finishing the same batch"), \
            inject_oom(at_steps={2}) as raised:
        history = autosplit.fit_large_batch(candidate, (x, y), batch_size=64,
                                            micro_batch_size=32, shuffle=False, verbose=0)
    assert raised == [(2, 32)]
    report = history.autosplit
    assert report.oom_recoveries == (OomRecovery(step=2, failed=32, retry=16),)
    assert report.micro_batch_size == 16 and report.accumulation_steps == 4
    assert report.micro_batch_sizes == (16,)
    assert int(candidate.optimizer.iterations) == 4
    assert_weights_close(reference.get_weights(), candidate.get_weights(), 1e-5)
    np.testing.assert_allclose(history.history["accuracy"], ref_history.history["accuracy"])


@pytest.mark.slow
def test_injected_oom_in_a_marked_epoch_of_a_batched_dataset_is_exact():
    # A batched dataset of unknown length (a filter hides it) is read by one iterator
    # whose epochs end at a marker: a resumed large batch (run_local, in pieces) must
    # stop there too. Step 3 is the first epoch's short last batch (230 rows); after it
    # the next epoch cuts smaller pieces.
    x, y = data(230)

    def batched():
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(10).filter(lambda *e: True)

    reference, candidate = twin(make, (x[:8], y[:8], None))
    ref_history = autosplit.fit_large_batch(reference, batched(), batch_size=64,
                                            micro_batch_size=32, epochs=2, verbose=0)
    with pytest.warns(UserWarning, match="finishing the same batch"), \
            inject_oom(at_steps={1, 3}) as raised:
        history = autosplit.fit_large_batch(candidate, batched(), batch_size=64,
                                            micro_batch_size=32, epochs=2, verbose=0)
    assert raised == [(1, 32), (3, 16)]
    assert int(candidate.optimizer.iterations) == 8 == int(reference.optimizer.iterations)
    assert_weights_close(reference.get_weights(), candidate.get_weights(), 1e-5)
    np.testing.assert_allclose(history.history["loss"], ref_history.history["loss"],
                               rtol=1e-5)


def test_on_oom_raise():
    x, y = data()
    with inject_oom(at_steps={0}), pytest.raises(tf.errors.ResourceExhaustedError):
        autosplit.fit_large_batch(make(), (x, y), batch_size=64, micro_batch_size=32,
                                  on_oom="raise", verbose=0)


@pytest.mark.slow
def test_a_failed_step_leaves_weights_and_optimizer_untouched():
    """A real failure part-way through the loop: the optimizer has not run."""
    x, y = data(64)
    model = make()
    train_on_large_batch(model, x, y, micro_batch_size=16)
    weights = [w.copy() for w in model.get_weights()]
    iterations = int(model.optimizer.iterations)
    bad_y = y.copy()
    bad_y[40] = 99  # an out-of-range label fails in micro-batch 3 of 4
    with pytest.raises(tf.errors.InvalidArgumentError):
        train_on_large_batch(model, x, bad_y, micro_batch_size=16)
    assert int(model.optimizer.iterations) == iterations
    assert all(np.array_equal(a, b) for a, b in zip(weights, model.get_weights(), strict=True))


def _ask_4tb(rows, limit):
    """0, after asking TensorFlow for 4 TB where ``rows``, a micro-batch of more than
    ``limit`` rows, holds a marked row (feature 0 above 100): a real
    ResourceExhaustedError."""
    marked = tf.reduce_any(rows[:, 0] > 100.0)
    size = tf.where(marked & (tf.shape(rows)[0] > limit), tf.constant(10**12, tf.int64),
                    tf.constant(1, tf.int64))
    return 0.0 * tf.reduce_sum(tf.zeros(tf.reshape(size, [1])))


class Hungry(keras.layers.Layer):
    """Identity, except that a micro-batch of more than ``limit`` rows holding a marked row
    (feature 0 above 100) asks TensorFlow for 4 TB in its forward pass."""

    def __init__(self, limit, **kwargs):
        super().__init__(**kwargs)
        self.limit = limit
        self.armed = True

    def call(self, x):
        if not self.armed:
            return x
        return x + _ask_4tb(x, self.limit)


class HungryBackward(Hungry):
    """``x * scale`` (a trainable scalar at 1) that asks for 4 TB as :class:`Hungry`
    does, in its backward pass: after the forward pass has run."""

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(), initializer="ones", name="scale")

    def call(self, x):
        scaled = x * self.scale
        if not self.armed:
            return scaled

        @tf.custom_gradient
        def hungry(t):
            return tf.identity(t), lambda dy: dy + _ask_4tb(t, self.limit)

        return hungry(scaled)


def hungry_model(layer=Hungry):
    model = keras.Sequential([keras.Input((6,)), layer(8),
                              keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


@pytest.mark.slow
@pytest.mark.parametrize("layer", [Hungry, HungryBackward], ids=["forward", "backward"])
def test_a_real_oom_in_the_middle_of_a_batch_costs_only_that_micro_batch(layer):
    """Micro-batch 3 of 4 of the second large batch runs out of memory (the allocator
    waits ~10 s before it gives up), in its forward pass or, after that ran (the metrics'
    inputs exist), in its backward pass. The two before it stay summed, nothing of it
    reaches the sums, the metrics or the row count, the rest of the batch runs in pieces
    of 8 rows, and the run equals the uninterrupted one, metrics too."""
    x, y = data(256)
    x[64 + 40, 0] = 1000.0  # batch 1, micro-batch 2 (rows 32-47)
    reference, candidate = twin(functools.partial(hungry_model, layer), (x[:8], y[:8], None))
    reference.layers[0].armed = False
    ref_history = autosplit.fit_large_batch(reference, x, y, batch_size=64,
                                            micro_batch_size=16, shuffle=False, verbose=0)
    with pytest.warns(UserWarning, match="finishing the same batch"):
        history = autosplit.fit_large_batch(candidate, x, y, batch_size=64,
                                            micro_batch_size=16, shuffle=False, verbose=0)
    assert history.autosplit.oom_recoveries == (OomRecovery(step=1, failed=16, retry=8),)
    assert int(candidate.optimizer.iterations) == 4
    assert_weights_close(reference.get_weights(), candidate.get_weights(), 1e-5)
    np.testing.assert_allclose(history.history["accuracy"], ref_history.history["accuracy"])
    np.testing.assert_allclose(history.history["loss"], ref_history.history["loss"], rtol=1e-6)


@pytest.mark.slow
def test_a_seeded_shuffled_run_that_recovered_ends_where_the_uninterrupted_one_does():
    """Arrays shuffled (the default) over 3 epochs, one real out-of-memory error in the
    first: the later epochs read a pipeline built again at the smaller size, in the order
    the uninterrupted run reads them (before, a rebuilt shuffle drew a new sequence and
    the weights ended 2.8e-3 apart). keras.utils.set_random_seed makes both runs draw
    the same seed."""
    x, y = data(256)
    x[100, 0] = 1000.0  # wherever the shuffle puts it, its micro-batch of 16 fails
    reference, candidate = twin(hungry_model, (x[:8], y[:8], None))
    reference.layers[0].armed = False
    keras.utils.set_random_seed(11)
    ref_history = autosplit.fit_large_batch(reference, x, y, batch_size=64,
                                            micro_batch_size=16, epochs=3, verbose=0)
    keras.utils.set_random_seed(11)
    with pytest.warns(UserWarning, match="finishing the same batch"):
        history = autosplit.fit_large_batch(candidate, x, y, batch_size=64,
                                            micro_batch_size=16, epochs=3, verbose=0)
    report = history.autosplit
    assert [(r.failed, r.retry) for r in report.oom_recoveries] == [(16, 8)]
    assert report.oom_recoveries[0].step < 4  # in the first epoch
    assert report.micro_batch_size == 8
    assert int(candidate.optimizer.iterations) == 12
    assert_weights_close(reference.get_weights(), candidate.get_weights(), 1e-5)
    np.testing.assert_allclose(history.history["loss"], ref_history.history["loss"], rtol=1e-5)
    np.testing.assert_allclose(history.history["accuracy"], ref_history.history["accuracy"])


@pytest.mark.slow
def test_real_oom_under_a_cap_recovers_to_the_weights_of_an_uninterrupted_run(tmp_path):
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
    saved = np.load(str(out / "weights.npz"))
    assert_weights_close(model.get_weights(), [saved[f"arr_{i}"] for i in range(len(saved))],
                         1e-5)


class TrackedStep(keras.Model):
    """A custom train_step with a tracker and a returned loss tensor."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.tracker = keras.metrics.Mean(name="tracked")

    @property
    def metrics(self):
        return [self.tracker]

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = keras.ops.mean(keras.ops.square(self(x) - y))
        self.optimizer.apply(tape.gradient(loss, self.trainable_variables),
                             self.trainable_variables)
        self.tracker.update_state(loss)
        return {"raw": loss, "tracked": self.tracker.result()}


@pytest.mark.slow
def test_pieces_of_padding_alone_are_not_run_after_an_oom_in_a_short_batch():
    """The short last batch (12 real rows of a 32-row element) runs out of memory at 12
    rows and again at 16 (two real errors, ~10 s each); at 8 rows its last two pieces
    hold padding alone. Run through a custom train_step on 0 rows, they made the epoch's
    logs NaN; they are recorded, not run. The step's tracker counted each failed piece
    before its backward pass ran out of memory (100.6 against 132.4): the redo puts back
    the metric variables the last committed piece left. The run equals the
    uninterrupted one, logs and weights."""
    r = np.random.default_rng(11)
    x, y = r.normal(size=(76, 6)).astype("float32"), r.normal(size=(76, 1)).astype("float32")
    x[70, 0] = 1000.0  # in the short last batch (rows 64-75)

    def make():
        inputs = keras.Input((6,))
        model = TrackedStep(inputs, keras.layers.Dense(1)(Hungry(10)(inputs)))
        model.compile(optimizer=keras.optimizers.SGD(0.01))
        return model

    reference, candidate = twin(make, (x[:8], y[:8], None))
    reference.layers[1].armed = False
    expected = autosplit.fit_large_batch(reference, x, y, batch_size=32, micro_batch_size=32,
                                         shuffle=False, verbose=0)
    with pytest.warns(UserWarning, match="finishing the same batch"):
        got = autosplit.fit_large_batch(candidate, x, y, batch_size=32, micro_batch_size=32,
                                        shuffle=False, verbose=0)
    assert [(o.failed, o.retry) for o in got.autosplit.oom_recoveries] == [(32, 16), (16, 8)]
    assert np.isfinite(got.history["raw"]).all()
    np.testing.assert_allclose(got.history["raw"], expected.history["raw"], rtol=1e-5)
    np.testing.assert_allclose(got.history["tracked"], expected.history["tracked"], rtol=1e-5)
    assert_weights_close(reference.get_weights(), candidate.get_weights(), 1e-5)
