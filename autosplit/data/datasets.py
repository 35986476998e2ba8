"""A ``tf.data.Dataset`` of examples or of batches (what its graph says without reading
it is read in ``autosplit.keras_hooks.tf_data``)."""


from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from autosplit.data.adapter import (
    EXAMPLE_CHUNK,
    InputAdapter,
    InputFacts,
    arity,
    check_class_weight_alone,
    check_known_rank,
    check_shared_rows,
    class_weight_fn,
    leading_rows,
    varying_axes,
)
from autosplit.errors import DatasetError
from autosplit.keras_hooks import tf_data
from autosplit.keras_hooks.tf_data import batch_rows, counted_rows, draws_randomness, ends_in_batch

__all__ = ["DatasetInput", "batch_rows", "batched_ancestor", "counted_rows"]


def batched_ancestor(dataset: tf.data.Dataset, model: keras.Model | None = None) -> str | None:
    """How ``dataset``'s elements are known to be batches, or None (they are examples):
    its graph says so (``tf_data.batched_ancestor``), or its elements have ``model``'s own
    input ranks, batch axis included (``from_generator`` or a ``map`` yielding whole
    batches), where the model declares its inputs."""
    found = tf_data.batched_ancestor(dataset)
    if found is None and model is not None and _shaped_as_batches(dataset.element_spec, model):
        return "elements of the model's input ranks"
    return found


def _shaped_as_batches(spec: Any, model: keras.Model) -> bool:
    """Whether ``spec``'s inputs have the ranks of the model's declared inputs, batch axis
    included (an example has one axis fewer)."""
    try:
        inputs = model.inputs  # a functional or Sequential model's Input()s
    except (AttributeError, ValueError):
        return False
    if not inputs:
        return False
    found = arity(spec)
    x = spec[0] if found else spec
    ranks = sorted(leaf.shape.rank if hasattr(leaf, "shape") else -1
                   for leaf in tf.nest.flatten(x))
    return ranks == sorted(len(t.shape) for t in tf.nest.flatten(inputs))


class DatasetInput(InputAdapter):
    """A ``tf.data.Dataset`` of examples or of batches (of any, even varying, size)."""

    def __init__(self, dataset: tf.data.Dataset, *, class_weight: dict | None = None,
                 name: str = "x", model: keras.Model | None = None) -> None:
        spec = dataset.element_spec
        found = arity(spec)
        if found is None:
            raise DatasetError(
                f"Expected `{name}` elements to be (x, y), (x, y, sample_weight) or x alone. "
                f"Received: element_spec={spec}. Map your dataset to such tuples, e.g. "
                "dataset.map(lambda e: (e['features'], e['label'])).")
        composite = [leaf for leaf in tf.nest.flatten(spec) if not isinstance(leaf, tf.TensorSpec)]
        if composite:
            raise DatasetError(
                f"Expected `{name}` elements of dense tensors: autosplit cuts micro-batches "
                f"by rows and pads them. Received: {', '.join(map(str, composite))}. Make "
                "them dense first: `.padded_batch(...)` in place of `.ragged_batch(...)`, "
                "or a map with `x.to_tensor()` (ragged) or `tf.sparse.to_dense(x)`.")
        check_known_rank(spec if found else (spec,), f"`{name}`")
        cardinality = int(dataset.cardinality())
        if cardinality == 0:
            raise DatasetError(f"Expected a non-empty `{name}`. Received: an empty dataset.")
        batched = batched_ancestor(dataset, model) is not None
        check_class_weight_alone(class_weight, found == 3, spec[1] if found >= 2 else None)
        self._class_weight = class_weight_fn(class_weight) if class_weight else None
        self.dataset = dataset
        if batched:
            parts = spec if found else (spec,)
            check_shared_rows(parts, f"`{name}`")
            rows = leading_rows(parts)
            if (len(rows) > 1 and None in rows.values() and not ends_in_batch(dataset)
                    and not draws_randomness(dataset)):
                # Row counts known only at run time: look at one batch now (later ones
                # are checked by the pipeline's rebatch); not where a look would move a
                # seed, nor after a batch(), whose parts share their rows.
                for first in dataset.take(1):
                    check_shared_rows(first if found else (first,), f"`{name}`")
        # Rows of varying shape (sequences of varying length): a padded_batch's, as long
        # as their batch; or examples, each as long as it is, which the pipeline pads
        # per large batch, as padded_batch(B) pads them.
        varying = varying_axes(spec, batched)
        self.facts = InputFacts(
            "batched tf.data.Dataset" if batched else "tf.data.Dataset of examples",
            batched=batched, infinite=cardinality == tf.data.INFINITE_CARDINALITY,
            rows=(counted_rows(dataset) if batched
                  else cardinality if cardinality > 0 else None),
            arity=found, varying=varying,
            lengths_from=("batch" if batched else "example") if varying else None)

    def own_batch_rows(self) -> int | None:
        return batch_rows(self.dataset) if self.batched else None

    def rows_dataset(self, *, shuffle_seed: int | None = None,
                     epoch: int | tf.Variable = 0,
                     batch_size: int | None = None) -> tf.data.Dataset:
        if self.batched:
            # No check of ours per batch: a map over every small batch costs a share of
            # every epoch, and the pipeline's rebatch already refuses a batch whose
            # parts do not share a row count.
            return self.dataset
        if self.rows_vary:  # one row each, padded to nothing: the cut pads them together
            return self.dataset.padded_batch(1)
        return self.dataset.batch(EXAMPLE_CHUNK)
