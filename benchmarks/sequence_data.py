"""The corpora and models of ``benchmarks/sequences.py``: token ids of heavy-tailed
lengths, and translation pairs of two correlated lengths.

- IMDB-shaped rows: lognormal lengths like ``keras.datasets.imdb``'s reviews (median 178
  tokens, mean 239, longest about 2,500: sigma 0.77), clipped to [8, 2,500] and divided
  by ``scale`` (default 4 on 2 CPU cores: the shape, and so the padding shares, kept).
- WMT-shaped pairs: a stand-in for WMT14 English-German after BPE (no corpus is
  downloaded): English lognormal, median 24 tokens, sigma 0.55, clipped to [1, 250]
  (fairseq's and OpenNMT-tf's usual length filter); German 1.05 times as long, times a
  lognormal factor of sigma 0.15, clipped alike: the lengths of a pair correlate as a
  translation's do. Not scaled.

Models (vocabulary 2,000, width 32, Adam): ``transformer``, an encoder classifier
(attention under its padding mask, a masked mean); ``gru``, a masked GRU classifier;
``causal_lm``, causal attention trained with a ``sample_weight`` mask;
``translation``, an encoder-decoder (self-attention over the source under its mask, a
decoder of causal self-attention and cross-attention to the source under the source's
mask), its per-token loss weighted by a ``sample_weight`` mask, as keras_hub's
``BartSeq2SeqLM`` trains.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

VOCAB, WIDTH = 2000, 32
IMDB_MEDIAN, IMDB_SIGMA, IMDB_LONGEST = 178, 0.77, 2500
WMT_MEDIAN, WMT_SIGMA, WMT_LONGEST, WMT_RATIO, WMT_RATIO_SIGMA = 24, 0.55, 250, 1.05, 0.15
PAIRS = ("translation",)  # the models trained on pairs


def lengths(kind: str, rows: int, scale: int, seed: int = 0) -> list[Any]:
    """Each row's length (IMDB-shaped), or (source, target) lengths for a model of pairs."""
    import numpy as np

    r = np.random.default_rng(seed)
    if kind in PAIRS:
        source = np.clip(r.lognormal(np.log(WMT_MEDIAN), WMT_SIGMA, rows), 1, WMT_LONGEST)
        target = np.clip(source * r.lognormal(np.log(WMT_RATIO), WMT_RATIO_SIGMA, rows), 1,
                         WMT_LONGEST)
        return [(int(s), int(t)) for s, t in zip(source, target, strict=True)]
    drawn = r.lognormal(np.log(IMDB_MEDIAN), IMDB_SIGMA, rows)
    clipped = np.clip(drawn, 8, IMDB_LONGEST) / scale
    return [max(int(n), 2) for n in clipped]


def longest(kind: str, sizes: Sequence[Any]) -> int:
    """What the costliest row costs: its length, or a pair's two lengths summed (the
    target's input and output share one)."""
    return max(sum(size) if kind in PAIRS else size for size in sizes)


def examples(kind: str, sizes: Sequence[Any], seed: int = 0):
    """The rows as a ``tf.data`` dataset of examples, each as long as it is."""
    import numpy as np
    import tensorflow as tf

    r = np.random.default_rng(seed)
    ids = tf.TensorSpec([None], tf.int32)
    if kind in PAIRS:
        pairs = [(r.integers(1, VOCAB, s).astype("int32"),
                  r.integers(1, VOCAB, t + 1).astype("int32")) for s, t in sizes]
        return tf.data.Dataset.from_generator(
            lambda: (({"source": s, "target": t[:-1]}, t[1:], np.ones(len(t) - 1, "float32"))
                     for s, t in pairs),
            output_signature=({"source": ids, "target": ids}, ids,
                              tf.TensorSpec([None], tf.float32))).cache()
    seqs = [r.integers(1, VOCAB, n).astype("int32") for n in sizes]
    if kind == "causal_lm":
        return tf.data.Dataset.from_generator(
            lambda: ((s[:-1], s[1:], np.ones(len(s) - 1, "float32")) for s in seqs),
            output_signature=(ids, ids, tf.TensorSpec([None], tf.float32))).cache()
    return tf.data.Dataset.from_generator(
        lambda: ((s, np.float32(s[0] % 2)) for s in seqs),
        output_signature=(ids, tf.TensorSpec([], tf.float32))).cache()


def _block(query, value, mask=None, causal=False):
    """Attention (under the value's padding ``mask``), its residual sum and a LayerNorm,
    then a feed-forward: a layer (not ``+``) sums, so that a Keras mask reaches on."""
    import keras

    attended = keras.layers.MultiHeadAttention(2, WIDTH // 2)(
        query, value, use_causal_mask=causal,
        **({} if mask is None else {"value_mask": mask}))
    hidden = keras.layers.LayerNormalization()(keras.layers.Add()([query, attended]))
    hidden = keras.layers.Dense(WIDTH * 2, activation="relu")(hidden)
    return keras.layers.Dense(WIDTH)(hidden)


def build(kind: str, accumulation: int | None = None, jit_compile: bool | str = "auto"):
    import keras

    keras.utils.set_random_seed(0)
    tokens = keras.Input((None,), dtype="int32")
    inputs: Any = tokens
    if kind == "gru":
        embedded = keras.layers.Embedding(VOCAB, WIDTH, mask_zero=True)(tokens)
        outputs = keras.layers.Dense(1)(keras.layers.GRU(WIDTH)(embedded))
    elif kind in PAIRS:
        target = keras.Input((None,), dtype="int32")
        inputs = {"source": tokens, "target": target}
        encoded = _block(*[keras.layers.Embedding(VOCAB, WIDTH, mask_zero=True)(tokens)] * 2)
        decoded = keras.layers.Embedding(VOCAB, WIDTH, mask_zero=True)(target)
        decoded = _block(_block(decoded, decoded, causal=True), encoded,
                         mask=keras.ops.not_equal(tokens, 0))
        outputs = keras.layers.Dense(VOCAB)(decoded)
    else:
        lm = kind == "causal_lm"
        embedded = keras.layers.Embedding(VOCAB, WIDTH, mask_zero=not lm)(tokens)
        hidden = _block(embedded, embedded, causal=lm)
        outputs = (keras.layers.Dense(VOCAB)(hidden) if lm else
                   keras.layers.Dense(1)(keras.layers.GlobalAveragePooling1D()(hidden)))
    model = keras.Model(inputs, outputs)
    loss = (keras.losses.SparseCategoricalCrossentropy(from_logits=True)
            if kind in ("causal_lm", *PAIRS) else keras.losses.BinaryCrossentropy(
                from_logits=True))
    model.compile(keras.optimizers.Adam(1e-3, gradient_accumulation_steps=accumulation), loss,
                  jit_compile=jit_compile)
    return model
