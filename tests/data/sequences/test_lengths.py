"""An example's lengths: which parts vary, along which axis, and which share a length,
as the data shows; and each row's length in each of them."""

import numpy as np
import tensorflow as tf

from autosplit.data.inputs import get_input
from autosplit.data.sequences.lengths import (
    costliest_row,
    group_lengths,
    lengths_of,
    padded_lengths,
    tie,
)

IDS = tf.TensorSpec([None, None], tf.int32)


def _pair(source, target):
    return ({"source": np.arange(1, source + 1), "mask": np.ones(source, bool),
             "target": np.arange(1, target + 1)}, np.arange(1, target + 1))


def test_each_varying_part_is_named_with_its_axis_and_parts_of_one_shape_have_none():
    spec = ({"ids": IDS, "extra": tf.TensorSpec([None, 4], tf.float32),
             "signal": tf.TensorSpec([None, 3, None], tf.float32)}, IDS, ())
    found = lengths_of(spec)
    assert found.names == ("x['extra']", "x['ids']", "x['signal']", "y")
    assert found.axes == (None, 1, 2, 1) and found.groups == (None, 0, 1, 2)
    assert found.uncut == () and found.number == 3
    assert lengths_of((tf.TensorSpec([None, 4], tf.float32), tf.TensorSpec([None]), ())) is None


def test_a_part_that_varies_along_two_axes_or_is_ragged_cannot_be_cut_and_says_so():
    spec = (tf.TensorSpec([None, None, None, 1], tf.float32), tf.TensorSpec([None]), ())
    assert lengths_of(spec).uncut == ("x varies in length along 2 axes (1, 2)",)
    ragged = (tf.RaggedTensorSpec([None, None], tf.int32), tf.TensorSpec([None]), ())
    assert lengths_of(ragged).uncut == ("x is RaggedTensorSpec",)


def test_parts_share_a_length_where_it_agrees_in_every_example():
    rows = [_pair(3, 5), _pair(7, 6), _pair(4, 4)]
    spec = tf.nest.map_structure(lambda t: tf.TensorSpec([None, None], tf.as_dtype(t.dtype)),
                                 rows[0])
    found = tie(lengths_of(spec), [tf.nest.map_structure(lambda t: t[None], r) for r in rows])
    # the source and its mask one length; the target and its labels another
    assert found.names == ("x['mask']", "x['source']", "x['target']", "y")
    assert found.groups == (0, 0, 1, 1)
    assert found.described(1) == "x['target'] and y"


def test_an_input_reads_its_lengths_once_from_its_examples_or_its_padded_batches():
    rows = [_pair(3, 5), _pair(7, 6), _pair(4, 4), _pair(2, 9)]
    spec = ({"source": tf.TensorSpec([None], tf.int64), "mask": tf.TensorSpec([None], tf.bool),
             "target": tf.TensorSpec([None], tf.int64)}, tf.TensorSpec([None], tf.int64))
    examples = tf.data.Dataset.from_generator(lambda: iter(rows), output_signature=spec)
    for data in (examples, examples.padded_batch(2)):
        adapter = get_input(data)
        assert adapter.lengths().groups == (0, 0, 1, 1)
        assert adapter.lengths() is adapter.lengths()  # read once
    # A dataset that shuffles is read too (as the check's sample reads it): the lengths
    # agree in every example or batch whatever their order.
    shuffled = examples.shuffle(4, seed=1)
    assert get_input(shuffled).lengths().groups == (0, 0, 1, 1)
    assert get_input(shuffled.padded_batch(2)).lengths().groups == (0, 0, 1, 1)
    # autosplit's own examples of ragged parts, shuffled each epoch by default
    ragged = get_input({name: tf.ragged.constant([r[0][name] for r in rows])
                        for name in ("source", "mask", "target")},
                       tf.ragged.constant([r[1] for r in rows]))
    assert ragged.lengths().groups == (0, 0, 1, 1)


def test_a_row_is_as_long_in_each_length_as_its_last_nonzero_entry_says():
    source = tf.constant([[5, 6, 0, 0], [7, 0, 0, 0]])
    signal = tf.constant([[[1.0, 0.0, 0.0], [0.0, 2.0, 0.0]], [[0.0] * 3, [0.0, 0.0, 3.0]]])
    lengths = lengths_of((tf.TensorSpec([None, None], tf.int32),
                          tf.TensorSpec([None, 2, None], tf.float32)))
    found = group_lengths([source, signal], lengths)
    np.testing.assert_array_equal(found, [[2, 2], [1, 3]])
    np.testing.assert_array_equal(group_lengths([source[:, ::-1], signal], lengths, pre=True),
                                  [[2, 3], [1, 1]])
    # a row costs its lengths summed, each rounded up to the multiple
    assert costliest_row(((source, signal), None, None), lengths, None) == 4
    assert costliest_row(((source, signal), None, None), lengths, None, buckets=True) == 16


def test_arrays_padded_to_one_length_have_one_length_in_every_part_that_long():
    spec = ((tf.TensorSpec([None, 60], tf.int32), tf.TensorSpec([None, 3], tf.float32)),
            tf.TensorSpec([None, 60], tf.int32), ())
    found = padded_lengths(spec, 60)
    assert found.axes == (1, None, 1) and found.groups == (0, None, 0)


def test_a_length_without_padding_is_read_in_one_place_dense_ragged_at_either_end():
    from autosplit.data.sequences.lengths import real_lengths

    dense = tf.constant([[[1, 0], [0, 0], [0, 2], [0, 0]], [[0, 0], [0, 0], [0, 0], [0, 0]]])
    assert real_lengths(dense).numpy().tolist() == [3, 0]  # any entry of a step counts
    assert real_lengths(tf.transpose(dense, [0, 2, 1]), axis=2).numpy().tolist() == [3, 0]
    assert real_lengths(tf.constant([[0, 5, 0, 0]]), pre=True).numpy().tolist() == [3]
    ragged = tf.ragged.constant([[1, 0, 0], [], [0, 0, 4, 0, 0]])
    assert real_lengths(ragged).numpy().tolist() == [1, 0, 3]
    assert real_lengths(tf.constant([[True, False, True, False]])).numpy().tolist() == [3]
