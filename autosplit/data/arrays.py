"""Arrays (``x, y[, sample_weight]`` as tensors, lists or dicts of them) as batches of
row numbers, shuffled each epoch; the pipeline gathers each micro-batch's rows."""


from __future__ import annotations

import functools
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from autosplit.data.adapter import (
    EXAMPLE_CHUNK,
    HINT,
    InputAdapter,
    InputFacts,
    check_class_weight_alone,
    class_weight_fn,
)
from autosplit.data.sequences.lengths import PaddedArrays, padded_sequences
from autosplit.data.structure import map_present
from autosplit.errors import DatasetError, describe
from autosplit.graph import HOST

__all__ = ["ArrayInput"]


class ArrayInput(InputAdapter):
    """NumPy arrays or tensors, one row per example; gathered on the host per micro-batch."""

    rows: int  # arrays always know their length

    def __init__(self, x: Any, y: Any, sample_weight: Any = None, *,
                 shuffle: bool | str = True, class_weight: dict | None = None,
                 name: str = "x") -> None:
        if y is None and sample_weight is not None:
            raise DatasetError(f"Expected targets `y` next to `{name}` and `sample_weight`. "
                               "Received: y=None.")
        # As Keras's adapters do: a list of inputs is a structure, never one array to
        # stack (tf.data would turn a list into one tensor).
        x, y, sample_weight = keras.tree.lists_to_tuples((x, y, sample_weight))
        with tf.device(HOST):
            arrays = tf.nest.map_structure(_to_tensor, (x, y, sample_weight))
        lengths: dict[str, set[int]] = {}
        for part, value in zip(("x", "y", "sample_weight"), arrays, strict=True):
            for leaf in tf.nest.flatten(value):
                if leaf is None:
                    continue
                if leaf.shape.rank == 0:
                    raise DatasetError(
                        f"Expected every array to have one row per example. Received: a "
                        f"scalar in {part}.")
                lengths.setdefault(part, set()).add(int(leaf.shape[0]))
        distinct = {n for values in lengths.values() for n in values}
        if len(distinct) != 1:
            raise DatasetError(
                "Expected x, y (and sample_weight) to have the same number of rows. Received: "
                f"{ {k: sorted(v) for k, v in lengths.items()} }. Make every array hold one "
                "row per example.")
        rows = distinct.pop()
        if rows == 0:
            raise DatasetError("Expected non-empty arrays. Received: arrays of 0 rows.")
        check_class_weight_alone(class_weight, sample_weight is not None, arrays[1])
        self.arrays = arrays
        self.shuffle = "batch" if _is_batch(shuffle) else bool(shuffle)
        self._class_weight = class_weight_fn(class_weight) if class_weight else None
        # Row numbers, which materialize gathers. No tf.data rewrites: each serializes the
        # graph with the arrays the gather captures, and none sped these stages up
        # (benchmarks.overhead; the pipeline asks for the parallel gather itself).
        self.facts = InputFacts("arrays", rows=rows, row_numbers=True,
                                arity=0 if y is None else 2, graph_rewrites=False)

    @property
    def shuffles(self) -> bool:
        return bool(self.shuffle)

    def rows_dataset(self, *, shuffle_seed: int | None = None,
                     epoch: int | tf.Variable = 0,
                     batch_size: int | None = None) -> tf.data.Dataset:
        """Row numbers, shuffled per iteration; with ``shuffle_seed`` the order depends on
        ``(shuffle_seed, epoch)`` alone (a stateless permutation), so processes seeded
        differently agree on it, and a pipeline built after an out-of-memory recovery
        gives every later epoch the order it would have had.

        With ``shuffle="batch"`` (Keras's meaning) large batch i holds the rows
        ``[i*B, (i+1)*B)``, as unshuffled, each epoch in a new order.
        """
        rows = self.rows
        if self.shuffle and shuffle_seed is not None:
            def permutation(_):
                # A variable counts the epochs of a repeated pipeline: read and advanced
                # once per iteration (this map's only element), so each is cut anew.
                number = (epoch.assign_add(1) - 1 if isinstance(epoch, tf.Variable)
                          else tf.constant(epoch, tf.int64))
                return tf.random.experimental.stateless_shuffle(
                    tf.range(rows, dtype=tf.int64),
                    seed=tf.stack([tf.constant(shuffle_seed, tf.int64), number]))

            index = tf.data.Dataset.from_tensors(0).map(permutation).unbatch()
        else:
            index = tf.data.Dataset.range(rows)
            if self.shuffle:
                index = index.shuffle(rows, reshuffle_each_iteration=True)
        if self.shuffle == "batch":
            if batch_size is None:
                raise TypeError("shuffle='batch' needs the large batch's `batch_size`.")
            index = index.batch(rows).map(
                functools.partial(_within_batches, batch_size=batch_size)).unbatch()
        return index.batch(EXAMPLE_CHUNK)

    def materialize(self, rows: Any) -> tuple:
        # The gather runs in the host pipeline: only the micro-batch's rows are copied.
        return self._weighted(*map_present(lambda t: tf.gather(t, rows), self.arrays))

    def sample(self, n: int) -> tuple:
        return self._weighted(*map_present(lambda t: t[:n], self.arrays))

    def padded_sequences(self, takes_any_length: bool) -> PaddedArrays | None:
        return padded_sequences(self.arrays, takes_any_length)


def _is_batch(shuffle: Any) -> bool:
    return isinstance(shuffle, str) and shuffle == "batch"


def _within_batches(permutation: tf.Tensor, batch_size: int) -> tf.Tensor:
    """A random permutation of the rows -> each run of ``batch_size`` rows in place, in
    random order. A stable sort by run keeps the permutation's order inside each run,
    which is uniformly random, and every row once."""
    return tf.gather(permutation, tf.argsort(permutation // batch_size, stable=True))


def _to_tensor(leaf: Any) -> Any:
    if leaf is None:
        return None
    if isinstance(leaf, (np.ndarray, tf.Tensor)) or hasattr(leaf, "__array__"):
        return tf.convert_to_tensor(leaf)
    if isinstance(leaf, (list, tuple)):
        return tf.convert_to_tensor(np.asarray(leaf))
    raise DatasetError(f"Expected arrays (NumPy arrays or tensors). Received: {describe(leaf)}. "
                       f"{HINT}")
