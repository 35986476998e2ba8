"""Where autosplit builds its ``tf.function``s: the options resolved once, each built once.

Keras compiles its train step in one place (``make_train_function``), with the options
``compile()`` resolved, caches it, and skips ``tf.function`` under ``run_eagerly``.
autosplit does the same here, and every ``tf.function`` of the library comes from this
module:

- :class:`Compilation`: ``jit_compile`` and ``run_eagerly`` as a call asked for them,
  else as ``model.compile`` resolved them (for the train step, its cache key and the
  probe's).
- :class:`FunctionCache`: the compiled functions of a train step (``autosplit.step.train_step``)
  or of validation (``autosplit.step.evaluate``), each built once per key with
  ``reduce_retracing=True``, their traces counted.
- :func:`trace`: a throwaway trace on specs that runs nothing, which the loss plan and
  a custom step's facts are learnt from (``autosplit.step.loss_plan``,
  ``autosplit.keras_hooks.custom_step``).
- :func:`run_once`: a one-off graph function (``autosplit.check``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, NamedTuple

import keras
import tensorflow as tf

__all__ = ["Compilation", "FunctionCache", "run_once"]


class Compilation(NamedTuple):
    """How a model's step is compiled: XLA for each micro-batch, or no graph at all."""

    jit_compile: bool
    run_eagerly: bool

    @classmethod
    def of(cls, model: keras.Model, jit_compile: bool | None = None,
           run_eagerly: bool | None = None) -> Compilation:
        """The options given, each ``None`` resolved as ``model.compile`` resolved it."""
        return cls(bool(model.jit_compile if jit_compile is None else jit_compile),
                   bool(model.run_eagerly if run_eagerly is None else run_eagerly))


class FunctionCache:
    """Compiled functions, each built once per key and reused by every later call.

    Example:
        >>> functions = FunctionCache()
        >>> double = functions.get("double", lambda t: 2 * t)
        >>> int(double(tf.constant(3))), functions.get("double", print) is double
        (6, True)
        >>> functions.tracing_count()
        1
    """

    def __init__(self) -> None:
        self._functions: dict[Hashable, Callable] = {}

    def get(self, key: Hashable, fn: Callable, *, run_eagerly: bool = False,
            jit_compile: bool | None = None) -> Callable:
        """The function under ``key``: ``fn`` compiled the first time (``fn`` itself
        under ``run_eagerly``), whatever ``fn`` later calls pass.

        Without autograph, as Keras compiles its train step (``do_not_convert``): the
        step's loops are ``tf.while_loop`` and ``tf.cond`` already, a model's ``call``
        and a custom ``train_step`` see what ``model.fit`` gives them, and tracing
        skips the source conversion of every function it calls."""
        if key not in self._functions:
            self._functions[key] = fn if run_eagerly else tf.function(
                fn, jit_compile=jit_compile, reduce_retracing=True, autograph=False)
        return self._functions[key]

    def clear(self) -> None:
        """Drop every function (they captured variables that are being replaced)."""
        self._functions.clear()

    def tracing_count(self) -> int:
        """Traces of every function so far (0 under ``run_eagerly``)."""
        return sum(fn.experimental_get_tracing_count() for fn in self._functions.values()
                   if hasattr(fn, "experimental_get_tracing_count"))


def run_once(fn: Callable, *args: Any, autograph: bool = True) -> Any:
    """``fn(*args)`` as a graph function, built for this one call (``autograph=False``:
    a model's own step traced as ``fit_large_batch`` traces it, its errors unwrapped)."""
    return tf.function(fn, autograph=autograph)(*args)
