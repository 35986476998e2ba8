"""What each kind of input is, read once into ``InputAdapter.facts``: pinned here, kind by
kind, since the cut, the probe and the pipeline all read it and none infers it again."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from autosplit.data.adapter import InputFacts
from autosplit.data.inputs import get_input

N = 10
rng = np.random.default_rng(0)
X, Y = rng.normal(size=(N, 3)).astype("float32"), np.arange(N, dtype="int32")
SEQUENCES = [np.arange(1, n + 1, dtype="int32") for n in range(2, 2 + N)]


def _varying():
    return tf.data.Dataset.from_generator(
        lambda: zip(SEQUENCES, Y, strict=True),
        output_signature=(tf.TensorSpec([None], tf.int32), tf.TensorSpec([], tf.int32)))


def _fixed_by_a_map():
    """keras-io's transformer_asr: each example padded to 8 by a map whose length
    TensorFlow's shapes leave unknown."""
    return _varying().map(lambda x, y: (tf.pad(x, [[0, 8]])[:8], y))


class Batches(keras.utils.PyDataset):
    def __len__(self):
        return 3

    def __getitem__(self, index):
        return X[index * 4:(index + 1) * 4], Y[index * 4:(index + 1) * 4]


def _generator():
    for start in range(0, N, 4):
        yield X[start:start + 4], Y[start:start + 4]


CASES = {
    "arrays": (lambda: get_input(X, Y), InputFacts(
        "arrays", rows=N, row_numbers=True, graph_rewrites=False)),
    "arrays_x_alone": (lambda: get_input(X), InputFacts(
        "arrays", rows=N, row_numbers=True, arity=0, graph_rewrites=False)),
    "examples": (lambda: get_input(tf.data.Dataset.from_tensor_slices((X, Y))), InputFacts(
        "tf.data.Dataset of examples", rows=N)),
    "examples_weighted": (lambda: get_input(tf.data.Dataset.from_tensor_slices(
        (X, Y, np.ones(N, "float32")))), InputFacts("tf.data.Dataset of examples", rows=N,
                                                    arity=3)),
    "examples_of_varying_length": (lambda: get_input(_varying()), InputFacts(
        "tf.data.Dataset of examples", varying=(("x", 1),), lengths_from="example")),
    "batched": (lambda: get_input(tf.data.Dataset.from_tensor_slices((X, Y)).batch(4)),
                InputFacts("batched tf.data.Dataset", batched=True, rows=N)),
    "repeated": (lambda: get_input(tf.data.Dataset.from_tensor_slices((X, Y)).batch(4)
                                   .repeat()),
                 InputFacts("batched tf.data.Dataset", batched=True, infinite=True)),
    "padded_batch": (lambda: get_input(_varying().padded_batch(4)), InputFacts(
        "batched tf.data.Dataset", batched=True, varying=(("x", 1),), lengths_from="batch")),
    # Its length is the map's 8, not the longest row without its trailing zeros.
    "fixed_by_a_map": (lambda: get_input(_fixed_by_a_map().batch(4)), InputFacts(
        "batched tf.data.Dataset", batched=True, varying=(("x", 1),), lengths_from="batch")),
    "ragged": (lambda: get_input(tf.ragged.constant(SEQUENCES), Y, shuffle=False),
               InputFacts("tf.data.Dataset of examples", rows=N, varying=(("x", 1),),
                          lengths_from="example")),
    "py_dataset": (lambda: get_input(Batches()), InputFacts(
        "keras.utils.PyDataset", batched=True)),
    "generator": (lambda: get_input(_generator()), InputFacts(
        "generator", batched=True, reiterable=False)),
}


@pytest.mark.parametrize("kind", list(CASES))
def test_each_input_kind_is_described_once(kind):
    make, expected = CASES[kind]
    adapter = make()
    assert adapter.facts == expected
    # the names every layer reads are views of the description, nothing set apart
    for name in ("kind", "rows", "reiterable", "row_numbers", "shares", "batched",
                 "infinite", "rows_vary"):
        assert getattr(adapter, name) == getattr(expected, name), name


def test_a_worker_s_share_is_described_as_one():
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    distributed = strategy.distribute_datasets_from_function(
        lambda context: tf.data.Dataset.from_tensor_slices((X, Y)).batch(
            context.get_per_replica_batch_size(4)))
    assert get_input(distributed).facts == InputFacts(
        "strategy.distribute_datasets_from_function(...)", batched=True,
        shares=True)


def test_the_description_is_frozen():
    facts = get_input(X, Y).facts
    with pytest.raises(AttributeError):
        facts.rows = 3  # type: ignore[misc]
    with pytest.raises(AttributeError):
        get_input(X, Y).rows = 3  # a view, not an attribute of its own
