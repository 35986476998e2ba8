"""``check``: the split against the full batch on the user's own model, state untouched."""

from __future__ import annotations

import json

import keras
import numpy as np
import pytest
from _check import SCE, assert_state_unchanged, data, mlp, rng, state

import autosplit
from autosplit.culprits import BATCH_NORM, HINT, RANDOM, CheckReport
from autosplit.equivalence import check
from autosplit.errors import BatchSizeError, ModelNotReadyError


class SubtractBatchMean(keras.layers.Layer):
    """Mixes examples: every row depends on the whole batch through its mean."""

    def call(self, inputs):
        return inputs - keras.ops.mean(inputs, axis=0, keepdims=True)


class MixingLoss(keras.losses.Loss):
    """One value per example, but each depends on the batch mean of the predictions."""

    def call(self, y_true, y_pred):
        centred = y_pred - keras.ops.mean(y_pred, axis=0, keepdims=True)
        return keras.ops.mean(keras.ops.square(centred), axis=-1)


@pytest.mark.slow
@pytest.mark.parametrize("weights", [False, True], ids=["plain", "sample-weights"])
def test_exact_mlp_leaves_state_bitwise_unchanged(weights):
    model = mlp()
    x, y, w = data()
    # 50 rows = 4 micro-batches of 13 with 2 padding rows
    report = check(model, x, y, w if weights else None, micro_batch_size=16)
    before = state(model)
    report = check(model, x, y, w if weights else None, micro_batch_size=16)
    assert_state_unchanged(before, model)
    assert report.exact and report.max_relative_difference < 1e-5
    assert (report.batch_size, report.micro_batch_size, report.accumulation_steps) == (50, 13, 4)
    assert report.decomposes and report.loss_decomposition_difference < 1e-5
    np.testing.assert_allclose(report.loss_split, report.loss_full, rtol=1e-5)
    assert report.culprits == () and report.hint is None
    assert [v.path for v in report.per_variable] == [v.path for v in model.trainable_variables]


def test_unbuilt_model_is_built_and_checked():
    model = mlp(inputs=False)
    x, y, _ = data(24)
    report = check(model, x, y, micro_batch_size=5)
    assert model.built and report.exact


@pytest.mark.slow
def test_batch_norm_is_a_culprit_and_its_statistics_are_restored():
    model = mlp(keras.layers.BatchNormalization(momentum=0.5))
    x, y, _ = data(48)
    check(model, x, y, micro_batch_size=16)  # build, then measure the second call
    before = state(model)
    report = check(model, x, y, micro_batch_size=16)
    assert_state_unchanged(before, model)  # moving mean/variance included
    assert not report.exact and report.max_relative_difference > 1e-3
    assert [(c.class_name, c.reason) for c in report.culprits] == [
        ("BatchNormalization", BATCH_NORM)]
    assert report.decomposes  # the loss is fine; the layer is not
    assert report.hint is None  # the culprit explains the difference


def test_frozen_batch_norm_uses_moving_statistics_and_is_exact():
    norm = keras.layers.BatchNormalization()
    model = mlp(norm)
    norm.trainable = False
    model.compile(optimizer="sgd", loss=SCE(from_logits=True))
    x, y, _ = data(48)
    report = check(model, x, y, micro_batch_size=16)
    assert report.exact and report.culprits == ()


@pytest.mark.slow
def test_dropout_is_a_culprit_and_its_seed_is_restored():
    model = mlp(keras.layers.Dropout(0.5))
    x, y, _ = data(48)
    check(model, x, y, micro_batch_size=16)
    before = state(model)  # includes the dropout SeedGenerator's state
    report = check(model, x, y, micro_batch_size=16)
    assert_state_unchanged(before, model)
    assert [(c.class_name, c.reason) for c in report.culprits] == [("Dropout", RANDOM)]
    assert not report.exact
    # One micro-batch: both sides start from the same seed and draw the same mask.
    assert check(model, x, y, micro_batch_size=64).max_relative_difference == 0.0
    # Rate 0 draws nothing.
    assert check(mlp(keras.layers.Dropout(0.0)), x, y, micro_batch_size=16).culprits == ()


def test_batch_mixing_layer_is_found_empirically_with_the_hint():
    model = mlp(SubtractBatchMean())
    x, y, _ = data(48)
    report = check(model, x, y, micro_batch_size=16)
    assert not report.exact and report.max_relative_difference > 1e-2
    assert report.culprits == () and report.hint == HINT
    assert report.decomposes
    assert "hint" in report.format() and "NOT exact" in report.format()


@pytest.mark.slow
def test_masked_embedding_model_is_exact():
    vocab, length = 30, 9
    r = rng(3)
    lengths = r.integers(1, length + 1, size=40)
    x = r.integers(1, vocab, size=(40, length)).astype("int32")
    x[np.arange(length)[None, :] >= lengths[:, None]] = 0
    y = r.integers(0, 6, size=(40, length)).astype("int32")
    model = keras.Sequential([
        keras.Input((length,), dtype="int32"),
        keras.layers.Embedding(vocab, 8, mask_zero=True),
        keras.layers.Dense(16, activation="relu"),
        keras.layers.Dense(6),
    ])
    model.compile(optimizer="adam", loss=SCE(from_logits=True), metrics=["accuracy"])
    report = check(model, x, y, micro_batch_size=6)  # 40 = 6*6 + 4, masks differ per row
    assert report.exact and report.max_relative_difference < 1e-5 and report.decomposes


@pytest.mark.slow
def test_multi_output_model_is_exact_and_its_loss_trackers_are_restored():
    inputs = keras.Input((12,))
    hidden = keras.layers.Dense(16, activation="tanh")(inputs)
    model = keras.Model(inputs, {"a": keras.layers.Dense(5, name="a")(hidden),
                                 "b": keras.layers.Dense(1, name="b")(hidden)})
    model.compile(optimizer="sgd", loss={"a": SCE(from_logits=True), "b": "mse"},
                  loss_weights={"a": 1.0, "b": 0.5})
    x, y, _ = data(50)
    targets = {"a": y, "b": rng(1).normal(size=(50, 1)).astype("float32")}
    check(model, x, targets, micro_batch_size=16)
    before = state(model)
    report = check(model, x, targets, micro_batch_size=16)
    assert_state_unchanged(before, model)
    assert report.exact and report.decomposes


def scalar_loss(y_true, y_pred):
    return keras.ops.mean(keras.ops.square(y_pred))  # one value: a mean over examples


def scalar_mixing_loss(y_true, y_pred):
    return keras.ops.square(keras.ops.mean(y_pred))  # one value: mixes examples


@pytest.mark.parametrize(("loss", "reason"), [
    (MixingLoss(), "is not a sum over examples"),
    (scalar_mixing_loss, "one value per batch"),
], ids=["mixes-examples", "scalar"])
def test_loss_that_is_not_a_per_example_sum(loss, reason):
    x, y, _ = data(50)
    report = check(mlp(loss=loss), x, y, micro_batch_size=16)
    assert not report.decomposes and not report.exact
    assert len(report.culprits) == 1 and reason in report.culprits[0].reason
    assert report.hint is None


def test_loss_that_returns_a_batch_mean_splits_exactly_with_padding():
    """One value per batch, a mean over its examples (the siamese example's contrastive
    loss as written): exact, since padding rows never reach it (50 = 3 * 16 + 2)."""
    x, y, _ = data(50)
    report = check(mlp(loss=scalar_loss), x, y, micro_batch_size=16)
    assert report.exact and not report.culprits, report.format()


def test_unreduced_loss_cannot_be_split():
    model = mlp(loss=SCE(from_logits=True, reduction=None))
    x, y, _ = data(16)
    report = check(model, x, y, micro_batch_size=4)
    assert not report.exact and not report.decomposes
    assert report.max_relative_difference is None and report.loss_split is None
    assert "reduction=None" in report.culprits[0].reason
    json.loads(report.to_json())


@pytest.mark.slow
def test_activity_regularizer_is_exact_with_padding_rows():
    """Keras divides an activity regulariser by each call's batch size: a per-example
    mean, exact once padding rows never reach the model."""
    model = keras.Sequential([keras.Input((12,)),
                              keras.layers.Dense(16, activity_regularizer="l1"),
                              keras.layers.Dense(5)])
    model.compile(optimizer="sgd", loss=SCE(from_logits=True))
    x, y, _ = data(48)
    assert check(model, x, y, micro_batch_size=16).exact  # 48 = 3*16: no padding rows
    report = check(model, x, y, micro_batch_size=10)  # 2 padding rows
    assert report.exact and not report.culprits, report.format()


class _AddedLoss(keras.layers.Layer):
    def __init__(self, reduce, **kwargs):
        super().__init__(**kwargs)
        self.reduce = reduce

    def call(self, h):
        self.add_loss(self.reduce(keras.ops.square(h)))
        return h


def _square_of_mean(h):
    return keras.ops.sum(keras.ops.square(keras.ops.mean(h, axis=0)))


@pytest.mark.parametrize(("reduce", "exact"), [(keras.ops.mean, True), (keras.ops.sum, True),
                                               (_square_of_mean, False)],
                         ids=["mean", "sum", "square_of_batch_mean"])
def test_added_losses_alone_are_checked(reduce, exact):
    """A model compiled with loss=None whose loss comes from add_loss: a mean or a sum
    over the examples splits exactly (a sum counts whole per micro-batch); a loss that
    mixes the examples does not, and is named."""
    model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(4), _AddedLoss(reduce)])
    model.compile(optimizer="sgd")
    x, _, _ = data(48)
    report = check(model, x, None, micro_batch_size=10)
    assert report.exact is exact, report.format()
    assert bool(report.culprits) is not exact and report.hint is None
    if not exact:
        assert "add_loss" in report.culprits[0].reason


def test_report_to_dict_is_json_and_format_reads():
    x, y, _ = data(20)
    report = check(mlp(keras.layers.BatchNormalization()), x, y, micro_batch_size=8)
    data_ = json.loads(report.to_json())
    assert data_ == report.to_dict()
    assert data_["culprits"][0] == {"name": report.culprits[0].name,
                                    "class_name": "BatchNormalization", "reason": BATCH_NORM}
    assert set(data_["per_variable"][0]) == {"path", "relative_difference"}
    text = report.format()
    assert "NOT exact" in text and "BatchNormalization" in text and "largest" in text
    assert isinstance(report, autosplit.CheckReport) and autosplit.check is check
    with pytest.raises(AttributeError):
        report.exact = True  # frozen


def test_errors_are_typed():
    x, y, _ = data(8)
    with pytest.raises(ModelNotReadyError):
        check(keras.Sequential([keras.Input((12,)), keras.layers.Dense(5)]), x, y,
              micro_batch_size=4)
    with pytest.raises(ModelNotReadyError):
        check("model", x, y, micro_batch_size=4)
    with pytest.raises(BatchSizeError):
        check(mlp(), x, y, micro_batch_size=0)


def test_check_report_is_reexported():
    assert "check" in autosplit.__all__ and "CheckReport" in autosplit.__all__
    assert CheckReport is autosplit.CheckReport


def test_check_says_a_loss_over_the_whole_batch_trains_exactly_in_fit_large_batch():
    # The summed split of in-batch negatives is not the batch's; the report says so, and
    # that fit_large_batch takes the whole-batch step for it, which is exact.
    from _whole_batch import dual_encoder, pairs

    x, y = pairs(64)
    report = autosplit.check(dual_encoder(), x, y, micro_batch_size=16)
    assert not report.exact
    assert report.step.startswith("outputs first, the loss over the whole batch")
    assert "fit_large_batch's whole-batch step is exact" in report.format()
    assert report.to_dict()["step"] == report.step
