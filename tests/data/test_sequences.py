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

import autosplit
from autosplit.data.inputs import get_input
from autosplit.data.lengths import LengthCut
from autosplit.data.pipeline import MicroBatches
from autosplit.errors import DatasetError, UnsupportedModelError
from autosplit.step.padding import check_padding
from autosplit.step.train_step import build_for
from tests.common import tensor_relative_error

B, M, VOCAB = 64, 16, 50


def _sequences(n=192, seed=0, median=10, longest=60):
    """Token ids (1..VOCAB-1) of lognormal lengths, as a text corpus's (3 to ``longest``)."""
    r = np.random.default_rng(seed)
    lengths = np.clip(r.lognormal(np.log(median), 0.6, n).astype(int), 3, longest)
    return [r.integers(1, VOCAB, n_).astype("int32") for n_ in lengths]


def _in_each_large_batch_reversed(rows):
    return [row for start in range(0, len(rows), B) for row in reversed(rows[start:start + B])]


def _examples(seqs, kind):
    """(generator of rows, their spec) for a model ``kind``: a classifier's (tokens,
    label), a language model's (tokens, next tokens, mask weights), GPT-2's dict."""
    if kind in ("lm_sample_weight", "lm_keras_mask"):
        spec = (tf.TensorSpec([None], tf.int32), tf.TensorSpec([None], tf.int32))
        if kind == "lm_sample_weight":
            spec += (tf.TensorSpec([None], tf.float32),)
        return (lambda: ((s[:-1], s[1:], np.ones(len(s) - 1, "float32"))[:len(spec)]
                         for s in seqs)), spec
    if kind == "gpt2":
        spec = ({"token_ids": tf.TensorSpec([None], tf.int32),
                 "padding_mask": tf.TensorSpec([None], tf.bool)},
                tf.TensorSpec([None], tf.int32), tf.TensorSpec([None], tf.float32))
        return (lambda: (({"token_ids": s[:-1], "padding_mask": np.ones(len(s) - 1, bool)},
                          s[1:], np.ones(len(s) - 1, "float32")) for s in seqs)), spec
    return (lambda: ((s, np.float32(s.sum() % 2)) for s in seqs)), (
        tf.TensorSpec([None], tf.int32), tf.TensorSpec([], tf.float32))


def _dataset(seqs, kind):
    if kind in ("features", "masked_features"):
        return _features(seqs)
    rows, spec = _examples(seqs, kind)
    return tf.data.Dataset.from_generator(rows, output_signature=spec)


def _model(kind, jit_compile=False):
    if kind == "features":
        return _reads_padding()
    keras.utils.set_random_seed(0)
    if kind == "masked_features":  # Masking: a step whose features are all 0 is padding
        model = keras.Sequential([keras.Input((None, 3)), keras.layers.Masking(),
                                  keras.layers.GRU(8), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.5),
                      keras.losses.BinaryCrossentropy(from_logits=True))
        return model
    binary = keras.losses.BinaryCrossentropy(from_logits=True)
    tokens = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if kind == "gpt2":
        keras_hub = pytest.importorskip("keras_hub")
        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=VOCAB, num_layers=1, num_heads=2, hidden_dim=16,
            intermediate_dim=32, max_sequence_length=64, dropout=0.0)
        model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
        model.compile(keras.optimizers.SGD(0.5), tokens,
                      weighted_metrics=["sparse_categorical_accuracy"])
        return model
    inputs = keras.Input((None,), dtype="int32")
    hidden = keras.layers.Embedding(VOCAB, 16, mask_zero=kind != "lm_sample_weight")(inputs)
    if kind in ("lm_sample_weight", "lm_keras_mask"):
        model = keras.Model(inputs, keras.layers.Dense(VOCAB)(
            keras.layers.Dense(16, activation="relu")(hidden)))
        model.compile(keras.optimizers.SGD(0.5), tokens, jit_compile=jit_compile,
                      **({"weighted_metrics": ["accuracy"]} if kind == "lm_sample_weight"
                         else {"metrics": ["accuracy"]}))
        return model
    if kind == "mha":
        hidden = keras.layers.MultiHeadAttention(2, 8)(hidden, hidden)
        hidden = keras.layers.GlobalAveragePooling1D()(hidden)
    else:
        hidden = {"gru": keras.layers.GRU, "lstm": keras.layers.LSTM}[kind](16)(hidden)
    model = keras.Model(inputs, keras.layers.Dense(1)(hidden))
    model.compile(keras.optimizers.SGD(0.5), binary, metrics=["accuracy"],
                  jit_compile=jit_compile)
    return model


def _trains_as_model_fit(kind, given, *, seqs=None, rtol=1e-5, epochs=2, **options):
    """fit_large_batch on ``given`` equals model.fit on padded_batch(B) of the same
    rows: weights (each against 3x the reference's own reordering noise where that is
    larger than ``rtol``), iterations and logs. Returns the history."""
    seqs = _sequences() if seqs is None else seqs
    reference, reordered, model = (_model(kind, options.get("jit_compile", False))
                                   for _ in range(3))
    expected = reference.fit(_dataset(seqs, kind).padded_batch(B), epochs=epochs, verbose=0)
    reordered.fit(_dataset(_in_each_large_batch_reversed(seqs), kind).padded_batch(B),
                  epochs=epochs, verbose=0)
    options.pop("jit_compile", None)
    options.setdefault("verbose", 0)
    got = autosplit.fit_large_batch(model, given, batch_size=B, micro_batch_size=M,
                                    epochs=epochs, **options)
    for variable, e, noisy, a in zip(reference.weights, reference.get_weights(),
                                     reordered.get_weights(), model.get_weights(), strict=True):
        bound = max(rtol, 3 * tensor_relative_error(e, noisy))
        assert tensor_relative_error(e, a) <= bound, (variable.path, bound)
    # model.fit on a dataset of unknown length counts one more iteration per epoch than
    # it trains (at the end of the data); the steps are those of the large batches.
    assert int(model.optimizer.iterations) == epochs * math.ceil(len(seqs) / B)
    for name, values in expected.history.items():
        np.testing.assert_allclose(got.history[name], values, rtol=rtol, err_msg=name)
    return got


@pytest.mark.parametrize("kind", ["gru", "lstm", "mha", "lm_sample_weight", "lm_keras_mask",
                                  pytest.param("gpt2", marks=pytest.mark.slow)])
def test_a_model_that_ignores_padding_is_cut_by_length_and_trains_as_model_fit(kind):
    # A Keras mask (GRU, LSTM, attention with a padding mask), a per-token loss weighted
    # by a sample_weight mask (sum_over_batch_size divides by the large batch's rows x
    # its longest row, a micro-batch by its own unless stretched), and keras_hub's GPT-2
    # with its padding_mask. The input comes in padded batches of 16.
    seqs = _sequences()
    got = _trains_as_model_fit(kind, _dataset(seqs, kind).padded_batch(16), seqs=seqs)
    assert got.autosplit.padding.startswith("by length: the model ignores padding")


@pytest.mark.parametrize("given", ["bucketed", "examples", "ragged", "list"])
def test_bucketed_batches_and_variable_length_examples_are_cut_by_length(given):
    # Bucketed batches arrive padded to their bucket's longest row; examples (a dataset
    # of them, a ragged tensor, a list of arrays) as long as they are.
    seqs = _sequences()
    labels = np.array([s.sum() % 2 for s in seqs], "float32")
    data = {
        "bucketed": lambda: (_dataset(seqs, "gru").bucket_by_sequence_length(
            lambda x, y: tf.shape(x)[0], [8, 16, 32], [16, 16, 16, 16]), None),
        "examples": lambda: (_dataset(seqs, "gru"), None),
        "ragged": lambda: (tf.ragged.constant(seqs), labels),
        "list": lambda: (list(seqs), labels),
    }[given]()
    if given == "bucketed":  # the reference: model.fit on B rows in the order they come
        seqs = [np.trim_zeros(x.numpy(), "b") for x, _ in data[0].unbatch()]
    if given in ("ragged", "list"):
        got = _trains_as_model_fit("gru", data[0], seqs=seqs, y=data[1], shuffle=False)
    else:
        got = _trains_as_model_fit("gru", data[0], seqs=seqs)
    assert got.autosplit.padding.startswith("by length")


@pytest.mark.parametrize("padding", ["pre", "post"])
@pytest.mark.parametrize("kind", ["gru", "lm_sample_weight"])
def test_arrays_padded_to_one_length_are_cut_by_length(kind, padding):
    # keras.utils.pad_sequences pads at the front by default: each micro-batch keeps its
    # last columns. model.fit sees every batch at the arrays' length, whose cells the
    # per-token mean of the LM divides by.
    seqs = _sequences()
    if kind == "gru":
        data = (keras.utils.pad_sequences(seqs, maxlen=60, padding=padding),
                np.array([s.sum() % 2 for s in seqs], "float32"))
    else:
        data = tuple(keras.utils.pad_sequences(part, maxlen=59, padding=padding) for part in (
            [s[:-1] for s in seqs], [s[1:] for s in seqs]))
        data += ((data[1] != 0).astype("float32"),)
    x, y, *weights = data
    options = {"sample_weight": weights[0]} if weights else {}
    reference, model = _model(kind), _model(kind)
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


def _reads_padding():
    """A model without a mask: its mean over every position reads the padding."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((None, 3)), keras.layers.Dense(8, activation="tanh"),
                              keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.5), keras.losses.BinaryCrossentropy(from_logits=True))
    return model


def _features(seqs):
    def rows():
        for s in seqs:
            yield np.stack([s, s % 7, s % 3], axis=1).astype("float32"), np.float32(s[0] % 2)
    return tf.data.Dataset.from_generator(rows, output_signature=(
        tf.TensorSpec([None, 3], tf.float32), tf.TensorSpec([], tf.float32)))


def test_a_model_that_reads_its_padding_is_padded_as_its_large_batch_and_says_so(capsys):
    seqs = _sequences()
    got = _trains_as_model_fit("features", _features(seqs).padded_batch(16), seqs=seqs,
                               verbose=2)
    assert got.autosplit.padding.startswith(
        "to the large batch's longest row: the model does not ignore padding: its gradients")
    assert "autosplit: micro-batches padded to their large batch's longest row" in (
        capsys.readouterr().out)


def test_rows_of_features_keep_their_feature_axis_and_are_cut_by_length():
    # (rows, length, 3): the feature axis stays static through the cut (it came out as
    # None), and Masking makes padding ignored.
    seqs = _sequences()
    got = _trains_as_model_fit("masked_features", _features(seqs).padded_batch(16), seqs=seqs)
    assert got.autosplit.padding.startswith("by length")


def test_by_length_true_refuses_a_model_that_reads_its_padding_and_changes_nothing():
    model = _reads_padding()
    before = [w.copy() for w in (model.build((None, None, 3)) or model.get_weights())]
    with pytest.raises(UnsupportedModelError, match=r"by_length=True.*does not ignore padding"
                       r".*by_length='auto'"):
        autosplit.fit_large_batch(model, _features(_sequences()).padded_batch(16),
                                  batch_size=B, micro_batch_size=M, by_length=True, verbose=0)
    for b, a in zip(before, model.get_weights(), strict=True):
        np.testing.assert_array_equal(b, a)
    assert int(model.optimizer.iterations) == 0


def test_by_length_asks_for_rows_that_vary_and_a_valid_choice():
    x, y = np.ones((8, 5), "int32"), np.zeros(8, "float32")  # no row padded
    with pytest.raises(DatasetError, match="vary in length with by_length=True"):
        autosplit.fit_large_batch(_model("gru"), x, y, batch_size=4, micro_batch_size=2,
                                  by_length=True, verbose=0)
    with pytest.raises(ValueError, match=r"`by_length`.*'auto', True, False.*'yes'"):
        autosplit.fit_large_batch(_model("gru"), x, y, batch_size=4, by_length="yes")


def test_jit_compiled_steps_cut_by_length_train_as_model_fit():
    # Lengths are rounded up to a multiple of 8: XLA compiles one program per length.
    seqs = _sequences()
    got = _trains_as_model_fit("lm_sample_weight", _dataset(seqs, "lm_sample_weight")
                               .padded_batch(16), seqs=seqs, jit_compile=True)
    assert got.autosplit.padding.startswith("by length")


def _cells(pipeline):
    """(real tokens, cells fed, the real rows' token lists) over one epoch of elements."""
    real, cells, rows = 0, 0, []
    for x, _, _, valid in pipeline.dataset():
        tokens = (x.inputs if pipeline.by_length is not None else x).numpy()
        kept = tokens[valid.numpy() > 0]
        cells += tokens.size
        real += int((kept != 0).sum())
        rows += [tuple(np.trim_zeros(t, "b")) for t in kept]
    return real, cells, rows


def test_the_length_cut_feeds_each_row_once_with_less_than_half_the_padding():
    # The shape: lognormal lengths (median 10, 3 to 60), B=128, m=24, input in
    # padded batches of 24. Cut as they come, 73-75% of the cells fed were padding.
    seqs = _sequences(256)
    adapter = get_input(_dataset(seqs, "gru").padded_batch(24))
    as_batched = _cells(MicroBatches(adapter, 128, 24))
    by_length = _cells(MicroBatches(adapter, 128, 24, by_length=LengthCut(1)))
    assert sorted(by_length[2]) == sorted(as_batched[2]) == sorted(tuple(s) for s in seqs)
    share = [1 - real / cells for real, cells, _ in (as_batched, by_length)]
    assert share[1] <= share[0] / 2, share
    for x, _, _, _ in MicroBatches(adapter, 128, 24, by_length=LengthCut(8)).dataset():
        # under XLA a multiple of 8, or the large batch's own length
        assert x.inputs.shape[1] % 8 == 0 or float(x.stretch[0]) == 1.0


def test_the_check_finds_what_reads_padding_and_leaves_the_model_as_it_was():
    seqs = _sequences(32)
    for make, data, expected in (
            (lambda: _model("gru"), _dataset(seqs, "gru"), True),
            (_reads_padding, _features(seqs), False)):
        model = make()
        adapter = get_input(data)
        spec = MicroBatches(adapter, 16, 8).element_spec()
        build_for(model, spec)
        before = [v.numpy().copy() for v in model.variables + model.optimizer.variables]
        found = check_padding(model, adapter.sample(16), spec[:3])
        assert found.ignores_padding is expected, found
        after = [v.numpy() for v in model.variables + model.optimizer.variables]
        for b, a in zip(before, after, strict=True):
            np.testing.assert_array_equal(b, a)


def test_dropout_does_not_hide_that_a_model_ignores_padding():
    # The check's two steps run with dropout still; training keeps its dropout.
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((None,), dtype="int32"),
                              keras.layers.Embedding(VOCAB, 8, mask_zero=True),
                              keras.layers.Dropout(0.5), keras.layers.GRU(8, dropout=0.3),
                              keras.layers.Dense(1)])
    model.compile("sgd", keras.losses.BinaryCrossentropy(from_logits=True))
    history = autosplit.fit_large_batch(model, _dataset(_sequences(64), "gru").padded_batch(16),
                                        batch_size=32, micro_batch_size=8, verbose=0)
    assert history.autosplit.padding.startswith("by length")
    assert model.layers[1].rate == 0.5


def test_check_reports_whether_a_batch_of_padded_sequences_can_be_cut_by_length():
    seqs = _sequences(32)
    x = np.zeros((32, 60), "int32")
    for row, s in zip(x, seqs, strict=True):
        row[:len(s)] = s
    y = np.array([s.sum() % 2 for s in seqs], "float32")
    report = autosplit.check(_model("gru"), x, y, micro_batch_size=8)
    assert report.padding.startswith("ignored: fit_large_batch cuts by length")
    assert "padding     ignored" in report.format()
    features = np.stack([x, x % 7, x % 3], axis=2).astype("float32")
    report = autosplit.check(_reads_padding(), features, y, micro_batch_size=8)
    assert report.padding.startswith("read: fit_large_batch pads to each large batch's longest")
    report = autosplit.check(_reads_padding(), features + 1, y, micro_batch_size=8)
    assert report.padding is None  # no row ends in padding: not a batch of sequences


def test_each_worker_cuts_its_own_share_of_every_large_batch_by_length():
    # Under MultiWorkerMirroredStrategy a worker owns a slice of every large batch:
    # sorted by length within that slice alone, it trains on the same rows as cut as
    # they come.
    from autosplit.data.layout import Layout

    seqs = _sequences(150)
    adapter = get_input(_dataset(seqs, "gru").padded_batch(16))
    shares = []
    for worker in (0, 1):
        where = Layout(workers=2, worker=worker, local_replicas=1, replicas=2)
        as_batched = _cells(MicroBatches(adapter, B, M, where))
        by_length = _cells(MicroBatches(adapter, B, M, where, by_length=LengthCut(1)))
        assert sorted(by_length[2]) == sorted(as_batched[2])
        shares.append(by_length[2])
    # rows 0-31 and 64-95 and the short last batch's 22 (the first share of it), and
    # rows 32-63 and 96-127
    assert [len(share) for share in shares] == [86, 64]
    assert sorted(shares[0] + shares[1]) == sorted(tuple(s) for s in seqs)


class _Hungry(keras.layers.Layer):
    """Identity on token ids, except that a micro-batch of more than 8 rows holding the
    token VOCAB - 1 asks TensorFlow for 4 TB: a real ResourceExhaustedError."""

    armed = True

    def call(self, x):
        if not self.armed:
            return x
        marked = tf.reduce_any(tf.equal(x, VOCAB - 1)) & (tf.shape(x)[0] > 8)
        size = tf.where(marked, tf.constant(10**12, tf.int64), tf.constant(1, tf.int64))
        return x + tf.cast(tf.reduce_sum(tf.zeros(tf.reshape(size, [1]))), x.dtype)


@pytest.mark.slow
def test_an_oom_in_a_micro_batch_cut_by_length_redoes_it_in_pieces_exactly():
    # The out-of-memory error comes in the first epoch; the second epoch's pipeline is
    # rebuilt at the smaller size, still cut by length. The reference: model.fit.
    seqs = [s % (VOCAB - 1) + (s == VOCAB - 1) for s in _sequences()]
    seqs[70][0] = VOCAB - 1  # in the second large batch

    def make():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((None,), dtype="int32"), _Hungry(),
                                  keras.layers.Embedding(VOCAB, 16, mask_zero=True),
                                  keras.layers.GRU(16), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.5), keras.losses.BinaryCrossentropy(
            from_logits=True), metrics=["accuracy"])
        return model

    reference, model = make(), make()
    reference.layers[0].armed = False
    expected = reference.fit(_dataset(seqs, "gru").padded_batch(B), epochs=2, verbose=0)
    with pytest.warns(UserWarning, match="finishing the same batch"):
        got = autosplit.fit_large_batch(model, _dataset(seqs, "gru").padded_batch(16),
                                        batch_size=B, micro_batch_size=M, epochs=2, verbose=0)
    assert got.autosplit.padding.startswith("by length")
    assert [(r.step, r.failed, r.retry) for r in got.autosplit.oom_recoveries] == [(1, 16, 8)]
    assert got.autosplit.micro_batch_sizes == (8, 8)
    assert int(model.optimizer.iterations) == 2 * math.ceil(len(seqs) / B)
    for e, a in zip(reference.get_weights(), model.get_weights(), strict=True):
        assert tensor_relative_error(e, a) <= 1e-5
    np.testing.assert_allclose(got.history["loss"], expected.history["loss"], rtol=1e-5)
