"""BatchNormalization's moving statistics under a split: committed once per large batch
with the exactly pooled statistics of every micro-batch (``batch_norm="pooled"``, the
default), or once per micro-batch (``"micro"``, Keras's gradient accumulation's way).

Where BatchNormalization sees the raw inputs, a micro-batch's activations are exactly
the full batch's rows, so the moving statistics must equal ``model.fit``'s at batch B.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
from common import TwoViews, relative_error

import autosplit
from autosplit.testing import inject_oom

# Every model here has BatchNormalization in training mode, so every call gives the
# ghost-batch note; that it does, and where it points, is tested in test_fit and
# test_warnings.
pytestmark = pytest.mark.filterwarnings("ignore:This model has BatchNormalization layers")

B, M = 50, 20  # 3 micro-batches of 17: one padding row


def moving(model):
    return [w.numpy().copy() for layer in model.layers
            if isinstance(layer, keras.layers.BatchNormalization)
            for w in (layer.moving_mean, layer.moving_variance)]


def assert_moving_close(expected, actual, tol=1e-6):
    for e, a in zip(expected, actual, strict=True):
        np.testing.assert_allclose(a, e, rtol=tol, atol=tol)


def first_layer_bn(input_shape, head, momentum=0.9):
    """BatchNormalization on the raw inputs, then ``head`` layers."""
    model = keras.Sequential([keras.Input(input_shape),
                              keras.layers.BatchNormalization(momentum=momentum), *head])
    model.compile(optimizer=keras.optimizers.SGD(0.05),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def twins(make):
    reference, candidate = make(), make()
    candidate.set_weights(reference.get_weights())
    return reference, candidate


def shifted(shape, seed=0):
    """Inputs with a mean and a spread far from 0 and 1, so the statistics matter."""
    r = np.random.default_rng(seed)
    return (3.0 + 2.0 * r.normal(size=shape)).astype("float32"), r.integers(0, 3, shape[0])


@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "sample-weights"])
def test_dense_inputs_equal_model_fit_at_batch_b(weighted):
    x, y = shifted((2 * B, 6))
    w = np.random.default_rng(1).uniform(0.2, 2.0, size=2 * B).astype("float32")
    reference, candidate = twins(lambda: first_layer_bn((6,), [keras.layers.Dense(3)]))
    kwargs = {"sample_weight": w} if weighted else {}
    reference.fit(x, y, batch_size=B, shuffle=False, verbose=0, **kwargs)
    history = autosplit.fit_large_batch(candidate, x, y, batch_size=B, micro_batch_size=M,
                                        shuffle=False, verbose=0, **kwargs)
    assert history.autosplit.batch_norm == "pooled"
    assert history.autosplit.padded_rows == 1
    assert int(candidate.optimizer.iterations) == 2
    assert_moving_close(moving(reference), moving(candidate))


def test_conv_inputs_count_spatial_positions():
    x, y = shifted((B, 6, 5, 3), seed=2)
    reference, candidate = twins(lambda: first_layer_bn(
        (6, 5, 3), [keras.layers.Conv2D(4, 3), keras.layers.GlobalAveragePooling2D(),
                    keras.layers.Dense(3)]))
    reference.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    autosplit.fit_large_batch(candidate, x, y, batch_size=B, micro_batch_size=M,
                              shuffle=False, verbose=0)
    assert_moving_close(moving(reference), moving(candidate))


@pytest.mark.slow
def test_masked_time_steps_count_unmasked_positions():
    """Embedding(mask_zero=True) -> BatchNormalization over time steps: the mask decides
    what is counted (the embedding is row-wise, so micro-batch rows are the batch's)."""
    r = np.random.default_rng(3)
    lengths = r.integers(1, 8, size=(B, 1))
    tokens = np.where(np.arange(7)[None, :] < lengths, r.integers(1, 20, size=(B, 7)), 0)
    y = r.integers(0, 3, size=B)

    def make():
        inputs = keras.Input((7,), dtype="int32")
        h = keras.layers.Embedding(20, 4, mask_zero=True)(inputs)
        h = keras.layers.BatchNormalization(momentum=0.8)(h)
        outputs = keras.layers.Dense(3)(keras.layers.GlobalAveragePooling1D()(h))
        model = keras.Model(inputs, outputs)
        model.compile(optimizer=keras.optimizers.SGD(0.05),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    reference, candidate = twins(make)
    reference.fit(tokens, y, batch_size=B, shuffle=False, verbose=0)
    autosplit.fit_large_batch(candidate, tokens, y, batch_size=B, micro_batch_size=M,
                              shuffle=False, verbose=0)
    assert_moving_close(moving(reference), moving(candidate))


def test_micro_mode_updates_once_per_micro_batch_as_before():
    x, y = shifted((B, 6), seed=4)
    reference, candidate = twins(lambda: first_layer_bn((6,), [keras.layers.Dense(3)]))
    history = autosplit.fit_large_batch(candidate, x, y, batch_size=B, micro_batch_size=25,
                                        shuffle=False, verbose=0, batch_norm="micro")
    assert history.autosplit.batch_norm == "micro"
    mean, var = np.zeros(6), np.ones(6)
    for part in (x[:25], x[25:]):  # what Keras's update does once per micro-batch
        mean = 0.9 * mean + 0.1 * part.mean(axis=0)
        var = 0.9 * var + 0.1 * part.var(axis=0)
    assert_moving_close([mean, var], moving(candidate), tol=1e-5)
    reference.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    assert relative_error(moving(reference), moving(candidate)) > 1e-3


def test_bad_batch_norm_argument_is_refused():
    model = first_layer_bn((6,), [keras.layers.Dense(3)])
    x, y = shifted((B, 6))
    with pytest.raises(ValueError, match="batch_norm"):
        autosplit.fit_large_batch(model, x, y, batch_size=B, micro_batch_size=M,
                                  batch_norm="ghost", verbose=0)


def resnet_like():
    inputs = keras.Input((6, 6, 3))
    h = keras.layers.Conv2D(8, 3, padding="same", use_bias=False)(inputs)
    h = keras.layers.BatchNormalization(name="bn1")(h)
    h = keras.layers.Activation("relu")(h)
    skip = h
    h = keras.layers.Conv2D(8, 3, padding="same", use_bias=False)(h)
    h = keras.layers.BatchNormalization(name="bn2")(h)
    h = keras.layers.Add()([keras.layers.Activation("relu")(h), skip])
    h = keras.layers.BatchNormalization(name="bn3")(h)
    outputs = keras.layers.Dense(3)(keras.layers.GlobalAveragePooling2D()(h))
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.SGD(0.05),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.mark.slow
def test_deeper_layers_pool_the_micro_batches_activations():
    """A ResNet-style block: each layer's moving statistics after one large batch equal
    Keras's update with the pooled statistics of the same micro-batches' activations at
    that layer, recorded independently (float64) from sub-models run in training mode."""
    x, y = shifted((B, 6, 6, 3), seed=5)
    model = resnet_like()
    before = {layer.name: (layer.moving_mean.numpy().copy(), layer.moving_variance.numpy().copy())
              for layer in model.layers if isinstance(layer, keras.layers.BatchNormalization)}
    probes = {name: keras.Model(model.input, model.get_layer(name).input) for name in before}
    # (Running the probes in training mode moves the shared layers' statistics: they are
    # put back before training.)
    # The activations every micro-batch's forward pass sees (weights do not change
    # within a large batch): 3 micro-batches of 17, 17 and 16 real rows.
    pieces = [x[0:17], x[17:34], x[34:50]]
    expected = {}
    for name, probe in probes.items():
        acts = np.concatenate([np.asarray(probe(p, training=True), np.float64) for p in pieces])
        flat = acts.reshape(-1, acts.shape[-1])
        old_mean, old_var = before[name]
        expected[name] = (0.99 * old_mean + 0.01 * flat.mean(axis=0),
                          0.99 * old_var + 0.01 * flat.var(axis=0))
    for name, (mean, var) in before.items():
        model.get_layer(name).moving_mean.assign(mean)
        model.get_layer(name).moving_variance.assign(var)
    autosplit.fit_large_batch(model, x, y, batch_size=B, micro_batch_size=M, shuffle=False,
                              verbose=0)
    assert int(model.optimizer.iterations) == 1
    for name, (mean, var) in expected.items():
        layer = model.get_layer(name)
        np.testing.assert_allclose(layer.moving_mean.numpy(), mean, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(layer.moving_variance.numpy(), var, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_out_of_memory_recovery_leaves_the_statistics_of_the_run_without_it():
    """Step 1 fails and is redone in smaller micro-batches: the pooled statistics of a
    first-layer BatchNormalization do not depend on the cut, nor count anything twice."""
    x, y = shifted((4 * B, 6), seed=6)
    reference, candidate = twins(lambda: first_layer_bn((6,), [keras.layers.Dense(3)]))
    autosplit.fit_large_batch(reference, x, y, batch_size=B, micro_batch_size=M,
                              shuffle=False, verbose=0)
    with pytest.warns(UserWarning, match="finishing the same batch"), \
            inject_oom(at_steps={1}) as raised:
        autosplit.fit_large_batch(candidate, x, y, batch_size=B, micro_batch_size=M,
                                  shuffle=False, verbose=0)
    assert raised
    assert int(candidate.optimizer.iterations) == 4
    assert_moving_close(moving(reference), moving(candidate), tol=1e-5)


@pytest.mark.slow
def test_mixed_float16_pools_in_float32():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        x, y = shifted((B, 6), seed=7)
        reference, candidate = twins(lambda: first_layer_bn(
            (6,), [keras.layers.Dense(3), keras.layers.Activation("linear", dtype="float32")]))
        reference.fit(x, y, batch_size=B, shuffle=False, verbose=0)
        autosplit.fit_large_batch(candidate, x, y, batch_size=B, micro_batch_size=M,
                                  shuffle=False, verbose=0)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    # Keras computes the update in float16 inputs' float32 result type; the moments of
    # float16 inputs agree to float16 precision.
    assert_moving_close(moving(reference), moving(candidate), tol=2e-3)


def two_views_functional():
    """One BatchNormalization layer shared by two inputs of a functional model."""
    a, b = keras.Input((4,)), keras.Input((4,))
    norm = keras.layers.BatchNormalization(momentum=0.9)
    out = keras.layers.Dense(3)(keras.layers.Concatenate()([norm(a), norm(b)]))
    model = keras.Model([a, b], out)
    model.compile(optimizer=keras.optimizers.SGD(0.05),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def two_views_custom():
    keras.utils.set_random_seed(0)
    model = TwoViews()
    model.compile(optimizer=keras.optimizers.SGD(0.1))
    model.build((None, 4))
    return model


@pytest.mark.slow
@pytest.mark.parametrize("m", [B, M], ids=["no-split", "split"])
@pytest.mark.parametrize("kind", ["functional", "custom-step"])
def test_a_layer_called_on_two_views_updates_once_per_call_as_model_fit_does(kind, m):
    """Keras moves a layer's statistics once per call: first with view a's, then with
    view b's. Pooling both calls into one update (as autosplit did) left them 0.48 off
    model.fit's even at m = B. On raw inputs every micro-batch's rows are the full
    batch's, so the statistics must equal model.fit's over two large batches."""
    a, y = shifted((2 * B, 4), seed=6)
    b = (-1.0 + 0.5 * shifted((2 * B, 4), seed=7)[0]).astype("float32")
    if kind == "functional":
        reference, candidate = twins(two_views_functional)
        x, targets = [a, b], y
    else:
        reference, candidate = twins(two_views_custom)
        x, targets = a, b  # the step reads (a, b) as its two views
    reference.fit(x, targets, batch_size=B, shuffle=False, verbose=0)
    autosplit.fit_large_batch(candidate, x, targets, batch_size=B, micro_batch_size=m,
                              shuffle=False, verbose=0)
    assert int(candidate.optimizer.iterations) == 2
    assert_moving_close(moving_of_all(reference), moving_of_all(candidate))
    if m == B:  # no split: the same step
        assert relative_error(reference.get_weights(), candidate.get_weights()) <= 1e-6


def moving_of_all(model):
    return [w.numpy().copy() for layer in model._flatten_layers()
            if isinstance(layer, keras.layers.BatchNormalization)
            for w in (layer.moving_mean, layer.moving_variance)]
