"""Input data -> large batches of a static shape.

autosplit takes single examples, never batches: a ``tf.data.Dataset`` whose elements
are ``(x, y)`` or ``(x, y, sample_weight)`` (each part may be a tensor, tuple or dict),
or a tuple of arrays ``(x, y[, sample_weight])`` with one row per example. It batches
them to ``batch_size`` itself and pads the short last batch of an epoch to the same
shape with copies of its own rows, reporting ``n_valid`` (the number of real rows), so
one trace of the compiled step serves the whole epoch. All checks run before any
state changes and raise ``DatasetError`` with what was expected and how to fix it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import tensorflow as tf
from keras.src import tree

from autosplit.errors import DatasetError, describe

__all__ = ["LargeBatches", "batched_ancestor", "to_tensors"]

_SHAPE_HINT = (
    "Pass a tf.data.Dataset of single examples, e.g. "
    "tf.data.Dataset.from_tensor_slices((x, y)), or a tuple of arrays (x, y) or "
    "(x, y, sample_weight)."
)


def batched_ancestor(dataset: tf.data.Dataset) -> str | None:
    """Name of a batching transformation upstream of ``dataset`` (not undone), or None."""
    node = dataset
    for _ in range(1000):
        name = type(node).__name__
        if "Unbatch" in name or "FromTensorSlices" in name:
            return None
        if "Batch" in name:
            return name.strip("_")
        node = getattr(node, "_input_dataset", None)
        if node is None:
            return None
    return None


def _leading(spec: tf.TensorSpec) -> Any:
    return spec.shape[0] if spec.shape.rank else None


def to_tensors(value: Any) -> Any:
    """Arrays (nested) -> tensors, refusing what is not array-like."""
    def convert(leaf):
        if leaf is None:
            return None
        if isinstance(leaf, (np.ndarray, tf.Tensor)) or hasattr(leaf, "__array__"):
            return tf.convert_to_tensor(leaf)
        if isinstance(leaf, (list, tuple)):
            return tf.convert_to_tensor(np.asarray(leaf))
        raise DatasetError(
            "Expected arrays (NumPy arrays or tensors) in the data tuple. Received: "
            f"{describe(leaf)}. {_SHAPE_HINT}"
        )
    return tree.map_structure(convert, value)


class LargeBatches:
    """Large batches of ``batch_size`` rows from single examples, plus ``n_valid``.

    Args:
        data: a ``tf.data.Dataset`` of single examples, or a tuple of arrays.
        batch_size: B, the number of examples in one large batch.
        shuffle: reshuffle array rows every epoch (like ``model.fit``); datasets are
            taken in their own order.
        name: the argument name used in error messages.
    """

    def __init__(self, data: Any, batch_size: int, *, shuffle: bool = True,
                 name: str = "dataset") -> None:
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.name = name
        self._arrays = None
        if isinstance(data, tf.data.Dataset):
            self._dataset = data
            spec = data.element_spec
            if not isinstance(spec, (tuple, list)) or len(spec) not in (2, 3):
                raise DatasetError(
                    f"Expected `{name}` elements to be (x, y) or (x, y, sample_weight). "
                    f"Received: element_spec={spec}. Map your dataset to such tuples, e.g. "
                    "dataset.map(lambda e: (e['features'], e['label']))."
                )
            batched = batched_ancestor(data)
            if batched is not None:
                raise DatasetError(
                    f"Expected `{name}` to yield single examples; autosplit makes the "
                    f"batches itself. Received: a dataset batched upstream ({batched}), "
                    f"element_spec={spec}. Call `{name}.unbatch()` (or drop the `.batch()`)."
                )
            self.has_weights = len(spec) == 3
            cardinality = int(data.cardinality())
            if cardinality == 0:
                raise DatasetError(f"Expected a non-empty `{name}`. Received: an empty dataset.")
            if cardinality == tf.data.INFINITE_CARDINALITY:
                self.num_examples = None
                self.infinite = True
            else:
                self.infinite = False
                self.num_examples = cardinality if cardinality > 0 else None
            self.variable_shape = any(
                None in s.shape.as_list() for s in tree.flatten(spec) if s.shape.rank
            )
        elif isinstance(data, (tuple, list)):
            if len(data) not in (2, 3):
                raise DatasetError(
                    f"Expected `{name}` to be (x, y) or (x, y, sample_weight). Received: a "
                    f"{type(data).__name__} of {len(data)} items. {_SHAPE_HINT}"
                )
            if len(data) == 3 and data[2] is None:
                data = tuple(data[:2])
            arrays = to_tensors(tuple(data))
            lengths = {}
            for part, value in zip(("x", "y", "sample_weight"), arrays, strict=False):
                for leaf in tree.flatten(value):
                    if leaf.shape.rank == 0:
                        raise DatasetError(
                            f"Expected every array in `{name}` to have one row per example. "
                            f"Received: a scalar in {part}."
                        )
                    lengths.setdefault(part, set()).add(int(leaf.shape[0]))
            distinct = {n for values in lengths.values() for n in values}
            if len(distinct) != 1:
                raise DatasetError(
                    f"Expected x, y (and sample_weight) in `{name}` to have the same number of "
                    f"rows. Received: lengths {({k: sorted(v) for k, v in lengths.items()})}. "
                    "Make every array hold one row per example."
                )
            self.num_examples = distinct.pop()
            if self.num_examples == 0:
                raise DatasetError(f"Expected a non-empty `{name}`. Received: arrays of 0 rows.")
            self._arrays = arrays
            self._dataset = None
            self.has_weights = len(arrays) == 3
            self.infinite = False
            self.variable_shape = False
        else:
            raise DatasetError(
                f"Expected `{name}` to be a tf.data.Dataset or a tuple of arrays. Received: "
                f"{describe(data)}. {_SHAPE_HINT}"
            )

    @property
    def steps_per_epoch(self) -> int | None:
        """Large batches in one pass over the data (None when unknown)."""
        if self.num_examples is None:
            return None
        return math.ceil(self.num_examples / self.batch_size)

    def _pad(self, batch):
        batch_size = self.batch_size
        n = tf.shape(tree.flatten(batch)[0])[0]
        # Copies of real rows, not zeros: padding rows must give finite losses. A full
        # batch passes through untouched: a gather would be one more copy of it.
        index = tf.range(batch_size) % n

        def pad(t):
            return tf.cond(n < batch_size, lambda: tf.gather(t, index),
                           lambda: tf.ensure_shape(t, [batch_size, *t.shape[1:]]))

        padded = tree.map_structure(pad, batch)
        return (*padded, n)

    def dataset(self, *, repeat: bool = False) -> tf.data.Dataset:
        """One epoch (or, with ``repeat``, endless epochs) of large batches.

        Elements are ``(x, y, sample_weight_or_empty, n_valid)``. Repeating inside one
        iterator reshuffles every epoch without building a new iterator per epoch:
        under a tight memory cap, a second iterator's buffers next to the first's are
        an avoidable peak (and tf.data does not survive an allocation failure).
        """
        if self._arrays is not None:
            arrays = self._arrays
            index = tf.data.Dataset.range(self.num_examples)
            if self.shuffle:
                index = index.shuffle(self.num_examples, reshuffle_each_iteration=True)
            index = index.batch(self.batch_size)
            ds = index.map(lambda i: self._pad(tree.map_structure(
                lambda t: tf.gather(t, i), arrays)))
        else:
            if self.variable_shape:
                ds = self._dataset.padded_batch(self.batch_size)
            else:
                ds = self._dataset.batch(self.batch_size)
            ds = ds.map(lambda *b: self._pad(b))
        if not self.has_weights:
            ds = ds.map(lambda x, y, n: (x, y, (), n))
        if repeat:
            ds = ds.repeat()
        # A sequential map and a prefetch of one: while a step runs, exactly one more
        # large batch is in memory (the probe counts it), not an autotuned number.
        return ds.prefetch(1)

    def first(self) -> tuple:
        """The first large batch ``(x, y, sample_weight_or_None, n_valid)``, with no
        iterator left running (a live prefetch thread would allocate during trials)."""
        x, y, w, n = self.dataset().take(1).get_single_element()
        return x, y, (w if self.has_weights else None), n

    def iterate(self, *, repeat: bool = False, streaming: bool = False) -> Iterator[tuple]:
        """``(x, y, sample_weight_or_None, n_valid)`` tuples, one per large batch.

        With ``streaming`` (arrays only) the tuples are ``(index, None, None, n_valid)``:
        the row numbers of each large batch, for a step that gathers its micro-batches
        from ``source`` itself.
        """
        if streaming:
            for index, n in self.index_dataset(repeat=repeat):
                yield index, None, None, n
            return
        for x, y, w, n in self.dataset(repeat=repeat):
            yield x, y, (w if self.has_weights else None), n

    @property
    def streamable(self) -> bool:
        """Whether the examples are arrays held in memory (what streaming gathers from)."""
        return self._arrays is not None

    @property
    def source(self) -> tuple:
        """The arrays ``(x, y, sample_weight_or_None)``, one row per example."""
        if self._arrays is None:
            raise DatasetError(
                "Expected arrays (x, y[, sample_weight]) for streaming=True. Received: a "
                "tf.data.Dataset. Streaming gathers each micro-batch from arrays held in "
                "memory; pass arrays, or streaming=False.")
        return (*self._arrays, None)[:3]

    def batch_bytes(self) -> int:
        """Bytes of one large batch of inputs, targets and weights."""
        if self._arrays is not None:
            return sum(int(t.dtype.size) * int(np.prod(t.shape[1:])) * self.batch_size
                       for t in tree.flatten(self._arrays))
        spec = self._dataset.element_spec
        return sum(int(s.dtype.size) * int(np.prod([d or 1 for d in s.shape.as_list()]))
                   * self.batch_size for s in tree.flatten(spec))

    def index_dataset(self, *, repeat: bool = False) -> tf.data.Dataset:
        """``(index, n_valid)`` per large batch: row numbers, padded to B with copies."""
        index = tf.data.Dataset.range(self.num_examples)
        if self.shuffle:
            index = index.shuffle(self.num_examples, reshuffle_each_iteration=True)
        index = index.batch(self.batch_size).map(lambda i: self._pad((i,)))
        if repeat:
            index = index.repeat()
        return index.prefetch(1)

    def first_index(self) -> tuple:
        """The first large batch's ``(index, n_valid)``."""
        index, n = self.index_dataset().take(1).get_single_element()
        return index, n

    def __iter__(self) -> Iterator[tuple]:
        return self.iterate()

    def sample(self, rows: int) -> tuple:
        """The first ``rows`` examples as one batch ``(x, y, sample_weight_or_None)``."""
        if self._arrays is not None:
            part = tree.map_structure(lambda t: t[:rows], self._arrays)
        else:
            ds = self._dataset.take(rows)
            ds = ds.padded_batch(rows) if self.variable_shape else ds.batch(rows)
            part = next(iter(ds), None)
            if part is None:
                raise DatasetError(
                    f"Expected a non-empty `{self.name}`. Received: a dataset that yielded "
                    "no example."
                )
        part = tuple(part)
        if len(part) == 2:
            part = (*part, None)
        return part
