"""Where this process sits in a ``tf.distribute`` job: workers, this worker, replicas.

Public ``tf.distribute`` API only. A plain model is one worker with one replica;
``MirroredStrategy`` is one worker with several local replicas;
``MultiWorkerMirroredStrategy`` reads the cluster from its resolver.
"""

from __future__ import annotations

from typing import NamedTuple

import tensorflow as tf

__all__ = ["Layout", "layout"]


class Layout(NamedTuple):
    """The shape of a (possibly distributed) job, from this process's point of view."""

    workers: int  # W, processes that train together
    worker: int  # this process's index among them
    local_replicas: int  # replicas (devices) in this process
    replicas: int  # W * local_replicas: num_replicas_in_sync

    @property
    def multi_worker(self) -> bool:
        return self.workers > 1


ALONE = Layout(workers=1, worker=0, local_replicas=1, replicas=1)  # no strategy


def layout(strategy: tf.distribute.Strategy) -> Layout:
    replicas = strategy.num_replicas_in_sync
    resolver = getattr(strategy, "cluster_resolver", None)
    workers, worker = 1, 0
    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) and resolver is not None:
        spec = resolver.cluster_spec()
        jobs = spec.jobs
        workers = sum(spec.num_tasks(job) for job in jobs if job in ("chief", "worker")) or 1
        worker = int(resolver.task_id or 0)
        if resolver.task_type == "worker" and "chief" in jobs:
            worker += spec.num_tasks("chief")
    local = max(1, replicas // workers)
    return Layout(workers, worker, local, replicas)
