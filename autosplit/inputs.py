"""Input adapters: every kind of input ``model.fit`` takes, as one small interface.

Separation of concerns (after Keras's ``trainers/data_adapters/``): an adapter knows
one input kind and turns it into a host-side ``tf.data`` stream of *rows*, batched any
way the input likes; ``autosplit.pipeline`` cuts that stream into micro-batches; the
compiled step (``autosplit.step``) pulls them. No adapter ever builds a large batch.

========================  ============================================================
input                     rows stream
========================  ============================================================
arrays ``(x, y[, w])``    batches of row *numbers* (shuffled each epoch); the pipeline
                          gathers each micro-batch's rows from the arrays on the host
``tf.data`` of examples   the examples, batched by 256 on the host
``tf.data``, batched      the user's batches as they come, any size (rebatched later)
``keras.utils.PyDataset`` Keras's own PyDataset adapter (workers, multiprocessing)
Python generator          Keras's own generator adapter; read once, not rewound
========================  ============================================================

Every element is ``(x, y)`` or ``(x, y, sample_weight)``; each part may be a tensor,
tuple or dict. ``class_weight`` becomes a sample weight, as in ``model.fit``. All
checks run before any state changes and raise ``DatasetError``.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Iterator
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from autosplit import _keras
from autosplit.errors import DatasetError, describe
from autosplit.piece import map_present

__all__ = [
    "ArrayInput",
    "DatasetInput",
    "InputAdapter",
    "KerasInput",
    "batch_rows",
    "batched_ancestor",
    "counted_rows",
    "get_input",
]

_HINT = ("Pass arrays (x, y[, sample_weight]), a tf.data.Dataset of (x, y[, sample_weight]) "
         "(single examples or batches), a keras.utils.PyDataset or a Python generator.")
_EXAMPLE_CHUNK = 256  # examples per host batch before the cut; any size gives the same rows

HOST = "/device:CPU:0"
_PARTS = ("x", "y", "sample_weight")


def _leading_rows(parts: tuple) -> dict[str, int | None]:
    """``{"x[0]": rows, "y": rows, ...}``: the leading dimension of every leaf."""
    counts: dict[str, int | None] = {}
    for name, part in zip(_PARTS, parts, strict=False):
        for path, leaf in keras.tree.flatten_with_path(part):
            if leaf is None:
                continue
            shape = tf.TensorShape(getattr(leaf, "shape", None))
            label = name + "".join(f"[{p!r}]" for p in path)
            counts[label] = None if shape.rank in (None, 0) else shape[0]
    return counts


def check_shared_rows(parts: tuple, what: str) -> None:
    """Refuse a batch (or spec) whose leaves do not share one number of rows."""
    counts = _leading_rows(parts)
    if len({n for n in counts.values() if n is not None}) > 1:
        raise DatasetError(
            f"Expected every part of a batch of {what} to have the same number of rows "
            f"(one row per example). Received: rows {counts}. Inputs whose parts do not "
            "share a row count (a merged graph of atoms and bonds, say) cannot be split "
            "into micro-batches by rows: train them with model.fit.")


class InputAdapter:
    """One input kind as a host-side stream of rows.

    Attributes:
        kind: what the user passed, for messages and ``history.autosplit``.
        rows: examples in one epoch, or None when only the end of the data tells.
        reiterable: a second pass reads the data again (generators: no).
        row_numbers: the stream's rows are row numbers, which ``materialize`` turns
            into data (arrays): padding them copies no data.
        graph_rewrites: ``tf.data``'s default static rewrites run on the pipeline
            (map-and-batch fusion, map parallelization and others, on the input's
            own stages too); see ``ArrayInput.graph_rewrites`` for why arrays turn
            them off.
    """

    kind = "input"
    rows: int | None = None
    reiterable = True
    row_numbers = False
    graph_rewrites = True
    _class_weight: Any = None  # (y, sample_weight) -> sample_weight, from ``class_weight``
    _arity = 2  # elements (x, y) = 2, (x, y, w) = 3, x alone (no targets) = 0

    def rows_dataset(self, *, shuffle_seed: int | None = None,
                     epoch: int | tf.Variable = 0,
                     batch_size: int | None = None) -> tf.data.Dataset:
        """One epoch as ``tf.data`` batches of rows (leading dimension = rows).

        Args:
            shuffle_seed: where this input shuffles (:attr:`shuffles`), its order is
                ``(shuffle_seed, epoch)``'s alone: the same in every process and in
                every pipeline built for it.
            epoch: the epoch's number, for the seeded order; or an int64 variable
                holding it, which each iteration reads and advances by one (a
                pipeline repeated over epochs).
            batch_size: B, the large batch the rows are cut into; what arrays with
                ``shuffle="batch"`` shuffle within.
        """
        raise NotImplementedError

    def own_batch_rows(self) -> int | None:
        """The rows of each of the input's own batches but the last, where it comes in
        batches of one size that can be read (a batched ``tf.data`` pipeline); else
        None. ``model.fit`` validates such an input batch by batch."""
        return None

    @property
    def shuffles(self) -> bool:
        """Whether the order of the rows is ours to shuffle (arrays with ``shuffle``)."""
        return False

    def materialize(self, rows: Any) -> tuple:
        """A cut piece of ``rows_dataset`` elements -> ``(x, y_or_None, sample_weight_or_None)``."""
        if self._arity == 0:
            # x alone: a model whose loss comes from add_loss in call() (targets, if any,
            # are among its inputs). A 1-tuple element is x, as model.fit unpacks it.
            return (rows[0] if isinstance(rows, tuple) and len(rows) == 1 else rows), None, None
        x, y, *w = rows
        return self._weighted(x, y, w[0] if w else None)

    def _weighted(self, x: Any, y: Any, w: Any) -> tuple:
        """``(x, y, w)`` with ``class_weight`` applied to ``w``, where one was given."""
        return x, y, (w if self._class_weight is None else self._class_weight(y, w))

    def sample(self, n: int) -> tuple:
        """Up to ``n`` leading examples as ``(x, y, sample_weight_or_None)`` tensors."""
        ds = self.rows_dataset().unbatch().take(n).batch(n)
        for batch in ds:
            return self.materialize(batch)
        raise DatasetError(f"Expected a non-empty {self.kind}. Received: one with no example.")

    def on_epoch_begin(self) -> None:
        pass

    def on_epoch_end(self) -> None:
        pass

    @property
    def epoch_hooks(self) -> bool:
        """Whether this kind overrides ``on_epoch_begin``/``on_epoch_end`` (a
        ``PyDataset``'s), so each epoch needs an iterator of its own."""
        kind = type(self)
        return (kind.on_epoch_begin is not InputAdapter.on_epoch_begin
                or kind.on_epoch_end is not InputAdapter.on_epoch_end)


def class_weight_fn(class_weight: dict) -> Any:
    """``(y, sample_weight) -> sample_weight`` applying ``class_weight`` as ``model.fit`` does.

    Integer class ids, ``(n, 1)`` ids or one-hot rows (argmax); classes missing from the
    dict weigh 1.
    """
    if not isinstance(class_weight, dict) or not class_weight:
        raise DatasetError(
            f"Expected `class_weight` to be a non-empty dict of class id -> weight. Received: "
            f"class_weight={describe(class_weight)}.")
    table = tf.constant([float(class_weight.get(c, 1.0))
                         for c in range(int(max(class_weight)) + 1)], tf.float32)

    def apply(y, sample_weight):
        if tf.nest.is_nested(y):
            raise DatasetError("Expected one target for `class_weight`. Received: a nested y; "
                               "use sample weights for multi-output models.")
        ids = y
        if ids.shape.rank > 1:
            ids = tf.argmax(ids, axis=-1) if ids.shape[-1] != 1 else tf.squeeze(ids, -1)
        ids = tf.cast(tf.round(tf.cast(ids, tf.float32)), tf.int32)
        n = table.shape[0]
        picked = tf.gather(table, tf.clip_by_value(ids, 0, n - 1))
        weights = tf.where((ids >= 0) & (ids < n), picked, 1.0)
        return weights if sample_weight is None else sample_weight * weights

    return apply


def arity(element: Any) -> int | None:
    """How ``model.fit`` reads an element: (x, y) 2, (x, y, w) 3, x alone 0; else None."""
    if not isinstance(element, tuple):
        return 0
    return {1: 0, 2: 2, 3: 3}.get(len(element))


def _check_class_weight_alone(class_weight, has_weights, y=None):
    """Refuse, before any pipeline is traced, what ``class_weight`` cannot apply to."""
    if class_weight is not None and has_weights:
        raise DatasetError(
            "Expected either `class_weight` or sample weights. Received: both. Fold the class "
            "weights into your sample weights, as model.fit also requires.")
    if class_weight is not None and tf.nest.is_nested(y):
        # Checked here, not only in the pipeline's map, where tracing wraps the error in
        # TensorFlow's StagingError.
        raise DatasetError(
            "Expected one target for `class_weight` (model.fit supports it for models with "
            "a single output). Received: nested targets. Pass per-output sample weights "
            "instead.")


class ArrayInput(InputAdapter):
    """NumPy arrays or tensors, one row per example; gathered on the host per micro-batch."""

    kind = "arrays"
    rows: int  # arrays always know their length
    row_numbers = True  # rows_dataset yields row numbers; materialize gathers them
    # tf.data rewrites a pipeline when its first iterator is made, and to rewrite it
    # serializes the graph, the arrays the gather captures included: 13 to 180 ms for
    # 50 MB (benchmarks.overhead's CNN and MLP 784 data), 198 to 717 ms for 400 MB, in
    # every call and every probe trial; without, 4 to 6 ms. Every stage here is
    # autosplit's (row numbers, the cut, the gather), and the one rewrite that did
    # anything for them, the gather run in parallel where tf.data autotunes (a GPU
    # host), the pipeline asks for itself (MicroBatches._build).
    # The epochs ran as fast without the rewrites (best of four, alternating: CNN
    # 2.146 s both ways, MLP 784 1.310 s with, 1.320 s without; the calls 0.02 and
    # 0.17 s shorter).
    graph_rewrites = False

    def __init__(self, x: Any, y: Any, sample_weight: Any = None, *,
                 shuffle: bool | str = True, class_weight: dict | None = None,
                 name: str = "x") -> None:
        if y is None and sample_weight is not None:
            raise DatasetError(f"Expected targets `y` next to `{name}` and `sample_weight`. "
                               "Received: y=None.")
        self._arity = 0 if y is None else 2
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
        self.rows = distinct.pop()
        if self.rows == 0:
            raise DatasetError("Expected non-empty arrays. Received: arrays of 0 rows.")
        _check_class_weight_alone(class_weight, sample_weight is not None, arrays[1])
        self.arrays = arrays
        self.shuffle = "batch" if _is_batch(shuffle) else bool(shuffle)
        self._class_weight = class_weight_fn(class_weight) if class_weight else None

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
        return index.batch(_EXAMPLE_CHUNK)

    def materialize(self, rows: Any) -> tuple:
        # The gather runs in the host pipeline: only the micro-batch's rows are copied.
        return self._weighted(*map_present(lambda t: tf.gather(t, rows), self.arrays))

    def sample(self, n: int) -> tuple:
        return self._weighted(*map_present(lambda t: t[:n], self.arrays))


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
                       f"{_HINT}")


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
        _check_class_weight_alone(class_weight, self._arity == 3,
                                  spec[1] if self._arity >= 2 else None)
        self._class_weight = class_weight_fn(class_weight) if class_weight else None
        self.dataset = dataset
        if self.batched:
            parts = spec if self._arity else (spec,)
            check_shared_rows(parts, f"`{name}`")
            rows = _leading_rows(parts)
            stacked = _stacks(_batching(dataset, _KEEP_ROWS))
            if (len(rows) > 1 and None in rows.values() and not stacked
                    and not _draws_randomness(dataset)):
                # Row counts only known at run time: look at one batch now (one batch
                # read twice, as Keras peeks a generator). A later batch whose parts
                # differ stops training with tf.data's InvalidArgumentError ("Input
                # element must have the same batch size in each component"): the
                # pipeline's rebatch checks every batch, at no cost of ours. Not where
                # the pipeline draws random numbers: an iterator more moves a seeded
                # shuffle on, and training saw another order than model.fit's (0.20
                # relative off after one epoch of shuffle(n, seed=5).batch(B)). Not
                # where it ends in a batch(), whose parts stack the same examples: the
                # look cost 7-25 ms a call, half of the adapter's set-up (MLP 128).
                for first in dataset.take(1):
                    check_shared_rows(first if self._arity else (first,), f"`{name}`")
        if not self.batched and any(
                None in s.shape.as_list() for s in tf.nest.flatten(spec) if s.shape.rank):
            raise DatasetError(
                f"Expected `{name}` examples of a fixed shape. Received: element_spec={spec}. "
                "Pad the examples first (e.g. `.padded_batch(32)`: autosplit rebatches "
                "batched datasets) so every micro-batch has one shape. If the elements are "
                "batches already (a generator or a map yielding whole batches, to a model "
                "that declares no Input), append `.unbatch().padded_batch(32)`.")

    def own_batch_rows(self) -> int | None:
        return batch_rows(self.dataset) if self.batched else None

    def rows_dataset(self, *, shuffle_seed: int | None = None,
                     epoch: int | tf.Variable = 0,
                     batch_size: int | None = None) -> tf.data.Dataset:
        if self.batched:
            # No check of ours per batch: a map over every small batch cost 5-8% of an
            # epoch (MLP 128 wide, batches of 32), and the pipeline's rebatch already
            # refuses a batch whose parts do not share a row count.
            return self.dataset
        return self.dataset.batch(_EXAMPLE_CHUNK)


class KerasInput(InputAdapter):
    """A ``keras.utils.PyDataset`` or a Python generator, read through Keras's own adapter."""

    def __init__(self, data: Any, *, shuffle: bool | str,
                 class_weight: dict | None) -> None:
        self.generator = isinstance(data, types.GeneratorType)
        self.kind = "generator" if self.generator else "keras.utils.PyDataset"
        self.reiterable = not self.generator
        if self.generator:
            if class_weight is not None:
                raise DatasetError("Expected no `class_weight` with a generator (model.fit "
                                   "refuses it too). Yield (x, y, sample_weight) instead.")
            data = _with_y_check(data)
            shuffle = False  # a generator's order is its own (Keras would warn)
        try:
            self.adapter = _keras.data_adapter(data, shuffle=shuffle, class_weight=class_weight)
        except ValueError as exc:
            raise DatasetError(f"Expected (x, y[, sample_weight]) batches. {exc}") from exc
        self._dataset = None
        spec = self.adapter.get_tf_dataset().element_spec
        found = arity(spec)
        if found is None:
            raise DatasetError(
                f"Expected the {self.kind} to yield (x, y), (x, y, sample_weight) or x "
                f"alone. Received: batches of {spec}.")
        self._arity = found
        first = (_keras.peeked_batches(self.adapter)[:1] if self.generator
                 else [data[0]] if len(data) else [])
        for batch in first:
            batch = keras.tree.lists_to_tuples(batch)
            check_shared_rows(batch if isinstance(batch, tuple) else (batch,),
                              f"the {self.kind}")

    def rows_dataset(self, *, shuffle_seed: int | None = None,
                     epoch: int | tf.Variable = 0,
                     batch_size: int | None = None) -> tf.data.Dataset:
        if self.generator:
            # One pass only: the same dataset object, so a second epoch ends at once.
            if self._dataset is None:
                self._dataset = self.adapter.get_tf_dataset()
            return self._dataset
        return self.adapter.get_tf_dataset()

    def sample(self, n: int) -> tuple:
        if self.generator:  # peeked batches, put back by Keras's adapter
            first = _keras.peeked_batches(self.adapter)
            batches = [tuple(tf.nest.map_structure(tf.convert_to_tensor, b)) for b in first]
            rows = tf.nest.map_structure(lambda *t: tf.concat(t, 0)[:n], *batches)
            return self.materialize(rows)
        return super().sample(n)

    def on_epoch_begin(self) -> None:
        self.adapter.on_epoch_begin()

    def on_epoch_end(self) -> None:
        self.adapter.on_epoch_end()


def _with_y_check(generator):
    first = next(generator, None)
    if first is None:
        raise DatasetError("Expected a generator that yields batches. Received: an empty one.")
    if isinstance(first, tuple) and len(first) not in (1, 2, 3):
        raise DatasetError(
            "Expected the generator to yield (x, y) or (x, y, sample_weight) tuples, or x "
            f"alone. Received: a tuple of {len(first)} items.")
    def restored():
        # Lists of inputs as tuples, as for arrays (Keras's generator adapter would
        # refuse a list in its output signature).
        yield keras.tree.lists_to_tuples(first)
        for batch in generator:
            yield keras.tree.lists_to_tuples(batch)

    return restored()


def get_input(x: Any, y: Any = None, sample_weight: Any = None, *, shuffle: bool | str = True,
              class_weight: dict | None = None, name: str = "x",
              model: keras.Model | None = None) -> InputAdapter:
    """The adapter for ``x`` (and ``y``, ``sample_weight`` when ``x`` is an array);
    ``model`` tells a dataset of batches from one of examples where nothing else does."""
    if isinstance(x, tf.data.Dataset):
        _only_x(name, y, sample_weight, "a tf.data.Dataset")
        return DatasetInput(x, class_weight=class_weight, name=name, model=model)
    if isinstance(x, (keras.utils.PyDataset, types.GeneratorType)):
        _only_x(name, y, sample_weight, type(x).__name__)
        return KerasInput(x, shuffle=shuffle, class_weight=class_weight)
    if isinstance(x, tuple) and y is None and sample_weight is None:
        # The tuple form fit_large_batch(model, (x, y[, w]), ...) of earlier releases.
        if len(x) not in (2, 3):
            raise DatasetError(
                f"Expected `{name}` to be (x, y) or (x, y, sample_weight). Received: a tuple "
                f"of {len(x)} items. {_HINT}")
        x, y, *rest = x
        sample_weight = rest[0] if rest else None
    if isinstance(x, (np.ndarray, tf.Tensor, dict, list, tuple)) or hasattr(x, "__array__"):
        return ArrayInput(x, y, sample_weight, shuffle=shuffle, class_weight=class_weight,
                          name=name)
    raise DatasetError(f"Expected `{name}` to be arrays or a dataset. Received: {describe(x)}. "
                       f"{_HINT}")


def _only_x(name, y, sample_weight, what):
    for arg, value in (("y", y), ("sample_weight", sample_weight)):
        if value is not None:
            raise DatasetError(
                f"Expected no `{arg}` when `{name}` is {what}. Received: {arg}=... Put the "
                f"{'targets' if arg == 'y' else 'weights'} in the elements of `{name}`.")
