"""Micro-batches sized in tokens (``micro_batch_tokens``): each large batch of sequences
cut by length into micro-batches of up to a budget of rows x padded length, as many as
it needs, and every step exactly model.fit's on the large batch.

The reference is model.fit on ``padded_batch(B)`` of the same rows, each weight judged
against 3x the reference's own movement when each large batch's rows come reversed,
where that is larger than the tolerance (``tests/data/test_sequences.py``).
"""

from __future__ import annotations

import json
import math

import keras
import numpy as np
import pytest
import tensorflow as tf
from _sequences import (
    VOCAB,
    B,
    dataset,
    features,
    hungry_gru,
    model_of,
    sequences,
    trains_as_model_fit,
)
from common import assert_within_reorder_noise, tensor_relative_error

import autosplit
from autosplit.data.pipeline import MicroBatches
from autosplit.errors import ArgumentError, UnsupportedModelError

TOKENS = 240  # 4 rows of the longest (60), 80 of the shortest (3)


def _trains_as_model_fit(kind, given, *, seqs, epochs=2, **options):
    """``trains_as_model_fit`` in micro-batches of TOKENS tokens. Returns the history."""
    got = trains_as_model_fit(kind, given, seqs=seqs, epochs=epochs,
                              micro_batch_tokens=TOKENS, **options)
    assert got.autosplit.tokens == TOKENS
    return got


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gru", "mha", "lm_sample_weight", "lm_keras_mask"])
def test_micro_batches_of_a_token_budget_train_as_model_fit(kind):
    # Short rows come many to a micro-batch, long ones few: more micro-batches than a
    # row cut of the rows the budget holds at the longest length, fewer cells.
    seqs = sequences()
    got = _trains_as_model_fit(kind, dataset(seqs, kind).padded_batch(16), seqs=seqs)
    assert got.autosplit.padding.endswith(f"micro-batches of up to {TOKENS} tokens")
    cut = got.autosplit.cut
    assert cut.large_batches == 3 and 2 <= cut.micro_batches <= 16
    assert cut.padding_share < 0.35


@pytest.mark.slow
@pytest.mark.parametrize("given", ["ragged", "examples"])
def test_variable_length_examples_are_cut_in_tokens(given):
    seqs = sequences()
    labels = np.array([s.sum() % 2 for s in seqs], "float32")
    if given == "ragged":
        got = _trains_as_model_fit("gru", tf.ragged.constant(seqs), seqs=seqs, y=labels,
                                   shuffle=False)
    else:
        got = _trains_as_model_fit("gru", dataset(seqs, "gru"), seqs=seqs)
    assert got.autosplit.tokens == TOKENS


@pytest.mark.slow
@pytest.mark.parametrize("padding", ["pre", "post"])
def test_arrays_padded_to_one_length_are_cut_in_tokens(padding):
    # The per-token mean of the LM divides by the arrays' length, as model.fit's does.
    seqs = sequences()
    x, y = (keras.utils.pad_sequences(part, maxlen=59, padding=padding)
            for part in ([s[:-1] for s in seqs], [s[1:] for s in seqs]))
    weights = (y != 0).astype("float32")
    reference, model = model_of("lm_sample_weight"), model_of("lm_sample_weight")
    expected = reference.fit(x, y, sample_weight=weights, batch_size=B, epochs=2,
                             shuffle=False, verbose=0)
    got = autosplit.fit_large_batch(model, x, y, sample_weight=weights, batch_size=B,
                                    micro_batch_tokens=TOKENS, epochs=2, shuffle=False,
                                    verbose=0)
    assert got.autosplit.tokens == TOKENS
    for e, a in zip(reference.get_weights(), model.get_weights(), strict=True):
        assert tensor_relative_error(e, a) <= 1e-5
    for name, values in expected.history.items():
        np.testing.assert_allclose(got.history[name], values, rtol=1e-5, err_msg=name)


@pytest.mark.slow
def test_a_large_batch_of_one_row_micro_batches_still_reaches_its_marker():
    # Rows of 31 to 60 tokens under a budget of 60: every micro-batch holds one row, so a
    # large batch is as many elements as rows, then its marker. Told to pull only the
    # rows, the loop left the marker for the next step, which read it as the input's
    # end: the epoch stopped after its first large batch.
    seqs = [s for s in sequences(800, median=45) if len(s) > 30][:2 * B]
    trains_as_model_fit("gru", dataset(seqs, "gru").padded_batch(16), seqs=seqs,
                        micro_batch_tokens=60)


@pytest.mark.slow
def test_an_epoch_of_unknown_length_ends_at_its_marker_and_a_longer_one_is_cut_short():
    # A generator's dataset does not tell its length: the first epoch learns it from the
    # input's end; with steps_per_epoch, an epoch that could run on ends at the count.
    seqs = sequences()
    got = _trains_as_model_fit("gru", dataset(seqs, "gru").padded_batch(16), seqs=seqs,
                               epochs=3)
    assert len(got.history["loss"]) == 3
    model = model_of("gru")
    history = autosplit.fit_large_batch(model, dataset(seqs, "gru").padded_batch(16).repeat(),
                                        batch_size=B, micro_batch_tokens=TOKENS, epochs=2,
                                        steps_per_epoch=2, verbose=0)
    assert int(model.optimizer.iterations) == 4 and len(history.history["loss"]) == 2


@pytest.mark.slow
def test_an_oom_in_a_token_micro_batch_redoes_it_in_pieces_and_the_next_epoch_halves_the_budget():
    # _Hungry raises a real ResourceExhaustedError on a micro-batch of more than 8 rows
    # holding the token VOCAB - 1. The budget holds many short rows together (the second
    # large batch's 7th to 30th shortest, 24 rows of up to 10 tokens), so the micro-batch
    # with that row fails and is redone in pieces of at most 8 rows. Half the budget may
    # still hold more than 8 rows of up to 10 tokens: the next epoch's same large batch
    # may fail once more, and is redone alike.
    seqs = [s % (VOCAB - 1) + (s == VOCAB - 1) for s in sequences()]
    short = sorted(range(64, 128), key=lambda i: len(seqs[i]))[15]
    seqs[short][0] = VOCAB - 1
    reference, model = hungry_gru(), hungry_gru()
    reference.layers[0].armed = False
    expected = reference.fit(dataset(seqs, "gru").padded_batch(B), epochs=2, verbose=0)
    with pytest.warns(UserWarning, match="finishing the same batch"):
        got = autosplit.fit_large_batch(model, dataset(seqs, "gru").padded_batch(16),
                                        batch_size=B, micro_batch_tokens=TOKENS, epochs=2,
                                        verbose=0)
    recoveries = got.autosplit.oom_recoveries
    per_epoch = math.ceil(len(seqs) / B)
    assert recoveries and recoveries[0].step == 1
    assert {r.step for r in recoveries} <= {1, 1 + per_epoch}
    assert got.autosplit.tokens < TOKENS  # the next epoch's pipeline: a smaller budget
    assert int(model.optimizer.iterations) == 2 * per_epoch
    # A bias near zero moves with the order of the sum (1.2e-5 seen): its bound is the
    # reference's own reorder noise.
    reordered = hungry_gru()
    reordered.layers[0].armed = False
    reordered.fit(dataset([s for start in range(0, len(seqs), B)
                           for s in reversed(seqs[start:start + B])], "gru").padded_batch(B),
                  epochs=2, verbose=0)
    assert_within_reorder_noise(reference, reordered, model.get_weights())
    np.testing.assert_allclose(got.history["loss"], expected.history["loss"], rtol=1e-5)


@pytest.mark.parametrize("bad", [0, -5, 2.5, "many", True])
def test_a_budget_that_is_not_a_positive_integer_is_refused_before_anything_changes(bad):
    seqs = sequences(64)
    model = model_of("gru")
    before = model.get_weights()
    with pytest.raises(ArgumentError, match="micro_batch_tokens"):
        autosplit.fit_large_batch(model, dataset(seqs, "gru").padded_batch(16), batch_size=B,
                                  micro_batch_tokens=bad, verbose=0)
    for a, b in zip(before, model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_a_budget_is_refused_where_tokens_cannot_apply():
    # Under XLA a model that averages over its micro-batch's rows on its own (its own
    # train_step) would be given its real rows, a program per count; rows of one shape
    # hold no sequences to cut by length; a model that reads its padding cannot be cut
    # by length. Each refusal says why, before anything changes.
    from test_sequence_steps import guide_gru

    seqs = sequences(64)
    model = guide_gru()
    model.compile(keras.optimizers.SGD(0.5), keras.losses.BinaryCrossentropy(from_logits=True),
                  jit_compile=True)
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(UnsupportedModelError, match=r"jit_compile with a model that averages "
                       r".*its own train_step.*Pass jit_compile=False"):
        autosplit.fit_large_batch(model, dataset(seqs, "gru").padded_batch(16), batch_size=B,
                                  micro_batch_tokens=TOKENS, verbose=0)
    assert all((a == b).all() for a, b in zip(before, model.get_weights(), strict=True))
    assert int(model.optimizer.iterations) == 0
    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    with pytest.raises(UnsupportedModelError, match=r"vary in length.*all have one shape"):
        autosplit.fit_large_batch(model, x, x[:, :1], batch_size=32, micro_batch_tokens=TOKENS,
                                  verbose=0)
    # A model that reads its padding: the refusal says what changed with the padding.
    with pytest.raises(UnsupportedModelError, match="does not ignore padding: its gradients "
                       "change"):
        autosplit.fit_large_batch(model_of("features"), features(seqs).padded_batch(16),
                                  batch_size=B, micro_batch_tokens=TOKENS, verbose=0)


@pytest.mark.slow
def test_auto_sizes_rows_where_a_micro_batch_size_is_given():
    seqs = sequences(64)
    got = autosplit.fit_large_batch(model_of("gru"), dataset(seqs, "gru").padded_batch(16),
                                    batch_size=B, micro_batch_size=16, verbose=0)
    assert got.autosplit.tokens is None and got.autosplit.micro_batch_size == 16
    assert got.autosplit.cut.micro_batches == 4


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["tokens", "tokens_xla"])
def test_under_a_real_cap_the_probe_finds_a_token_budget_that_trains_as_model_fit(
        scenario, tmp_path):
    # A causal attention LM whose large batch at its longest rows (255 inputs) needs far
    # more than the cap: the probe's trials (in a child process, as under any CPU cap)
    # find a token budget, and training at it peaks within the budget, with no
    # out-of-memory error. Under XLA (jit_compile=True, as compile() resolves "auto" on
    # a GPU) the trials run XLA's shapes: lengths in buckets, rows padded to the budget's.
    # The reference: model.fit, uncapped, on padded_batch(256), compiled alike.
    from tests.search.test_probe import run_child

    report, folder = run_child(scenario, tmp_path, 150)
    fit = report["autosplit"]
    if scenario == "tokens_xla":
        assert "under XLA each length rounded up to a bucket" in fit["padding"]
        assert 1 <= fit["programs"] <= 18  # 9 buckets up to 256, two row counts each
    probe = fit["probe"]
    assert fit["tokens"] == probe["tokens"] == probe["micro_batch_size"] * probe[
        "reference_length"]
    # the longest input, 255 tokens (its bucket under XLA, 256)
    assert probe["reference_length"] == (256 if scenario == "tokens_xla" else 255)
    assert probe["micro_batch_size"] < 256
    assert any(not t["fits"] for t in probe["trials"])  # the cap was met
    assert fit["oom_recoveries"] == [] and max(report["peaks"]) <= probe["budget_bytes"]
    assert fit["cut"]["micro_batches"] > 1 and fit["cut"]["padding_share"] < 0.5
    with np.load(folder / "rows.npz") as saved:
        seqs = [saved[f"arr_{i}"] for i in range(len(saved.files))]

    def rows(order):
        return tf.data.Dataset.from_generator(
            lambda: ((s[:-1], s[1:], np.ones(len(s) - 1, "float32")) for s in order),
            output_signature=(tf.TensorSpec([None], tf.int32), tf.TensorSpec([None], tf.int32),
                              tf.TensorSpec([None], tf.float32))).padded_batch(256)

    reference, reordered = (keras.saving.load_model(folder / "initial.keras") for _ in "ab")
    assert reference.jit_compile is (scenario == "tokens_xla")
    expected = reference.fit(rows(seqs), epochs=2, verbose=0)
    reordered.fit(rows([s for start in (0, 256) for s in reversed(seqs[start:start + 256])]),
                  epochs=2, verbose=0)
    with np.load(folder / "weights.npz") as saved:
        assert_within_reorder_noise(reference, reordered,
                                    [saved[f"arr_{i}"] for i in range(len(saved.files))])
    assert report["iterations"] == 4
    np.testing.assert_allclose(report["loss"], expected.history["loss"], rtol=1e-5)


@pytest.mark.slow
def test_the_cli_probes_a_language_model_in_tokens(capsys, tmp_path, monkeypatch):
    from autosplit.cli import EXIT_OK, EXIT_USAGE, main

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    code = main(["probe", "--model", "lm", "--lengths", "10,40", "--batch-size", "32",
                 "--json", "--no-cache"])
    assert code == EXIT_OK
    result = json.loads(capsys.readouterr().out)
    assert result["tokens"] == result["micro_batch_size"] * result["reference_length"]
    assert 2 <= result["reference_length"] <= 40
    assert main(["probe", "--model", "lm", "--lengths", "40,10", "--batch-size", "32"]) == (
        EXIT_USAGE)
    assert "--lengths" in capsys.readouterr().err


@pytest.mark.slow
def test_the_cli_under_a_real_cap_finds_a_token_budget_below_the_whole_batch():
    from tests.faces.test_cli import run_cli

    done = run_cli("probe", "--model", "lm", "--lengths", "45,500", "--batch-size", "256",
                   "--memory-limit", "300MiB", "--no-cache")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "chosen      micro_batch_tokens=" in done.stdout
    assert "(rows of 500 tokens)" in done.stdout and "OOM" in done.stdout


@pytest.mark.slow
def test_validation_runs_in_micro_batches_of_the_rows_the_budget_holds_at_the_longest_row(
        monkeypatch):
    # Validation is cut by rows: as many rows of the longest row sampled (of the first
    # large batch) as TOKENS holds.
    from autosplit.training import fit

    made = []

    def recorded(adapter, batch_size, rows, *args, **kwargs):
        made.append(rows)
        return MicroBatches(adapter, batch_size, rows, *args, **kwargs)

    monkeypatch.setattr(fit, "MicroBatches", recorded)
    kind = "lm_sample_weight"
    seqs, held_out = sequences(), sequences(64, seed=1)
    reference, model = model_of(kind), model_of(kind)
    expected = reference.fit(dataset(seqs, kind).padded_batch(B), epochs=1, verbose=0,
                             validation_data=dataset(held_out, kind).padded_batch(B))
    got = autosplit.fit_large_batch(model, dataset(seqs, kind).padded_batch(16), batch_size=B,
                                    micro_batch_tokens=TOKENS, epochs=1, verbose=0,
                                    validation_data=dataset(held_out, kind).padded_batch(B))
    for name in ("val_loss", "val_accuracy"):
        np.testing.assert_allclose(got.history[name], expected.history[name], rtol=1e-5)
    assert made == [TOKENS // max(len(s) - 1 for s in seqs[:B])]


@pytest.mark.slow
def test_a_generator_of_padded_batches_is_probed_in_tokens_on_its_sample():
    # A generator is read once: the probe's trials cut a sample of its padded rows (as
    # arrays) by length in tokens, and training cuts the generator's own rows so.
    seqs = sequences()
    labels = np.array([s.sum() % 2 for s in seqs], "float32")

    def batches():
        for start in range(0, len(seqs), 16):
            yield (keras.utils.pad_sequences(seqs[start:start + 16], padding="post"),
                   labels[start:start + 16])

    reference, model = model_of("gru"), model_of("gru")
    expected = reference.fit(dataset(seqs, "gru").padded_batch(B), epochs=1, verbose=0)
    got = autosplit.fit_large_batch(model, batches(), batch_size=B, epochs=1, verbose=0,
                                    cache=False)
    report = got.autosplit
    assert report.tokens == report.probe.tokens is not None
    # the longest of the batches Keras's adapter peeked at
    assert report.probe.reference_length in {max(len(s) for s in seqs[:n])
                                             for n in range(16, B + 1, 16)}
    for e, a in zip(reference.get_weights(), model.get_weights(), strict=True):
        assert tensor_relative_error(e, a) <= 1e-5
    np.testing.assert_allclose(got.history["loss"], expected.history["loss"], rtol=1e-5)


@pytest.mark.slow
def test_a_generator_of_features_the_child_cannot_cut_keeps_the_probes_rows():
    # PaddedArrays features, not token ids: the probe's trials on the generator's sample run
    # in rows (no budget in tokens to find), and training keeps the rows they chose,
    # cut by length, where it ran micro-batches of the whole large batch.
    seqs = sequences()
    labels = np.array([s[0] % 2 for s in seqs], "float32")

    def batches():
        for start in range(0, len(seqs), 16):
            part = keras.utils.pad_sequences(seqs[start:start + 16], padding="post")
            yield np.stack([part, part % 7, part % 3], axis=2).astype("float32"), labels[
                start:start + 16]

    reference, model = model_of("masked_features"), model_of("masked_features")
    expected = reference.fit(features(seqs).padded_batch(B), epochs=1, verbose=0)
    got = autosplit.fit_large_batch(model, batches(), batch_size=B, epochs=1, verbose=0,
                                    cache=False)
    report = got.autosplit
    assert report.tokens is None and report.probe.tokens is None
    assert report.micro_batch_size == report.probe.micro_batch_size
    assert report.padding.startswith("by length") and "tokens" not in report.padding
    for e, a in zip(reference.get_weights(), model.get_weights(), strict=True):
        assert tensor_relative_error(e, a) <= 1e-5
    np.testing.assert_allclose(got.history["loss"], expected.history["loss"], rtol=1e-5)
