"""The gradient noise scale on two replicas (MirroredStrategy over two logical CPU
devices, configured before TensorFlow starts them): each replica's micro-batches and its
share of the large batch give its estimate, before any all-reduce. Prints, as JSON, each
case's (estimate, closed form), and whether the weights are bitwise those of a run
without the estimate.

Run by ``tests/step/test_noise_scale.py``: ``python noise_child.py``.
"""

from __future__ import annotations

import json

import tensorflow as tf

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402
import numpy as np  # noqa: E402
from _noise import fitted_noise_scale, line, regression  # noqa: E402

import autosplit  # noqa: E402


def main() -> None:
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    found = {}
    x, y, exact = regression(256 * 120, 3.0)
    for policy in ("float32", "mixed_float16"):
        keras.mixed_precision.set_global_policy(policy)
        with strategy.scope():
            model = line()
        keras.mixed_precision.set_global_policy("float32")
        # 128 rows a replica, in micro-batches of 32
        found[policy] = [fitted_noise_scale(model, x, y, 256, 32), exact]
    rng = np.random.default_rng(5)
    x = rng.normal(size=(230, 5)).astype("float32")
    y = rng.normal(size=(230, 2)).astype("float32")
    weights = []
    for noise_scale in (True, False):
        keras.utils.set_random_seed(1)
        with strategy.scope():
            model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(
                7, activation="tanh", kernel_regularizer=keras.regularizers.L2(0.05)),
                keras.layers.Dense(2)])
            model.compile(optimizer="adam", loss="mse")
        autosplit.fit_large_batch(model, x, y, batch_size=64, micro_batch_size=10, epochs=2,
                                  verbose=0, noise_scale=noise_scale, shuffle=False)
        weights.append(model.get_weights())
    found["same_weights"] = all(np.array_equal(a, b) for a, b in zip(*weights, strict=True))
    print(json.dumps(found))


if __name__ == "__main__":
    main()
