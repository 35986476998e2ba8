"""fit_large_batch as a drop-in for model.fit: what callbacks see, what it leaves behind.
Each test runs plain ``model.fit`` with the same large batch as reference."""

from __future__ import annotations

import csv
import gc

import keras
import numpy as np
import psutil
import pytest
import tensorflow as tf
from _parity import B, M, data, mlp, pair
from common import assert_weights_close

import autosplit


def test_ema_weights_are_swapped_in_at_the_end():
    def make():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.SGD(0.1, use_ema=True, ema_momentum=0.9),
                      loss="mse")
        return model

    r = np.random.default_rng(0)
    x, y = r.normal(size=(64, 4)).astype("float32"), r.normal(size=(64, 2)).astype("float32")
    reference, candidate = make(), make()
    reference.build((None, 4))
    candidate.build((None, 4))
    candidate.set_weights(reference.get_weights())
    reference.fit(x, y, batch_size=32, shuffle=False, verbose=0)
    autosplit.fit_large_batch(candidate, x, y, batch_size=32, micro_batch_size=8,
                              shuffle=False, verbose=0)
    assert_weights_close(reference.get_weights(), candidate.get_weights(), 1e-6)


def test_model_checkpoint_every_n_large_batches(tmp_path):
    x, y = data()
    saves = []

    class Spy(keras.callbacks.ModelCheckpoint):
        def _save_model(self, epoch, batch, logs):
            saves.append((epoch, batch))
            super()._save_model(epoch, batch, logs)

    autosplit.fit_large_batch(mlp(), x, y, batch_size=B, micro_batch_size=M, epochs=2,
                              verbose=0, callbacks=[Spy(str(tmp_path / "m.keras"), save_freq=3)])
    # 4 large batches per epoch, a save every 3: after steps 3, 6 (epoch 2, batch 1).
    assert saves == [(0, 2), (1, 1)]
    assert (tmp_path / "m.keras").exists()


class Interrupt(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 2:
            raise RuntimeError("interrupted")


@pytest.mark.slow
def test_backup_and_restore_resumes_to_the_uninterrupted_weights(tmp_path):
    x, y = data()
    uninterrupted, resumed = pair(mlp)
    autosplit.fit_large_batch(uninterrupted, x, y, batch_size=B, micro_batch_size=M,
                              epochs=4, shuffle=False, verbose=0)
    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    with pytest.raises(RuntimeError, match="interrupted"):
        autosplit.fit_large_batch(resumed, x, y, batch_size=B, micro_batch_size=M, epochs=4,
                                  shuffle=False, verbose=0, callbacks=[backup, Interrupt()])
    assert int(resumed.optimizer.iterations) == 8
    history = autosplit.fit_large_batch(resumed, x, y, batch_size=B, micro_batch_size=M,
                                        epochs=4, shuffle=False, verbose=0,
                                        callbacks=[backup])
    assert len(history.history["loss"]) == 2  # epochs 3 and 4 only
    assert int(resumed.optimizer.iterations) == 16
    assert_weights_close(uninterrupted.get_weights(), resumed.get_weights(), 1e-6)


@pytest.mark.slow
def test_reduce_lr_csv_logger_and_learning_rate_scheduler_as_in_model_fit(tmp_path):
    x, y = data()
    reference, candidate = pair(mlp)

    def callbacks(name):
        return [keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0,
                                                  min_delta=10.0),
                keras.callbacks.CSVLogger(str(tmp_path / f"{name}.csv"))]

    reference.fit(x, y, batch_size=B, epochs=3, shuffle=False, verbose=0,
                  callbacks=callbacks("reference"))
    autosplit.fit_large_batch(candidate, x, y, batch_size=B, micro_batch_size=M, epochs=3,
                              shuffle=False, verbose=0, callbacks=callbacks("candidate"))
    # min_delta=10: no epoch after the first counts as an improvement, so two halvings.
    assert float(candidate.optimizer.learning_rate) == pytest.approx(0.1 * 0.5**2)
    assert float(reference.optimizer.learning_rate) == float(candidate.optimizer.learning_rate)
    assert_weights_close(reference.get_weights(), candidate.get_weights(), 1e-5)
    rows = {name: list(csv.DictReader((tmp_path / f"{name}.csv").read_text().splitlines()))
            for name in ("reference", "candidate")}
    assert [r["epoch"] for r in rows["candidate"]] == ["0", "1", "2"]
    assert rows["candidate"][0].keys() == rows["reference"][0].keys()
    for ref, got in zip(rows["reference"], rows["candidate"], strict=True):
        for key in ref:
            if ref[key] == "NA":
                assert got[key] == "NA"
            else:
                np.testing.assert_allclose(float(got[key]), float(ref[key]), rtol=1e-5)
    model = mlp()
    autosplit.fit_large_batch(model, x, y, batch_size=B, micro_batch_size=M, epochs=3,
                              verbose=0, callbacks=[keras.callbacks.LearningRateScheduler(
                                  lambda epoch, lr: 0.01 * (epoch + 1))])
    assert float(model.optimizer.learning_rate) == pytest.approx(0.03)


def test_terminate_on_nan_stops_after_the_large_batch_that_went_nan():
    x, y = data()
    x[120, 0] = np.inf  # in the third large batch
    model = mlp()
    history = autosplit.fit_large_batch(model, x, y, batch_size=B, micro_batch_size=M,
                                        epochs=3, shuffle=False, verbose=0,
                                        callbacks=[keras.callbacks.TerminateOnNaN()])
    assert int(model.optimizer.iterations) == 3
    assert len(history.history["loss"]) == 1


def test_tensorboard_writes_one_point_per_update_freq_large_batches(tmp_path):
    x, y = data()
    autosplit.fit_large_batch(mlp(), x, y, batch_size=B, micro_batch_size=M, epochs=2,
                              verbose=0, callbacks=[keras.callbacks.TensorBoard(
                                  str(tmp_path), update_freq=2)])
    steps = set()
    for path in (tmp_path / "train").glob("*tfevents*"):
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            for value in event.summary.value:
                if value.tag == "batch_loss":
                    steps.add(event.step)
    assert steps == {2, 4, 6, 8}, steps  # 8 large batches, a point every 2


def test_add_loss_in_call_warns_when_split():
    class Penalty(keras.layers.Layer):
        def call(self, x):
            self.add_loss(keras.ops.sum(keras.ops.abs(x)) * 1e-3)
            return x

    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4), Penalty(),
                              keras.layers.Dense(3)])
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(True))
    x, y = data()
    with pytest.warns(UserWarning, match=r"adds losses in call\(\).*autosplit\.check"):
        autosplit.fit_large_batch(model, x, y, batch_size=B, micro_batch_size=M, verbose=0)


@pytest.mark.slow
def test_the_search_shows_one_line_per_trial_only_when_verbose(capsys, tmp_path,
                                                               monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    x, y = data()
    autosplit.fit_large_batch(mlp(), x, y, batch_size=B, verbose=1, cache=False)
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.strip().startswith("trial ")]
    assert lines and all("micro_batch_size=" in line and " s" in line for line in lines)
    assert "chose micro_batch_size=" in out
    autosplit.fit_large_batch(mlp(), x, y, batch_size=B, verbose=0, cache=False)
    assert capsys.readouterr().out == ""


@pytest.mark.slow
def test_calling_it_again_reuses_the_step_and_memory_stays_flat():
    x, y = data(1024)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(256, activation="relu"),
                              keras.layers.Dense(10)])
    model.compile(optimizer="adam", metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    def once():
        return autosplit.fit_large_batch(model, x, y, batch_size=1024, micro_batch_size=128,
                                         verbose=0)

    once()
    assert once().autosplit.traces == 0  # nothing traced again
    process = psutil.Process()
    for _ in range(10):
        once()
    gc.collect()
    before = process.memory_info().rss
    for _ in range(30):
        once()
    gc.collect()
    growth = process.memory_info().rss - before
    assert growth < 4 * 2**20, f"RSS grew by {growth / 2**20:.1f} MiB over 30 calls"


def test_loss_returning_one_value_per_batch_is_exact_with_padding_rows():
    """A loss that returns the batch's mean itself (the siamese example's): each
    micro-batch holds real rows only, so B=32, m=12 (3 of 11, one padding row) is exact."""
    def mean_loss(y_true, y_pred):
        return keras.ops.mean(keras.ops.square(y_true - y_pred))

    def make():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=mean_loss)
        return model

    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    y = 2 * x[:, :1]
    reference, candidate = make(), make()
    candidate.set_weights(reference.get_weights())
    expected = reference.fit(x, y, batch_size=32, shuffle=False, verbose=0)
    got = autosplit.fit_large_batch(candidate, x, y, batch_size=32, micro_batch_size=12,
                                    shuffle=False, verbose=0)
    assert got.autosplit.padded_rows == 1
    assert_weights_close(reference.get_weights(), candidate.get_weights(), 1e-5)
    np.testing.assert_allclose(got.history["loss"], expected.history["loss"], rtol=1e-5)
