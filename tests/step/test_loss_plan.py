"""``loss_plan``: what a model's loss is made of, learnt from one throwaway trace: each
compiled loss's kind and group, the losses added in call(), the per-batch values."""

from __future__ import annotations

import keras
import pytest
import tensorflow as tf

from autosplit.step.loss_plan import COUNT_GROUP, SUM_GROUP, loss_plan
from autosplit.step.reduction import COUNT, SUM, WEIGHT
from autosplit.step.train_step import build_for

ROWS = 4
X = tf.TensorSpec([ROWS, 3], tf.float32)
Y = tf.TensorSpec([ROWS, 1], tf.float32)
W = tf.TensorSpec([ROWS], tf.float32)


class Penalty(keras.layers.Layer):
    def call(self, x):
        self.add_loss(keras.ops.mean(keras.ops.square(x)))  # a mean over the rows
        return x


def _plan(loss, *, weights=False, penalty=False):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((3,))
    hidden = Penalty()(inputs) if penalty else inputs
    model = keras.Model(inputs, keras.layers.Dense(1)(hidden))
    model.compile("sgd", loss)
    build_for(model, (X, Y, W if weights else (), tf.TensorSpec([ROWS])))
    return loss_plan(model, (X, Y, W if weights else None)), model


def test_a_mean_over_rows_folds_into_the_rows_group():
    plan, _ = _plan("mse")
    assert plan.kinds == (COUNT,) and plan.folded == (True,) and plan.per_row == (1,)
    assert plan.groups == (COUNT_GROUP,) and plan.weights == (1.0,)
    assert not plan.forward_losses and not plan.per_batch_losses
    assert plan.has_grad == (True, True) and not plan.real_rows_only


def test_a_sum_is_divided_by_nothing():
    plan, _ = _plan(keras.losses.MeanSquaredError(reduction="sum"))
    assert plan.kinds == (SUM,) and plan.groups == (SUM_GROUP,)


def test_a_mean_over_the_sample_weights_is_deferred_to_its_own_denominator():
    plan, _ = _plan(keras.losses.MeanSquaredError(reduction="mean_with_sample_weight"),
                    weights=True)
    assert plan.kinds == (WEIGHT,) and plan.folded == (False,)
    assert plan.groups == (("deferred", 0),)


def test_a_loss_added_in_call_is_a_mean_weighed_by_rows():
    plan, _ = _plan("mse", penalty=True)
    assert plan.forward_losses and plan.forward_summed == (False,)
    assert plan.groups == (COUNT_GROUP,) and plan.real_rows_only


@pytest.mark.parametrize(("loss", "ratio"), [
    (lambda y, p: keras.ops.mean(keras.ops.square(y - p)), False),  # a mean over rows
    (lambda y, p: keras.ops.max(keras.ops.square(y - p)), True)])  # not one
def test_a_loss_of_one_value_per_batch_is_told_a_mean_over_rows_or_not(loss, ratio):
    plan, _ = _plan(loss)
    assert plan.per_batch_losses and plan.per_batch_ratios is ratio


def test_the_plan_is_learnt_once_per_spec():
    plan, model = _plan("mse")
    assert loss_plan(model, (X, Y, None)) is plan
