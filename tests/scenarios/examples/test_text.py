"""Text examples from keras.io, shrunk, trained with model.fit and with fit_large_batch.

- nlp/text_classification_from_scratch.py: raw strings through TextVectorization, both
  inside the model (string inputs) and mapped over a tf.data dataset (its main recipe).
- nlp/text_classification_with_transformer.py: a Transformer block classifier.

Their Adam sees dense Embedding gradients in both twins (``_compare.dense_gradients``).
"""

from __future__ import annotations

import _compare
import keras
import numpy as np
import tensorflow as tf
from _compare import ADAM_RTOL, assert_exact, assert_same_training, fit_both, steps, twins
from keras import layers, ops

WORDS = ["the", "movie", "was", "great", "bad", "awful", "film", "plot", "actor", "loved",
         "hated", "boring", "fun", "story", "scene", "music", "long", "short", "best",
         "worst", "ever", "<br />", "again"]


def reviews(n, seed=0):
    """Raw review strings of 3 to 14 words, with a label that depends on the words."""
    rng = np.random.default_rng(seed)
    texts, labels = [], []
    for _ in range(n):
        words = rng.choice(WORDS, size=rng.integers(3, 15))
        texts.append(" ".join(words).capitalize() + ".")
        labels.append(int(("great" in words) or ("loved" in words)))
    return np.array(texts), np.array(labels, dtype="int32")


MAX_FEATURES, EMBEDDING_DIM, SEQUENCE_LENGTH = 40, 16, 12


def vectorizer(texts):
    def custom_standardization(input_data):  # as in the example: lowercase, no <br />
        lowercase = tf.strings.lower(input_data)
        stripped_html = tf.strings.regex_replace(lowercase, "<br />", " ")
        return tf.strings.regex_replace(stripped_html, r"[.,!?]", "")

    vectorize_layer = layers.TextVectorization(
        standardize=custom_standardization, max_tokens=MAX_FEATURES,
        output_mode="int", output_sequence_length=SEQUENCE_LENGTH)
    vectorize_layer.adapt(texts)
    return vectorize_layer


def conv_classifier(inputs, x):
    x = layers.Embedding(MAX_FEATURES, EMBEDDING_DIM)(x)
    x = layers.Dropout(0.0)(x)  # 0.5 in the example
    x = layers.Conv1D(16, 3, padding="valid", activation="relu", strides=2)(x)
    x = layers.Conv1D(16, 3, padding="valid", activation="relu", strides=2)(x)
    x = layers.GlobalMaxPooling1D()(x)
    x = layers.Dense(16, activation="relu")(x)
    x = layers.Dropout(0.0)(x)
    predictions = layers.Dense(1, activation="sigmoid", name="predictions")(x)
    model = keras.Model(inputs, predictions)
    model.compile(loss="binary_crossentropy",
                  optimizer=_compare.dense_gradients(keras.optimizers.Adam)(),
                  metrics=["accuracy"])
    return model


def test_text_classification_end_to_end_from_raw_strings():
    # The example's end-to-end model: a string input, TextVectorization inside the model.
    n, batch, micro = 100, 50, 20
    texts, labels = reviews(n)
    vectorize_layer = vectorizer(texts)

    def make():
        inputs = keras.Input(shape=(1,), dtype="string")
        return conv_classifier(inputs, vectorize_layer(inputs))

    x = tf.constant(texts)[:, None]  # Keras cannot take a NumPy unicode array
    assert_exact(make, x, labels, n=n, batch_size=batch, micro_batch_size=micro,
                 rtol=ADAM_RTOL)


def test_text_classification_with_text_vectorization_over_a_dataset():
    # The example's main recipe: a batched tf.data of (text, label), vectorized by .map.
    n, batch, micro = 100, 50, 20
    texts, labels = reviews(n, seed=1)
    vectorize_layer = vectorizer(texts)

    def vectorize_text(text, label):
        text = tf.expand_dims(text, -1)
        return vectorize_layer(text), label

    raw_train_ds = tf.data.Dataset.from_tensor_slices((texts, labels)).batch(batch)
    train_ds = raw_train_ds.map(vectorize_text).cache().prefetch(buffer_size=10)

    def make():
        inputs = keras.Input(shape=(None,), dtype="int64")
        return conv_classifier(inputs, inputs)

    reference, candidate = twins(make)
    expected, got = fit_both(reference, candidate, train_ds, batch_size=batch,
                             micro_batch_size=micro, epochs=2)
    assert_same_training(reference, candidate, expected, got, rtol=ADAM_RTOL,
                         steps=steps(n, batch, 2))


# text_classification_with_transformer.py: IMDB, vocab 20000, 200 tokens, embed 32,
# 2 heads; here vocab 60, 16 tokens, embed 16.
VOCAB_SIZE, MAXLEN, EMBED_DIM, NUM_HEADS, FF_DIM = 60, 16, 16, 2, 16


class TransformerBlock(layers.Layer):
    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1):
        super().__init__()
        # use_bias=False: the key projection's bias has a zero gradient (softmax ignores
        # it); Adam turns its rounding noise into full-size steps (see test_vision).
        self.att = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim,
                                             use_bias=False)
        self.ffn = keras.Sequential(
            [layers.Dense(ff_dim, activation="relu"), layers.Dense(embed_dim)])
        self.layernorm1 = layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = layers.Dropout(rate)
        self.dropout2 = layers.Dropout(rate)

    def call(self, inputs):
        attn_output = self.att(inputs, inputs)
        attn_output = self.dropout1(attn_output)
        out1 = self.layernorm1(inputs + attn_output)
        ffn_output = self.ffn(out1)
        ffn_output = self.dropout2(ffn_output)
        return self.layernorm2(out1 + ffn_output)


class TokenAndPositionEmbedding(layers.Layer):
    def __init__(self, maxlen, vocab_size, embed_dim):
        super().__init__()
        self.token_emb = layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.pos_emb = layers.Embedding(input_dim=maxlen, output_dim=embed_dim)

    def call(self, x):
        maxlen = ops.shape(x)[-1]
        positions = ops.arange(start=0, stop=maxlen, step=1)
        positions = self.pos_emb(positions)
        x = self.token_emb(x)
        return x + positions


def test_transformer_classifier():
    n, batch, micro = 96, 48, 20
    rng = np.random.default_rng(0)
    x = rng.integers(1, VOCAB_SIZE, size=(n, MAXLEN)).astype("int32")
    x[:, MAXLEN // 2:] *= rng.integers(0, 2, size=(n, 1))  # padded reviews, as IMDB's
    y = (x[:, 0] < VOCAB_SIZE // 2).astype("int32")

    def make():
        inputs = layers.Input(shape=(MAXLEN,))
        x = TokenAndPositionEmbedding(MAXLEN, VOCAB_SIZE, EMBED_DIM)(inputs)
        x = TransformerBlock(EMBED_DIM, NUM_HEADS, FF_DIM, rate=0.0)(x)
        x = layers.GlobalAveragePooling1D()(x)
        x = layers.Dropout(0.0)(x)
        x = layers.Dense(16, activation="relu")(x)
        x = layers.Dropout(0.0)(x)
        outputs = layers.Dense(2, activation="softmax")(x)
        model = keras.Model(inputs=inputs, outputs=outputs)
        model.compile(optimizer=_compare.dense_gradients(keras.optimizers.Adam)(),
                      loss="sparse_categorical_crossentropy",
                      metrics=["accuracy"])
        return model

    assert_exact(make, x, y, n=n, batch_size=batch, micro_batch_size=micro,
                 rtol=ADAM_RTOL)
