"""What ``check`` reports (:class:`CheckReport`), and what can make a split differ from
the whole batch (:class:`Culprit`): layers that normalise, draw random numbers or mix
examples per micro-batch, losses that are not sums over examples, a step of the model's
own."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, NamedTuple

import keras

from autosplit.keras_hooks import internals as _keras
from autosplit.keras_hooks.custom_step import overridden_steps

__all__ = ["CheckReport", "Culprit", "VariableDifference", "static_culprits",
           "unreduced_culprits"]

BATCH_NORM = "normalises each micro-batch with its own statistics (ghost batch norm); its " \
    "moving statistics are pooled exactly over the large batch and updated once by " \
    "fit_large_batch (batch_norm='pooled', the default)"
RANDOM = "draws random numbers per micro-batch: the split equals the full batch in " \
    "distribution, not bitwise"
MIXES = "mixes examples across the batch, and draws random numbers per micro-batch"
ADDED = "losses added in call() (add_loss): the split is exact for a mean over the " \
    "micro-batch's examples (padding rows never reach the model), not for a loss summed " \
    "over the batch or one that mixes examples"
PER_BATCH = "returns one value per batch, not one per example: autosplit feeds it the " \
    "real rows of each micro-batch and weighs each value by them, which is exact for a " \
    "mean over the batch's examples, not for a loss that mixes them"
OWN_STEP = "overrides"
HINT = "The split differs from the full batch but no known layer explains it: a layer " \
    "mixes examples across the batch, e.g. attention over the batch axis or a custom " \
    "layer calling reduce_* over axis 0 (batch statistics, a batch-wise softmax)."

_RATE_LAYERS = {  # random layer -> the attribute that switches it off at 0
    keras.layers.Dropout: "rate",  # SpatialDropout1D/2D/3D subclass Dropout
    keras.layers.GaussianDropout: "rate",
    keras.layers.AlphaDropout: "rate",
    keras.layers.GaussianNoise: "stddev",
}
_MIXING_LAYERS = ("MixUp", "CutMix")


class Culprit(NamedTuple):
    """A layer (or loss, or model) that can make the split differ from the full batch."""

    name: str  # layer.name, the loss's name, or the model's name
    class_name: str
    reason: str


class VariableDifference(NamedTuple):
    """How far one variable's split gradient is from its full-batch gradient."""

    path: str  # variable.path
    relative_difference: float  # max|g_split - g_full| / max|g_full| (floored, see check)


@dataclasses.dataclass(frozen=True)
class CheckReport:
    """What ``check`` found; immutable and JSON-serialisable (``to_dict``/``to_json``).

    ``max_relative_difference`` and ``loss_split`` are None when the split step could
    not run at all (a compiled loss with ``reduction=None``). For a model with its own
    ``train_step`` (or ``compute_loss``) the reference is that step on the whole batch,
    its ``apply_gradients`` caught: ``loss_full`` is the ``"loss"`` it logs (None if it
    logs none), ``loss_split`` None (each micro-batch's step logs its own), and
    ``decomposes`` is what the gradients say.
    """

    batch_size: int
    micro_batch_size: int
    accumulation_steps: int
    tolerance: float
    exact: bool  # max_relative_difference <= tolerance
    max_relative_difference: float | None
    loss_full: float | None
    loss_split: float | None
    decomposes: bool  # every compiled loss is a per-example sum, checked empirically too
    loss_decomposition_difference: float | None  # same predictions, whole vs micro-batches
    per_variable: tuple[VariableDifference, ...]
    culprits: tuple[Culprit, ...]
    hint: str | None  # set when not exact and no culprit explains it
    # a batch of padded sequences: whether the model ignores padding (fit_large_batch
    # then cuts by length) and why; None for a batch without rows padded at their end
    padding: str | None = None
    # mixed_float16: a float16 gradient within 2x of float16's overflow at the current
    # loss scale on this batch (where a full batch and a split could decide an overflow
    # apart); None where none comes that close
    float16: str | None = None
    # a loss over the whole batch (in-batch negatives, a statistic of the batch):
    # fit_large_batch trains it exactly with the whole-batch step, outputs first, which
    # this split (its gradients summed over micro-batches) is not; None for a sum over rows
    step: str | None = None

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["per_variable"] = [v._asdict() for v in self.per_variable]
        data["culprits"] = [c._asdict() for c in self.culprits]
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    def format(self, *, worst: int = 5) -> str:
        """A short report for people; ``worst`` variables are listed."""
        def number(value: float | None) -> str:
            return "n/a" if value is None else f"{value:.3g}"

        verdict = "exact" if self.exact else "NOT exact"
        if self.step and not self.exact:
            verdict += " summed; fit_large_batch's whole-batch step is exact"
        lines = [
            f"split       batch {self.batch_size} = {self.accumulation_steps} micro-batch(es) "
            f"of {self.micro_batch_size}",
            f"gradients   max relative difference {number(self.max_relative_difference)} "
            f"(tolerance {self.tolerance:.0e}): {verdict}",
            f"loss        full {number(self.loss_full)}, split {number(self.loss_split)}; "
            f"sum over examples: {'yes' if self.decomposes else 'NO'}",
        ]
        if self.culprits:
            lines.append("culprits")
            groups: dict[tuple[str, str], list[str]] = {}
            for c in self.culprits:
                groups.setdefault((c.class_name, c.reason), []).append(c.name)
            for (class_name, reason), names in groups.items():
                shown = ", ".join(names[:3]) + (
                    f" and {len(names) - 3} more" if len(names) > 3 else "")
                lines.append(f"  {shown} ({class_name}): {reason}")
        else:
            lines.append("culprits    none known")
        ranked = sorted(self.per_variable, key=lambda v: -v.relative_difference)[:worst]
        if ranked and not self.exact:
            lines.append("largest differences")
            lines += [f"  {v.relative_difference:9.2e}  {v.path}" for v in ranked]
        if self.step:
            lines.append(f"step        {self.step}")
        if self.padding:
            lines.append(f"padding     {self.padding}")
        if self.float16:
            lines.append(f"float16     {self.float16}")
        if self.hint:
            lines.append(f"hint        {self.hint}")
        return "\n".join(lines)


def static_culprits(model: keras.Model) -> list[Culprit]:
    """What the model's structure alone says cannot match: its layers, and a train step
    or loss of its own (compared here through the compiled loss only)."""
    culprits = layer_culprits(model)
    for method in overridden_steps(model):
        culprits.append(Culprit(
            model.name, type(model).__name__,
            f"{OWN_STEP} `{method}`: fit_large_batch runs the model's own step once per "
            "micro-batch, exact only where its loss is a mean or sum over the examples "
            "kept apart (not a similarity matrix of the batch, SimCLR's, or a "
            "cross-correlation over it, Barlow Twins')"))
    return culprits


def unreduced_culprits(model: keras.Model) -> list[Culprit]:
    """Compiled losses that are not reduced to a sum over examples (cannot be split)."""
    return [Culprit(f.loss.name, type(f.loss).__name__,
                    f"reduction={f.loss.reduction!r}: the loss is not reduced to a sum over "
                    "examples, so it cannot be split")
            for f in _keras.flat_losses(model)
            if getattr(f.loss, "reduction", None) in (None, "none")]


def layer_culprits(model: keras.Model) -> list[Culprit]:
    """Layers that, active in training, make micro-batches differ from the batch."""
    found = []
    for layer in _keras.flatten_layers(model)[1:]:
        name, cls = layer.name, type(layer).__name__
        mro = [c.__name__ for c in type(layer).__mro__]
        if any("BatchNorm" in c for c in mro):
            # Keras 3 normalises with the moving statistics when the layer is frozen.
            if layer.trainable:
                found.append(Culprit(name, cls, BATCH_NORM))
        elif any(c in _MIXING_LAYERS for c in mro):
            found.append(Culprit(name, cls, MIXES))
        elif any(isinstance(layer, c) for c in _RATE_LAYERS):
            attribute = next(a for c, a in _RATE_LAYERS.items() if isinstance(layer, c))
            if float(getattr(layer, attribute, 1.0)) > 0:
                found.append(Culprit(name, cls, RANDOM))
        elif any(isinstance(v, keras.random.SeedGenerator) for v in vars(layer).values()):
            found.append(Culprit(name, cls, RANDOM))
    return found
