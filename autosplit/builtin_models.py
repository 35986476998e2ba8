"""Built-in models for the CLI and the demo: small, compiled, no downloads.

``load_model("mlp" | "cnn" | "transformer" | "mobilenet_v2" | "resnet50", input_shape)``
returns a compiled Keras model (Adam, sparse categorical cross-entropy on logits), and
``load_model("lm")`` a causal language model over token ids of any length;
``load_model("package.module:function", input_shape)`` calls a user's factory;
``load_model("path/to/model.keras")`` loads a model saved by ``model.save`` (compiled as
saved; with the built-in default above when it was saved uncompiled).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import keras

__all__ = ["ANY_LENGTH", "MODELS", "is_saved_model", "load_model", "parse_shape",
           "saved_input_shape", "synthetic_targets"]

_SAVED_SUFFIXES = (".keras", ".h5", ".hdf5")


def is_saved_model(spec: str) -> bool:
    """Whether ``--model`` names a file or directory rather than a built-in or factory."""
    import os

    return str(spec).endswith(_SAVED_SUFFIXES) or os.path.isdir(spec)


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


def lm(input_shape: Sequence[int] | None = None, classes: int = 1000, *, layers: int = 2,
       heads: int = 4, width: int = 64) -> keras.Model:
    """A causal Transformer language model over token ids of any length (``classes``
    of them), a per-token loss weighed by ``sample_weight``; ``input_shape`` is unused."""
    import keras

    tokens = keras.Input((None,), dtype="int32")
    h = keras.layers.Embedding(classes, width)(tokens)
    for _ in range(layers):
        attention = keras.layers.MultiHeadAttention(heads, width // heads)(
            h, h, use_causal_mask=True)
        h = keras.layers.LayerNormalization()(keras.layers.Add()([h, attention]))
        ff = keras.layers.Dense(width)(keras.layers.Dense(4 * width, activation="gelu")(h))
        h = keras.layers.LayerNormalization()(keras.layers.Add()([h, ff]))
    model = keras.Model(tokens, keras.layers.Dense(classes)(h), name="lm")
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


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
    "lm": lm,
    "mobilenet_v2": _application("MobileNetV2"),
    "resnet50": _application("ResNet50"),
}


ANY_LENGTH = frozenset({"lm"})  # built-ins over token ids of any length: no input shape


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


def _load_saved(path: str) -> keras.Model:
    import os

    import keras

    if os.path.isdir(path):
        raise ValueError(
            "Expected `--model` to be a model file saved by model.save('model.keras') (or "
            f".h5). Received: the directory {path!r}; Keras 3 loads a SavedModel directory "
            "only for inference (keras.layers.TFSMLayer), which cannot be trained.")
    if not os.path.exists(path):
        raise ValueError(f"Expected `--model` to name an existing file. Received: {path!r}.")
    try:
        model = keras.models.load_model(path)
    except Exception as exc:  # Keras raises many types for a bad file; say which file
        raise ValueError(f"Expected `--model` to be a Keras model file. Received: {path!r}, "
                         f"which Keras could not load ({type(exc).__name__}: {exc}).") from exc
    if not getattr(model, "compiled", False) or model.optimizer is None:
        model = _compile(model)
    return model


def saved_input_shape(model: keras.Model) -> tuple[int, ...]:
    """The example shape of a loaded model's one input (without the batch axis)."""
    inputs = getattr(model, "inputs", None) or []
    shape = tuple(inputs[0].shape[1:]) if len(inputs) == 1 else ()
    if not shape or any(d is None for d in shape):
        raise ValueError(
            "Expected a saved model with one input of a fixed shape, to make synthetic data "
            f"for. Received: inputs {[tuple(i.shape) for i in inputs]}. Pass --input-shape.")
    return tuple(int(d) for d in shape)


def synthetic_targets(model: keras.Model, n: int, classes: int, rng) -> object:
    """Targets that suit the compiled loss: class ids below the output's width for a
    sparse categorical loss, else values shaped like the output (one output only)."""

    outputs = getattr(model, "outputs", None) or []
    if len(outputs) != 1 or outputs[0].shape[-1] is None:
        return rng.integers(0, classes, size=(n,)).astype("int32")
    loss = getattr(model, "loss", None)
    name = str(getattr(loss, "name", loss) or "").lower()
    width = int(outputs[0].shape[-1])
    if "sparse" in name:
        return rng.integers(0, max(1, width), size=(n,)).astype("int32")
    return rng.uniform(size=(n, *tuple(outputs[0].shape[1:]))).astype("float32")


def load_model(spec: str, input_shape: Sequence[int] | None = None) -> keras.Model:
    """A built-in model by name, ``module:function`` returning a compiled model, or a
    model file saved by ``model.save``."""
    import keras

    if is_saved_model(spec):
        return _load_saved(spec)
    if spec in ANY_LENGTH:
        return MODELS[spec]()
    if input_shape is None:
        raise ValueError(
            "Expected `--input-shape` for a built-in or module:function model. Received: "
            "none (only a saved model's shape can be read from it).")
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

