"""Translation pairs, the encoder-decoders the tests of several lengths per example share,
and the comparison with model.fit on padded_batch(B) of the same pairs."""

from __future__ import annotations

import contextlib
import math

import keras
import numpy as np
import tensorflow as tf
from _sequences import VOCAB, B, M, sequences
from common import assert_within_reorder_noise, dense_gradients

import autosplit

WIDTH = 16


def pairs(n=192, seed=0, median=10, longest=60):
    """(source, target) token ids of correlated lengths, as a parallel corpus's: the
    source lognormal (median 10, 3 to ``longest`` tokens), the target 0.8-1.3 times as
    long, and 1 more for its start token."""
    r = np.random.default_rng(seed + 1)
    sources = sequences(n, seed, median=median, longest=longest)
    found = []
    for s in sources:
        length = int(np.clip(round(len(s) * r.uniform(0.8, 1.3)), 3, longest))
        found.append((s, r.integers(1, VOCAB, length + 1).astype("int32")))
    return found


def in_each_large_batch_reversed(rows):
    return [row for start in range(0, len(rows), B) for row in reversed(rows[start:start + B])]


def examples(data, kind):
    """A ``tf.data`` dataset of one example per pair, for a model ``kind``: the GRU's
    ``((source, target_in), target_out)``; the Transformer's dict inputs and a
    ``sample_weight`` mask over the target. Its length is known: on a dataset of unknown
    length model.fit counts one more iteration per epoch than it trains (at the end of
    the data), which moves Adam's bias correction in every later epoch."""
    return _examples(data, kind).apply(tf.data.experimental.assert_cardinality(len(data)))


def _examples(data, kind):
    if kind == "transformer":
        spec = ({"source": tf.TensorSpec([None], tf.int32),
                 "target": tf.TensorSpec([None], tf.int32)},
                tf.TensorSpec([None], tf.int32), tf.TensorSpec([None], tf.float32))
        return tf.data.Dataset.from_generator(lambda: (
            ({"source": s, "target": t[:-1]}, t[1:], np.ones(len(t) - 1, "float32"))
            for s, t in data), output_signature=spec)
    spec = ((tf.TensorSpec([None], tf.int32), tf.TensorSpec([None], tf.int32)),
            tf.TensorSpec([None], tf.int32))
    return tf.data.Dataset.from_generator(lambda: (((s, t[:-1]), t[1:]) for s, t in data),
                                          output_signature=spec)


def gru_seq2seq(optimizer="sgd"):
    """A GRU encoder whose last state starts a GRU decoder; both embeddings masked, the
    loss a masked mean over the target's tokens."""
    keras.utils.set_random_seed(0)
    source = keras.Input((None,), dtype="int32")
    target = keras.Input((None,), dtype="int32")
    _, state = keras.layers.GRU(WIDTH, return_state=True)(
        keras.layers.Embedding(VOCAB, WIDTH, mask_zero=True)(source))
    decoded = keras.layers.GRU(WIDTH, return_sequences=True)(
        keras.layers.Embedding(VOCAB, WIDTH, mask_zero=True)(target), initial_state=state)
    model = keras.Model([source, target], keras.layers.Dense(VOCAB)(decoded))
    model.compile(_optimizer(optimizer),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def transformer_seq2seq(optimizer="sgd"):
    """One encoder block (self-attention under the source's padding mask) and one decoder
    block (causal self-attention, cross-attention to the source under its padding mask,
    given as the guides give it: a residual sum drops Keras's mask), the loss weighted
    by a ``sample_weight`` mask and divided by every target cell, as
    ``sum_over_batch_size`` divides."""
    keras.utils.set_random_seed(0)
    source = keras.Input((None,), dtype="int32", name="source")
    target = keras.Input((None,), dtype="int32", name="target")
    encoded = keras.layers.Embedding(VOCAB, WIDTH, mask_zero=True)(source)
    encoded = keras.layers.LayerNormalization()(
        encoded + keras.layers.MultiHeadAttention(2, 8)(encoded, encoded))
    decoded = keras.layers.Embedding(VOCAB, WIDTH, mask_zero=True)(target)
    decoded = keras.layers.LayerNormalization()(decoded + keras.layers.MultiHeadAttention(
        2, 8)(decoded, decoded, use_causal_mask=True))
    decoded = keras.layers.LayerNormalization()(
        decoded + keras.layers.MultiHeadAttention(2, 8)(
            decoded, encoded, value_mask=keras.ops.not_equal(source, 0)))
    logits = keras.layers.Dense(VOCAB)(keras.layers.Dense(32, activation="relu")(decoded))
    model = keras.Model({"source": source, "target": target}, logits)
    model.compile(_optimizer(optimizer),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  weighted_metrics=["accuracy"])
    return model


def _optimizer(name):
    """SGD, or Adam given dense gradients (``common.dense_gradients``): Keras applies an
    Embedding's sparse gradient to Adam per occurrence of a row, autosplit the dense sum."""
    if name == "sgd":
        return keras.optimizers.SGD(0.5)
    return dense_gradients(keras.optimizers.Adam)(1e-2)


MODELS = {"gru": gru_seq2seq, "transformer": transformer_seq2seq}


def large_batch_padding(ds, large_batches=4):
    """The share of padding in the inputs of the first ``large_batches`` of ``ds``
    (padded batches of pairs, each input a length of its own): 1 - real tokens / cells."""
    real = cells = 0
    for index, (x, *_) in enumerate(ds):
        if index == large_batches:
            break
        for t in tf.nest.flatten(x):
            held = np.asarray(t) != 0
            last = np.where(held, np.arange(1, t.shape[1] + 1), 0).max(axis=1)
            real, cells = real + int(last.sum()), cells + t.shape[0] * t.shape[1]
    return 1 - real / cells


def pairs_train_as_model_fit(kind, given=None, *, data=None, optimizer="sgd", epochs=2,
                             strategy=None, **options):
    """fit_large_batch on ``given`` (default: padded batches of 32 of ``data``), in
    micro-batches of M rows (its model built in ``strategy``'s scope), equals model.fit
    on padded_batch(B) of the same pairs on one device: the
    weights within 1e-5 (SGD) or 1e-4 (Adam), or 3x the reference's own movement when
    each large batch's rows come reversed; iterations; logs. Returns the history."""
    data = pairs() if data is None else data
    rtol = 1e-5 if optimizer == "sgd" else 1e-4
    make = MODELS[kind]
    reference, reordered = (make(optimizer) for _ in range(2))
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        model = make(optimizer)
    expected = reference.fit(examples(data, kind).padded_batch(B), epochs=epochs, verbose=0)
    reordered.fit(examples(in_each_large_batch_reversed(data), kind).padded_batch(B),
                  epochs=epochs, verbose=0)
    given = examples(data, kind).padded_batch(32) if given is None else given
    options.setdefault("verbose", 0)
    if "micro_batch_tokens" not in options:
        options.setdefault("micro_batch_size", M)
    got = autosplit.fit_large_batch(model, given, batch_size=B, epochs=epochs, **options)
    assert_within_reorder_noise(reference, reordered, model.get_weights(), rtol)
    assert int(model.optimizer.iterations.numpy()) == epochs * math.ceil(len(data) / B)
    for name, values in expected.history.items():
        np.testing.assert_allclose(got.history[name], values, rtol=rtol, err_msg=name)
    return got
