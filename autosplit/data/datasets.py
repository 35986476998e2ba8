"""A ``tf.data.Dataset`` of examples or of batches, and what its graph says without
reading it: whether its elements are batches, and how many rows one pass holds."""


from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import keras
import tensorflow as tf

from autosplit.data.adapter import (
    EXAMPLE_CHUNK,
    InputAdapter,
    arity,
    check_class_weight_alone,
    check_shared_rows,
    class_weight_fn,
    leading_rows,
)
from autosplit.errors import DatasetError

__all__ = ["DatasetInput", "batch_rows", "batched_ancestor", "counted_rows"]


def batched_ancestor(dataset: tf.data.Dataset, model: keras.Model | None = None) -> str | None:
    """How ``dataset``'s elements are known to be batches, or None (they are examples).

    A batching transformation upstream on any path of its inputs, not undone by an
    ``unbatch`` (through ``zip``, ``concatenate``, ``sample_from_datasets``, as
    SimSiam's and SimCLR's pipelines zip batched views); ``from_tensors``, whose one
    element ``model.fit`` reads as a batch; else elements of ``model``'s own input
    ranks, batch axis included (``from_generator`` or a ``map`` yielding whole
    batches), where the model declares its inputs.
    """
    def yields_batches(node: tf.data.Dataset) -> bool:
        # Past an unbatch, a path yields examples; a flat_map or interleave yields what
        # its function makes (from_generator is a flat_map over from_tensors of an id).
        name = type(node).__name__
        return not any(part in name for part in ("Unbatch", "TensorSlice", "FlatMap",
                                                 "Interleave"))

    for node in _upstream(dataset, yields_batches):
        name = type(node).__name__
        if yields_batches(node) and ("Batch" in name or name == "_TensorDataset"):
            return name.strip("_")
    if model is not None and _shaped_as_batches(dataset.element_spec, model):
        return "elements of the model's input ranks"
    return None


# Transformations that hand on every batch whole and in order: what a batched
# pipeline puts after its batch() (keras.utils.image_dataset_from_directory: batch,
# then prefetch).
_WHOLE = ("_PrefetchDataset", "CacheDataset", "_CacheDataset", "_OptionsDataset",
          "_MaxIntraOpParallelismDataset", "_PrivateThreadPoolDataset",
          "_AssertCardinalityDataset")
# ...and a shuffle of batches, which keeps every row of a pass (not each batch's place).
_KEEP_ROWS = (*_WHOLE, "_ShuffleDataset")
_BATCHES = ("_BatchDataset", "_PaddedBatchDataset", "_ParallelBatchDataset")


def _batching(dataset: tf.data.Dataset, passes: tuple[str, ...]) -> tf.data.Dataset:
    """The dataset under ``dataset``'s transformations named in ``passes``; not past a
    ``cache`` in a file, which replays what the file holds (written from other data, a
    stale file has other rows: model.fit then reads as many batches as the pipeline
    says)."""
    node = dataset
    while type(node).__name__ in passes and tf.get_static_value(
            getattr(node, "_filename", b"")) in (b"", ""):
        node = node._input_dataset  # tf.data internal, as _dataset_inputs
    return node


def _static_rows(node: tf.data.Dataset) -> int | None:
    """The one static leading dimension of ``node``'s elements, or None."""
    rows = {leaf.shape[0] for leaf in tf.nest.flatten(node.element_spec)
            if isinstance(leaf, tf.TensorSpec) and leaf.shape.rank}
    return rows.pop() if len(rows) == 1 and None not in rows else None


def _one(counts: Iterator[int | None]) -> int | None:
    """The count every part of a ``zip`` has, or None (one unknown, or two that differ:
    the parts of an element would not share their rows)."""
    found = set(counts)
    return found.pop() if len(found) == 1 and None not in found else None


def _stacks(node: tf.data.Dataset) -> bool:
    """Whether ``node`` is a ``batch`` (or ``padded_batch``): each element stacks
    elements of its input, so every part of it has the same rows."""
    return type(node).__name__ in _BATCHES


def counted_rows(dataset: tf.data.Dataset) -> int | None:
    """The rows of one pass over a batched ``dataset``, known without reading it; None
    unless certain.

    Known where the pipeline ends in ``batch`` (or ``padded_batch``) of examples of known
    cardinality, followed only by transformations that hand each batch on whole
    (``prefetch``, ``cache`` in memory, ``shuffle``, ``assert_cardinality``, options);
    where it is ``from_tensors`` of one batch of a static row count; or a ``zip`` of
    such pipelines of one batch size and one count. Else the first epoch's end tells:
    after a ``map`` too, whose function may change a batch's row count (appending
    augmented copies), which nothing short of running it tells.
    """
    node = _batching(dataset, _KEEP_ROWS)
    if type(node).__name__ == "_TensorDataset":
        return _static_rows(node)
    if type(node).__name__ == "_ZipDataset":  # SimSiam's two views, each batched
        parts = _dataset_inputs(node)
        sizes = (_batching(part, _KEEP_ROWS) for part in parts)
        if _one(int(s._batch_size) if _stacks(s) else None for s in sizes) is None:
            return None  # batches of other sizes paired: their rows differ
        return _one(counted_rows(part) for part in parts)
    if not _stacks(node):
        return None
    count = int(node._input_dataset.cardinality())  # the elements it stacks: its rows
    if count < 0:
        return None
    size = int(node._batch_size)
    return count - count % size if bool(node._drop_remainder) else count


def batch_rows(dataset: tf.data.Dataset) -> int | None:
    """The rows of every batch of a batched ``dataset`` but the last (which may be
    short), or None.

    Read where the pipeline ends in one ``batch`` (or ``padded_batch``) followed only by
    ``prefetch``, ``cache``, ``take`` or options; or ``from_tensors``' one batch. Past a
    ``map``, which may change a batch's rows (``x[:20]``), where the first batch has the
    batch's size, read if that moves no seed (:func:`_draws_randomness`). Not past a
    ``shuffle`` of batches, which moves the short one.
    """
    node = _batching(dataset, (*_WHOLE, "_TakeDataset"))
    if type(node).__name__ == "_TensorDataset":
        return _static_rows(node)
    if type(node).__name__ == "_ZipDataset":
        return _one(batch_rows(part) for part in _dataset_inputs(node))
    if _stacks(node):
        return int(node._batch_size)
    node = _batching(dataset, (*_WHOLE, "_TakeDataset", "_MapDataset", "_ParallelMapDataset"))
    if not _stacks(node) or _draws_randomness(dataset):
        return None
    size = int(node._batch_size)
    for first in dataset.take(1):
        rows = {leaf.shape[0] for leaf in tf.nest.flatten(first) if getattr(leaf, "shape", ())}
        return size if rows == {size} else None
    return None


def _draws_randomness(dataset: tf.data.Dataset) -> bool:
    """Whether ``dataset`` or a dataset upstream shuffles, samples or runs a function
    with a random op (a ``map`` that augments): each new iterator then moves a seed on."""
    for node in _upstream(dataset):
        name = type(node).__name__
        if "Shuffle" in name or "Random" in name or "DirectedInterleave" in name:
            return True
        for value in vars(node).values():
            graph = getattr(getattr(value, "function", None), "graph", None)
            if graph is not None and any("Random" in op.type
                                         for op in graph.get_operations()):
                return True
    return False


def _upstream(dataset: tf.data.Dataset,
              descend: Callable[[tf.data.Dataset], bool] = lambda _: True
              ) -> Iterator[tf.data.Dataset]:
    """``dataset`` and the datasets on every path of its inputs, once each, depth first;
    the inputs of a node where ``descend`` is false are not visited."""
    seen: set[int] = set()
    stack = [dataset]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        yield node
        if descend(node):
            stack += _dataset_inputs(node)


def _dataset_inputs(node: tf.data.Dataset) -> list:
    try:
        return list(node._inputs())  # tf.data internal: every input dataset
    except (AttributeError, NotImplementedError, TypeError):
        parent = getattr(node, "_input_dataset", None)
        return [] if parent is None else [parent]


def _shaped_as_batches(spec: Any, model: keras.Model) -> bool:
    """Whether ``spec``'s inputs have the ranks of the model's declared inputs, batch axis
    included (an example has one axis fewer)."""
    try:
        inputs = model.inputs  # a functional or Sequential model's Input()s
    except (AttributeError, ValueError):
        return False
    if not inputs:
        return False
    found = arity(spec)
    x = spec[0] if found else spec
    ranks = sorted(leaf.shape.rank if hasattr(leaf, "shape") else -1
                   for leaf in tf.nest.flatten(x))
    return ranks == sorted(len(t.shape) for t in tf.nest.flatten(inputs))


class DatasetInput(InputAdapter):
    """A ``tf.data.Dataset`` of examples or of batches (of any, even varying, size)."""

    def __init__(self, dataset: tf.data.Dataset, *, class_weight: dict | None = None,
                 name: str = "x", model: keras.Model | None = None) -> None:
        spec = dataset.element_spec
        found = arity(spec)
        if found is None:
            raise DatasetError(
                f"Expected `{name}` elements to be (x, y), (x, y, sample_weight) or x alone. "
                f"Received: element_spec={spec}. Map your dataset to such tuples, e.g. "
                "dataset.map(lambda e: (e['features'], e['label'])).")
        self._arity = found
        composite = [leaf for leaf in tf.nest.flatten(spec) if not isinstance(leaf, tf.TensorSpec)]
        if composite:
            raise DatasetError(
                f"Expected `{name}` elements of dense tensors: autosplit cuts micro-batches "
                f"by rows and pads them. Received: {', '.join(map(str, composite))}. Make "
                "them dense first: `.padded_batch(...)` in place of `.ragged_batch(...)`, "
                "or a map with `x.to_tensor()` (ragged) or `tf.sparse.to_dense(x)`.")
        cardinality = int(dataset.cardinality())
        if cardinality == 0:
            raise DatasetError(f"Expected a non-empty `{name}`. Received: an empty dataset.")
        self.batched = batched_ancestor(dataset, model) is not None
        self.kind = "batched tf.data.Dataset" if self.batched else "tf.data.Dataset of examples"
        self.infinite = cardinality == tf.data.INFINITE_CARDINALITY
        self.rows = (counted_rows(dataset) if self.batched
                     else cardinality if cardinality > 0 else None)
        check_class_weight_alone(class_weight, self._arity == 3,
                                  spec[1] if self._arity >= 2 else None)
        self._class_weight = class_weight_fn(class_weight) if class_weight else None
        self.dataset = dataset
        if self.batched:
            parts = spec if self._arity else (spec,)
            check_shared_rows(parts, f"`{name}`")
            rows = leading_rows(parts)
            stacked = _stacks(_batching(dataset, _KEEP_ROWS))
            if (len(rows) > 1 and None in rows.values() and not stacked
                    and not _draws_randomness(dataset)):
                # Row counts only known at run time: look at one batch now (one batch
                # read twice, as Keras peeks a generator). A later batch whose parts
                # differ stops training with tf.data's InvalidArgumentError ("Input
                # element must have the same batch size in each component"): the
                # pipeline's rebatch checks every batch, at no cost of ours. Not where
                # the pipeline draws random numbers: an iterator more moves a seeded
                # shuffle on, and training would see another order than model.fit's.
                # Not where it ends in a batch(), whose parts stack the same examples:
                # the look would be half of the adapter's set-up, for nothing.
                for first in dataset.take(1):
                    check_shared_rows(first if self._arity else (first,), f"`{name}`")
        # Examples of varying shape (sequences of varying length) are padded per large
        # batch by the pipeline (``autosplit.data.pipeline``), as padded_batch(B) pads.
        self.own_lengths = not self.batched
        self._varying = not self.batched and any(
            None in s.shape.as_list() for s in tf.nest.flatten(spec) if s.shape.rank)

    def own_batch_rows(self) -> int | None:
        return batch_rows(self.dataset) if self.batched else None

    def rows_dataset(self, *, shuffle_seed: int | None = None,
                     epoch: int | tf.Variable = 0,
                     batch_size: int | None = None) -> tf.data.Dataset:
        if self.batched:
            # No check of ours per batch: a map over every small batch costs a share of
            # every epoch, and the pipeline's rebatch already refuses a batch whose
            # parts do not share a row count.
            return self.dataset
        if self._varying:  # one row each, padded to nothing: the cut pads them together
            return self.dataset.padded_batch(1)
        return self.dataset.batch(EXAMPLE_CHUNK)
