"""The length factor of a micro-batch cut short of its large batch: per model output, in
the output's structure; as the metrics' weights; scaled to the large batch's length where
workers each cut their own share (``ShareFactor``)."""

from __future__ import annotations

import numpy as np
import tensorflow as tf
from _sequences import B, M, cut_by_length, dataset, model_of, sequences

from autosplit.data.inputs import get_input
from autosplit.data.pipeline import MicroBatches
from autosplit.data.sequences.length_factor import (
    ShareFactor,
    Shortened,
    inputs_of,
    metric_weight,
    output_length_factors,
)


def test_each_output_takes_its_own_factor_in_the_outputs_structure():
    factor = tf.constant([2.0, 1.5])
    outputs = {"tokens": tf.zeros([3, 5, 7]), "label": tf.zeros([3, 1])}
    found = output_length_factors(factor, outputs)
    assert sorted(found) == ["label", "tokens"]
    assert {k: float(v) for k, v in found.items()} == {"label": 2.0, "tokens": 1.5}
    assert output_length_factors(None, outputs) is None
    assert output_length_factors(tf.zeros([0]), outputs) is None


def test_a_metric_over_a_length_weighs_each_row_as_its_large_batch_does():
    # A row padded to 4 of a large batch of length 8 weighs half as much in a mean over
    # its tokens: its weights are divided by the factor 2. Only an output whose length
    # the shapes leave open (it follows the micro-batch's) takes it.
    @tf.function(input_signature=[tf.TensorSpec([None, None, 5])])
    def weights(y_pred):
        given = metric_weight(tf.fill([tf.shape(y_pred)[0], 4], 3.0), y_pred, 2.0)
        ones = metric_weight(None, y_pred, 2.0)
        return given["sample_weight"], ones["sample_weight"]

    given, ones = weights(tf.zeros([3, 4, 5]))
    np.testing.assert_allclose(given, np.full((3, 4), 1.5))
    np.testing.assert_allclose(ones, np.full((3, 1), 0.5))  # (rows, 1): a mask multiplies it
    assert metric_weight(None, tf.zeros([3, 1]), 2.0) == {}  # no length axis
    assert metric_weight(None, tf.zeros([3, 4, 5]), None) == {}


def test_inputs_come_shortened_with_their_factor():
    x = Shortened(tf.zeros([2, 3]), tf.ones([2, 1]))
    assert inputs_of(x) is x.inputs and inputs_of(x.inputs) is x.inputs


def test_a_share_s_factor_is_ones_until_the_workers_agree_then_scales_each_micro_batch():
    share = ShareFactor()
    plain = tf.TensorSpec([None, 3])
    share.bind(plain)  # not cut by length: nothing to hold
    assert share.variable is None and share.applied(tf.zeros([1, 3])).shape == (1, 3)
    share.bind(Shortened(plain, tf.TensorSpec([None, 2])))
    assert share.variable.numpy().tolist() == [1.0, 1.0]

    def bounds(local):  # the collective's answer: every worker's most and least
        return tf.maximum(local, [12.0, 4.0]), tf.minimum(local, [12.0, 4.0])

    least = share.agree(tf.constant([6.0, 0.0]), bounds)  # a share of no row in length 1
    assert float(least) == 0.0
    assert share.variable.numpy().tolist() == [2.0, 1.0]
    scaled = share.applied(Shortened(tf.zeros([1, 3]), tf.constant([[1.5, 3.0]])))
    assert scaled.length_factor.numpy().tolist() == [[3.0, 3.0]]
    share.bind(Shortened(plain, tf.TensorSpec([None, 2])))  # a later run forgets it
    assert share.variable.numpy().tolist() == [1.0, 1.0]


def test_a_step_reused_without_headers_counts_each_micro_batch_by_its_own_length():
    """The large batch's length the workers last agreed on (``agree_lengths``) is
    forgotten when a pipeline is bound again: a later run of the same step, unsharded,
    counts its own large batch's length."""
    from autosplit.step.train_step import build_for, step_for

    adapter = get_input(dataset(sequences(), "lm_sample_weight").padded_batch(16))
    model = model_of("lm_sample_weight")
    build_for(model, MicroBatches(adapter, B, M).element_spec())  # as the cut's choice does
    step = step_for(model, MicroBatches(adapter, B, M, cut=cut_by_length(adapter)))
    scale = step.update.share_factor.variable
    assert scale is not None and scale.numpy().tolist() == [1.0]
    scale.assign([2.5])  # as an agreement leaves it
    again = step_for(model, MicroBatches(adapter, B, M, cut=cut_by_length(adapter)))
    assert again is step and scale.numpy().tolist() == [1.0]
