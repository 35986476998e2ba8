"""``autosplit.traced``: what a traced scalar's graph says about how it adds up over rows,
checked against the arithmetic itself: a value the walk calls a mean (a sum) equals the
rows-weighed mean (the sum) of its values on two parts of the batch; one it calls neither
does not."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from keras import ops

from autosplit.traced import counts_rows, row_reduction

FORMS = {
    "mean": (lambda x: ops.mean(ops.square(x)), "mean"),
    "sum": (lambda x: ops.sum(ops.square(x)), "sum"),
    "half_sum_minus_sum": (lambda x: 0.5 * ops.sum(x) - ops.sum(ops.abs(x)), "sum"),
    "mean_over_rows_of_row_sums": (lambda x: -ops.mean(ops.sum(x, axis=1)) / 3.0, "mean"),
    "mean_plus_sum": (lambda x: ops.mean(x) + ops.sum(x), None),
    "ratio": (lambda x: ops.sum(x * x) / ops.sum(ops.abs(x)), None),
    "mean_of_column_maxima": (lambda x: ops.mean(ops.max(x, axis=0)), None),
    "similarity": (lambda x: ops.mean(ops.matmul(x, ops.transpose(x))), None),
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
        kinds.append(row_reduction(value, (t,)))
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
