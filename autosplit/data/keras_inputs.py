"""A ``keras.utils.PyDataset`` or a Python generator, read through Keras's own adapter."""


from __future__ import annotations

import types
from typing import Any

import keras
import tensorflow as tf

from autosplit.data.adapter import (
    InputAdapter,
    InputFacts,
    arity,
    check_shared_rows,
    varying_axes,
)
from autosplit.errors import DatasetError
from autosplit.keras_hooks import internals as _keras

__all__ = ["KerasInput"]


class KerasInput(InputAdapter):
    """A ``keras.utils.PyDataset`` or a Python generator, read through Keras's own adapter."""

    def __init__(self, data: Any, *, shuffle: bool | str,
                 class_weight: dict | None) -> None:
        self.generator = isinstance(data, types.GeneratorType)
        kind = "generator" if self.generator else "keras.utils.PyDataset"
        if self.generator:
            if class_weight is not None:
                raise DatasetError("Expected no `class_weight` with a generator (model.fit "
                                   "refuses it too). Yield (x, y, sample_weight) instead.")
            data = _with_y_check(data)
            shuffle = False  # a generator's order is its own (Keras would warn)
        try:
            self.adapter = _keras.data_adapter(data, shuffle=shuffle, class_weight=class_weight)
        except ValueError as exc:
            raise DatasetError(f"Expected (x, y[, sample_weight]) batches. {exc}") from exc
        self._dataset = None
        spec = self.adapter.get_tf_dataset().element_spec
        found = arity(spec)
        if found is None:
            raise DatasetError(
                f"Expected the {kind} to yield (x, y), (x, y, sample_weight) or x "
                f"alone. Received: batches of {spec}.")
        varying = varying_axes(spec, batched=True)
        self.facts = InputFacts(kind, batched=True, reiterable=not self.generator,
                                arity=found, varying=varying,
                                lengths_from="batch" if varying else None)
        first = (_keras.peeked_batches(self.adapter)[:1] if self.generator
                 else [data[0]] if len(data) else [])
        for batch in first:
            batch = keras.tree.lists_to_tuples(batch)
            check_shared_rows(batch if isinstance(batch, tuple) else (batch,),
                              f"the {self.kind}")

    def rows_dataset(self, *, shuffle_seed: int | None = None,
                     epoch: int | tf.Variable = 0,
                     batch_size: int | None = None) -> tf.data.Dataset:
        if self.generator:
            # One pass only: the same dataset object, so a second epoch ends at once.
            if self._dataset is None:
                self._dataset = self.adapter.get_tf_dataset()
            return self._dataset
        return self.adapter.get_tf_dataset()

    def sample(self, n: int) -> tuple:
        if self.generator:  # peeked batches, put back by Keras's adapter
            first = _keras.peeked_batches(self.adapter)
            batches = [tuple(tf.nest.map_structure(tf.convert_to_tensor, b)) for b in first]
            rows = tf.nest.map_structure(lambda *t: _concat_padded(t)[:n], *batches)
            return self.materialize(rows)
        return super().sample(n)

    def first_elements(self, rows: int = 256, most: int = 64) -> list:
        if self.generator:  # peeked batches, put back by Keras's adapter: none is read
            return [keras.tree.lists_to_tuples(b) for b in _keras.peeked_batches(
                self.adapter)][:most]
        return super().first_elements(rows, most)

    def on_epoch_begin(self) -> None:
        self.adapter.on_epoch_begin()

    def on_epoch_end(self) -> None:
        self.adapter.on_epoch_end()


def _concat_padded(parts: tuple) -> tf.Tensor:
    """``parts`` (batches) as one, each padded at its end with zeros to the longest along
    every axis after the rows (a generator's padded batches of sequences)."""
    longest = tf.reduce_max(tf.stack([tf.shape(t)[1:] for t in parts]), axis=0)
    return tf.concat([tf.pad(t, tf.concat([[[0, 0]], tf.stack(
        [tf.zeros_like(longest), longest - tf.shape(t)[1:]], axis=1)], 0)) for t in parts], 0)


def _with_y_check(generator):
    first = next(generator, None)
    if first is None:
        raise DatasetError("Expected a generator that yields batches. Received: an empty one.")
    if isinstance(first, tuple) and len(first) not in (1, 2, 3):
        raise DatasetError(
            "Expected the generator to yield (x, y) or (x, y, sample_weight) tuples, or x "
            f"alone. Received: a tuple of {len(first)} items.")
    def restored():
        # Lists of inputs as tuples, as for arrays (Keras's generator adapter would
        # refuse a list in its output signature).
        yield keras.tree.lists_to_tuples(first)
        for batch in generator:
            yield keras.tree.lists_to_tuples(batch)

    return restored()
