"""Sequence examples from keras.io, shrunk, trained with model.fit and with fit_large_batch.

- nlp/bidirectional_lstm_imdb.py: two Bidirectional LSTMs over an Embedding.
- nlp/lstm_seq2seq.py: an encoder-decoder LSTM fed as a list ``[encoder_in, decoder_in]``.
- nlp/neural_machine_translation_with_transformer.py: a Transformer fed as a dict, with
  padding masks from ``Embedding(mask_zero=True)`` and a causal mask (a masked loss).
- timeseries/timeseries_weather_forecasting.py: windows from
  ``keras.utils.timeseries_dataset_from_array`` (the same dataset fed to both).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
from _compare import (
    ADAM_RTOL,
    assert_exact,
    assert_same_training,
    dense_gradients,
    fit_both,
    steps,
    twins,
)
from keras import layers, ops

import autosplit


# bidirectional_lstm_imdb.py: 20000 words, 200 tokens, LSTM(64) twice, Adam, batch 32.
@pytest.mark.slow
def test_bidirectional_lstm():
    max_features, maxlen, n, batch, micro = 50, 12, 64, 32, 14
    rng = np.random.default_rng(0)
    x = rng.integers(1, max_features, size=(n, maxlen)).astype("int32")
    y = (x[:, :3].sum(axis=1) > 75).astype("int32")

    def make():
        inputs = keras.Input(shape=(None,), dtype="int32")
        x = layers.Embedding(max_features, 16)(inputs)
        x = layers.Bidirectional(layers.LSTM(8, return_sequences=True))(x)
        x = layers.Bidirectional(layers.LSTM(8))(x)
        outputs = layers.Dense(1, activation="sigmoid")(x)
        model = keras.Model(inputs, outputs)
        model.compile(dense_gradients(keras.optimizers.Adam)(), "binary_crossentropy",
                      metrics=["accuracy"])
        return model

    assert_exact(make, x, y, n=n, batch_size=batch, micro_batch_size=micro,
                 rtol=ADAM_RTOL)


# lstm_seq2seq.py: character-level English to French, one-hot, latent 256, RMSprop,
# batch 64; here 10 input and 12 target characters, sequences of 7 and 9, latent 16.
def test_lstm_seq2seq_with_list_inputs():
    num_encoder_tokens, num_decoder_tokens, latent_dim = 10, 12, 16
    max_encoder_seq_length, max_decoder_seq_length = 7, 9
    n, batch, micro = 90, 45, 20
    rng = np.random.default_rng(0)
    eye_in, eye_out = np.eye(num_encoder_tokens, dtype="float32"), np.eye(
        num_decoder_tokens, dtype="float32")
    encoder_input_data = eye_in[rng.integers(0, num_encoder_tokens,
                                             size=(n, max_encoder_seq_length))]
    target = rng.integers(0, num_decoder_tokens, size=(n, max_decoder_seq_length + 1))
    decoder_input_data = eye_out[target[:, :-1]]
    decoder_target_data = eye_out[target[:, 1:]]  # one step ahead, as in the example

    def make():
        encoder_inputs = keras.Input(shape=(None, num_encoder_tokens))
        encoder = keras.layers.LSTM(latent_dim, return_state=True)
        _, state_h, state_c = encoder(encoder_inputs)
        encoder_states = [state_h, state_c]
        decoder_inputs = keras.Input(shape=(None, num_decoder_tokens))
        decoder_lstm = keras.layers.LSTM(latent_dim, return_sequences=True, return_state=True)
        decoder_outputs, _, _ = decoder_lstm(decoder_inputs, initial_state=encoder_states)
        decoder_dense = keras.layers.Dense(num_decoder_tokens, activation="softmax")
        decoder_outputs = decoder_dense(decoder_outputs)
        model = keras.Model([encoder_inputs, decoder_inputs], decoder_outputs)
        model.compile(optimizer="rmsprop", loss="categorical_crossentropy",
                      metrics=["accuracy"])
        return model

    reference, candidate = twins(make)
    expected, got = fit_both(reference, candidate, [encoder_input_data, decoder_input_data],
                             decoder_target_data, batch_size=batch, micro_batch_size=micro,
                             epochs=2)
    assert_same_training(reference, candidate, expected, got, rtol=ADAM_RTOL,
                         steps=steps(n, batch, 2))


# neural_machine_translation_with_transformer.py: English to Spanish, vocab 15000, 20
# tokens, embed 256, 8 heads, RMSprop, batch 64; here vocab 30, 8 tokens, embed 16.
VOCAB, SEQ_LEN, EMBED_DIM, LATENT_DIM, NUM_HEADS = 30, 8, 16, 32, 2


class TransformerEncoder(layers.Layer):
    def __init__(self, embed_dim, dense_dim, num_heads, **kwargs):
        super().__init__(**kwargs)
        # use_bias=False: the key bias has a zero gradient, which adaptive optimizers turn
        # into rounding-noise steps (see test_vision).
        self.attention = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim,
                                                   use_bias=False)
        self.dense_proj = keras.Sequential(
            [layers.Dense(dense_dim, activation="relu"), layers.Dense(embed_dim)])
        self.layernorm_1 = layers.LayerNormalization()
        self.layernorm_2 = layers.LayerNormalization()
        self.supports_masking = True

    def call(self, inputs, mask=None):
        padding_mask = None
        if mask is not None:
            padding_mask = ops.cast(mask[:, None, :], dtype="int32")
        attention_output = self.attention(query=inputs, value=inputs, key=inputs,
                                          attention_mask=padding_mask)
        proj_input = self.layernorm_1(inputs + attention_output)
        proj_output = self.dense_proj(proj_input)
        return self.layernorm_2(proj_input + proj_output)


class PositionalEmbedding(layers.Layer):
    def __init__(self, sequence_length, vocab_size, embed_dim, **kwargs):
        super().__init__(**kwargs)
        self.token_embeddings = layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.position_embeddings = layers.Embedding(input_dim=sequence_length,
                                                    output_dim=embed_dim)

    def call(self, inputs):
        length = ops.shape(inputs)[-1]
        positions = ops.arange(0, length, 1)
        return self.token_embeddings(inputs) + self.position_embeddings(positions)

    def compute_mask(self, inputs, mask=None):
        return ops.not_equal(inputs, 0)  # Embedding(mask_zero=True)'s mask


class TransformerDecoder(layers.Layer):
    def __init__(self, embed_dim, latent_dim, num_heads, **kwargs):
        super().__init__(**kwargs)
        self.attention_1 = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim,
                                                     use_bias=False)
        self.attention_2 = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim,
                                                     use_bias=False)
        self.dense_proj = keras.Sequential(
            [layers.Dense(latent_dim, activation="relu"), layers.Dense(embed_dim)])
        self.layernorm_1 = layers.LayerNormalization()
        self.layernorm_2 = layers.LayerNormalization()
        self.layernorm_3 = layers.LayerNormalization()
        self.supports_masking = True

    def call(self, inputs, encoder_outputs, mask=None):
        causal_mask = self.get_causal_attention_mask(inputs)
        padding_mask = None
        if mask is not None:
            padding_mask = ops.cast(mask[:, None, :], dtype="int32")
            padding_mask = ops.minimum(padding_mask, causal_mask)
        attention_output_1 = self.attention_1(query=inputs, value=inputs, key=inputs,
                                              attention_mask=causal_mask)
        out_1 = self.layernorm_1(inputs + attention_output_1)
        attention_output_2 = self.attention_2(query=out_1, value=encoder_outputs,
                                              key=encoder_outputs,
                                              attention_mask=padding_mask)
        out_2 = self.layernorm_2(out_1 + attention_output_2)
        proj_output = self.dense_proj(out_2)
        return self.layernorm_3(out_2 + proj_output)

    def get_causal_attention_mask(self, inputs):
        input_shape = ops.shape(inputs)
        batch_size, sequence_length = input_shape[0], input_shape[1]
        i = ops.arange(sequence_length)[:, None]
        j = ops.arange(sequence_length)
        mask = ops.cast(i >= j, dtype="int32")
        return ops.broadcast_to(mask[None], (batch_size, sequence_length, sequence_length))


def transformer_translator():
    encoder_inputs = keras.Input(shape=(None,), dtype="int64", name="encoder_inputs")
    x = PositionalEmbedding(SEQ_LEN, VOCAB, EMBED_DIM)(encoder_inputs)
    encoder_outputs = TransformerEncoder(EMBED_DIM, LATENT_DIM, NUM_HEADS)(x)
    decoder_inputs = keras.Input(shape=(None,), dtype="int64", name="decoder_inputs")
    x = PositionalEmbedding(SEQ_LEN, VOCAB, EMBED_DIM)(decoder_inputs)
    x = TransformerDecoder(EMBED_DIM, LATENT_DIM, NUM_HEADS)(x, encoder_outputs)
    x = layers.Dropout(0.0)(x)  # 0.5 in the example
    decoder_outputs = layers.Dense(VOCAB, activation="softmax")(x)
    transformer = keras.Model({"encoder_inputs": encoder_inputs,
                               "decoder_inputs": decoder_inputs},
                              decoder_outputs, name="transformer")
    transformer.compile(dense_gradients(keras.optimizers.RMSprop)(),
                        loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return transformer


def sentences(rng, n, length):
    """Token ids, each sentence zero-padded after a random length (at least 2)."""
    ids = rng.integers(2, VOCAB, size=(n, length))
    lengths = rng.integers(2, length + 1, size=(n, 1))
    return np.where(np.arange(length) < lengths, ids, 0).astype("int64")


@pytest.mark.slow
def test_transformer_translation_with_dict_inputs_and_masks():
    n, batch, micro = 80, 40, 15
    rng = np.random.default_rng(0)
    eng = sentences(rng, n, SEQ_LEN)
    spa = sentences(rng, n, SEQ_LEN + 1)  # "[start] ... [end]", as format_dataset cuts it
    x = {"encoder_inputs": eng, "decoder_inputs": spa[:, :-1]}
    y = spa[:, 1:]
    reference, candidate = twins(transformer_translator)
    expected, got = fit_both(reference, candidate, x, y, batch_size=batch,
                             micro_batch_size=micro, epochs=2)
    assert_same_training(reference, candidate, expected, got, rtol=ADAM_RTOL,
                         steps=steps(n, batch, 2))


# timeseries_weather_forecasting.py: 14 features every 10 minutes, one sample an hour
# (sampling_rate=6), 120 hours of past, the temperature 72 hours later; LSTM(32), Adam,
# mse, batch 256. Here 5 features, 12 steps of past, 3 ahead, LSTM(8), batch 40.
def test_timeseries_weather_forecasting_from_timeseries_dataset_from_array():
    rng = np.random.default_rng(0)
    step, past, future, batch, micro = 6, 72, 18, 40, 15
    raw = np.cumsum(rng.normal(size=(600, 5)), axis=0).astype("float32")
    features = (raw - raw.mean(axis=0)) / raw.std(axis=0)
    train_split = 420
    train_data, val_data = features[:train_split], features[train_split:]
    start = past + future
    sequence_length = past // step
    x_train = train_data[:len(train_data) - start]  # as in the example: x then y aligned
    y_train = features[start:start + len(x_train)][:, 1]
    dataset_train = keras.utils.timeseries_dataset_from_array(
        x_train, y_train, sequence_length=sequence_length, sampling_rate=step,
        batch_size=batch)
    x_val = val_data[:len(val_data) - start]
    y_val = features[train_split + start:train_split + start + len(x_val)][:, 1]
    dataset_val = keras.utils.timeseries_dataset_from_array(
        x_val, y_val, sequence_length=sequence_length, sampling_rate=step, batch_size=batch)
    n = sum(int(b[0].shape[0]) for b in dataset_train)

    def make():
        inputs = keras.layers.Input(shape=(sequence_length, features.shape[1]))
        lstm_out = keras.layers.LSTM(8)(inputs)
        outputs = keras.layers.Dense(1)(lstm_out)
        model = keras.Model(inputs=inputs, outputs=outputs)
        model.compile(optimizer=keras.optimizers.Adam(learning_rate=0.001), loss="mse")
        return model

    reference, candidate = twins(make)
    expected, got = fit_both(reference, candidate, dataset_train, batch_size=batch,
                             micro_batch_size=micro, epochs=2)
    assert_same_training(reference, candidate, expected, got, rtol=ADAM_RTOL,
                         steps=steps(n, batch, 2))
    # A third epoch with validation_data, as in the example: val_loss is the exact mean.
    history = autosplit.fit_large_batch(
        candidate, dataset_train, batch_size=batch, micro_batch_size=micro, epochs=1,
        shuffle=False, verbose=0, validation_data=dataset_val).history
    reference.fit(dataset_train, epochs=1, shuffle=False, verbose=0)
    exact = reference.evaluate(dataset_val, verbose=0, return_dict=True)
    np.testing.assert_allclose(history["val_loss"], [exact["loss"]], rtol=ADAM_RTOL)
