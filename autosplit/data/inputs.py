"""``get_input``: the adapter (``autosplit.data.adapter``) for whatever ``model.fit``
would take: arrays (``arrays``), a ``tf.data.Dataset`` (``datasets``), a
``keras.utils.PyDataset`` or a generator (``keras_inputs``)."""

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
from autosplit.errors import DatasetError, describe

__all__ = ["get_input"]


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
                f"of {len(x)} items. {HINT}")
        x, y, *rest = x
        sample_weight = rest[0] if rest else None
    if isinstance(x, (np.ndarray, tf.Tensor, dict, list, tuple)) or hasattr(x, "__array__"):
        return ArrayInput(x, y, sample_weight, shuffle=shuffle, class_weight=class_weight,
                          name=name)
    raise DatasetError(f"Expected `{name}` to be arrays or a dataset. Received: {describe(x)}. "
                       f"{HINT}")


def _only_x(name, y, sample_weight, what):
    for arg, value in (("y", y), ("sample_weight", sample_weight)):
        if value is not None:
            raise DatasetError(
                f"Expected no `{arg}` when `{name}` is {what}. Received: {arg}=... Put the "
                f"{'targets' if arg == 'y' else 'weights'} in the elements of `{name}`.")
