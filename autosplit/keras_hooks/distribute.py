"""This worker's own pipeline of a ``tf.distribute`` input, as ``model.fit`` reads it.

``strategy.experimental_distribute_dataset(ds)`` rebatches ``ds`` to per-replica
batches and auto-shards it (the dataset's ``auto_shard_policy``: FILE, DATA, AUTO);
``strategy.distribute_datasets_from_function(fn)`` calls ``fn`` with this worker's
``tf.distribute.InputContext``. Either way TensorFlow keeps one ``tf.data`` pipeline
per input worker, whose elements are per-replica batches, one per local replica in
turn, which its iterator moves to the devices. autosplit reads that same pipeline on
the host (private: ``_cloned_datasets`` and ``_datasets``), so each worker reads what
``model.fit`` would have it read, and nothing more. The canary in
``tests/keras_hooks/test_keras_canaries.py`` checks the reliance.
"""

from __future__ import annotations

import tensorflow as tf

__all__ = ["worker_pipeline"]


def worker_pipeline(distributed: tf.distribute.DistributedDataset) -> tf.data.Dataset | None:
    """The one per-worker ``tf.data`` pipeline of ``distributed`` in this process, or None
    where TensorFlow keeps several (several input workers in one process) or none."""
    datasets = getattr(distributed, "_cloned_datasets", None)
    if datasets is None:  # distribute_datasets_from_function
        datasets = getattr(distributed, "_datasets", None)
    if not datasets or len(datasets) != 1 or not isinstance(datasets[0], tf.data.Dataset):
        return None
    return datasets[0]
