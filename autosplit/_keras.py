"""The few Keras 3 internals autosplit relies on, in one place.

autosplit must reproduce exactly what ``model.fit`` does on a full batch, and Keras
keeps some of that behind private attributes (the compiled loss's flat list of
per-output losses, the compiled metrics, the loss tracker, the symbolic build).
Every such access lives here so that a Keras upgrade touches one file; each
function says what it reads. Checked against Keras 3.x up to 3.15 (TensorFlow 2.21).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import keras
from keras.src import tree
from keras.src.losses.loss import squeeze_or_expand_to_same_rank

__all__ = [
    "FlatLoss",
    "build_model",
    "flat_losses",
    "get_keras_mask",
    "loss_tracker",
    "metric_lists",
    "resolve_path",
    "squeeze_or_expand_to_same_rank",
]


class FlatLoss(NamedTuple):
    """One compiled loss: where its output sits and how it is weighted."""

    path: tuple  # keys/indices into y_true and y_pred; () for a single output
    loss: keras.losses.Loss
    weight: float | None  # `loss_weights` entry, None when not given


def get_keras_mask(x: Any) -> Any:
    """The Keras mask carried by a tensor (``_keras_mask``), or None."""
    return keras.backend.get_keras_mask(x) if hasattr(keras.backend, "get_keras_mask") else (
        getattr(x, "_keras_mask", None))


def build_model(model: keras.Model, data_batch: tuple) -> None:
    """Build the model, its compiled loss and metrics and the optimizer, symbolically.

    ``model.fit`` does the same before it traces its train function
    (``Trainer._symbolic_build``); nothing is computed and no state changes.
    """
    model._symbolic_build(data_batch=data_batch)
    if model.optimizer is not None and not model.optimizer.built:
        model.optimizer.build(model.trainable_variables)


def flat_losses(model: keras.Model) -> list[FlatLoss]:
    """The compiled loss as a flat list, in Keras's own order (``CompileLoss._flat_losses``)."""
    compile_loss = getattr(model, "_compile_loss", None)
    if compile_loss is None:
        return []
    flat = getattr(compile_loss, "_flat_losses", None)
    if flat is None:
        raise RuntimeError(
            "autosplit could not read the compiled loss of this Keras version "
            f"({keras.__version__}): `model._compile_loss` has no `_flat_losses`."
        )
    return [FlatLoss(tuple(entry[0]), entry[1], entry[2]) for entry in flat]


def metric_lists(model: keras.Model) -> tuple[list, list, Any]:
    """(unweighted, weighted, flatten_fn) of the compiled metrics, one entry per output.

    ``metrics=`` entries get no sample weight from Keras; ``weighted_metrics=`` do.
    """
    compile_metrics = getattr(model, "_compile_metrics", None)
    if compile_metrics is None or not compile_metrics.built:
        return [], [], tree.flatten
    return (
        list(compile_metrics._flat_metrics),
        list(compile_metrics._flat_weighted_metrics),
        compile_metrics._flatten_y,
    )


def loss_tracker(model: keras.Model) -> keras.metrics.Metric | None:
    """The ``Mean`` metric behind the ``loss`` entry of the logs."""
    return getattr(model, "_loss_tracker", None)


def resolve_path(path: tuple, obj: Any) -> Any:
    """``obj[path[0]][path[1]]...``, as ``CompileLoss`` resolves an output."""
    for key in path:
        obj = obj[key]
    return obj
