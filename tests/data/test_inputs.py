"""Every input model.fit takes goes through one host pipeline of micro-batches: exactness
for each input kind against plain ``model.fit``, generators, inputs of unknown length.
"""

from __future__ import annotations

import math

import keras
import numpy as np
import pytest
import tensorflow as tf
from _inputs import B, Batches, M, N, batches, candidate, data, make, reference_and_initial
from common import assert_weights_close

import autosplit

pytestmark = pytest.mark.slow  # every input kind trained against model.fit

KINDS = {
    "arrays": lambda x, y, w: dict(x=x, y=y, sample_weight=w, shuffle=False),
    "examples": lambda x, y, w: dict(x=tf.data.Dataset.from_tensor_slices((x, y, w))),
    "batched-by-32": lambda x, y, w: dict(x=tf.data.Dataset.from_tensor_slices((x, y, w))
                                          .batch(32)),
    "batched-by-7": lambda x, y, w: dict(x=tf.data.Dataset.from_tensor_slices((x, y, w))
                                         .batch(7)),
    "PyDataset": lambda x, y, w: dict(x=Batches(x, y, w, 25), shuffle=False),
    # Batches autosplit must recognise though no `.batch` ends the pipeline: SimSiam's
    # and SimCLR's zip of batched views, one element holding every row, a generator of
    # batches (told by the model's Input rank).
    "zipped-batches": lambda x, y, w: dict(x=tf.data.Dataset.zip(
        tuple(tf.data.Dataset.from_tensor_slices(a).batch(32) for a in (x, y, w)))),
    "from_tensors": lambda x, y, w: dict(x=tf.data.Dataset.from_tensors((x, y, w))),
    "generated-batches": lambda x, y, w: dict(x=tf.data.Dataset.from_generator(
        lambda: batches(x, y, w, 25), output_signature=(
            tf.TensorSpec((None, 6), tf.float32), tf.TensorSpec((None,), tf.int32),
            tf.TensorSpec((None,), tf.float32)))),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_input_kind_equals_model_fit(kind):
    reference, initial = reference_and_initial(epochs=2)
    model = candidate(initial)
    history = autosplit.fit_large_batch(model, batch_size=B, micro_batch_size=M, epochs=2,
                                        verbose=0, **KINDS[kind](*data()))
    assert int(model.optimizer.iterations) == 2 * math.ceil(N / B)
    assert_weights_close(reference.get_weights(), model.get_weights(), 1e-5)
    np.testing.assert_allclose(history.history["loss"], reference.history.history["loss"],
                               rtol=1e-5)


def test_a_generator_read_once_to_its_end():
    reference, initial = reference_and_initial(epochs=1)
    model = candidate(initial)
    history = autosplit.fit_large_batch(model, batches(*data(), 23), batch_size=B,
                                        micro_batch_size=M, verbose=0)
    assert history.autosplit.input == "generator"
    assert int(model.optimizer.iterations) == math.ceil(N / B)
    assert_weights_close(reference.get_weights(), model.get_weights(), 1e-5)


@pytest.mark.parametrize("rows", [N, 4 * B])  # a short last batch, or an exact end
def test_an_input_of_unknown_length_runs_each_large_batch_in_one_call(monkeypatch, rows):
    # A batched dataset whose length hides behind a filter tells its end only when it
    # comes: each large batch is one call (the loop, then the apply only if a row
    # came), and a call that finds the input spent applies nothing: the optimizer steps
    # once per large batch, as model.fit does.
    from autosplit.step.train_step import TrainStep

    calls = {"run_if_any": 0, "run_local": 0, "finish": 0}

    def counted(name):
        original = getattr(TrainStep, name)

        def spy(self, *args, **kwargs):
            calls[name] += 1
            return original(self, *args, **kwargs)
        return spy

    for name in calls:
        monkeypatch.setattr(TrainStep, name, counted(name))
    reference, initial = reference_and_initial(epochs=2, rows=rows)
    model = candidate(initial)
    x, y, w = (a[:rows] for a in data(max(rows, N)))
    history = autosplit.fit_large_batch(
        model, tf.data.Dataset.from_tensor_slices((x, y, w)).batch(10).filter(lambda *e: True),
        batch_size=B, micro_batch_size=M, epochs=2, verbose=0)
    steps = math.ceil(rows / B)
    assert int(model.optimizer.iterations) == 2 * steps
    # The short last batch runs into the epoch's end marker; a first epoch that ends
    # on a whole large batch learns its end from one more call, which finds the marker.
    exact = rows % B == 0
    assert calls == {"run_if_any": 2 * steps + exact, "run_local": 0, "finish": 0}
    assert_weights_close(reference.get_weights(), model.get_weights(), 1e-5)
    np.testing.assert_allclose(history.history["loss"], reference.history.history["loss"],
                               rtol=1e-5)


class OwnStep(keras.Model):
    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables, strict=True))
        return {"own_loss": loss}


def _model_of(kind):
    keras.utils.set_random_seed(1)
    inputs = keras.Input((6,))
    h = keras.layers.Dense(16, activation="relu")(inputs)
    if kind == "batch-norm":
        h = keras.layers.BatchNormalization()(h)
    outputs = keras.layers.Dense(3)(h)
    model = (OwnStep if kind == "own-train-step" else keras.Model)(inputs, outputs)
    optimizer = keras.optimizers.Adam(1e-2)
    if kind == "loss-scale":
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=None if kind == "own-train-step" else ["accuracy"],
                  run_eagerly=kind == "run-eagerly", jit_compile=kind == "jit")
    return model


@pytest.mark.filterwarnings("ignore:This model has BatchNormalization")
@pytest.mark.parametrize("kind", ["run-eagerly", "loss-scale", "own-train-step", "batch-norm",
                                  "jit"])
def test_the_guarded_apply_of_an_input_of_unknown_length_equals_the_arrays_path(kind):
    # A batched dataset's large batches apply inside a tf.cond (run_if_any), arrays'
    # without one: the same weights, logs and steps with a loss scale, a custom step's
    # own logs, pooled BatchNormalization statistics, XLA, or no graph at all.
    x, y, _ = data(200)
    on_arrays, on_batches = _model_of(kind), _model_of(kind)
    expected = autosplit.fit_large_batch(on_arrays, x, y, batch_size=64, micro_batch_size=16,
                                         epochs=2, shuffle=False, verbose=0)
    got = autosplit.fit_large_batch(
        on_batches, tf.data.Dataset.from_tensor_slices((x, y)).batch(10), batch_size=64,
        micro_batch_size=16, epochs=2, verbose=0)
    assert int(on_batches.optimizer.iterations) == int(on_arrays.optimizer.iterations) == 8
    assert_weights_close(on_arrays.get_weights(), on_batches.get_weights(), 1e-6)
    assert got.history.keys() == expected.history.keys()
    for name, values in expected.history.items():
        np.testing.assert_allclose(got.history[name], values, rtol=1e-6)


def test_an_endless_generator_with_steps_per_epoch():
    reference, initial = reference_and_initial(epochs=1, rows=3 * B)
    model = candidate(initial)
    autosplit.fit_large_batch(model, batches(*data(), 20, forever=True), batch_size=B,
                              micro_batch_size=M, steps_per_epoch=3, verbose=0)
    assert int(model.optimizer.iterations) == 3
    assert_weights_close(reference.get_weights(), model.get_weights(), 1e-5)


def test_a_second_epoch_of_a_spent_generator_warns_and_stops():
    model = make()
    with pytest.warns(UserWarning, match="ran out of data"):
        history = autosplit.fit_large_batch(model, batches(*data(), 23), batch_size=B,
                                            micro_batch_size=M, epochs=3, verbose=0)
    assert len(history.history["loss"]) == 1
