"""The whole-batch step against model.fit on the full batch: in-batch negatives,
supervised contrastive learning as keras-io publishes it, a statistic of the batch, a
multi-output model with one such loss; under XLA and mixed_float16; Dropout replayed;
what cannot be exact refused before anything changes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
from _whole_batch import (
    B,
    M,
    N,
    SupervisedContrastiveLoss,
    chi_square,
    dual_encoder,
    labelled,
    pairs,
    projection,
    trains_as_model_fit,
)
from common import TESTS, child_env, relative_error

import autosplit
from autosplit.errors import UnsupportedModelError

pytestmark = pytest.mark.slow  # every test trains twins (2-6 s on 2 cores)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_in_batch_negatives_train_as_model_fit(optimizer):
    # Summed per micro-batch, each query saw its micro-batch's 8 documents, not the
    # batch's 32: 3.5e-1 (SGD) and 1.1 (Adam) from model.fit, with no warning.
    x, y = pairs()
    got, _, _ = trains_as_model_fit(lambda: dual_encoder(optimizer, metrics=["mae"]), x, y,
                                    rtol=1e-5 if optimizer == "sgd" else 1e-4)
    assert "move with the batch's other rows" in got.autosplit.step
    assert got.autosplit.micro_batch_size == M and got.autosplit.accumulation_steps == 4


def test_weight_penalties_count_once_and_losses_added_in_call_per_row():
    x, y = pairs()
    trains_as_model_fit(lambda: dual_encoder(penalties=True), x, y)


def test_supervised_contrastive_learning_as_published_trains_as_model_fit():
    # keras-io's loss overrides __call__: it crashed with a bare NotImplementedError.
    x, y = labelled()
    got, _, _ = trains_as_model_fit(lambda: projection(SupervisedContrastiveLoss(0.1)), x, y,
                                    rtol=1e-4)
    assert "overrides __call__" in got.autosplit.step


def test_a_statistic_of_the_whole_batch_trains_as_model_fit():
    # A chi-square between histograms of the batch: 18x off model.fit when weighed by rows.
    rng = np.random.default_rng(3)
    x = rng.normal(size=(N, 6)).astype("float32")
    y = (x[:, :1] * 0.5 + rng.normal(size=(N, 1)) * 0.5).astype("float32")

    def make():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                                  keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.1), chi_square)
        return model

    got, _, _ = trains_as_model_fit(make, x, y)
    assert "one value per batch" in got.autosplit.step


@pytest.mark.parametrize("regularized", [False, True])
def test_a_compute_loss_of_the_model_s_own_trains_as_model_fit(regularized):
    # Keras 3's way of writing one's own loss: in-batch negatives and a per-row term in
    # compute_loss. It was refused (the reading found a product over the rows); now its
    # value is computed once on the whole batch, its weight penalties with it.
    from _whole_batch import own_loss_encoder

    x, y = pairs()
    got, _, _ = trains_as_model_fit(lambda: own_loss_encoder(regularized), x, y)
    assert "its compute_loss is not a sum over the rows" in got.autosplit.step


def test_a_model_with_one_loss_over_the_batch_and_one_per_row_trains_as_model_fit():
    x, labels = labelled()
    targets = x[:, :1].copy()
    got, _, _ = trains_as_model_fit(
        lambda: projection([SupervisedContrastiveLoss(0.1), "mse"], outputs=2), x,
        (labels, targets), rtol=1e-4)
    assert set(got.history) == {"loss", "head_loss", "value_loss"}  # model.fit's logs


def test_under_xla_the_passes_compile_and_train_as_model_fit():
    x, y = pairs()
    got, _, _ = trains_as_model_fit(lambda: dual_encoder(jit_compile=True), x, y)
    assert got.autosplit.traces <= 4  # the fused call, its two XLA pieces, once each


def test_under_mixed_float16_the_scale_and_the_skips_are_model_fit_s():
    # The loss is scaled before its gradient with respect to the outputs: the weights'
    # come scaled, the optimizer unscales them and skips an overflow once per large
    # batch, as model.fit's; weights within the mixed tolerance (float16's sums round
    # apart between the micro-batches and the full batch, 3e-4 in one step). Smooth
    # towers (tanh, 5e-3 after 8 steps): with ReLU ones one step moved a layer 5e-2, as
    # a ReLU whose input float16 rounds to the other side of 0 in one of the two moves
    # its row's whole gradient, which says nothing of the step.
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        x, y = pairs()
        _, reference, model = trains_as_model_fit(
            lambda: dual_encoder(activation="tanh"), x, y, rtol=3e-2)
        assert float(model.optimizer.dynamic_scale.numpy()) == float(
            reference.optimizer.dynamic_scale.numpy())
    finally:
        keras.mixed_precision.set_global_policy("float32")


def test_dropout_draws_the_same_in_both_passes():
    # In one micro-batch of the whole batch the two passes draw from the random states
    # model.fit's step draws from: bitwise its weights. Without the replay the second
    # pass's masks differ from the first's: 2.0 relative off.
    x, y = pairs()
    _, reference, model = trains_as_model_fit(lambda: dual_encoder(dropout=0.5), x, y,
                                              micro_batch_size=B)
    assert relative_error(reference.get_weights(), model.get_weights()) == 0.0


def test_batch_normalization_in_training_mode_is_refused_before_anything_changes():
    keras.utils.set_random_seed(0)
    xq, xd = keras.Input((6,)), keras.Input((6,))
    towers = [keras.layers.Dense(8)(keras.layers.BatchNormalization()(keras.layers.Dense(8)(t)))
              for t in (xq, xd)]
    model = keras.Model([xq, xd], keras.layers.Concatenate()(towers))
    from _whole_batch import in_batch_softmax

    model.compile("sgd", in_batch_softmax)
    x, y = pairs()
    model.build([(None, 6), (None, 6)])
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(UnsupportedModelError, match=r"BatchNormalization in training mode"):
        autosplit.fit_large_batch(model, x, y, batch_size=B, micro_batch_size=M, verbose=0)
    assert int(model.optimizer.iterations) == 0
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights(), strict=True))


def test_a_loss_that_is_a_sum_over_rows_keeps_the_summed_step():
    x, y = labelled()

    def make():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4)])
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    got = autosplit.fit_large_batch(make(), x, y, batch_size=B, micro_batch_size=M, verbose=0)
    assert got.autosplit.step.startswith("summed")


@pytest.mark.parametrize("validation_batch_size", [None, 16])
def test_validation_computes_each_batch_s_loss_over_the_whole_batch(validation_batch_size):
    # Summed per micro-batch, val_loss was 2.34 where model.fit's is 3.80. The last
    # validation batch is short (100 rows), and its loss weighs by its rows.
    x, y = pairs()
    validation = pairs(100, seed=5)
    got, _, _ = trains_as_model_fit(lambda: dual_encoder(metrics=["mae"]), x, y,
                                    validation_data=validation,
                                    validation_batch_size=validation_batch_size)
    assert "val_loss" in got.history and "val_mae" in got.history


def test_on_two_replicas_negatives_come_from_the_global_batch_as_model_fit_s_full_batch():
    # model.fit under MirroredStrategy computes the loss per replica, over its own rows: the
    # whole-batch step gathers every replica's outputs, so each case trains as one device's
    # model.fit on the full batch (the child asserts it), with a short last batch and
    # validation too.
    run = subprocess.run([sys.executable, str(Path(__file__).with_name("whole_batch_child.py"))],
                         env=child_env(PYTHONPATH=os.pathsep.join(
                             [child_env()["PYTHONPATH"], str(Path(__file__).parent)])),
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    assert set(found) == {"sgd", "adam", "validation", "short_last_batch",
                          "supervised_contrastive"}
    for case in found.values():
        assert case["replicas"] == 2
        assert case["step"].startswith("outputs first, the loss over the whole batch")


@pytest.mark.parametrize("scenario", ["whole_batch", "whole_batch_recover"])
def test_under_a_real_cap_the_probe_and_the_recovery_run_both_passes(tmp_path, scenario):
    # In a child under TensorFlow's CPU cap: the probe's trials run whole large batches
    # of the two-pass step (its kept outputs and the loss over B rows included), or a
    # micro-batch of the whole batch runs out of memory, and the same large batch is
    # redone from the host's store in smaller parts. Either trains as the run without a
    # cap. oneDNN is off in the child: its fused MatMul kernel (_MklFusedMatMul, which a
    # forward pass without a tape fuses Dense, bias and activation into) ends the
    # process on a failed allocation instead of raising (TensorFlow 2.21), as its
    # convolutions do (docs/memory.md).
    from autosplit.capped import run_capped

    def child(name, cap_mib, folder):
        folder.mkdir()
        run = run_capped([str(TESTS / "capped_child.py"), name, str(folder)],
                         cap_mib * 2**20, timeout=600, capture=True,
                         env={"PYTHONPATH": f"{TESTS.parent}:{TESTS}",
                              "TF_ENABLE_ONEDNN_OPTS": "0"})
        assert run.returncode == 0, run.stderr[-3000:]
        saved = np.load(str(folder / "weights.npz"))
        return run.result, [saved[f"arr_{i}"] for i in range(len(saved))]

    result, weights = child(scenario, 20, tmp_path / "capped")
    report = result["autosplit"]
    assert report["step"].startswith("outputs first, the loss over the whole batch")
    assert report["micro_batch_size"] < 1024
    if scenario == "whole_batch":
        assert report["probe"]["micro_batch_size"] == report["micro_batch_size"]
    else:
        assert report["oom_recoveries"][0]["failed"] == 1024
    assert result["iterations"] == 2
    # The run without a cap (micro-batches of 256), with the same kernels: oneDNN's
    # differ from TensorFlow's own by more than the rounding compared here.
    expected, reference = child("whole_batch_reference", 2048, tmp_path / "reference")
    assert relative_error(reference, weights) <= 1e-5
    np.testing.assert_allclose(result["loss"], expected["loss"], rtol=1e-5)


def test_on_two_workers_negatives_come_from_the_global_batch(tmp_path):
    # MultiWorkerMirroredStrategy on localhost: each worker keeps its share of every
    # large batch, and every worker's outputs are gathered before the loss, so each run
    # trains as single-device model.fit on the full batch (the child asserts it).
    from common import local_workers

    codes = local_workers(lambda index: [str(TESTS / "step" / "whole_batch_workers_child.py"),
                                         str(tmp_path / f"worker{index}")], tmp_path)
    assert codes == [0, 0], [(tmp_path / f"worker{i}.stderr").read_text()[-3000:]
                             for i in range(2)]
    for index in range(2):
        found = json.loads((tmp_path / f"worker{index}.json").read_text())
        assert set(found) == {"arrays", "sharded", "supervised_contrastive"}
        for case in found.values():
            assert case["workers"] == 2
            assert case["step"].startswith("outputs first, the loss over the whole batch")


def _counted(dataset, reads):
    """``dataset``, one entry in ``reads`` per iterator made over it."""
    import tensorflow as tf

    return tf.data.Dataset.from_tensors(0).map(
        lambda _: tf.py_function(lambda: reads.append(1) or 0, [], tf.int32)
    ).flat_map(lambda _: dataset)


def _masked_gru(loss):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((None, 3)), keras.layers.Masking(),
                              keras.layers.GRU(8),
                              # no bias: a shift a centred loss cannot see has a gradient
                              # of float32 noise (1e-9), not of the loss
                              keras.layers.Dense(4, use_bias=False)])
    model.compile(keras.optimizers.SGD(0.1), loss)
    return model


@pytest.mark.parametrize("centred", [True, False])
def test_sequences_of_varying_length_keep_their_large_batch_s_padding_as_model_fit(centred):
    # Cut by length, each micro-batch would be padded to its own longest row; the loss
    # over the whole batch (each row's output centred on the batch's mean) takes the
    # whole-batch step, which keeps a large batch's rows as model.fit's padded_batch pads
    # them, and the report says why. A loss of the user's own over each row is cut by
    # length; its check and the check of padding read one sample of the input between
    # them: before training, the look at its lengths and that sample, no more.
    import tensorflow as tf
    from _sequences import features, sequences

    def loss(y_true, y_pred):
        shift = tf.reduce_mean(y_pred, axis=0) if centred else 0.0
        return tf.reduce_sum(tf.square(y_pred - shift), axis=1)

    reference, model = _masked_gru(loss), _masked_gru(loss)
    expected = reference.fit(features(sequences()).padded_batch(B), epochs=1, verbose=0)
    reads = []
    before = keras.callbacks.LambdaCallback(
        on_train_begin=lambda logs: reads.append("training begins"))
    got = autosplit.fit_large_batch(
        model, _counted(features(sequences()).padded_batch(B), reads), batch_size=B,
        micro_batch_size=M, verbose=0, callbacks=[before])
    assert reads.index("training begins") == 2
    if centred:
        assert got.autosplit.step.startswith("outputs first, the loss over the whole batch")
        assert "the loss is computed over the whole batch" in got.autosplit.padding
    else:
        assert got.autosplit.step.startswith("summed")
    assert relative_error(reference.get_weights(), model.get_weights()) <= 1e-5
    np.testing.assert_allclose(got.history["loss"], expected.history["loss"], rtol=1e-5)
