"""``whole_batch_reason``: whether a loss is the whole batch's, found on evidence (its
own ``__call__``, a value per batch that is not a mean over the rows, per-example values
that move with the other rows on a sample), and a sum over the rows left alone."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from _whole_batch import SupervisedContrastiveLoss, chi_square, in_batch_softmax

from autosplit.step.loss_plan import loss_plan
from autosplit.step.mixing import whole_batch_reason
from autosplit.step.train_step import build_for

ROWS = 16
rng = np.random.default_rng(0)
X = rng.normal(size=(ROWS, 16)).astype("float32")
Y = rng.integers(0, 3, size=(ROWS, 1)).astype("int32")


def _reason(loss):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(16)])
    model.compile("sgd", loss)
    x, y = tf.TensorSpec([ROWS, 16]), tf.TensorSpec([ROWS, 1], tf.int32)
    build_for(model, (x, y, (), tf.TensorSpec([ROWS])))
    return whole_batch_reason(model, loss_plan(model, (x, y, None)), (X, Y, None))


def _pairs_by_position(y_true, y_pred):
    """Rows 2i and 2i+1 a positive pair: one value per row, from its partner's."""
    partner = tf.reshape(tf.reverse(tf.reshape(y_pred, [-1, 2, 16]), [1]), [-1, 16])
    return tf.reduce_sum(tf.square(y_pred - partner), axis=1)


@pytest.mark.parametrize(("loss", "found"), [
    (keras.losses.MeanSquaredError(), None),
    ("mse", None),
    (lambda y, p: tf.reduce_mean(tf.square(p), axis=1), None),  # per row, its own
    (lambda y, p: tf.reduce_mean(tf.square(p)), None),  # a plain mean over the rows
    (SupervisedContrastiveLoss(0.1), "overrides __call__"),
    (chi_square, "one value per batch that is not a mean"),
    (lambda y, p: in_batch_softmax(y, p), "move with the batch's other rows"),
    (lambda y, p: tf.reduce_sum(tf.square(p - tf.reduce_mean(p, axis=0)), axis=1),
     "move with the batch's other rows"),  # centred on the batch's mean
    (_pairs_by_position, "move with the batch's other rows"),
], ids=["mse_object", "mse", "per_row", "row_mean", "own_call", "chi_square",
        "in_batch_negatives", "batch_mean", "pairs_by_position"])
def test_a_loss_is_the_whole_batch_s_only_on_evidence(loss, found):
    reason = _reason(loss)
    assert (reason is None) if found is None else (found in reason), reason
