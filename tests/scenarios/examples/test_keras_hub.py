"""keras_hub models, tiny, from their constructors (no preset: nothing is downloaded).

Each is trained by ``model.fit`` and by ``fit_large_batch`` at an uneven split and
compared on weights, optimizer state, iterations and History (``_compare``). Dropout is
0 everywhere: its masks depend on how a batch is cut.
"""

from __future__ import annotations

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf
from _compare import ADAM_RTOL, SGD_RTOL, assert_logs_close, dense_gradients, fit_both, steps
from _compare import twins as compare_twins
from common import relative_error

import autosplit

N, B, M = 96, 32, 12
SEQUENCE = 12
VOCABULARY = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]",
              "the", "a", "cat", "dog", "sat", "ran", "on", "mat", "fast", "slow", "big"]


def tokens(n=N, seed=0):
    """Token ids with padding after a random length, and their padding mask."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(5, len(VOCABULARY), size=(n, SEQUENCE)).astype("int32")
    lengths = rng.integers(4, SEQUENCE + 1, size=n)
    mask = np.arange(SEQUENCE)[None, :] < lengths[:, None]
    return np.where(mask, ids, 0).astype("int32"), mask


def _noise_only(path):
    return path.endswith("key/bias") or "key_bias" in path


def assert_same_training(reference, candidate, expected, got, *, rtol, steps, x, y,
                         sample_weight=None, reordered=None):
    """``_compare.assert_same_training`` without the attention key biases, after checking
    on the first large batch that their gradients are rounding noise (below 1e-6 of the
    largest gradient). Given ``reordered``, model.fit's run on the same batches with their
    rows reordered, the weights and the optimizer variables are each judged against
    max(rtol, 3x how far that run is from the reference)."""
    fresh = compare_twins(lambda: reference.__class__.from_config(reference.get_config()))[0]
    batch = [None if part is None else keras.tree.map_structure(lambda t: t[:B], part)
             for part in (x, y, sample_weight)]
    with tf.GradientTape() as tape:
        predictions = fresh(batch[0], training=True)
        loss = fresh.compute_loss(x=batch[0], y=batch[1], y_pred=predictions,
                                  sample_weight=batch[2])
    gradients = tape.gradient(loss, fresh.trainable_variables)
    largest = max(float(tf.reduce_max(tf.abs(g))) for g in gradients)
    noise = [float(tf.reduce_max(tf.abs(g))) for g, v in
             zip(gradients, fresh.trainable_variables, strict=True) if _noise_only(v.path)]
    assert noise and max(noise) <= 1e-6 * largest, (noise, largest)
    assert int(reference.optimizer.iterations) == int(candidate.optimizer.iterations) == steps

    def kept(variables):
        return [np.asarray(v) for v in variables if not _noise_only(v.path)]

    for group, of in (("weights", lambda model: model.weights),
                      ("optimizer variables", lambda model: model.optimizer.variables)):
        bound = rtol if reordered is None else max(
            rtol, 3 * relative_error(kept(of(reference)), kept(of(reordered))))
        err = relative_error(kept(of(reference)), kept(of(candidate)))
        assert err <= bound, f"{group}: relative error {err:.2e} > {bound:.2e}"
    assert_logs_close(expected, got, rtol)


def fit_reordered(model, x, y, *, epochs):
    """``model.fit`` as ``fit_both`` runs it, on the same large batches with the rows of
    each in reverse order."""
    order = np.concatenate([np.arange(start, min(start + B, N))[::-1]
                            for start in range(0, N, B)])
    keras.utils.set_random_seed(7)
    model.fit(keras.tree.map_structure(lambda part: part[order], x), y[order], batch_size=B,
              epochs=epochs, shuffle=False, verbose=0)
    return model


def assert_exact(make, x, y, *, rtol, sample_weight=None, epochs=2):
    reference, candidate = compare_twins(make)
    expected, got = fit_both(reference, candidate, x, y, batch_size=B, micro_batch_size=M,
                             epochs=epochs, sample_weight=sample_weight)
    assert_same_training(reference, candidate, expected, got, rtol=rtol,
                         steps=steps(N, B, epochs), x=x, y=y, sample_weight=sample_weight)
    return reference, candidate


def bert_backbone(dtype=None):
    return keras_hub.models.BertBackbone(
        vocabulary_size=len(VOCABULARY), num_layers=2, num_heads=2, hidden_dim=16,
        intermediate_dim=32, dropout=0.0, max_sequence_length=SEQUENCE, dtype=dtype)


def compile_classifier(model, optimizer=None):
    model.compile(optimizer=optimizer or dense_gradients(keras.optimizers.Adam)(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def bert_classifier(lora=False, dtype=None):
    backbone = bert_backbone(dtype)
    if lora:
        backbone.enable_lora(rank=2)
    model = keras_hub.models.BertTextClassifier(backbone, num_classes=3, preprocessor=None,
                                                dropout=0.0, dtype=dtype)
    return compile_classifier(model)


def bert_inputs(n=N, seed=0):
    ids, mask = tokens(n, seed)
    x = {"token_ids": ids, "segment_ids": np.zeros_like(ids), "padding_mask": mask}
    y = (ids[:, 0] % 3).astype("int32")
    return x, y


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_bert_classifier_trains_as_under_model_fit(lora):
    x, y = bert_inputs()
    _, candidate = assert_exact(lambda: bert_classifier(lora), x, y, rtol=ADAM_RTOL)
    if lora:  # only the low-rank factors and the head train
        assert len(candidate.trainable_weights) < len(candidate.weights) / 2


def test_a_gpt2_causal_lm_with_the_padding_mask_as_sample_weight():
    """Next-token loss over real tokens only: sample_weight is the padding mask, so each
    large batch's loss is a ratio of sums over uneven micro-batches."""
    ids, mask = tokens()

    def make():
        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=len(VOCABULARY), num_layers=2, num_heads=2, hidden_dim=16,
            intermediate_dim=32, dropout=0.0, max_sequence_length=SEQUENCE)
        model = keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)
        model.compile(optimizer=dense_gradients(keras.optimizers.AdamW)(1e-3,
                                                                        weight_decay=0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      weighted_metrics=["sparse_categorical_accuracy"])
        return model

    x = {"token_ids": ids[:, :-1], "padding_mask": mask[:, :-1]}
    assert_exact(make, x, ids[:, 1:], sample_weight=mask[:, 1:].astype("float32"),
                 rtol=ADAM_RTOL)


def test_a_vit_image_classifier_trains_as_under_model_fit():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, 16, 16, 3)).astype("float32")
    y = rng.integers(0, 3, size=N).astype("int32")

    def make():
        backbone = keras_hub.models.ViTBackbone(
            image_shape=(16, 16, 3), patch_size=4, num_layers=1, num_heads=2, hidden_dim=16,
            mlp_dim=32)
        model = keras_hub.models.ViTImageClassifier(backbone, num_classes=3,
                                                    preprocessor=None)
        return compile_classifier(model, keras.optimizers.SGD(0.05, momentum=0.9))

    assert_exact(make, x, y, rtol=SGD_RTOL)


def test_a_bert_classifier_in_mixed_float16_scales_its_loss_as_under_model_fit():
    """float16 activations round differently per CPU and per graph (autosplit traces a
    static batch dimension, model.fit a dynamic one: as far off with one micro-batch), so
    each group is judged against tests/step/test_mixed_precision.py's tolerance or, where
    more, 3x how far model.fit itself moves with each batch's rows reversed."""
    x, y = bert_inputs()

    def make():
        return bert_classifier(dtype="mixed_float16")

    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        reference, candidate = compare_twins(make)
        assert isinstance(candidate.optimizer, keras.optimizers.LossScaleOptimizer)
        expected, got = fit_both(reference, candidate, x, y, batch_size=B,
                                 micro_batch_size=M, epochs=2)
        reordered = fit_reordered(compare_twins(make)[0], x, y, epochs=2)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    # One loss scale per large batch, lowered or raised as model.fit's.
    assert float(candidate.optimizer.dynamic_scale) == float(reference.optimizer.dynamic_scale)
    assert_same_training(reference, candidate, expected, got, rtol=2e-3,
                         steps=steps(N, B, 2), x=x, y=y, reordered=reordered)


def sentences(n=N, seed=0):
    rng = np.random.default_rng(seed)
    words = VOCABULARY[5:]
    text = np.array([" ".join(rng.choice(words, size=rng.integers(2, 9)))
                     for _ in range(n)])
    labels = np.array([len(t.split()) % 3 for t in text], "int32")
    return text, labels


def raw_text_classifier():
    tokenizer = keras_hub.models.BertTokenizer(vocabulary=VOCABULARY)
    preprocessor = keras_hub.models.BertTextClassifierPreprocessor(tokenizer,
                                                                   sequence_length=SEQUENCE)
    model = keras_hub.models.BertTextClassifier(bert_backbone(), num_classes=3,
                                                preprocessor=preprocessor, dropout=0.0)
    return compile_classifier(model)


@pytest.mark.parametrize("form", ["arrays", "dataset"])
def test_a_task_fed_raw_strings_trains_as_its_own_fit_trains_it(form):
    """The Task's preprocessor (tokenize, pack, pad) runs in a tf.data map over the
    batches, as in the Task's own fit; validation data too."""
    x, y = sentences()
    vx, vy = sentences(40, seed=1)
    if form == "dataset":
        x, y = tf.data.Dataset.from_tensor_slices((x, y)).batch(B), None
        validation = tf.data.Dataset.from_tensor_slices((vx, vy)).batch(B)
    else:
        validation = (vx, vy)
    reference, candidate = compare_twins(raw_text_classifier)
    expected = reference.fit(x, y, batch_size=None if y is None else B, epochs=2,
                             validation_data=validation, shuffle=False, verbose=0).history
    got = autosplit.fit_large_batch(candidate, x, y, batch_size=B, micro_batch_size=M,
                                    epochs=2, validation_data=validation, shuffle=False,
                                    verbose=0).history
    assert "val_loss" in got
    tokens_x, tokens_y = bert_inputs()  # for the key bias's gradient, any tokens do
    assert_same_training(reference, candidate, expected, got, rtol=ADAM_RTOL,
                         steps=steps(N, B, 2), x=tokens_x, y=tokens_y)


def test_a_task_fed_a_generator_is_refused_before_anything_changes():
    x, y = sentences()
    model = raw_text_classifier()

    def batches():
        for start in range(0, N, B):
            yield x[start:start + B], y[start:start + B]

    with pytest.raises(autosplit.DatasetError, match=r"arrays or a tf.data.Dataset.*"
                       r"preprocessor = None"):
        autosplit.fit_large_batch(model, batches(), batch_size=B, micro_batch_size=M,
                                  verbose=0)
    assert int(model.optimizer.iterations) == 0
