"""Typed errors raised by autosplit.

Every error subclasses a builtin (``ValueError``, ``TypeError``, ``RuntimeError``,
``MemoryError``) so ``except ValueError`` in user code keeps working, and every
message says what was expected, what was received and how to fix it. All argument
errors are raised before any model, optimizer or metric state changes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

__all__ = [
    "ArgumentError",
    "AutosplitError",
    "BatchSizeError",
    "DatasetError",
    "MemoryLimitError",
    "ModelNotReadyError",
    "NothingFitsError",
    "UnsupportedModelError",
    "WorkerLostError",
]


class AutosplitError(Exception):
    """Base class of every error autosplit raises on purpose."""


class ArgumentError(AutosplitError, ValueError):
    """An argument is outside the values it takes (``epochs=0``, ``verbose=3``...).

    Raised for ``epochs``, ``initial_epoch``, ``steps_per_epoch``, ``validation_steps``,
    ``validation_freq``, ``validation_split``, ``verbose``, ``shuffle``, ``jit_compile``
    and the choices (``on_oom``, ``batch_norm``, ``objective``). Sizes, the data and the
    memory settings have their own types: :class:`BatchSizeError`,
    :class:`DatasetError` and :class:`MemoryLimitError`.
    """


class BatchSizeError(AutosplitError, ValueError):
    """A batch or micro-batch size is not a positive integer, or does not divide as needed."""


class ModelNotReadyError(AutosplitError, ValueError):
    """The model is not compiled, has no optimizer or loss, or has no trainable weights."""


class UnsupportedModelError(AutosplitError, TypeError):
    """The model cannot be split exactly (custom ``train_step``, unreduced loss...)."""


class DatasetError(AutosplitError, ValueError):
    """The data's structure, shapes or row counts do not make ``(x, y[, sample_weight])`` rows."""


class MemoryLimitError(AutosplitError, ValueError):
    """A memory setting (``memory_limit``, ``headroom``) is invalid, or the limit too small."""


class WorkerLostError(AutosplitError, RuntimeError):
    """Another worker of a multi-worker run died or stopped answering mid-step."""


class NothingFitsError(AutosplitError, MemoryError):
    """Not even a micro-batch of one example fits in the memory budget."""

    def __init__(self, message: str, *, bytes_per_example: int | None = None,
                 budget_bytes: int | None = None) -> None:
        super().__init__(message)
        self.bytes_per_example = bytes_per_example
        self.budget_bytes = budget_bytes


def describe(value: object) -> str:
    """Short ``repr`` for error messages: type and value, truncated."""
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{text} (type {type(value).__name__})"


def said(error: BaseException) -> str:
    """An error's type and its own line: a traced function's error ends with it, after
    the trace."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip() and not (
        line.lstrip().startswith(("File ", "Graph execution", "Detected at", "in user code"))
        or line.startswith(("\t", "        ")))]
    return f"{type(error).__name__}: {lines[-1] if lines else ''}"


@contextlib.contextmanager
def refusing(expected: str, received: str, fix: str) -> Iterator[None]:
    """A model's own error raised inside becomes an :class:`UnsupportedModelError` that
    says what autosplit did to its inputs, with the model's error as its ``__cause__``.

    A model's error (a reshape that fixes the batch size, a step that reads positions
    along the rows) is a refusal like any other: ``except UnsupportedModelError`` catches
    it, however many of our frames it passes. Our own errors say why already, and an
    out-of-memory error is the search's to catch: both pass as they are.
    """
    import tensorflow as tf  # the errors above stay importable without it

    try:
        yield
    except (AutosplitError, tf.errors.ResourceExhaustedError):
        raise
    except (ValueError, TypeError, IndexError, tf.errors.OpError) as error:
        raise UnsupportedModelError(
            f"Expected {expected}. Received: {received}, and it failed there with "
            f"{said(error)} (this error's __cause__). {fix}") from error


def check_choice(name: str, value: Any, choices: tuple[Any, ...]) -> Any:
    """``value`` if it is one of ``choices`` (of the same type: True is not 1), else
    an ``ArgumentError`` that lists them."""
    if not any(type(value) is type(c) and value == c for c in choices):
        raise ArgumentError(
            f"Expected `{name}` to be one of {', '.join(repr(c) for c in choices)}. "
            f"Received: {name}={describe(value)}.")
    return value
