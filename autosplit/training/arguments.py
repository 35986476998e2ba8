"""Argument checks for every public entry point, in one place.

Each public function validates its arguments once, here, before any model, optimizer,
metric or cache state changes; every error says what was expected, what was received
and how to fix it, and subclasses a builtin (``autosplit.errors``). The warnings about
what a split cannot make equal to the full batch (:func:`warn_if_inexact`) live here too.
"""

from __future__ import annotations

import dataclasses
import types
from typing import TYPE_CHECKING, Any

import keras
import tensorflow as tf

from autosplit.data.split import check_size
from autosplit.errors import (
    ArgumentError,
    BatchSizeError,
    DatasetError,
    ModelNotReadyError,
    check_choice,
    describe,
)
from autosplit.keras_hooks import internals as _keras
from autosplit.keras_hooks.batchnorm import MODES
from autosplit.keras_hooks.checks import check_model, check_trainable
from autosplit.memory.device import check_headroom
from autosplit.search.policy import OBJECTIVES
from autosplit.warn import warn_user

if TYPE_CHECKING:
    from autosplit.data.adapter import InputAdapter

__all__ = [
    "check_choice",
    "check_compiled_loss",
    "check_count",
    "check_fraction",
    "check_initial_epoch",
    "check_model",
    "check_optional_count",
    "check_optional_size",
    "check_size",
    "check_trainable",
    "check_verbose",
    "warn_if_inexact",
]


def check_verbose(verbose: Any) -> int:
    """``"auto"`` -> 1; 0, 1 and 2 as themselves."""
    if verbose == "auto":
        return 1
    if verbose in (0, 1, 2) and not isinstance(verbose, bool):
        return int(verbose)
    raise ArgumentError(
        f"Expected `verbose` to be 'auto', 0, 1 or 2. Received: verbose={describe(verbose)}.")


def check_optional_size(name: str, value: Any) -> int | None:
    return None if value is None else check_size(name, value)


def check_count(name: str, value: Any) -> int:
    """A positive whole number of epochs or steps: the test of ``check_size``, which is
    for numbers of examples, with an error of its own.

    >>> check_count("epochs", 3)
    3
    """
    try:
        return check_size(name, value)
    except BatchSizeError:
        raise ArgumentError(
            f"Expected `{name}` to be a positive integer. Received: {name}={describe(value)}. "
            f"Pass a whole number such as {name}=1.") from None


def check_optional_count(name: str, value: Any) -> int | None:
    return None if value is None else check_count(name, value)


def check_fraction(name: str, value: Any, *, upper_open: bool = True) -> float:
    """A float in [0, 1) (or [0, 1] with ``upper_open=False``)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok:
        ok = 0 <= value < 1 if upper_open else 0 <= value <= 1
    if not ok:
        raise ArgumentError(
            f"Expected `{name}` to be a number in [0, 1{')' if upper_open else ']'}. "
            f"Received: {name}={describe(value)}. Pass a fraction such as {name}=0.2.")
    return float(value)


def check_initial_epoch(initial_epoch: Any, epochs: int) -> int:
    """An int >= 0; at or past ``epochs`` the call trains nothing, as ``model.fit``
    (a resumed script run again after its last epoch)."""
    if isinstance(initial_epoch, bool) or not isinstance(initial_epoch, int) or (
            initial_epoch < 0):
        raise ArgumentError(
            f"Expected `initial_epoch` to be an int >= 0 (epochs={epochs}). "
            f"Received: initial_epoch={describe(initial_epoch)}. Pass the number of epochs "
            "already run, 0 for a fresh start.")
    return initial_epoch


def check_compiled_loss(model: Any) -> None:
    """For ``check``: a compiled model (no optimizer step runs). A model compiled with
    ``loss=None`` must add its loss in call(): the loss plan says so when it traces."""
    if not isinstance(model, keras.Model):
        raise ModelNotReadyError(
            f"Expected `model` to be a compiled keras.Model. Received: model={describe(model)}.")
    if not getattr(model, "compiled", False):
        raise ModelNotReadyError(
            "Expected a compiled model. Received: a model that is not compiled. Call "
            "`model.compile(optimizer=..., loss=...)` first.")


def warn_if_inexact(model: keras.Model, *, accumulation_steps: int, rows: int,
                    batch_size: int, pooled: bool, adds_losses: bool,
                    per_batch_losses: bool = False, sparse_gradients: bool = False,
                    batch_norm_in_training: bool = False) -> None:
    """Warn once about what cannot equal the full batch when it is split, or
    ``model.fit`` at all.

    ``rows`` per micro-batch of the global ``batch_size``; ``pooled``: BatchNormalization
    statistics pooled over the large batch; ``adds_losses``: the model adds losses in
    ``call()``; ``per_batch_losses``: a compiled loss returns one value per batch
    that is not a plain mean over the batch's rows (``reduction.mean_over_rows``);
    ``sparse_gradients``: a gradient is ``tf.IndexedSlices`` (an ``Embedding``'s);
    ``batch_norm_in_training``: a BatchNormalization layer normalises with the batch's
    statistics in the step (a frozen one, or one a custom step calls without
    ``training=True``, does not). The
    warnings name the user's line (``autosplit.warn``).
    """
    optimizer = getattr(model.optimizer, "inner_optimizer", model.optimizer)
    clipping = [name for name in ("clipvalue", "clipnorm", "global_clipnorm")
                if getattr(optimizer, name, None) is not None]
    if sparse_gradients and (clipping or not isinstance(optimizer, keras.optimizers.SGD)):
        # Keras applies sparse gradients per occurrence of a row; autosplit's are dense.
        how = (f" with {' and '.join(clipping)} set. Keras clips a sparse gradient per "
               "occurrence of a row (each occurrence's value clipped, or counted apart in "
               "the norm), not the sum of a row's occurrences" if clipping else
               ". Keras applies a sparse gradient to such an optimizer per occurrence of a "
               "row (Adam's second moment adds the square of each occurrence's gradient, "
               "not the square of their sum)")
        warn_user(
            "This model's Embedding layers get sparse gradients (tf.IndexedSlices) and "
            f"its optimizer is {type(optimizer).__name__}{how}; autosplit sums every "
            "micro-batch into one dense gradient, the batch's true gradient, so its "
            "updates of rows that occur more than once differ from model.fit's, even "
            "without a split. With SGD without clipping the two agree.")
    if accumulation_steps > 1 and per_batch_losses:
        warn_user(
            "A loss of this model (compiled, or the one its train_step differentiates) "
            "returns one value per batch, not one per example. autosplit weighs each "
            "micro-batch's value by its share of the "
            "batch's real rows: equal to the full batch for a mean over the batch's rows, "
            "not for another ratio (sum(loss * mask) / sum(mask), a mean over tokens) "
            "nor for a loss that mixes the batch's rows (a similarity matrix of the "
            "batch, as a supervised-contrastive loss builds). "
            "Return per-example values (shape (batch,) or (batch, ...)) and mask with "
            "sample_weight or ignore_class, or run autosplit.check(model, x, y, "
            "micro_batch_size=...) to compare with the full batch.")
    if accumulation_steps > 1 and batch_norm_in_training:
        moving = ("their moving statistics are updated once per large batch with the "
                  "exactly pooled statistics of all its micro-batches, as on the whole "
                  "batch" if pooled else
                  "their moving statistics are updated once per micro-batch "
                  "(batch_norm='micro'), not once per large batch")
        warn_user(
            "This model has BatchNormalization layers in training mode: they normalise "
            f"each micro-batch of {rows} with its own statistics (ghost batch norm), "
            f"not the whole batch of {batch_size}, and gradients are exact for that "
            f"computation; {moving}.")
    if accumulation_steps > 1:
        _warn_recurrent_float16(model)
    if accumulation_steps > 1 and adds_losses:
        warn_user(
            "This model adds losses in call() (add_loss or activity regularizers). "
            "autosplit counts a loss that is a sum over the rows (a vector of one value "
            "per example, which Keras sums, or ops.sum of per-row values) whole per "
            "micro-batch, and weighs any other by the micro-batch's share of the batch's "
            "real rows, which equals the full batch for a mean over the rows (as Keras's "
            "activity regularizers are) but not for a sum it cannot see as one (it comes "
            "out k times smaller) nor for a loss that mixes examples (a product of batch "
            "means, as a mixture of experts' load-balancing loss). Run "
            "autosplit.check(model, x, y, micro_batch_size=...) to compare with the full "
            "batch.")


def _warn_recurrent_float16(model: keras.Model) -> None:
    """Warn where a recurrent layer computes in float16: its overflow is not decided as
    the full batch's (``autosplit.step.overflow``)."""
    recurrent = [layer.name for layer in _keras.flatten_layers(model)
                 if isinstance(layer, keras.layers.RNN) and layer.compute_dtype == "float16"]
    if recurrent:
        warn_user(
            f"This model's recurrent layers ({', '.join(recurrent[:3])}) compute in float16 "
            "(mixed_float16). The full batch's loop adds each time step's float16 gradient "
            "sum over all its rows in float32, and overflows where one step's sum does; "
            "autosplit's micro-batches sum fewer rows a step, and it cannot tell a step's "
            "sum from their total: where one step would overflow the full batch and not a "
            "micro-batch, it applies a large batch that model.fit skips, and the loss scale "
            "takes another path from there.")


# ---------------------------------------------------------------- fit_large_batch's


@dataclasses.dataclass(frozen=True)
class Args:
    """``fit_large_batch``'s arguments, checked (:func:`validate_fit`)."""

    batch_size: int
    micro_batch_size: int | None  # None: "auto"
    epochs: int
    verbose: int
    initial_epoch: int
    steps_per_epoch: int | None
    validation_steps: int | None
    validation_batch_size: int | None
    validation_freq: int
    validation_split: float
    on_oom: str
    batch_norm: str
    by_length: bool | None = None  # None: "auto"
    micro_batch_tokens: int | str | None = "auto"  # an int, "auto" or None
    noise_scale: bool = False  # estimate the gradient noise scale


def validate_fit(model: Any, given: dict[str, Any]) -> Args:
    """Every argument check, before anything changes."""
    batch_size = check_size("batch_size", given["batch_size"])
    micro = given["micro_batch_size"]
    micro = None if (isinstance(micro, str) and micro == "auto") else check_size(
        "micro_batch_size", micro)
    epochs = check_count("epochs", given["epochs"])
    check_choice("on_oom", given["on_oom"], ("recover", "raise"))
    check_choice("batch_norm", given["batch_norm"], MODES)
    check_choice("objective", given["objective"], OBJECTIVES)
    check_choice("by_length", given["by_length"], ("auto", True, False))
    check_choice("noise_scale", given["noise_scale"], (True, False))
    tokens = given["micro_batch_tokens"]
    if not (tokens is None or (isinstance(tokens, str) and tokens == "auto")
            or (type(tokens) is int and tokens >= 1)):
        raise ArgumentError(
            "Expected `micro_batch_tokens` to be a positive integer (tokens, rows x padded "
            "length, per micro-batch), 'auto' or None. Received: "
            f"micro_batch_tokens={describe(tokens)}. Pass e.g. micro_batch_tokens=8192.")
    if given["shuffle"] not in (True, False, "batch"):
        raise ArgumentError(f"Expected `shuffle` to be True, False or 'batch'. Received: "
                            f"shuffle={describe(given['shuffle'])}.")
    if isinstance(given["y"], int) and not isinstance(given["y"], bool):
        raise ArgumentError(
            f"Expected targets as the third argument. Received: y={given['y']}. Pass the "
            "batch size by name: fit_large_batch(model, x, y, batch_size=...).")
    args = Args(
        batch_size=batch_size,
        micro_batch_size=micro,
        epochs=epochs,
        verbose=check_verbose(given["verbose"]),
        initial_epoch=check_initial_epoch(given["initial_epoch"], epochs),
        steps_per_epoch=check_optional_count("steps_per_epoch", given["steps_per_epoch"]),
        validation_steps=check_optional_count("validation_steps", given["validation_steps"]),
        validation_batch_size=check_optional_size("validation_batch_size",
                                                  given["validation_batch_size"]),
        validation_freq=check_count("validation_freq", given["validation_freq"]),
        validation_split=check_fraction("validation_split", given["validation_split"]),
        on_oom=given["on_oom"],
        batch_norm=given["batch_norm"],
        by_length=None if given["by_length"] == "auto" else given["by_length"],
        micro_batch_tokens=tokens,
        noise_scale=given["noise_scale"],
    )
    check_headroom(given["headroom"])
    if given["jit_compile"] not in (None, True, False):
        raise ArgumentError(f"Expected `jit_compile` to be None, True or False. Received: "
                            f"jit_compile={describe(given['jit_compile'])}.")
    if isinstance(given["validation_data"], tf.distribute.DistributedDataset):
        raise DatasetError(
            "Expected `validation_data` to be arrays or a tf.data.Dataset: validation reads "
            "its input on every worker. Received: a tf.distribute dataset. Pass the "
            "tf.data.Dataset itself.")
    if args.validation_split and given["validation_data"] is not None:
        warn_user("Both `validation_split` and `validation_data` were given; "
                  "`validation_data` is used, as in model.fit.")
    check_model(model)
    return args


def split_off_validation(x: Any, y: Any, sample_weight: Any, fraction: float
                          ) -> tuple[Any, Any, Any, tuple[Any, ...]]:
    """The last ``fraction`` of the arrays as validation data, as ``model.fit`` splits
    them; ``x`` alone (a model whose loss needs no targets: an autoencoder's own
    train_step, RealNVP) is split alone. A tuple ``x`` is read as ``get_input`` reads it:
    ``(x, y[, sample_weight])`` when neither ``y`` nor ``sample_weight`` is given."""
    if isinstance(x, tuple) and y is None and sample_weight is None and len(x) in (2, 3):
        x, y, *rest = x
        sample_weight = rest[0] if rest else None
    if isinstance(x, (tf.data.Dataset, tf.distribute.DistributedDataset, keras.utils.PyDataset,
                      types.GeneratorType)):
        raise DatasetError(
            "Expected arrays with `validation_split` (model.fit only splits arrays). "
            f"Received: x={describe(x)}. Pass `validation_data=` instead.")
    (x, y, sample_weight), (vx, vy, vw) = _keras.train_validation_split(
        (x, y, sample_weight), fraction)
    if vy is None and vw is None:
        return x, y, sample_weight, (vx,)
    return x, y, sample_weight, (vx, vy) if vw is None else (vx, vy, vw)


def check_input(adapter: InputAdapter, args: Args) -> None:
    if getattr(adapter, "infinite", False) and args.steps_per_epoch is None:
        raise ArgumentError(
            "Expected `steps_per_epoch` with an infinite (repeated) dataset. Received: "
            "steps_per_epoch=None. Pass steps_per_epoch= or drop the `.repeat()`.")
