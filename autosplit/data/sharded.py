"""Inputs that every worker reads only its own share of: ``tf.data`` sharded as
``model.fit`` shards it, and ``tf.distribute`` inputs.

Under ``MultiWorkerMirroredStrategy`` ``model.fit`` hands a ``tf.data.Dataset`` to
``strategy.experimental_distribute_dataset``: each worker's pipeline is the dataset
auto-sharded by its ``tf.data.Options().experimental_distribute.auto_shard_policy``
(AUTO by default: FILE where the files can be split, else DATA) and rebatched to
per-replica batches. :func:`sharded_input` does the same with the dataset batched by
``batch_size`` (the large batch is the global batch), and reads the per-worker pipeline
TensorFlow built (``autosplit.keras_hooks.distribute``): with FILE, worker w reads files
w, w+W, ... alone; with DATA it reads every row and keeps every W-th piece of each
batch, as TensorFlow's DATA does. With the policy OFF the dataset stays as it is:
every worker reads it whole and keeps its share (``autosplit.data.split``).

Sequences of varying length cut by length (``Cut.sorted``) are sharded alike,
``padded_batch(B)`` first (:func:`shards_by_length`): each worker sorts and cuts its own
share, and since a per-token denominator and a metric count the large batch's padded
length, each share's pieces come after a header that holds the share's length per model
output (``by_length.cut_by_length``); the workers agree on the longest before the share's
first micro-step (``TrainStep.agree_lengths``). On R local replicas a step's R
per-replica batches are joined into the share first (:func:`joined_shares`), which is
cut as one device cuts it, each replica taking one of its micro-batches per micro-step.
Sequences padded to the large batch's longest row (a model that reads its padding) are
read whole by every worker, each keeping its share.

A large batch is then the union of every worker's share of one step: R per-replica
batches in turn on a worker of R local replicas (:class:`ShardedInput`). The shares
may differ in size (the last batch of a worker's files is short, and workers' files
hold different numbers of rows); the loss denominators are the union's rows, summed
by the step's agreement. A worker whose pipeline has ended contributes no row while
the others go on, as TensorFlow's iterator gives it empty batches; the epoch ends
when every worker's pipeline has.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tensorflow as tf

from autosplit.data.adapter import (
    InputAdapter,
    InputFacts,
    arity,
    check_class_weight_alone,
    class_weight_fn,
    varying_axes,
)
from autosplit.data.datasets import DatasetInput, batch_rows
from autosplit.data.layout import Layout
from autosplit.data.sequences.cut import Cut
from autosplit.data.sequences.lengths import Lengths
from autosplit.errors import DatasetError
from autosplit.graph import HOST
from autosplit.keras_hooks.distribute import worker_pipeline

# The elements one large batch of a sharded input may take: no bound (an int32), its
# loop stops at the share's marker. Each step trains on what the per-worker pipeline
# yields, as model.fit does (it takes no batch size with such an input); batch_size B
# sizes the split (B / R rows per replica), and a larger share takes more micro-batches.
SHARE_ELEMENTS = 2**31 - 1

__all__ = [
    "SHARE_ELEMENTS",
    "ShardedInput",
    "cut_shares",
    "joined_shares",
    "reads_whole",
    "sharded_input",
    "shards_by_length",
]


class ShardedInput(InputAdapter):
    """This worker's ``tf.distribute`` pipeline: per-replica batches, one per local
    replica in turn, the shares of successive large batches.

    Args:
        distributed: what ``experimental_distribute_dataset`` or
            ``distribute_datasets_from_function`` returned.
        kind: what the user passed, for messages.
        class_weight: as in ``model.fit``; or ``weighting``, one made already
            (``InputAdapter.weighting``).
        lengths: the lengths of an example (``InputAdapter.lengths``), read from the
            whole input, where its batches are padded sequences; None: one shape.

    The facts: no rows (each worker's own count; the epoch ends where every worker's
    does), shares of each step.
    """

    def __init__(self, distributed: tf.distribute.DistributedDataset, kind: str, *,
                 class_weight: dict | None = None, weighting: Any = None,
                 lengths: Lengths | None = None) -> None:
        dataset = worker_pipeline(distributed)
        if dataset is None:
            raise DatasetError(
                f"Expected a {kind} with one input pipeline in this process, as "
                "MultiWorkerMirroredStrategy and MirroredStrategy build. Received: one "
                "without. Pass the tf.data.Dataset itself.")
        found = arity(dataset.element_spec)
        if found is None:
            raise DatasetError(
                f"Expected the {kind}'s elements to be (x, y), (x, y, sample_weight) or x "
                f"alone. Received: element_spec={dataset.element_spec}.")
        vars(self)["_lengths"] = lengths
        varying = varying_axes(dataset.element_spec, batched=True)
        if varying and lengths is None:
            raise DatasetError(
                f"Expected the {kind}'s batches to have one shape beyond their rows. "
                f"Received: element_spec={dataset.element_spec}. Pad to a fixed length, or "
                "pass the tf.data.Dataset itself.")
        check_class_weight_alone(class_weight, found == 3,
                                 dataset.element_spec[1] if found >= 2 else None)
        self._class_weight = class_weight_fn(class_weight) if class_weight else weighting
        self.dataset = dataset
        self.facts = InputFacts(
            kind, batched=True, shares=True, arity=found, varying=varying,
            infinite=int(dataset.cardinality()) == tf.data.INFINITE_CARDINALITY,
            lengths_from="share" if varying else None)

    def rows_dataset(self, *, shuffle_seed: int | None = None,
                     epoch: int | tf.Variable = 0,
                     batch_size: int | None = None) -> tf.data.Dataset:
        return self.dataset


def reads_whole(dataset: tf.data.Dataset) -> bool:
    """Whether ``dataset`` asks every worker to read it whole (``AutoShardPolicy.OFF``)."""
    policy = dataset.options().experimental_distribute.auto_shard_policy
    return policy == tf.data.experimental.AutoShardPolicy.OFF


def shards_by_length(adapter: InputAdapter, where: Layout) -> bool:
    """Whether ``adapter``'s sequences of varying length, cut by length, are sharded
    across workers (:func:`sharded_input` with a sorted cut)."""
    return (isinstance(adapter, DatasetInput) and where.multi_worker and adapter.rows_vary
            and not reads_whole(adapter.dataset))


def sharded_input(adapter: InputAdapter, strategy: tf.distribute.Strategy, where: Layout,
                  batch_size: int, cut: Cut | None = None) -> InputAdapter:
    """``adapter`` as this worker reads it: a ``tf.data`` input of several workers
    sharded as ``model.fit`` shards it (batched by ``batch_size`` first); sequences of
    varying length only where ``cut`` sorts them (:func:`shards_by_length`), padded by
    ``padded_batch(batch_size)``; any other input, or one whose policy is OFF, as it is."""
    if (not isinstance(adapter, DatasetInput) or not where.multi_worker
            or reads_whole(adapter.dataset)):
        return adapter
    if adapter.rows_vary and not (cut is not None and cut.sorted
                                  and shards_by_length(adapter, where)):
        return adapter
    dataset = adapter.dataset
    batch = dataset.padded_batch if adapter.rows_vary else dataset.batch
    if not adapter.batched:
        dataset = batch(batch_size)
    elif batch_rows(dataset) != batch_size:
        # Not Dataset.rebatch: TensorFlow reads a batch() for the size it splits into
        # per-replica batches, and splits a rebatch() otherwise (its legacy rebatch).
        dataset = dataset.unbatch()
        dataset = (dataset.padded_batch if adapter.rows_vary else dataset.batch)(batch_size)
    with tf.device(HOST):
        distributed = strategy.experimental_distribute_dataset(dataset)
    return ShardedInput(distributed, f"{adapter.kind} sharded across workers",
                        weighting=adapter.weighting,
                        lengths=adapter.lengths() if adapter.rows_vary else None)


def cut_shares(ds: tf.data.Dataset, *, rows: int, local_replicas: int,
               element: Callable[..., tuple], group: Callable[..., tuple],
               marker: Callable[[Any], tf.data.Dataset | None]) -> tf.data.Dataset:
    """Per-replica batches -> micro-batch elements of ``rows`` rows (``element`` pads a
    piece), each large batch's ended by ``marker``'s element of no row.

    A large batch is ``local_replicas`` per-replica batches in turn (a window of them);
    its rows are cut in order, and ``group`` puts ``local_replicas`` pieces side by side.
    Any cut of a share gives the same sums: only the union of the rows of one step
    counts.
    """
    def pieces(*parts: Any) -> tf.data.Dataset:
        share = parts[0] if len(parts) == 1 else parts
        if local_replicas > 1:  # a window: datasets of the share's batches, in turn
            cut = tf.data.Dataset.zip(share).rebatch(rows)
        else:
            cut = tf.data.Dataset.from_tensors(share).rebatch(rows)
        cut = cut.map(element)
        if local_replicas > 1:
            cut = cut.batch(local_replicas).map(group)
        end = marker(cut.element_spec)
        if end is None:
            raise DatasetError(
                "Expected a sharded input's elements to be dense tensors. Received: "
                f"{cut.element_spec}.")
        return cut.concatenate(end)

    if local_replicas > 1:
        ds = ds.window(local_replicas)
    return ds.flat_map(pieces)


def joined_shares(ds: tf.data.Dataset, local_replicas: int) -> tf.data.Dataset:
    """A worker's pipeline of sequences (``local_replicas`` per-replica batches of each
    step in turn, each padded to its own longest row) as one batch per step, its share:
    the batches' rows together, every part padded with zeros at the end to the most of
    any along each axis but the rows, which stay the batches' own (none added)."""
    def rows_of(*element: Any) -> tuple:
        whole = element[0] if len(element) == 1 else element
        return whole, tf.shape(tf.nest.flatten(whole)[0])[0]

    def joined(element: Any, rows: tf.Tensor) -> Any:
        real = tf.sequence_mask(rows, tf.reduce_max(rows))
        return tf.nest.map_structure(lambda t: tf.boolean_mask(t, real), element)

    def share(*parts: Any) -> tf.data.Dataset:
        window = tf.data.Dataset.zip(parts[0] if len(parts) == 1 else parts)
        return window.map(rows_of).padded_batch(local_replicas).map(joined)

    return ds.window(local_replicas).flat_map(share)
