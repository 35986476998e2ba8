"""``Shapes``: the distinct shapes of micro-batch a run gives its step (under XLA, its
programs), counted as they are pulled, markers left out."""

from __future__ import annotations

import tensorflow as tf

from autosplit.data.sequences.shapes import Shapes


def _element(rows, length, valid=1.0):
    return (tf.zeros([rows, length], tf.int32), tf.zeros([rows]), tf.fill([rows], valid))


def test_each_distinct_shape_counts_once_and_a_marker_not_at_all():
    shapes = Shapes()
    elements = [_element(4, 8), _element(4, 8), _element(4, 16), _element(2, 8),
                _element(0, 0), _element(1, 8, valid=0.0)]  # an end marker, a header-like
    ds = tf.data.Dataset.from_generator(
        lambda: iter(elements), output_signature=(
            tf.TensorSpec([None, None], tf.int32), tf.TensorSpec([None]),
            tf.TensorSpec([None]))).map(shapes.record)
    seen = list(ds)
    assert len(seen) == len(elements)  # every element passes, as it was
    assert shapes.count() == 3
