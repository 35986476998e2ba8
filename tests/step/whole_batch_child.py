"""The whole-batch step on two replicas (MirroredStrategy over two logical CPU devices,
configured before TensorFlow starts them): every replica's outputs gathered, so each
row's negatives are the global batch's, and each case trains as model.fit on the full
batch on one device (the helper asserts it). Prints, as JSON, what ``FitReport`` said.

Run by ``tests/step/test_whole_batch.py``: ``python whole_batch_child.py``.
"""

from __future__ import annotations

import json

import tensorflow as tf

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

from _whole_batch import (  # noqa: E402
    SupervisedContrastiveLoss,
    dual_encoder,
    labelled,
    pairs,
    projection,
    trains_as_model_fit,
)


def main() -> None:
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    found = {}
    x, y = pairs()
    for name, make, options in (
            ("sgd", lambda: dual_encoder(metrics=["mae"]), {}),
            ("adam", lambda: dual_encoder("adam"), {}),
            ("validation", dual_encoder, {"validation_data": pairs(100, seed=5)}),
            ("short_last_batch", dual_encoder, {"batch_size": 48})):  # 128 = 2 x 48 + 32
        got, _, _ = trains_as_model_fit(make, x, y, strategy=strategy,
                                        rtol=1e-4 if name == "adam" else 1e-5, **options)
        found[name] = {"step": got.autosplit.step, "replicas": got.autosplit.replicas}
    x, y = labelled()
    got, _, _ = trains_as_model_fit(lambda: projection(SupervisedContrastiveLoss(0.1)), x, y,
                                    strategy=strategy, rtol=1e-4)
    found["supervised_contrastive"] = {"step": got.autosplit.step,
                                       "replicas": got.autosplit.replicas}
    print(json.dumps(found))


if __name__ == "__main__":
    main()
