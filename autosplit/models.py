"""Built-in models for the CLI and the demo: small, compiled, no downloads.

``load_model("mlp" | "cnn" | "transformer" | "mobilenet_v2" | "resnet50", input_shape)``
returns a compiled Keras model (Adam, sparse categorical cross-entropy on logits);
``load_model("package.module:function", input_shape)`` calls a user's factory.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import keras

__all__ = ["MODELS", "load_model", "parse_shape"]


def _compile(model: keras.Model) -> keras.Model:
    import keras

    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def mlp(input_shape: Sequence[int], classes: int = 10) -> keras.Model:
    import keras

    inputs = keras.Input(tuple(input_shape))
    h = keras.layers.Flatten()(inputs) if len(input_shape) > 1 else inputs
    for width in (512, 512):
        h = keras.layers.Dense(width, activation="relu")(h)
    return _compile(keras.Model(inputs, keras.layers.Dense(classes)(h), name="mlp"))


def cnn(input_shape: Sequence[int], classes: int = 10) -> keras.Model:
    import keras

    inputs = keras.Input(tuple(input_shape))
    h = inputs
    for filters in (32, 64, 128):
        h = keras.layers.Conv2D(filters, 3, padding="same", activation="relu")(h)
        h = keras.layers.MaxPooling2D()(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    return _compile(keras.Model(inputs, keras.layers.Dense(classes)(h), name="cnn"))


def transformer(input_shape: Sequence[int], classes: int = 10, *, layers: int = 2,
                heads: int = 4) -> keras.Model:
    """A Transformer encoder over (sequence, features) inputs, mean-pooled."""
    import keras

    if len(input_shape) != 2:
        raise ValueError(
            "Expected `input_shape` (sequence_length, features) for the transformer. "
            f"Received: input_shape={tuple(input_shape)}. Example: --input-shape 128,64"
        )
    inputs = keras.Input(tuple(input_shape))
    width = input_shape[-1]
    h = inputs
    for _ in range(layers):
        attention = keras.layers.MultiHeadAttention(heads, max(width // heads, 1))(h, h)
        h = keras.layers.LayerNormalization()(h + attention)
        ff = keras.layers.Dense(4 * width, activation="gelu")(h)
        h = keras.layers.LayerNormalization()(h + keras.layers.Dense(width)(ff))
    h = keras.layers.GlobalAveragePooling1D()(h)
    return _compile(keras.Model(inputs, keras.layers.Dense(classes)(h), name="transformer"))


def _application(name: str) -> Callable[..., keras.Model]:
    def build(input_shape: Sequence[int], classes: int = 10) -> keras.Model:
        import keras

        factory = getattr(keras.applications, name)
        model = factory(weights=None, input_shape=tuple(input_shape), classes=classes,
                        classifier_activation=None)
        return _compile(model)
    build.__name__ = name
    return build


MODELS: dict[str, Callable[..., keras.Model]] = {
    "mlp": mlp,
    "cnn": cnn,
    "transformer": transformer,
    "mobilenet_v2": _application("MobileNetV2"),
    "resnet50": _application("ResNet50"),
}


def parse_shape(text: str) -> tuple[int, ...]:
    """``"224,224,3"`` -> ``(224, 224, 3)``, with a clear error otherwise."""
    try:
        shape = tuple(int(part) for part in str(text).split(","))
    except ValueError:
        shape = ()
    if not shape or any(d < 1 for d in shape):
        raise ValueError(
            "Expected `--input-shape` as positive integers separated by commas, e.g. "
            f"224,224,3. Received: {text!r}."
        )
    return shape


def load_model(spec: str, input_shape: Sequence[int]) -> keras.Model:
    """A built-in model by name, or ``module:function`` returning a compiled model."""
    import keras

    if spec in MODELS:
        return MODELS[spec](input_shape)
    if ":" not in spec:
        raise ValueError(
            f"Expected `--model` to be one of {sorted(MODELS)} or 'module:function'. "
            f"Received: {spec!r}."
        )
    module_name, _, function_name = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(
            f"Expected `--model` 'module:function' to name an importable function. "
            f"Received: {spec!r} ({exc})."
        ) from exc
    try:
        model = factory(tuple(input_shape))
    except TypeError:
        model = factory()
    if not isinstance(model, keras.Model):
        raise ValueError(
            f"Expected {spec} to return a compiled keras.Model. Received: {type(model).__name__}."
        )
    return model

