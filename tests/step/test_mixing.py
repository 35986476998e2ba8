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
from autosplit.step.mixing import KERAS_PER_ROW, _moved, whole_batch_reason
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
    return whole_batch_reason(model, loss_plan(model, (x, y, None)), lambda: (X, Y, None))


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


def _values_for(fn):
    """``(y_true, y_pred)`` of 16 rows as ``fn`` reads them."""
    r = np.random.default_rng(1)
    probs = tf.nn.softmax(r.normal(size=(ROWS, 3)).astype("float32"))
    if fn is keras.losses.sparse_categorical_crossentropy:
        return tf.constant(Y), probs
    if fn is keras.losses.categorical_generalized_cross_entropy:
        return tf.constant(Y[:, 0]), probs
    if fn is keras.losses.ctc:  # labels (rows, 2) of classes 1..2, logits (rows, 5, 3)
        labels = tf.constant(r.integers(1, 3, size=(ROWS, 2)), tf.int32)
        return labels, tf.constant(r.normal(size=(ROWS, 5, 3)).astype("float32"))
    return tf.one_hot(Y[:, 0], 3), probs


@pytest.mark.parametrize("fn", sorted(KERAS_PER_ROW, key=lambda f: f.__name__),
                         ids=lambda f: f.__name__)
def test_each_keras_loss_told_without_a_sample_reads_its_own_row(fn):
    # The list that spares a sample (an iterator more over the input) is checked on the
    # evidence it stands for: the per-example values, halves and reversed, unmoved.
    kwargs = {"q": 0.5} if fn is keras.losses.categorical_generalized_cross_entropy else {}
    class Own(keras.losses.Loss):
        def call(self, y_true, y_pred):
            return fn(y_true, y_pred, **kwargs)

    y_true, y_pred = _values_for(fn)
    assert _moved(Own(), y_true, y_pred, ROWS) is None


def test_keras_losses_alone_read_no_sample():
    def sample():
        raise AssertionError("a sample was read")

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(3)])
    model.compile("sgd", [keras.losses.SparseCategoricalCrossentropy(from_logits=True)])
    x, y = tf.TensorSpec([ROWS, 16]), tf.TensorSpec([ROWS, 1], tf.int32)
    build_for(model, (x, y, (), tf.TensorSpec([ROWS])))
    assert whole_batch_reason(model, loss_plan(model, (x, y, None)), sample) is None

    class Centred(keras.losses.MeanSquaredError):  # a subclass of the user's: not told
        def call(self, y_true, y_pred):
            return super().call(y_true, y_pred - tf.reduce_mean(y_pred, axis=0))

    model.compile("sgd", Centred())
    y = tf.TensorSpec([ROWS, 3])
    build_for(model, (x, y, (), tf.TensorSpec([ROWS])))
    with pytest.raises(AssertionError, match="a sample was read"):
        whole_batch_reason(model, loss_plan(model, (x, y, None)), sample)
