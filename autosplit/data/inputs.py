"""``get_input``: the adapter (``autosplit.data.adapter``) for whatever ``model.fit``
would take: arrays (``arrays``), a ``tf.data.Dataset`` (``datasets``), a
``keras.utils.PyDataset`` or a generator (``keras_inputs``), a ``tf.distribute``
dataset (``sharded``); and sequences of varying
length, which ``model.fit`` takes only padded: a ``tf.RaggedTensor``, a list of arrays
one per example, or an object array of them, made a dataset of examples that the
pipeline pads per large batch, as ``padded_batch(B)`` pads."""

from __future__ import annotations

import types
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from autosplit.data.adapter import HINT, InputAdapter
from autosplit.data.arrays import ArrayInput
from autosplit.data.datasets import DatasetInput
from autosplit.data.keras_inputs import KerasInput
from autosplit.data.sharded import ShardedInput
from autosplit.errors import DatasetError, describe

__all__ = ["get_input"]

_DISTRIBUTED = {"DistributedDataset": "strategy.experimental_distribute_dataset(...)",
                "DistributedDatasetsFromFunction":
                    "strategy.distribute_datasets_from_function(...)"}


def get_input(x: Any, y: Any = None, sample_weight: Any = None, *, shuffle: bool | str = True,
              class_weight: dict | None = None, name: str = "x",
              model: keras.Model | None = None) -> InputAdapter:
    """The adapter for ``x`` (and ``y``, ``sample_weight`` when ``x`` is an array);
    ``model`` tells a dataset of batches from one of examples where nothing else does."""
    if isinstance(x, tf.distribute.DistributedDataset):
        _only_x(name, y, sample_weight, "a tf.distribute dataset")
        return ShardedInput(x, _DISTRIBUTED.get(type(x).__name__, "tf.distribute dataset"),
                            class_weight=class_weight)
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
                f"of {len(x)} items. {HINT}")
        x, y, *rest = x
        sample_weight = rest[0] if rest else None
    examples = next((len(p) for p in (y, x) if isinstance(p, (np.ndarray, list))), None)
    if any(_varying(member, examples) for part in (x, y, sample_weight)
           for member in _members(part)):
        return DatasetInput(_examples(x, y, sample_weight, shuffle), class_weight=class_weight,
                            name=name, model=model)
    if isinstance(x, (np.ndarray, tf.Tensor, dict, list, tuple)) or hasattr(x, "__array__"):
        return ArrayInput(x, y, sample_weight, shuffle=shuffle, class_weight=class_weight,
                          name=name)
    raise DatasetError(f"Expected `{name}` to be arrays or a dataset. Received: {describe(x)}. "
                       f"{HINT}")


def _varying(part: Any, examples: int | None = None) -> bool:
    """Whether ``part`` holds one sequence per example, of varying length: a
    ``tf.RaggedTensor``, an object array of arrays, or a list of as many arrays as
    ``examples`` (``y``'s rows, where given) whose lengths differ and whose other axes
    agree. A list of one array per model input differs in its other axes, and has as
    many arrays as the model has inputs."""
    if isinstance(part, tf.RaggedTensor):
        return True
    if isinstance(part, np.ndarray):
        return part.dtype == object and part.ndim == 1 and len(part) > 0 and all(
            isinstance(e, (np.ndarray, list)) for e in part)
    if (not isinstance(part, list) or len(part) < 2 or (examples not in (None, len(part)))
            or not all(isinstance(e, (np.ndarray, list)) for e in part)):
        return False
    shapes = [np.shape(e) for e in part]
    return (all(len(s) >= 1 for s in shapes) and len({s[0] for s in shapes}) > 1
            and len({s[1:] for s in shapes}) == 1)


def _members(part: Any) -> list:
    """The inputs of a part: a dict's values or a tuple's items (one per model input, a
    pair's source and target), else the part itself."""
    if isinstance(part, dict):
        return list(part.values())
    return list(part) if isinstance(part, tuple) else [part]


def _examples(x: Any, y: Any, sample_weight: Any, shuffle: bool | str) -> tf.data.Dataset:
    """A dataset of ``(x, y[, sample_weight])`` examples, each sequence as long as it is;
    shuffled once per epoch where ``shuffle`` asks (seeded by NumPy's global generator,
    which ``keras.utils.set_random_seed`` sets)."""
    def column(part):
        if isinstance(part, tf.RaggedTensor):
            return part
        if _varying(part):
            rows = [np.asarray(e) for e in part]
            return tf.RaggedTensor.from_row_lengths(np.concatenate(rows), [len(r) for r in rows])
        return part

    def columns(part):
        if isinstance(part, dict):
            return {name: column(member) for name, member in part.items()}
        return tuple(column(m) for m in part) if isinstance(part, tuple) else column(part)

    parts = tuple(columns(p) for p in (x, y, sample_weight) if p is not None)
    rows = {int(p.nrows()) if isinstance(p, tf.RaggedTensor) else len(p)
            for p in tf.nest.flatten(parts)}
    if len(rows) > 1:
        raise DatasetError(
            f"Expected x, y (and sample_weight) to hold one example each per row. Received: "
            f"{sorted(rows)} rows. Give one sequence per example to each.")
    ds = tf.data.Dataset.from_tensor_slices(parts).map(lambda *row: tf.nest.map_structure(
        lambda t: t.to_tensor() if isinstance(t, tf.RaggedTensor) else t, row))
    if shuffle:
        ds = ds.shuffle(rows.pop(), seed=int(np.random.randint(2**31)),
                        reshuffle_each_iteration=True)
    return ds if len(parts) > 1 else ds.map(lambda row: row)


def _only_x(name, y, sample_weight, what):
    for arg, value in (("y", y), ("sample_weight", sample_weight)):
        if value is not None:
            raise DatasetError(
                f"Expected no `{arg}` when `{name}` is {what}. Received: {arg}=... Put the "
                f"{'targets' if arg == 'y' else 'weights'} in the elements of `{name}`.")
