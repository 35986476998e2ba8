"""fit_large_batch: model.fit behaviour over epochs, callbacks, validation and steps."""

from __future__ import annotations

import dataclasses
import json
import math
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from _fit import data, make_mlp
from common import assert_weights_close, twin

import autosplit
from autosplit.data.pipeline import MicroBatches


@pytest.mark.slow
def test_fit_equals_model_fit_over_epochs_with_a_short_last_batch():
    x, y = data(230)  # 230 = 3 * 64 + 38: a short last large batch each epoch
    reference, candidate = twin(make_mlp, (x[:16], y[:16], None))
    reference.fit(x, y, batch_size=64, epochs=3, shuffle=False, verbose=0)
    history = autosplit.fit_large_batch(candidate, (x, y), batch_size=64, micro_batch_size=16,
                                        epochs=3, shuffle=False, verbose=0)
    assert_weights_close(reference.get_weights(), candidate.get_weights(), 1e-5)
    assert int(candidate.optimizer.iterations) == 3 * math.ceil(230 / 64)
    assert history.autosplit.micro_batch_size == 16
    assert history.autosplit.accumulation_steps == 4
    assert history.autosplit.traces == 1  # the padded last batch reuses the trace
    assert history.autosplit.micro_batch_sizes == (16, 16, 16)
    assert history.autosplit.oom_recoveries == ()
    assert len(history.history["loss"]) == 3


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["arrays", "examples", "generator"])
def test_one_iterator_reads_every_epoch_where_the_epoch_is_known(kind, monkeypatch):
    # Making an iterator instantiates the pipeline's functions (13-20 ms an epoch): where
    # each epoch's elements are known, one iterator of the repeated pipeline reads them
    # all, and the weights are model.fit's; a generator's epoch ends when it does.
    x, y = data(230)
    made = []
    original = MicroBatches.dataset

    def dataset(self, **kwargs):
        made.append(kwargs.get("repeat", False))
        return original(self, **kwargs)

    monkeypatch.setattr(MicroBatches, "dataset", dataset)
    reference, candidate = twin(make_mlp, (x[:16], y[:16], None))
    if kind == "generator":
        def batches():
            for start in range(0, 230, 23):
                yield x[start:start + 23], y[start:start + 23]
        reference.fit(x, y, batch_size=230, epochs=1, shuffle=False, verbose=0)
        given = {"x": batches(), "batch_size": 230, "epochs": 1}  # one pass: one epoch
    else:
        reference.fit(x, y, batch_size=64, epochs=3, shuffle=False, verbose=0)
        given = {"x": tf.data.Dataset.from_tensor_slices((x, y)) if kind == "examples"
                 else x, "y": None if kind == "examples" else y, "batch_size": 64, "epochs": 3}
    autosplit.fit_large_batch(candidate, **given, micro_batch_size=16, shuffle=False,
                              verbose=0)
    # The first call gives the step its element spec; then one per iterator made.
    assert made == ([False, False] if kind == "generator" else [False, True])
    assert_weights_close(reference.get_weights(), candidate.get_weights(), 1e-5)


@pytest.mark.slow
def test_a_full_collection_only_where_memory_is_measured_or_capped(monkeypatch):
    # gc.collect() frees an earlier call's pipelines before the probe measures, under a
    # cap and on a GPU; on a plain CPU it is left to Python, as after model.fit (it cost
    # 0.1-0.3 s a call in a process with a few models).
    import autosplit.training.plan as plan_module

    calls = []
    monkeypatch.setattr(plan_module.gc, "collect", lambda *a: calls.append(a) or 0)
    monkeypatch.delenv("TF_CPU_ALLOCATOR_USE_BFC", raising=False)
    monkeypatch.setattr(plan_module.tf.config, "list_logical_devices", lambda kind=None: [])
    # The variable alone, set after TensorFlow made its allocator, caps nothing: no
    # trial of the given size in a child process (autosplit.search.isolation).
    monkeypatch.setattr(plan_module, "kernels_may_crash", lambda: False)
    x, y = data(64)
    autosplit.fit_large_batch(make_mlp(), x, y, batch_size=32, micro_batch_size=16, verbose=0)
    assert calls == []
    monkeypatch.setenv("TF_CPU_ALLOCATOR_USE_BFC", "true")
    autosplit.fit_large_batch(make_mlp(), x, y, batch_size=32, micro_batch_size=16, verbose=0)
    assert len(calls) == 1


def test_the_report_is_immutable_its_dict_plain_and_indexing_it_deprecated():
    report = autosplit.FitReport(
        batch_size=64, micro_batch_size=8, accumulation_steps=8, padded_rows=0,
        micro_batch_reason="given", input="arrays", batch_norm="pooled", replicas=1,
        workers=1, micro_batch_sizes=(16, 8), oom_recoveries=(autosplit.OomRecovery(3, 16, 8),),
        probe=None, traces=2)
    plain = report.to_dict()
    assert plain["oom_recoveries"] == [{"step": 3, "failed": 16, "retry": 8}]
    assert plain["micro_batch_sizes"] == [16, 8] and plain["probe"] is None
    assert json.loads(json.dumps(plain)) == plain
    assert list(plain) == [f.name for f in dataclasses.fields(report)]
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.traces = 0
    with pytest.warns(DeprecationWarning, match=r"read history.autosplit.oom_recoveries"):
        assert report["oom_recoveries"] == plain["oom_recoveries"]


def test_dataset_of_examples_with_dict_inputs_and_weights():
    x, y = data(100)
    w = np.linspace(0.5, 1.5, 100).astype("float32")
    inputs = {"a": keras.Input((3,), name="a"), "b": keras.Input((3,), name="b")}
    out = keras.layers.Dense(3)(keras.layers.Concatenate()([inputs["a"], inputs["b"]]))

    def make():
        model = keras.Model(inputs, out)
        model.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    ref = make()
    ref.build({"a": (None, 3), "b": (None, 3)})
    features = {"a": x[:, :3], "b": x[:, 3:]}
    initial = ref.get_weights()
    ref.fit(features, y, sample_weight=w, batch_size=40, shuffle=False, verbose=0)
    model = make()
    model.set_weights(initial)
    ds = tf.data.Dataset.from_tensor_slices((features, y, w))
    autosplit.fit_large_batch(model, ds, batch_size=40, micro_batch_size=8, verbose=0)
    assert_weights_close(ref.get_weights(), model.get_weights(), 1e-5)


def test_learning_rate_schedule_sees_large_batch_steps():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=1, decay_rate=0.5)
    model = make_mlp(keras.optimizers.SGD(schedule))
    x, y = data(200)
    autosplit.fit_large_batch(model, (x, y), batch_size=50, micro_batch_size=10, epochs=2,
                              verbose=0)
    assert int(model.optimizer.iterations) == 8
    np.testing.assert_allclose(float(model.optimizer.learning_rate), 0.1 * 0.5**8, rtol=1e-6)


def test_initial_epoch_at_or_past_epochs_trains_nothing_as_model_fit():
    # A resumed script run again after its last epoch: model.fit returns quietly.
    x, y = data(128)
    reference, candidate = twin(make_mlp, (x[:16], y[:16], None))
    expected = reference.fit(x, y, batch_size=64, epochs=2, initial_epoch=2, verbose=0)
    seen = []
    record = keras.callbacks.LambdaCallback(on_train_begin=lambda logs: seen.append("begin"),
                                            on_train_end=lambda logs: seen.append("end"))
    history = autosplit.fit_large_batch(candidate, x, y, batch_size=64, micro_batch_size=16,
                                        epochs=2, initial_epoch=2, verbose=0,
                                        callbacks=[record])
    assert history.history == expected.history == {}
    assert history.epoch == expected.epoch == []
    assert seen == ["begin", "end"]
    assert int(candidate.optimizer.iterations) == 0
    assert_weights_close(reference.get_weights(), candidate.get_weights(), 0)


def test_callbacks_see_large_batches_and_stop_training():
    x, y = data(300)
    seen = []

    class Recorder(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append((batch, self.params["micro_batch_size"], sorted(logs)))
            if len(seen) == 5:
                self.model.stop_training = True

    model = make_mlp()
    history = autosplit.fit_large_batch(model, (x, y), batch_size=100, micro_batch_size=25,
                                        epochs=4, callbacks=[Recorder()], verbose=0)
    assert [b for b, _, _ in seen] == [0, 1, 2, 0, 1]
    assert seen[0][1] == 25 and seen[0][2] == ["accuracy", "loss"]
    assert len(history.history["loss"]) == 2
    assert int(model.optimizer.iterations) == 5


@pytest.mark.slow
def test_early_stopping_checkpoint_tensorboard_and_validation(tmp_path):
    x, y = data(200)
    model = make_mlp()
    callbacks = [
        keras.callbacks.EarlyStopping(monitor="val_loss", patience=0, min_delta=10.0),
        keras.callbacks.ModelCheckpoint(str(tmp_path / "best.keras"), monitor="val_loss"),
        keras.callbacks.TensorBoard(str(tmp_path / "tb")),
    ]
    history = autosplit.fit_large_batch(
        model, (x, y), batch_size=100, micro_batch_size=20, epochs=5,
        validation_data=(x[:50], y[:50]), callbacks=callbacks, verbose=0)
    assert len(history.history["val_loss"]) == 2  # patience 0 with an impossible delta
    assert (tmp_path / "best.keras").exists()
    assert any((tmp_path / "tb").rglob("*tfevents*"))
    evaluated = model.evaluate(x[:50], y[:50], verbose=0, return_dict=True)
    np.testing.assert_allclose(history.history["val_loss"][-1], evaluated["loss"], rtol=1e-5)


def test_progress_bar_is_shown(capsys):
    x, y = data(100)
    autosplit.fit_large_batch(make_mlp(), (x, y), batch_size=50, micro_batch_size=10,
                              verbose=1)
    out = capsys.readouterr().out
    assert "2/2" in out and "loss" in out


def test_steps_per_epoch_with_repeated_dataset():
    x, y = data(100)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).repeat()
    model = make_mlp()
    autosplit.fit_large_batch(model, ds, batch_size=30, micro_batch_size=10, epochs=2,
                              steps_per_epoch=3, verbose=0)
    assert int(model.optimizer.iterations) == 6


@pytest.mark.slow
@pytest.mark.parametrize(("steps", "epochs", "iterations"), [(3, 4, 8), (2, 3, 6), (5, 2, 8)])
def test_steps_per_epoch_past_the_data_ends_the_epoch_and_reads_it_again(steps, epochs,
                                                                        iterations):
    # Keras 3 counts an input's batches: an epoch that reaches the end of the data ends
    # there with a warning, and the next one reads the data again. autosplit stopped
    # training (5 large batches where model.fit ran 8, weights 0.70 apart).
    x, y = data(230)  # 4 large batches of 64: 64, 64, 64, 38
    reference, candidate = twin(make_mlp, (x[:16], y[:16], None))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Keras's own "ran out of data"
        reference.fit(x, y, batch_size=64, epochs=epochs, steps_per_epoch=steps,
                      shuffle=False, verbose=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = autosplit.fit_large_batch(candidate, x, y, batch_size=64, micro_batch_size=16,
                                            epochs=epochs, steps_per_epoch=steps,
                                            shuffle=False, verbose=0)
    assert int(candidate.optimizer.iterations) == int(reference.optimizer.iterations)
    assert int(candidate.optimizer.iterations) == iterations
    assert len(history.epoch) == epochs
    assert_weights_close(reference.get_weights(), candidate.get_weights(), 1e-5)
    short = [w for w in caught if "the next one reads the data again" in str(w.message)]
    assert bool(short) == (4 % steps != 0)  # an epoch ended early


@pytest.mark.slow
def test_batch_norm_warns_once_per_step_build():
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8),
                              keras.layers.BatchNormalization(), keras.layers.Dense(3)])
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(True))
    x, y = data(64)
    with pytest.warns(UserWarning, match="ghost batch norm"):
        autosplit.fit_large_batch(model, (x, y), batch_size=64, micro_batch_size=16, verbose=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        autosplit.fit_large_batch(model, (x, y), batch_size=64, micro_batch_size=64, verbose=0)


@pytest.mark.slow
def test_shuffle_batch_keeps_each_large_batch_so_it_trains_as_unshuffled():
    """Keras's shuffle="batch": large batch i holds rows [i*B, (i+1)*B) in a new order
    each epoch; a large batch's gradient does not depend on that order. (A full shuffle,
    what "batch" used to become, moves rows between large batches and fails this.)"""
    x, y = data(230)
    reference, candidate = twin(make_mlp, (x[:16], y[:16], None))
    reference.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
    autosplit.fit_large_batch(candidate, x, y, batch_size=64, micro_batch_size=16, epochs=2,
                              shuffle="batch", verbose=0)
    assert_weights_close(reference.get_weights(), candidate.get_weights(), 1e-5)


class HookLog(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.events = []

    def on_test_begin(self, logs=None):
        self.events.append(("begin",))

    def on_test_batch_begin(self, batch, logs=None):
        self.events.append(("batch_begin", batch))

    def on_test_batch_end(self, batch, logs=None):
        self.events.append(("batch_end", batch, round(logs["loss"], 5)))

    def on_test_end(self, logs=None):
        self.events.append(("end", round(logs["loss"], 5), round(logs["accuracy"], 5)))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["arrays", "batched"])
def test_validation_calls_the_test_hooks_as_model_fit_does(kind):
    # model.fit validates through model.evaluate with its callbacks: on_test_begin, a
    # batch's begin and end for each validation batch (running logs), on_test_end with
    # the logs. autosplit called none of them (TensorBoard lacked its evaluation_*
    # curves). Batches of B = 64 rows: 64 and 36 of 100.
    x, y = data(128)
    vx, vy = data(100, seed=1)

    def validation():
        return (vx, vy) if kind == "arrays" else tf.data.Dataset.from_tensor_slices(
            (vx, vy)).batch(64)

    reference, candidate = twin(make_mlp, (x[:16], y[:16], None))
    expected, got = HookLog(), HookLog()
    reference.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0,
                  validation_data=validation(), callbacks=[expected])
    autosplit.fit_large_batch(candidate, x, y, batch_size=64, micro_batch_size=16, epochs=2,
                              shuffle=False, verbose=0, validation_data=validation(),
                              callbacks=[got])
    assert [e[:2] for e in got.events] == [e[:2] for e in expected.events]
    np.testing.assert_allclose([e[1:] for e in got.events if e[0] == "end"],
                               [e[1:] for e in expected.events if e[0] == "end"], rtol=1e-5)
    np.testing.assert_allclose([e[2] for e in got.events if e[0] == "batch_end"],
                               [e[2] for e in expected.events if e[0] == "batch_end"],
                               rtol=1e-4)


def test_a_loss_that_overflows_logs_inf_as_model_fit_with_padding_rows():
    # m = 12 does not divide B = 32: padding rows copy real rows. Multiplied by 0, a
    # copy's inf loss made the sum NaN; TerminateOnNaN's logs then read nan, not inf.
    r = np.random.default_rng(0)
    x = (r.normal(size=(96, 4)) * 100).astype("float32")
    y = (r.normal(size=(96, 1)) * 1e18).astype("float32")

    def make():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(1e6), loss="mse")
        return model

    reference, candidate = twin(make, (x[:8], y[:8], None))
    stop = [keras.callbacks.TerminateOnNaN()]
    expected = reference.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0,
                             callbacks=stop)
    got = autosplit.fit_large_batch(candidate, x, y, batch_size=32, micro_batch_size=12,
                                    epochs=3, shuffle=False, verbose=0, callbacks=stop)
    assert np.isinf(expected.history["loss"]).all()
    np.testing.assert_array_equal(got.history["loss"], expected.history["loss"])
    assert int(candidate.optimizer.iterations) == int(reference.optimizer.iterations)


@pytest.mark.slow
def test_rereading_shuffled_arrays_every_epoch_builds_the_cut_once(monkeypatch):
    # With steps_per_epoch each pass over the data is a new iterator. Cut per epoch and
    # cached, shuffled arrays grew by 47 MB over 300 epochs; one cut, whose epoch is a
    # variable, serves them all.
    x, y = data(64)
    built = []
    original = MicroBatches._build

    def counting(self, **kwargs):
        built.append(kwargs["shuffle_seed"])
        return original(self, **kwargs)

    monkeypatch.setattr(MicroBatches, "_build", counting)
    model = make_mlp()
    autosplit.fit_large_batch(model, x, y, batch_size=32, micro_batch_size=16, epochs=12,
                              steps_per_epoch=2, verbose=0)
    assert int(model.optimizer.iterations) == 24
    assert len(built) <= 2  # the element spec's unseeded cut, and the seeded one


@pytest.mark.slow
@pytest.mark.parametrize("batched", [True, False])
def test_steps_per_epoch_past_an_input_of_unknown_length_reads_it_again(batched):
    # Keras learns the count of batches where the data first ends and reads the data
    # again in the next epoch; autosplit stopped training there (2 epochs of 4). 160
    # rows, B = 32: 5 large batches a pass, 3 + 2 + 3 + 2 over 4 epochs.
    x, y = data(160)
    reference, candidate = twin(make_mlp, (x[:16], y[:16], None))

    def unknown():  # a filter hides the length (cardinality unknown)
        ds = tf.data.Dataset.from_tensor_slices((x, y)).filter(lambda a, b: True)
        return ds.batch(32) if batched else ds

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = reference.fit(unknown() if batched else unknown().batch(32),
                                 steps_per_epoch=3, epochs=4, verbose=0)
        got = autosplit.fit_large_batch(candidate, unknown(), batch_size=32,
                                        micro_batch_size=16, steps_per_epoch=3, epochs=4,
                                        verbose=0)
    assert len(got.history["loss"]) == len(expected.history["loss"]) == 4
    # Keras also counts its steps that found the data ended (12); 10 large batches ran.
    assert int(candidate.optimizer.iterations) == 10
    assert_weights_close(reference.get_weights(), candidate.get_weights(), 1e-5)
    np.testing.assert_allclose(got.history["loss"], expected.history["loss"], rtol=1e-5)
