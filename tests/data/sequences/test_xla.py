"""Sequences under XLA (``jit_compile=True``, what ``compile()`` resolves ``"auto"`` to on
a GPU): micro-batches in tokens, each length rounded up to a bucket and each micro-batch's
rows to what the budget holds there or half that, every step exactly model.fit's under
XLA on the large batch, with a bounded set of programs.

The reference is model.fit, compiled alike, on ``padded_batch(B)`` of the same rows
(``_sequences.trains_as_model_fit``). The token budget found by the probe's trials under
a real cap is tested with the other budgets (``test_token_budget.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf
from _pairs import large_batch_padding
from _sequences import B, dataset, model_of, sequences, trains_as_model_fit
from common import child_env, relative_error

import autosplit
from autosplit.data.sequences.cut import Cut

TOKENS = 240  # 4 rows of the longest (60), 30 of the shortest (3, in the bucket of 8)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gru", "lm_sample_weight"])
def test_micro_batches_in_tokens_under_xla_train_as_model_fit(kind):
    # The lengths of a text corpus (lognormal, median 10, 3 to 60) in large batches of
    # 128: less than half the padding of the large batch padded to its longest row
    # (0.75), every row of a micro-batch's shape counted, its copies included; no more
    # programs than the bound (lengths up to 60: 5 buckets, two row counts each).
    seqs = sequences(256)
    got = trains_as_model_fit(kind, dataset(seqs, kind).padded_batch(32), seqs=seqs,
                              batch_size=128, micro_batch_tokens=TOKENS, jit_compile=True)
    report = got.autosplit
    assert report.tokens == TOKENS
    assert "under XLA each length rounded up to a bucket: 8, 16, 32" in report.padding
    assert report.cut.padding_share <= large_batch_padding(
        dataset(seqs, kind).padded_batch(128)) / 2, report.cut
    bound = Cut("tokens", buckets=True, tokens=TOKENS).programs(60)
    assert bound == 10 and 1 <= report.programs <= bound


@pytest.mark.slow
def test_mixed_float16_in_tokens_under_xla_steps_and_scales_as_model_fit():
    # Copies of a row weigh nothing in the float16 sums the overflow check reads too:
    # the same iterations and loss scale, weights within the mixed tolerance.
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        seqs = sequences()
        reference = model_of("lm_sample_weight", jit_compile=True)
        expected = reference.fit(dataset(seqs, "lm_sample_weight").padded_batch(B), epochs=2,
                                 verbose=0)
        model = model_of("lm_sample_weight", jit_compile=True)
        got = autosplit.fit_large_batch(model, dataset(seqs, "lm_sample_weight").padded_batch(32),
                                        batch_size=B, micro_batch_tokens=TOKENS, epochs=2,
                                        verbose=0)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert got.autosplit.programs is not None
    assert int(model.optimizer.iterations.numpy()) == int(reference.optimizer.iterations.numpy())
    assert float(model.optimizer.dynamic_scale.numpy()) == float(
        reference.optimizer.dynamic_scale.numpy())
    assert relative_error(reference.get_weights(), model.get_weights()) <= 3e-2
    np.testing.assert_allclose(got.history["loss"], expected.history["loss"], rtol=3e-2)


@pytest.mark.slow
def test_a_table_of_512_positions_trains_under_xla_on_rows_up_to_500_as_model_fit():
    keras_hub = pytest.importorskip("keras_hub")
    r = np.random.default_rng(0)
    seqs = [r.integers(1, 50, n).astype("int32") for n in r.integers(3, 80, 62)] + [
        r.integers(1, 50, 500).astype("int32"), r.integers(1, 50, 490).astype("int32")]

    def make():
        keras.utils.set_random_seed(0)
        ids = keras.Input((None,), dtype="int32")
        hidden = keras.layers.Embedding(50, 8)(ids)
        hidden = keras.layers.Add()([hidden, keras_hub.layers.PositionEmbedding(512)(hidden)])
        model = keras.Model(ids, keras.layers.Dense(50)(hidden))
        model.compile(keras.optimizers.SGD(0.5), keras.losses.SparseCategoricalCrossentropy(
            from_logits=True), weighted_metrics=["accuracy"], jit_compile=True)
        return model

    def examples():
        return tf.data.Dataset.from_generator(
            lambda: ((s[:-1], s[1:], np.ones(len(s) - 1, "float32")) for s in seqs),
            output_signature=(tf.TensorSpec([None], tf.int32), tf.TensorSpec([None], tf.int32),
                              tf.TensorSpec([None], tf.float32))).apply(
            tf.data.experimental.assert_cardinality(len(seqs)))

    reference, model = make(), make()
    reference.fit(examples().padded_batch(32), epochs=1, verbose=0)
    for tokens in (None, 4096):
        model = make()
        got = autosplit.fit_large_batch(model, examples().padded_batch(16), batch_size=32,
                                        micro_batch_size=8, micro_batch_tokens=tokens,
                                        epochs=1, verbose=0)
        assert got.autosplit.padding.startswith("by length (under XLA"), got.autosplit.padding
        np.testing.assert_allclose(np.concatenate([w.ravel() for w in model.get_weights()]),
                                   np.concatenate([w.ravel() for w in reference.get_weights()]),
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_the_programs_xla_compiles_on_lengths_up_to_512_stay_within_the_bound(tmp_path):
    # XLA's own dumps count the modules it compiled for the step's per-micro-batch
    # function (in a child process: XLA_FLAGS is read when TensorFlow starts), and
    # FitReport.programs counts the same. The bound: 9 token buckets up to 512, two row
    # counts each, 18; in rows cut by length, 16 buckets.
    run = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("xla_programs_child.py")), str(tmp_path)],
        env=child_env(XLA_FLAGS=f"--xla_dump_to={tmp_path} "
                                "--xla_dump_hlo_module_re=.*contribute.*",
                      PYTHONPATH=os.pathsep.join([child_env()["PYTHONPATH"],
                                                  str(Path(__file__).parent)])),
        capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["longest"] > 256  # lengths reach the last buckets below 512
    for name, bound in (("tokens", 18), ("rows", 16)):
        found = report[name]
        assert 1 <= found["compiled"] == found["programs"] <= bound, (name, found)
    assert Cut("tokens", buckets=True, tokens=4096).programs(512) == 18
    assert Cut("length", buckets=True).programs(512) == 16
