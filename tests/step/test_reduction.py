"""``combined_loss``: the one place the summed terms become the loss, checked by hand.

The train step (``piece.combine``), validation (``evaluate``) and ``check``
(``equivalence``) all divide through it; the tests that compare with ``model.fit`` and
``model.evaluate`` cover it end to end, this one pins the arithmetic.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from autosplit.step.reduction import COUNT, SUM, WEIGHT, combined_loss, output_terms

# Three real rows in two micro-batches of two; the second repeats row 2 as padding.
PIECES = ((slice(0, 2), [1.0, 1.0]), (slice(2, 4), [1.0, 0.0]))


def _summed(loss, y_true, y_pred):
    """The numerator and denominator of ``loss``, summed over ``PIECES``."""
    y_true = np.concatenate([y_true, y_true[-1:]])
    y_pred = np.concatenate([y_pred, y_pred[-1:]])
    numerator = denominator = 0.0
    for rows, valid in PIECES:
        terms = output_terms(loss, tf.constant(y_true[rows]), tf.constant(y_pred[rows]), None,
                             tf.constant(valid))
        numerator += float(terms.numerator)
        denominator += float(terms.denominator)
    return numerator, denominator, terms.kind


@pytest.mark.parametrize("dtype", [tf.float32, tf.float64])
def test_two_outputs_loss_weights_added_loss_and_padding_by_hand(dtype):
    # Output a, sum_over_batch_size: squared errors 1, 0, 4 over 3 rows -> 5/3.
    a = _summed(keras.losses.MeanSquaredError(),
                np.array([[1.0], [2.0], [3.0]], "float32"),
                np.array([[0.0], [2.0], [5.0]], "float32"))
    # Output b, reduction="sum": absolute errors 1, 1, 3 -> 5, divided by nothing.
    b = _summed(keras.losses.MeanAbsoluteError(reduction="sum"),
                np.array([[1.0], [1.0], [1.0]], "float32"),
                np.array([[2.0], [0.0], [4.0]], "float32"))
    assert a == (5.0, 3.0, COUNT)
    assert b[0] == 5.0 and b[2] == SUM
    # An added loss (a mean over each micro-batch's real rows): 0.3 over 2 rows, then
    # 0.9 over 1 row, weighed by the rows -> 1.5 over 3 rows = 0.5 per row; and one
    # summed over the rows (a vector of one value per example): 0.1 + 0.2, whole.
    forward, rows = [0.3 * 2 + 0.9 * 1, 0.1 + 0.2], 3.0

    def tensor(value):
        return tf.constant(value, dtype)

    loss, per_output = combined_loss(
        [tensor(a[0]), tensor(b[0])], [tensor(a[1]), tensor(b[1])], tensor(forward),
        tensor(rows), kinds=(a[2], b[2]), weights=(2.0, 0.5), regularization=tensor(0.25))
    assert loss.dtype == dtype
    np.testing.assert_allclose([float(v) for v in per_output], [5 / 3, 5.0], rtol=1e-7)
    # 0.25 + 0.5 + 0.3 + 2 * 5/3 + 0.5 * 5
    np.testing.assert_allclose(float(loss), 1.05 + 10 / 3 + 2.5, rtol=1e-7)


def test_weight_kind_divides_by_the_weight_and_an_empty_sum_gives_zero_not_nan():
    loss, per_output = combined_loss(
        [tf.constant(6.0), tf.constant(0.0)], [tf.constant(1.5), tf.constant(0.0)],
        tf.zeros([2]), tf.constant(0.0), kinds=(WEIGHT, COUNT), weights=(1.0, 1.0))
    assert [float(v) for v in per_output] == [4.0, 0.0]
    assert float(loss) == 4.0

