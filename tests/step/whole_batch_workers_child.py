"""One worker of two on localhost (``TF_CONFIG``) training a loss over the whole batch:
``python whole_batch_workers_child.py OUT``. Every worker's outputs are gathered, so the
negatives of each row are the global large batch's, and each run trains as single-device
model.fit on the full batch (the helper asserts it, in the worker). ``OUT.json``: what
``FitReport`` said of each run.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf

sys.path.insert(0, os.path.dirname(__file__))
from _whole_batch import (
    B,
    M,
    SupervisedContrastiveLoss,
    dual_encoder,
    labelled,
    pairs,
    projection,
    trains_as_model_fit,
)
from common import relative_error

import autosplit


def main(out: str) -> None:
    options = tf.distribute.experimental.CommunicationOptions(timeout_seconds=60.0)
    strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)
    found = {}
    x, y = pairs()
    got, _, _ = trains_as_model_fit(dual_encoder, x, y, strategy=strategy)
    found["arrays"] = {"step": got.autosplit.step, "workers": got.autosplit.workers}
    # A dataset sharded as model.fit shards it (DATA: each worker its slice of every
    # batch): each worker reads and stores its own share.
    data = tf.data.Dataset.from_tensor_slices(((x[0], x[1]), y)).batch(B)
    sharding = tf.data.Options()
    sharding.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.DATA)
    reference = dual_encoder()
    with strategy.scope():
        model = dual_encoder()
    model.set_weights(reference.get_weights())
    reference.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0)
    got = autosplit.fit_large_batch(model, data.with_options(sharding), batch_size=B,
                                    micro_batch_size=M, epochs=2, verbose=0)
    assert relative_error(reference.get_weights(), model.get_weights()) <= 1e-5
    assert "sharded across workers" in got.autosplit.input, got.autosplit.input
    found["sharded"] = {"step": got.autosplit.step, "workers": got.autosplit.workers}
    x, y = labelled()
    got, _, _ = trains_as_model_fit(lambda: projection(SupervisedContrastiveLoss(0.1)), x, y,
                                    strategy=strategy, rtol=1e-4)
    found["supervised_contrastive"] = {"step": got.autosplit.step,
                                       "workers": got.autosplit.workers}
    with open(f"{out}.json", "w") as handle:
        handle.write(json.dumps(found))


if __name__ == "__main__":
    main(sys.argv[1])
