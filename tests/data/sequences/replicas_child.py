"""Sequences cut by length on two replicas (MirroredStrategy over two logical CPU
devices, configured before TensorFlow starts them): each case trains as model.fit on
padded_batch(B) of the same rows on one device (the helpers assert it), and prints, as
JSON, what ``FitReport`` said of each cut and the padding of the large batches.

Run by ``tests/data/test_replicas.py``: ``python replicas_child.py``.
"""

from __future__ import annotations

import json

import tensorflow as tf

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

from _pairs import examples, large_batch_padding, pairs, pairs_train_as_model_fit  # noqa: E402
from _sequences import B, dataset, sequences, trains_as_model_fit  # noqa: E402


def report(history, full):
    return {"padding": history.autosplit.padding, "tokens": history.autosplit.tokens,
            "padding_share": history.autosplit.cut.padding_share,
            "micro_batches": history.autosplit.cut.micro_batches, "full": full}


def main() -> None:
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    found = {}
    # 185 rows: the last large batch has 57, so one replica's last micro-batch is a row
    # short and takes a copy that weighs nothing.
    seqs = sequences(185)
    full = large_batch_padding(dataset(seqs, "gru").padded_batch(B))
    for name, options in (("rows", {"micro_batch_size": 8}),
                          ("tokens", {"micro_batch_tokens": 160}),
                          ("auto", {"micro_batch_size": "auto"})):
        got = trains_as_model_fit("gru", dataset(seqs, "gru").padded_batch(16), seqs=seqs,
                                  strategy=strategy, **options)
        found[name] = report(got, full)
    # Under XLA: each replica's own shape, of the buckets' bounded set.
    seqs = sequences(256)
    for name, kind, options in (("xla_tokens", "gru", {"micro_batch_tokens": 240}),
                                ("xla_rows", "lm_sample_weight", {"micro_batch_size": 16})):
        got = trains_as_model_fit(kind, dataset(seqs, kind).padded_batch(32), seqs=seqs,
                                  strategy=strategy, batch_size=128, jit_compile=True,
                                  **options)
        found[name] = report(got, large_batch_padding(dataset(seqs, kind).padded_batch(128)))
        found[name]["programs"] = got.autosplit.programs
    seqs = sequences()
    got = trains_as_model_fit("lm_sample_weight", dataset(seqs, "lm_sample_weight")
                              .padded_batch(32), seqs=seqs, strategy=strategy,
                              micro_batch_tokens=160)
    found["per_token"] = report(got, large_batch_padding(
        dataset(seqs, "lm_sample_weight").padded_batch(B)))
    data = pairs()
    for kind, optimizer, options in (("gru", "adam", {"micro_batch_size": 8}),
                                     ("transformer", "sgd", {"micro_batch_tokens": 360})):
        got = pairs_train_as_model_fit(kind, data=data, optimizer=optimizer,
                                       strategy=strategy, **options)
        found[f"pairs_{kind}"] = report(got, large_batch_padding(
            examples(data, kind).padded_batch(B)))
    print(json.dumps(found))


if __name__ == "__main__":
    main()
