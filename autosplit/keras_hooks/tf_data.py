"""What a ``tf.data`` graph says without reading it, from tf.data's private structure
(its datasets' class names, ``_input_dataset``, ``_inputs()``, ``_batch_size``,
``_drop_remainder``, a cache's ``_filename``, the functions a map holds): whether a
dataset's elements are batches, and how many rows one pass holds. The canaries in
``tests/keras_hooks/test_keras_canaries.py`` check each reliance.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import tensorflow as tf

__all__ = ["batch_rows", "batched_ancestor", "counted_rows", "draws_randomness",
           "ends_in_batch"]


def batched_ancestor(dataset: tf.data.Dataset) -> str | None:
    """How ``dataset``'s elements are known to be batches from its graph, or None.

    A batching transformation upstream on any path of its inputs, not undone by an
    ``unbatch`` (through ``zip``, ``concatenate``, ``sample_from_datasets``, as
    SimSiam's and SimCLR's pipelines zip batched views); ``from_tensors``, whose one
    element ``model.fit`` reads as a batch.
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


def ends_in_batch(dataset: tf.data.Dataset) -> bool:
    """Whether ``dataset`` ends in a ``batch`` (or ``padded_batch``), followed only by
    transformations that keep every row of a pass."""
    return _stacks(_batching(dataset, _KEEP_ROWS))


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
    batch's size, read if that moves no seed (:func:`draws_randomness`). Not past a
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
    if not _stacks(node) or draws_randomness(dataset):
        return None
    size = int(node._batch_size)
    for first in dataset.take(1):
        rows = {leaf.shape[0] for leaf in tf.nest.flatten(first) if getattr(leaf, "shape", ())}
        return size if rows == {size} else None
    return None


def draws_randomness(dataset: tf.data.Dataset) -> bool:
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
