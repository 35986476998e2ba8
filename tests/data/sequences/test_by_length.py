"""Sequences of varying length: each large batch cut by length where the model ignores
padding, padded to its longest row where it does not, and both exactly model.fit's.

The reference is model.fit on ``padded_batch(B)`` of the same rows. Where a weight's
gradient cancels (an attention key bias, whose gradient is zero in exact arithmetic),
the reference itself moves when the rows of each large batch come in another order:
each weight is judged against 3x that measured movement where it exceeds the tolerance.
"""

from __future__ import annotations

import math

import keras
import numpy as np
import pytest
import tensorflow as tf
from _sequences import (
    VOCAB,
    B,
    M,
    cut_by_length,
    dataset,
    features,
    hungry_gru,
    model_of,
    reads_padding,
    sequences,
    trains_as_model_fit,
)
from common import tensor_relative_error

import autosplit
from autosplit.data.inputs import get_input
from autosplit.data.pipeline import MicroBatches
from autosplit.data.sequences.buckets import LENGTH_BUCKETS

pytestmark = pytest.mark.slow  # every test trains models on sequences (2-26 s on 2 cores)


@pytest.mark.parametrize("kind", ["gru", "lstm", "mha", "lm_sample_weight", "lm_keras_mask",
                                  pytest.param("gpt2", marks=pytest.mark.slow)])
def test_a_model_that_ignores_padding_is_cut_by_length_andtrains_as_model_fit(kind):
    # A Keras mask (GRU, LSTM, attention with a padding mask), a per-token loss weighted
    # by a sample_weight mask (sum_over_batch_size divides by the large batch's rows x
    # its longest row, a micro-batch by its own times its length factor), and keras_hub's GPT-2
    # with its padding_mask. The input comes in padded batches of 16.
    seqs = sequences()
    got = trains_as_model_fit(kind, dataset(seqs, kind).padded_batch(16), seqs=seqs)
    assert got.autosplit.padding.startswith("by length: the model ignores padding")


@pytest.mark.parametrize("given", ["bucketed", "examples", "ragged", "list"])
def test_bucketed_batches_and_variable_length_examples_are_cut_by_length(given):
    # Bucketed batches arrive padded to their bucket's longest row; examples (a dataset
    # of them, a ragged tensor, a list of arrays) as long as they are.
    seqs = sequences()
    labels = np.array([s.sum() % 2 for s in seqs], "float32")
    data = {
        "bucketed": lambda: (dataset(seqs, "gru").bucket_by_sequence_length(
            lambda x, y: tf.shape(x)[0], [8, 16, 32], [16, 16, 16, 16]), None),
        "examples": lambda: (dataset(seqs, "gru"), None),
        "ragged": lambda: (tf.ragged.constant(seqs), labels),
        "list": lambda: (list(seqs), labels),
    }[given]()
    if given == "bucketed":  # the reference: model.fit on B rows in the order they come
        seqs = [np.trim_zeros(x.numpy(), "b") for x, _ in data[0].unbatch()]
    if given in ("ragged", "list"):
        got = trains_as_model_fit("gru", data[0], seqs=seqs, y=data[1], shuffle=False)
    else:
        got = trains_as_model_fit("gru", data[0], seqs=seqs)
    assert got.autosplit.padding.startswith("by length")


@pytest.mark.parametrize("padding", ["pre", "post"])
@pytest.mark.parametrize("kind", ["gru", "lm_sample_weight"])
def test_arrays_padded_to_one_length_are_cut_by_length(kind, padding):
    # keras.utils.pad_sequences pads at the front by default: each micro-batch keeps its
    # last columns. model.fit sees every batch at the arrays' length, whose cells the
    # per-token mean of the LM divides by.
    seqs = sequences()
    if kind == "gru":
        data = (keras.utils.pad_sequences(seqs, maxlen=60, padding=padding),
                np.array([s.sum() % 2 for s in seqs], "float32"))
    else:
        data = tuple(keras.utils.pad_sequences(part, maxlen=59, padding=padding) for part in (
            [s[:-1] for s in seqs], [s[1:] for s in seqs]))
        data += ((data[1] != 0).astype("float32"),)
    x, y, *weights = data
    options = {"sample_weight": weights[0]} if weights else {}
    reference, model = model_of(kind), model_of(kind)
    expected = reference.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0, **options)
    got = autosplit.fit_large_batch(model, x, y, batch_size=B, micro_batch_size=M, epochs=2,
                                    shuffle=False, verbose=0, **options)
    assert got.autosplit.padding.startswith("by length")
    for e, a in zip(reference.get_weights(), model.get_weights(), strict=True):
        assert tensor_relative_error(e, a) <= 1e-5
    for name, values in expected.history.items():
        np.testing.assert_allclose(got.history[name], values, rtol=1e-5, err_msg=name)


def test_arrays_of_one_length_for_a_model_of_one_length_are_not_sequences():
    # Integer rows that end in zeros, to a model whose input has a fixed length: nothing
    # to cut by length, and nothing checked.
    x = np.zeros((64, 12), "int32")
    x[:, :6] = np.arange(1, 7)
    model = keras.Sequential([keras.Input((12,), dtype="int32"),
                              keras.layers.Embedding(10, 4), keras.layers.Flatten(),
                              keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    history = autosplit.fit_large_batch(model, x, np.zeros(64, "float32"), batch_size=32,
                                        micro_batch_size=8, verbose=0)
    assert history.autosplit.padding is None


def test_a_model_that_reads_its_padding_is_padded_as_its_large_batch_and_says_so(capsys):
    seqs = sequences()
    got = trains_as_model_fit("features", features(seqs).padded_batch(16), seqs=seqs,
                               verbose=2)
    assert got.autosplit.padding.startswith(
        "to the large batch's longest row: the model does not ignore padding: its gradients")
    assert "autosplit: micro-batches padded to their large batch's longest row" in (
        capsys.readouterr().out)


def test_rows_of_features_keep_their_feature_axis_and_are_cut_by_length():
    # (rows, length, 3): the feature axis stays static through the cut (it came out as
    # None), and Masking makes padding ignored.
    seqs = sequences()
    got = trains_as_model_fit("masked_features", features(seqs).padded_batch(16), seqs=seqs)
    assert got.autosplit.padding.startswith("by length")


def test_jit_compiled_steps_cut_by_length_train_as_model_fit():
    # Lengths are rounded up to buckets: XLA compiles one program per bucket.
    seqs = sequences()
    got = trains_as_model_fit("lm_sample_weight", dataset(seqs, "lm_sample_weight")
                               .padded_batch(16), seqs=seqs, jit_compile=True)
    assert got.autosplit.padding.startswith("by length")


def _cells(pipeline):
    """(real tokens, cells fed, the real rows' token lists) over one epoch of elements."""
    real, cells, rows = 0, 0, []
    for x, _, _, valid in pipeline.dataset():
        tokens = (x.inputs if pipeline.cut.sorted else x).numpy()
        kept = tokens[valid.numpy() > 0]
        cells += tokens.size
        real += int((kept != 0).sum())
        rows += [tuple(np.trim_zeros(t, "b")) for t in kept]
    return real, cells, rows


def test_the_length_cut_feeds_each_row_once_with_less_than_half_the_padding():
    # The shape: lognormal lengths (median 10, 3 to 60), B=128, m=24, input in
    # padded batches of 24. Cut as they come, 73-75% of the cells fed were padding.
    seqs = sequences(256)
    adapter = get_input(dataset(seqs, "gru").padded_batch(24))
    as_batched = _cells(MicroBatches(adapter, 128, 24))
    by_length = _cells(MicroBatches(adapter, 128, 24, cut=cut_by_length(adapter)))
    assert sorted(by_length[2]) == sorted(as_batched[2]) == sorted(tuple(s) for s in seqs)
    share = [1 - real / cells for real, cells, _ in (as_batched, by_length)]
    assert share[1] <= share[0] / 2, share
    met = 0
    for x, _, _, valid in MicroBatches(adapter, 128, 24,
                                       cut=cut_by_length(adapter, buckets=True)).dataset():
        # under XLA a bucket, even past the large batch's own length, but never past
        # the longest row met so far (a large batch's longest piece comes first)
        ids = x.inputs.numpy()[valid.numpy() > 0]
        met = max(met, *(len(np.trim_zeros(t, "b")) for t in ids))
        assert x.inputs.shape[1] in LENGTH_BUCKETS or x.inputs.shape[1] == met, met


def test_check_reports_whether_a_batch_of_padded_sequences_can_be_cut_by_length():
    seqs = sequences(32)
    x = np.zeros((32, 60), "int32")
    for row, s in zip(x, seqs, strict=True):
        row[:len(s)] = s
    y = np.array([s.sum() % 2 for s in seqs], "float32")
    report = autosplit.check(model_of("gru"), x, y, micro_batch_size=8)
    assert report.padding.startswith("ignored: fit_large_batch cuts by length")
    assert "padding     ignored" in report.format()
    features = np.stack([x, x % 7, x % 3], axis=2).astype("float32")
    report = autosplit.check(reads_padding(), features, y, micro_batch_size=8)
    assert report.padding.startswith("read: fit_large_batch pads to each large batch's longest")
    report = autosplit.check(reads_padding(), features + 1, y, micro_batch_size=8)
    assert report.padding is None  # no row ends in padding: not a batch of sequences


def test_each_worker_cuts_its_own_share_of_every_large_batch_by_length():
    # Under MultiWorkerMirroredStrategy a worker owns a slice of every large batch:
    # sorted by length within that slice alone, it trains on the same rows as cut as
    # they come.
    from autosplit.data.layout import Layout

    seqs = sequences(150)
    adapter = get_input(dataset(seqs, "gru").padded_batch(16))
    shares = []
    for worker in (0, 1):
        where = Layout(workers=2, worker=worker, local_replicas=1, replicas=2)
        as_batched = _cells(MicroBatches(adapter, B, M, where))
        by_length = _cells(MicroBatches(adapter, B, M, where, cut=cut_by_length(adapter)))
        assert sorted(by_length[2]) == sorted(as_batched[2])
        shares.append(by_length[2])
    # rows 0-31 and 64-95 and the short last batch's 22 (the first share of it), and
    # rows 32-63 and 96-127
    assert [len(share) for share in shares] == [86, 64]
    assert sorted(shares[0] + shares[1]) == sorted(tuple(s) for s in seqs)


@pytest.mark.slow
def test_an_oom_in_a_micro_batch_cut_by_length_redoes_it_in_pieces_exactly():
    # The out-of-memory error comes in the first epoch; the second epoch's pipeline is
    # rebuilt at the smaller size, still cut by length. The reference: model.fit.
    seqs = [s % (VOCAB - 1) + (s == VOCAB - 1) for s in sequences()]
    seqs[70][0] = VOCAB - 1  # in the second large batch
    reference, model = hungry_gru(), hungry_gru()
    reference.layers[0].armed = False
    expected = reference.fit(dataset(seqs, "gru").padded_batch(B), epochs=2, verbose=0)
    with pytest.warns(UserWarning, match="finishing the same batch"):
        got = autosplit.fit_large_batch(model, dataset(seqs, "gru").padded_batch(16),
                                        batch_size=B, micro_batch_size=M, epochs=2, verbose=0)
    assert got.autosplit.padding.startswith("by length")
    assert [(r.step, r.failed, r.retry) for r in got.autosplit.oom_recoveries] == [(1, 16, 8)]
    assert got.autosplit.micro_batch_sizes == (8, 8)
    assert int(model.optimizer.iterations) == 2 * math.ceil(len(seqs) / B)
    for e, a in zip(reference.get_weights(), model.get_weights(), strict=True):
        assert tensor_relative_error(e, a) <= 1e-5
    np.testing.assert_allclose(got.history["loss"], expected.history["loss"], rtol=1e-5)


def test_arrays_padded_at_the_front_that_the_model_reads_report_the_padding_they_feed():
    # pad_sequences pads at the front by default; a model without a mask reads it, so
    # every micro-batch keeps the arrays' length, and the report counts the padding from
    # the side it is on.
    x = keras.utils.pad_sequences(sequences(), maxlen=60)
    y = np.array([row[-1] % 2 for row in x], "float32")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((None,), dtype="int32"),
                              keras.layers.Embedding(VOCAB, 8),
                              keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1)])
    model.compile("sgd", keras.losses.BinaryCrossentropy(from_logits=True))
    got = autosplit.fit_large_batch(model, x, y, batch_size=B, micro_batch_size=M,
                                    shuffle=False, verbose=0)
    assert got.autosplit.padding.startswith("to the large batch's longest row: the model "
                                            "does not ignore padding")
    assert got.autosplit.cut.padding_share == pytest.approx(1 - (x != 0).sum() / x.size)
