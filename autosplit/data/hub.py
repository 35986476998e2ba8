"""keras_hub Tasks: their preprocessor mapped over the data, as their own ``fit`` maps it.

A ``keras_hub.models.Task`` with a ``preprocessor`` (a tokenizer and packer, an image
converter) takes raw data: strings, images of any size. Its ``fit`` batches arrays by
``batch_size``, or takes a ``tf.data.Dataset`` as it comes, and maps
``task.preprocess_samples`` over the batches (``keras_hub``'s ``PipelineModel.fit``).
:func:`preprocessed` does the same for ``fit_large_batch`` and ``probe``, so the model
sees the token ids ``task.fit`` would give it; autosplit then cuts those batches into
micro-batches as it cuts any batched dataset. As with ``task.fit``, a dataset made
here is not shuffled by ``shuffle=True``: shuffle the data before, or pass a shuffled
``tf.data.Dataset``.
"""

from __future__ import annotations

import types
from typing import Any

import keras
import tensorflow as tf

from autosplit.errors import DatasetError

__all__ = ["preprocessed", "preprocessed_validation", "takes_raw_data"]


def takes_raw_data(model: keras.Model) -> bool:
    """Whether ``model`` is a keras_hub Task (a ``PipelineModel``) with a preprocessor."""
    return (callable(getattr(model, "preprocess_samples", None))
            and getattr(model, "preprocessor", None) is not None)


def preprocessed(model: keras.Model, x: Any, y: Any, sample_weight: Any, batch_size: int,
                 name: str = "x") -> tuple[Any, Any, Any]:
    """``(x, y, sample_weight)`` as a Task that :func:`takes_raw_data` trains on them: a
    dataset of batches of ``batch_size`` rows (arrays) or of the dataset's own batches,
    with ``model.preprocess_samples`` mapped over them; then ``None, None``.

    Raises:
        DatasetError: a generator or ``keras.utils.PyDataset`` (the Task's own ``fit``
            takes arrays or a ``tf.data.Dataset``).
    """
    preprocess = model.preprocess_samples
    if isinstance(x, (types.GeneratorType, keras.utils.PyDataset)):
        raise DatasetError(
            f"Expected `{name}` as arrays or a tf.data.Dataset for "
            f"{type(model).__name__}, whose preprocessor runs in a tf.data map as in its own "
            f"fit(). Received: {type(x).__name__}. Pass a tf.data.Dataset "
            "(tf.data.Dataset.from_generator), or preprocess the data yourself and set "
            "`model.preprocessor = None`.")
    if not isinstance(x, tf.data.Dataset):
        data = keras.utils.pack_x_y_sample_weight(x, y, sample_weight)
        x = tf.data.Dataset.from_tensor_slices(data).batch(batch_size)
    elif y is not None or sample_weight is not None:
        return x, y, sample_weight  # refused by the input adapter, as by model.fit
    return x.map(lambda *element: preprocess(*element),
                 num_parallel_calls=tf.data.AUTOTUNE), None, None


def preprocessed_validation(model: keras.Model, data: Any, batch_size: int) -> Any:
    """``validation_data`` (a tuple of arrays or a dataset) as :func:`preprocessed` makes it."""
    if isinstance(data, tf.data.Dataset):
        return preprocessed(model, data, None, None, batch_size, "validation_data")[0]
    vx, vy, vw = keras.utils.unpack_x_y_sample_weight(data)
    return preprocessed(model, vx, vy, vw, batch_size, "validation_data")[0]
