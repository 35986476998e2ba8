"""Checks of a Keras model that every entry point makes before anything changes: typed
errors that say what was expected, what was received and how to fix it."""

from __future__ import annotations

from typing import Any

import keras

from autosplit.errors import ModelNotReadyError, UnsupportedModelError, describe
from autosplit.keras_hooks.custom_step import has_custom_step

__all__ = ["check_model", "check_trainable"]


def check_model(model: Any) -> None:
    """Raise a typed error, changing nothing, unless ``model`` can be trained split."""
    if not isinstance(model, keras.Model):
        raise ModelNotReadyError(
            f"Expected `model` to be a compiled keras.Model. Received: model={describe(model)}.")
    if getattr(model, "compiled", False) and model.optimizer is None and has_custom_step(model):
        raise UnsupportedModelError(
            f"Expected `{type(model).__name__}` with a custom train_step to be compiled with "
            "an optimizer, which autosplit applies once per large batch. Received: "
            "model.optimizer=None. A step that applies optimizers of its own (a GAN's two) "
            "has no exact split in one pass: train it with model.fit.")
    if not getattr(model, "compiled", False) or model.optimizer is None:
        raise ModelNotReadyError(
            "Expected a compiled model with an optimizer. Received: a model that "
            f"{'is not compiled' if not getattr(model, 'compiled', False) else 'has no optimizer'}"
            ". Call `model.compile(optimizer=..., loss=...)` first.")
    check_trainable(model)


def check_trainable(model: keras.Model) -> None:
    if model.built and not model.trainable_variables:
        raise ModelNotReadyError(
            "Expected a model with trainable weights. Received: a model whose "
            "`trainable_variables` is empty (are all layers frozen?).")
