"""Everything autosplit keeps on a user's model, under one key that follows ``compile()``.

Keras drops ``model.train_function`` in ``compile()``: whatever was built from the
compile state goes with it. autosplit builds three things from that state and keeps
them on the model so that a second call traces nothing new: the compiled train steps
(one per batch size), the loss plans (``autosplit.step.loss_plan.loss_plan``) and the
validation evaluator. They live in one :class:`ModelState`, stored on the model, with
one :class:`CompileKey`. Any change of the key drops all of it, and the next call
builds afresh: never a stale step.

The key holds, by identity, what ``compile()`` replaces and what the step captured:

- the loss tracker (``compile()`` makes a new one every time, whatever it is passed),
- the compiled loss (with its ``loss_weights``) and the compiled metrics,
- the optimizer,
- the trainable variables, in order (``layer.trainable = False`` changes them, with or
  without a recompile: a step traced for other variables would apply the wrong ones).

Within one state, train steps are keyed on the batch size, on ``jit_compile`` and
``run_eagerly`` as resolved for the call (``autosplit.step.compiled.Compilation``), and on
the ``batch_norm`` mode (:func:`step_key`).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field
from typing import Any

import keras

from autosplit.keras_hooks import internals as _keras
from autosplit.step.compiled import Compilation

__all__ = ["CompileKey", "ModelState", "model_state", "step_key"]

_ATTR = "_autosplit_state"


@dataclass(frozen=True, eq=False)
class CompileKey:
    """What a model's autosplit state was built from (objects compared by identity)."""

    loss_tracker: Any
    compile_loss: Any
    compile_metrics: Any
    optimizer: Any
    trainable: tuple  # the trainable variables, in order

    @classmethod
    def of(cls, model: keras.Model) -> CompileKey:
        """The key of ``model`` now."""
        loss_tracker, compile_loss, compile_metrics = _keras.compile_state(model)
        return cls(
            loss_tracker=loss_tracker,
            compile_loss=compile_loss,
            compile_metrics=compile_metrics,
            optimizer=getattr(model, "optimizer", None),
            trainable=tuple(model.trainable_variables) if model.built else (),
        )

    def matches(self, other: CompileKey) -> bool:
        objects = ("loss_tracker", "compile_loss", "compile_metrics", "optimizer")
        return (all(getattr(self, name) is getattr(other, name) for name in objects)
                and len(self.trainable) == len(other.trainable)
                and all(a is b for a, b in zip(self.trainable, other.trainable, strict=True)))


@dataclass(eq=False)
class ModelState:
    """What autosplit built for one model under one :class:`CompileKey`."""

    key: CompileKey
    steps: dict = field(default_factory=dict)  # step_key(...) -> TrainStep
    plans: dict = field(default_factory=dict)  # repr of (x, y, sample_weight) specs -> LossPlan
    evaluator: Any = None  # autosplit.step.evaluate.Evaluator
    # (batch_size, micro_batch_size, jit_compile) -> the size whose trial step ran in a
    # child process (autosplit.search.isolation.checked_micro_batch)
    checked: dict = field(default_factory=dict)


def step_key(batch_size: int, compilation: Compilation, batch_norm: str = "pooled",
             noise_scale: bool = False) -> tuple[int, bool, bool, str, bool]:
    """A train step's key within a state."""
    return (batch_size, compilation.jit_compile, compilation.run_eagerly, batch_norm,
            noise_scale)


def model_state(model: keras.Model) -> ModelState:
    """The model's state for its compile state now; a fresh one if anything changed."""
    key = CompileKey.of(model)
    state = model.__dict__.get(_ATTR)
    if state is not None and state.key.matches(key):
        return state
    if state is not None:
        # The old steps' compiled functions hold their float32 sums in reference
        # cycles: free them before the new step allocates its own.
        model.__dict__.pop(_ATTR)
        del state
        gc.collect()
    state = ModelState(key)
    model.__dict__[_ATTR] = state
    return state
