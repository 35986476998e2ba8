"""Long runs: interrupted, resumed, saved, reloaded, cloned, alternated with model.fit.

Every test runs the same sequence with plain ``model.fit`` (batch_size=B) as reference
and compares weights, optimizer variables, iterations and logs.
"""

from __future__ import annotations

import functools
import zipfile

import h5py
import keras
import numpy as np
import pytest
from common import assert_weights_close, three_classes

import autosplit

N, B, M = 200, 50, 20  # 4 large batches an epoch, each cut 20 + 20 + 10 rows


def data(n=N, seed=0):
    return three_classes(n, seed)


def mlp(batch_norm=False):
    """Dense layers trained with Adam; with ``batch_norm`` a BatchNormalization layer too
    (it normalises each micro-batch alone, so it is compared with autosplit only)."""
    keras.utils.set_random_seed(3)
    norm = [keras.layers.BatchNormalization()] if batch_norm else []
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"),
                              *norm, keras.layers.Dense(3)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def twins(count=2, batch_norm=False):
    models = [mlp(batch_norm) for _ in range(count)]
    for model in models:
        model.build((None, 6))
        model.set_weights(models[0].get_weights())
    return models


def fit_both(reference, candidate, x, y, **kwargs):
    """``model.fit`` on the reference, ``fit_large_batch`` on the candidate."""
    expected = reference.fit(x, y, batch_size=B, shuffle=False, verbose=0, **kwargs)
    got = autosplit.fit_large_batch(candidate, x, y, batch_size=B, micro_batch_size=M,
                                    shuffle=False, verbose=0, **kwargs)
    return expected, got


def assert_same_state(reference, candidate, rtol=1e-4):
    """Weights (BatchNormalization's moving statistics too) and the optimizer's slots to
    Adam's tolerance; iterations exactly."""
    assert int(candidate.optimizer.iterations) == int(reference.optimizer.iterations)
    assert_weights_close(reference.get_weights(), candidate.get_weights(), rtol)
    assert_weights_close([v.numpy() for v in reference.optimizer.variables],
                         [v.numpy() for v in candidate.optimizer.variables], rtol)


def assert_same_logs(expected, got, rtol=1e-4):
    assert expected.history.keys() == got.history.keys()
    for key, values in expected.history.items():
        np.testing.assert_allclose(got.history[key], values, rtol=rtol, err_msg=key)


class StopAt(keras.callbacks.Callback):
    """Raises ``error`` before large batch ``batch`` of epoch ``epoch`` (an interruption)."""

    def __init__(self, epoch, batch, error=KeyboardInterrupt):
        super().__init__()
        self.at, self.error = (epoch, batch), error
        self.epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            raise self.error("interrupted")


@pytest.mark.parametrize("save_freq", ["epoch", 3])
def test_backup_and_restore_resumes_as_model_fit_resumes(tmp_path, save_freq):
    """Interrupted (Ctrl-C) before batch 2 of epoch 2, then resumed with the same
    callback. With save_freq="epoch" both equal the uninterrupted run. With save_freq=3
    Keras restores the weights of the last save (after batch 0 of epoch 2) and runs
    epoch 2 again from its first batch, so neither equals it: autosplit does what
    model.fit does, step for step."""
    x, y = data()
    reference, candidate, uninterrupted = twins(3)
    autosplit.fit_large_batch(uninterrupted, x, y, batch_size=B, micro_batch_size=M,
                              epochs=4, shuffle=False, verbose=0)
    histories = []
    for model, folder in ((reference, "ref"), (candidate, "cand")):
        backup = keras.callbacks.BackupAndRestore(str(tmp_path / folder), save_freq=save_freq)
        train = (model.fit if model is reference else
                 functools.partial(autosplit.fit_large_batch, model, micro_batch_size=M))
        with pytest.raises(KeyboardInterrupt):
            train(x, y, batch_size=B, epochs=4, shuffle=False, verbose=0,
                  callbacks=[backup, StopAt(2, 2)])
        histories.append(train(x, y, batch_size=B, epochs=4, shuffle=False, verbose=0,
                               callbacks=[backup]))
    assert_same_state(reference, candidate)
    assert_same_logs(*histories)
    if save_freq == "epoch":
        assert_same_state(uninterrupted, candidate)
        assert len(histories[1].history["loss"]) == 2  # epochs 3 and 4
    else:
        assert int(candidate.optimizer.iterations) == 4 * 4 + 1  # batch 0 of epoch 2 twice


def test_an_error_in_the_middle_of_a_large_batch_leaves_nothing_behind():
    """A bad label in micro-batch 2 of 3 of the second large batch: the first large batch
    is applied, the second not at all, and the next call starts clean (no partial
    sums, no half-pooled BatchNormalization statistics): it ends where a model that
    trained the first large batch and then the good data ends."""
    x, y = data()
    candidate, reference = twins(batch_norm=True)
    bad = y.copy()
    bad[B + M + 3] = 99  # out of range for 3 classes
    with pytest.raises(Exception, match="99"):
        autosplit.fit_large_batch(candidate, x, bad, batch_size=B, micro_batch_size=M,
                                  shuffle=False, verbose=0)
    assert int(candidate.optimizer.iterations) == 1
    for model, (xs, ys) in ((reference, (x[:B], y[:B])), (reference, (x, y)),
                            (candidate, (x, y))):
        autosplit.fit_large_batch(model, xs, ys, batch_size=B, micro_batch_size=M,
                                  shuffle=False, verbose=0)
    assert_same_state(reference, candidate, rtol=1e-6)


def _saved_variables(path):
    """The paths of every array ``model.save`` wrote into a ``.keras`` file."""
    with zipfile.ZipFile(path) as archive, archive.open("model.weights.h5") as raw, \
            h5py.File(raw, "r") as weights:
        names = []
        weights.visititems(lambda name, item: names.append(name)
                           if isinstance(item, h5py.Dataset) else None)
    return sorted(names)


def test_model_save_holds_what_model_fit_saves_and_load_model_continues_exactly(tmp_path):
    x, y = data()
    reference, candidate = twins()
    fit_both(reference, candidate, x, y, epochs=2)
    reference.save(tmp_path / "reference.keras")
    candidate.save(tmp_path / "candidate.keras")
    # No accumulator, stash or row count of autosplit's step is saved with the model.
    assert _saved_variables(tmp_path / "candidate.keras") == \
        _saved_variables(tmp_path / "reference.keras")
    loaded_reference = keras.saving.load_model(tmp_path / "reference.keras")
    loaded = keras.saving.load_model(tmp_path / "candidate.keras")
    assert_same_state(candidate, loaded, rtol=0)
    expected, got = fit_both(loaded_reference, loaded, x, y, epochs=2)
    fit_both(reference, candidate, x, y, epochs=2)  # the run that was not saved
    assert_same_state(loaded_reference, loaded)
    assert_same_state(candidate, loaded)
    assert_same_logs(expected, got)


def test_clone_model_model_fit_around_it_and_two_models_in_turn():
    x, y = data()
    ref_a, cand_a = twins()
    ref_b = keras.models.clone_model(ref_a)
    ref_b.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    ref_b.build((None, 6))
    cand_b = keras.models.clone_model(ref_b)
    cand_b.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                   loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                   metrics=["accuracy"])
    cand_b.build((None, 6))
    cand_b.set_weights(ref_b.get_weights())
    # model.fit before, then the two models in turn, then model.fit after.
    for model in (ref_a, cand_a):
        model.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    for _ in range(2):
        for reference, candidate in ((ref_a, cand_a), (ref_b, cand_b)):
            expected, got = fit_both(reference, candidate, x, y)
            assert_same_logs(expected, got)
    for model in (ref_b, cand_b):
        model.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    assert_same_state(ref_a, cand_a)
    assert_same_state(ref_b, cand_b)


def test_early_stopping_restores_the_best_weights_as_model_fit_does():
    x, y = data()
    xv, yv = data(60, seed=1)
    reference, candidate = twins()

    def stopper():
        return keras.callbacks.EarlyStopping(monitor="val_loss", patience=1, min_delta=0.05,
                                             restore_best_weights=True)

    expected, got = fit_both(reference, candidate, x, y, epochs=30,
                             validation_data=(xv, yv), callbacks=[stopper()])
    assert len(got.history["loss"]) == len(expected.history["loss"]) < 30
    assert_same_logs(expected, got)
    assert_same_state(reference, candidate)


class Recorder(keras.callbacks.Callback):
    """What the model holds after every large batch: the learning rate and the weights."""

    def __init__(self):
        super().__init__()
        self.steps = []

    def on_train_batch_end(self, batch, logs=None):
        self.steps.append((float(self.model.optimizer.learning_rate),
                           [w.copy() for w in self.model.get_weights()]))


def test_callbacks_that_change_training_act_at_the_same_steps_as_in_model_fit(tmp_path):
    """LearningRateScheduler, ReduceLROnPlateau and ModelCheckpoint(save_freq=3) together,
    then TerminateOnNaN: the same learning rate and weights after every step, the same
    checkpoints, the same stop."""
    x, y = data()
    reference, candidate = twins()
    recorders = {}
    for name, model in (("reference", reference), ("candidate", candidate)):
        recorders[name] = Recorder()
        callbacks = [
            keras.callbacks.LearningRateScheduler(lambda epoch, lr: lr * 0.9),
            keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0,
                                              min_delta=10.0),
            keras.callbacks.ModelCheckpoint(str(tmp_path / name / "{epoch}-{batch}.weights.h5"),
                                            save_weights_only=True, save_freq=3),
            recorders[name]]
        if model is reference:
            model.fit(x, y, batch_size=B, epochs=3, shuffle=False, verbose=0,
                      callbacks=callbacks)
        else:
            autosplit.fit_large_batch(model, x, y, batch_size=B, micro_batch_size=M, epochs=3,
                                      shuffle=False, verbose=0, callbacks=callbacks)
    expected, got = recorders["reference"].steps, recorders["candidate"].steps
    assert len(got) == len(expected) == 12
    for (lr_e, w_e), (lr_g, w_g) in zip(expected, got, strict=True):
        assert lr_g == pytest.approx(lr_e, rel=1e-7)
        assert_weights_close(w_e, w_g, 1e-4)
    saved = {name: sorted(p.name for p in (tmp_path / name).iterdir())
             for name in recorders}
    assert saved["candidate"] == saved["reference"] and len(saved["candidate"]) == 4
    for file in saved["candidate"]:
        reference.load_weights(tmp_path / "reference" / file)
        candidate.load_weights(tmp_path / "candidate" / file)
        assert_weights_close(reference.get_weights(), candidate.get_weights(), 1e-4)

    bad = x.copy()
    bad[B * 2 + 5, 0] = np.inf  # the third large batch goes NaN
    stopped = []
    for model in twins():
        train = (model.fit if not stopped else
                 functools.partial(autosplit.fit_large_batch, model, micro_batch_size=M))
        history = train(bad, y, batch_size=B, epochs=3, shuffle=False, verbose=0,
                        callbacks=[keras.callbacks.TerminateOnNaN()])
        stopped.append((int(model.optimizer.iterations), len(history.history["loss"])))
    assert stopped[0] == stopped[1] == (3, 1)
