"""Bitwise save and restore of everything a trial step can change.

The probe and ``check`` run real training steps on the user's model and must leave it
exactly as they found it: weights, BatchNormalization statistics, seed generator
states, optimizer slots and iterations, metric totals.
"""

from __future__ import annotations

import keras
import numpy as np

__all__ = ["Snapshot"]


class Snapshot:
    """Bitwise copy of every model, metric and optimizer variable, to put back later."""

    def __init__(self, model: keras.Model) -> None:
        optimizer = getattr(model, "optimizer", None)
        seen: set[int] = set()
        self.variables = []
        for v in (list(model.variables) + list(model.metrics_variables)
                  + (list(optimizer.variables) if optimizer is not None else [])):
            if id(v) not in seen:
                seen.add(id(v))
                self.variables.append(v)
        self.values = [np.array(v.numpy(), copy=True) for v in self.variables]

    def restore(self) -> None:
        for v, value in zip(self.variables, self.values, strict=True):
            v.assign(value)
