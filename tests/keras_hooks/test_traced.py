"""``autosplit.keras_hooks.traced``: what a traced scalar's graph says about how it adds up
over rows, checked against the arithmetic itself: a value the walk calls a mean (a sum) equals the
rows-weighed mean (the sum) of its values on two parts of the batch; one it calls neither
does not."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from keras import ops

from autosplit.keras_hooks.traced import counts_rows, repeats_rows, row_reduction

PENALTY = tf.Variable([1.0, -2.0])  # a weight penalty reads variables, not the batch

FORMS = {
    "mean": (lambda x: ops.mean(ops.square(x)), "mean"),
    "sum": (lambda x: ops.sum(ops.square(x)), "sum"),
    "half_sum_minus_sum": (lambda x: 0.5 * ops.sum(x) - ops.sum(ops.abs(x)), "sum"),
    "mean_over_rows_of_row_sums": (lambda x: -ops.mean(ops.sum(x, axis=1)) / 3.0, "mean"),
    "mean_plus_sum": (lambda x: ops.mean(x) + ops.sum(x), None),
    "ratio": (lambda x: ops.sum(x * x) / ops.sum(ops.abs(x)), "ratio"),
    # Keras's own reduction (losses.loss.reduce_values): a sum over a count from shapes.
    "keras_reduction": (lambda x: ops.divide_no_nan(
        ops.sum(x), ops.cast(ops.prod(ops.shape(x)), "float32")), "mean"),
    "sum_over_rows": (lambda x: ops.sum(x) / ops.cast(ops.shape(x)[0], "float32"), "mean"),
    # Keras's compute_loss: the stack of the loss and a penalty that reads no batch.
    "stack_of_mean_and_penalty": (lambda x: ops.sum(ops.stack(
        [ops.mean(x), 0.1 * ops.sum(ops.square(PENALTY))])), "mean"),
    "stack_of_sum_and_penalty": (lambda x: ops.sum(ops.stack(
        [ops.sum(x), ops.sum(PENALTY)])), None),
    "mean_of_column_maxima": (lambda x: ops.mean(ops.max(x, axis=0)), None),
    "similarity": (lambda x: ops.mean(ops.matmul(x, ops.transpose(x))), None),
    "cross_correlation": (lambda x: ops.sum(ops.square(ops.matmul(ops.transpose(x), x))),
                          None),
    "rows_times_a_matrix": (lambda x: ops.mean(ops.matmul(x, ops.ones((3, 2)))), "mean"),
    "rows_through_a_variable": (lambda x: ops.sum(ops.matmul(x, ops.reshape(
        ops.concatenate([PENALTY, PENALTY, PENALTY]), (3, 2)))), "sum"),
    "a_matrix_times_the_rows": (lambda x: ops.mean(ops.square(ops.matmul(
        ops.ones((2, ops.shape(x)[0])), x))), None),
    "batched_einsum": (lambda x: ops.mean(ops.einsum(
        "bi,bj->bij", x, x)), "mean"),
    "paired_einsum": (lambda x: ops.mean(ops.einsum("ik,jk->ij", x, x)), None),
    "centred": (lambda x: ops.mean(ops.square(x - ops.mean(x, axis=0))), None),
}


@pytest.mark.parametrize("name", sorted(FORMS))
def test_row_reduction_is_what_the_arithmetic_says(name):
    fn, expected = FORMS[name]
    x = np.random.default_rng(0).normal(size=(6, 3)).astype("float32")
    kinds = []

    @tf.function(input_signature=[tf.TensorSpec([None, 3])])
    def traced(t):
        value = fn(t)
        kinds.append(row_reduction(value, (t,), rows=None))
        return value

    assert kinds == [] and traced(x) is not None and kinds == [expected]
    whole, first, second = (float(traced(part)) for part in (x, x[:2], x[2:]))
    mean, total = (2 * first + 4 * second) / 6, first + second
    assert np.isclose(whole, mean, rtol=1e-5) == (expected == "mean"), (whole, mean)
    assert np.isclose(whole, total, rtol=1e-5) == (expected == "sum"), (whole, total)


def test_counts_rows_tells_a_count_from_a_value():
    seen = {}

    @tf.function(input_signature=[tf.TensorSpec([None, 3])])
    def traced(t):
        for name, value in {"rows": tf.shape(t)[0], "tokens": tf.size(t) * 2,
                            "constant": tf.constant(1.0), "loss": tf.reduce_mean(t),
                            "rows_times_loss": tf.cast(tf.shape(t)[0], tf.float32)
                            * tf.reduce_mean(t)}.items():
            seen[name] = counts_rows(value)
        return t

    traced(np.zeros((2, 3), "float32"))
    assert seen == {"rows": True, "tokens": True, "constant": False, "loss": False,
                    "rows_times_loss": False}


def test_with_static_shapes_a_division_by_the_count_is_a_mean_and_by_another_constant_not():
    # A step traced on a micro-batch of a known size sees ops.shape(x)[0] as a number:
    # dividing by it (or by the number of elements) is a mean; by another constant (a
    # global batch size, as tf.nn.compute_average_loss divides) it scales a sum.
    kinds = {}

    @tf.function(input_signature=[tf.TensorSpec([6, 3])])
    def traced(t):
        forms = {"by_rows": 0.5 * (ops.sum(t) / ops.shape(t)[0]),
                 "by_elements": ops.sum(t) / float(np.prod(t.shape)),
                 # Keras's reduction: its count is a product tf.get_static_value does
                 # not fold; computed from the graph, it is the number of elements.
                 "keras_reduction": ops.divide_no_nan(
                     ops.sum(t), ops.cast(ops.prod(ops.shape(t)), "float32")),
                 "by_global_batch": ops.sum(ops.square(t)) / 32.0,
                 "mean": ops.mean(t)}
        for name, value in forms.items():
            kinds[name] = row_reduction(value, rows=6)
        return t

    traced(np.zeros((6, 3), "float32"))
    assert kinds == {"by_rows": "mean", "by_elements": "mean", "keras_reduction": "mean",
                     "by_global_batch": "sum", "mean": "mean"}


TABLE = tf.Variable(tf.ones((6, 2)))
LOOKUPS = {  # the indices looked up: do they name a row twice, in every batch?
    "arange": (lambda x: ops.arange(0, 6), False),
    "arange_from_shape": (lambda x: ops.arange(0, ops.shape(x)[1]), False),
    "two_aranges": (lambda x: ops.concatenate([ops.arange(0, 3), ops.arange(0, 2)]), True),
    "token_ids": (lambda x: ops.cast(ops.abs(x[:, 0]) * 3, "int32") % 6, True),
    "random": (lambda x: tf.random.uniform((4,), 0, 6, tf.int32), True),
}


@pytest.mark.parametrize("name", sorted(LOOKUPS))
def test_repeats_rows_computes_indices_that_read_no_batch(name):
    lookup, expected = LOOKUPS[name]
    found = []

    @tf.function(autograph=False)
    def step(x):
        with tf.GradientTape() as tape:
            loss = ops.sum(tf.gather(TABLE, lookup(x)))
        found.append(tape.gradient(loss, TABLE))
        return loss

    step.get_concrete_function(tf.TensorSpec((5, 6)))
    [gradient] = found
    assert isinstance(gradient, tf.IndexedSlices)
    assert repeats_rows(gradient) is expected
