"""The sequences, models and layers the tests of the cut by length share."""

from __future__ import annotations

import contextlib
import math

import keras
import numpy as np
import pytest
import tensorflow as tf
from common import assert_within_reorder_noise

import autosplit
from autosplit.data.sequences.cut import Cut

B, M, VOCAB = 64, 16, 50


def cut_by_length(adapter, buckets=False, tokens=None, outputs=(0,), replicas=1):
    """The pipeline's Cut by length (in tokens with ``tokens``; under XLA's length
    buckets with ``buckets``; on ``replicas`` local replicas) of ``adapter``'s rows, with
    one output that follows the first length (its ``Shortened.length_factor``)."""
    return Cut("tokens" if tokens else "length", lengths=adapter.lengths(),
               buckets=buckets, tokens=tokens, outputs=outputs, replicas=replicas)


def sequences(n=192, seed=0, median=10, longest=60):
    """Token ids (1..VOCAB-1) of lognormal lengths, as a text corpus's (3 to ``longest``)."""
    r = np.random.default_rng(seed)
    lengths = np.clip(r.lognormal(np.log(median), 0.6, n).astype(int), 3, longest)
    return [r.integers(1, VOCAB, n_).astype("int32") for n_ in lengths]


def in_each_large_batch_reversed(rows, batch_size=B):
    return [row for start in range(0, len(rows), batch_size)
            for row in reversed(rows[start:start + batch_size])]


def examples(seqs, kind):
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


def dataset(seqs, kind):
    if kind in ("features", "masked_features"):
        return features(seqs)
    rows, spec = examples(seqs, kind)
    return tf.data.Dataset.from_generator(rows, output_signature=spec)


def model_of(kind, jit_compile=False):
    if kind == "features":
        return reads_padding()
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
    ids = HungryRows()(inputs) if kind == "lm_hungry" else inputs
    hidden = keras.layers.Embedding(VOCAB, 16,
                                    mask_zero=kind not in ("lm_sample_weight", "lm_hungry"))(ids)
    if kind in ("lm_sample_weight", "lm_keras_mask", "lm_hungry"):
        model = keras.Model(inputs, keras.layers.Dense(VOCAB)(
            keras.layers.Dense(16, activation="relu")(hidden)))
        model.compile(keras.optimizers.SGD(0.5), tokens, jit_compile=jit_compile,
                      **({"metrics": ["accuracy"]} if kind == "lm_keras_mask"
                         else {"weighted_metrics": ["accuracy"]}))
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


def reads_padding():
    """A model without a mask: its mean over every position reads the padding."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((None, 3)), keras.layers.Dense(8, activation="tanh"),
                              keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.5), keras.losses.BinaryCrossentropy(from_logits=True))
    return model


def features(seqs):
    def rows():
        for s in seqs:
            yield np.stack([s, s % 7, s % 3], axis=1).astype("float32"), np.float32(s[0] % 2)
    return tf.data.Dataset.from_generator(rows, output_signature=(
        tf.TensorSpec([None, 3], tf.float32), tf.TensorSpec([], tf.float32)))


class Hungry(keras.layers.Layer):
    """Identity on token ids, except that a micro-batch of more than 8 rows holding the
    token VOCAB - 1 asks TensorFlow for 4 TB: a real ResourceExhaustedError."""

    armed = True

    def call(self, x):
        if not self.armed:
            return x
        marked = tf.reduce_any(tf.equal(x, VOCAB - 1)) & (tf.shape(x)[0] > 8)
        size = tf.where(marked, tf.constant(10**12, tf.int64), tf.constant(1, tf.int64))
        return x + tf.cast(tf.reduce_sum(tf.zeros(tf.reshape(size, [1]))), x.dtype)


class HungryRows(keras.layers.Layer):
    """Identity on token ids, except that a micro-batch holding the token VOCAB - 1
    asks TensorFlow for 80 MB per row: under a real cap of 200 MiB, a real
    ResourceExhaustedError for a micro-batch of 3 rows or more, none for 2."""

    def call(self, x):
        marked = tf.reduce_any(tf.equal(x, VOCAB - 1))
        size = tf.where(marked, tf.cast(tf.shape(x)[0], tf.int64) * 2 * 10**7,
                        tf.constant(1, tf.int64))
        return x + tf.cast(tf.reduce_sum(tf.zeros(tf.reshape(size, [1]))), x.dtype)


def hungry_gru():
    """A masked GRU classifier behind a :class:`Hungry` layer."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((None,), dtype="int32"), Hungry(),
                              keras.layers.Embedding(VOCAB, 16, mask_zero=True),
                              keras.layers.GRU(16), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.5), keras.losses.BinaryCrossentropy(
        from_logits=True), metrics=["accuracy"])
    return model


def trains_as_model_fit(kind, given, *, seqs=None, rtol=1e-5, epochs=2, batch_size=B,
                        strategy=None, **options):
    """fit_large_batch on ``given`` (in micro-batches of M rows unless ``options`` size
    them; its model built in ``strategy``'s scope) equals model.fit on
    padded_batch(batch_size) of the same rows on one device: weights
    (``common.assert_within_reorder_noise``), iterations and logs. Returns the history."""
    seqs = sequences() if seqs is None else seqs
    reference, reordered = (model_of(kind, options.get("jit_compile", False))
                            for _ in range(2))
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        model = model_of(kind, options.get("jit_compile", False))
    expected = reference.fit(dataset(seqs, kind).padded_batch(batch_size), epochs=epochs,
                             verbose=0)
    reordered.fit(dataset(in_each_large_batch_reversed(seqs, batch_size), kind)
                  .padded_batch(batch_size), epochs=epochs, verbose=0)
    options.pop("jit_compile", None)
    options.setdefault("verbose", 0)
    if "micro_batch_tokens" not in options:
        options.setdefault("micro_batch_size", M)
    got = autosplit.fit_large_batch(model, given, batch_size=batch_size, epochs=epochs,
                                    **options)
    assert_within_reorder_noise(reference, reordered, model.get_weights(), rtol)
    # model.fit on a dataset of unknown length counts one more iteration per epoch than
    # it trains (at the end of the data); the steps are those of the large batches.
    assert int(model.optimizer.iterations.numpy()) == epochs * math.ceil(len(seqs) / batch_size)
    for name, values in expected.history.items():
        np.testing.assert_allclose(got.history[name], values, rtol=rtol, err_msg=name)
    return got
