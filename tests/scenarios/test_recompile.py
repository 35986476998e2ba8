"""A second ``model.compile()`` and changes of ``trainable``: a fresh, correct step every
time, never a stale one. Each case runs ``model.fit`` on a twin model as the reference.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
from common import relative_error

import autosplit
from autosplit.step.model_state import model_state

N, B, M = 120, 60, 25  # an uneven split: 3 micro-batches of 20


def regression_data(n=N, features=8, seed=0):
    r = np.random.default_rng(seed)
    x = r.normal(size=(n, features)).astype("float32")
    return x, (x @ r.normal(size=(features, 2))).astype("float32")


def mlp():
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                             keras.layers.Dense(2)])


def twins(make):
    reference, candidate = make(), make()
    candidate.set_weights(reference.get_weights())
    return reference, candidate


def fit_both(reference, candidate, x, y, *, epochs=1, micro_batch_size=M):
    expected = reference.fit(x, y, batch_size=B, epochs=epochs, shuffle=False, verbose=0)
    got = autosplit.fit_large_batch(candidate, x, y, batch_size=B, epochs=epochs,
                                    micro_batch_size=micro_batch_size, shuffle=False,
                                    verbose=0)
    return expected.history, got.history


def assert_same(reference, candidate, expected_logs, got_logs, rtol):
    assert relative_error(reference.get_weights(), candidate.get_weights()) <= rtol
    ref_opt = [v.numpy() for v in reference.optimizer.variables]
    got_opt = [v.numpy() for v in candidate.optimizer.variables]
    assert relative_error(ref_opt, got_opt) <= rtol
    assert set(expected_logs) == set(got_logs)
    for name, values in expected_logs.items():
        np.testing.assert_allclose(got_logs[name], values, rtol=rtol, atol=1e-6, err_msg=name)


def compile_all(models, **kwargs):
    for model in models:
        model.compile(**{k: (v() if callable(v) and k == "optimizer" else v)
                         for k, v in kwargs.items()})


def test_recompile_with_the_same_optimizer_and_a_new_loss():
    x, y = regression_data()
    reference, candidate = twins(mlp)
    optimizers = {id(m): keras.optimizers.SGD(0.05) for m in (reference, candidate)}
    for model in (reference, candidate):
        model.compile(optimizer=optimizers[id(model)], loss="mse")
    assert_same(reference, candidate, *fit_both(reference, candidate, x, y), 1e-5)
    for model in (reference, candidate):  # same optimizer object, a new loss
        model.compile(optimizer=optimizers[id(model)], loss="mae", metrics=["mse"])
    expected, got = fit_both(reference, candidate, x, y, epochs=2)
    assert got["loss"][0] > 0.1  # not a stale plan's 0.0
    assert_same(reference, candidate, expected, got, 1e-5)


@pytest.mark.parametrize("change", ["freeze", "unfreeze"])
def test_recompile_after_a_change_of_trainable(change):
    x, y = regression_data()
    reference, candidate = twins(mlp)
    compile_all((reference, candidate), optimizer=lambda: keras.optimizers.Adam(0.01),
                loss="mse")
    if change == "unfreeze":
        for model in (reference, candidate):
            model.layers[0].trainable = False
        compile_all((reference, candidate), optimizer=lambda: keras.optimizers.Adam(0.01),
                    loss="mse")
    assert_same(reference, candidate, *fit_both(reference, candidate, x, y), 1e-4)
    for model in (reference, candidate):
        model.layers[0].trainable = change == "unfreeze"
    compile_all((reference, candidate), optimizer=lambda: keras.optimizers.Adam(0.01),
                loss="mse", metrics=["mae"])
    assert_same(reference, candidate, *fit_both(reference, candidate, x, y), 1e-4)
    assert int(candidate.optimizer.iterations) == N // B


def test_a_change_of_trainable_without_recompile_gives_a_fresh_step():
    """model.fit keeps its traced step (and warns); autosplit rebuilds, so the frozen
    layer is left alone rather than updated through a stale list of variables."""
    x, y = regression_data()
    model = mlp()
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    autosplit.fit_large_batch(model, x, y, batch_size=B, micro_batch_size=M, verbose=0)
    model.layers[0].trainable = False
    frozen = [w.copy() for w in model.layers[0].get_weights()]
    # The optimizer was built for the old variables, as model.fit's would be; a new one
    # is needed either way.
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    autosplit.fit_large_batch(model, x, y, batch_size=B, micro_batch_size=M, verbose=0)
    for before, after in zip(frozen, model.layers[0].get_weights(), strict=True):
        np.testing.assert_array_equal(before, after)


def conv_base():
    # No conv bias before a BatchNormalization (as in ResNets): its gradient cancels to
    # rounding noise, which Adam would turn into steps of the learning rate's size.
    inputs = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(8, 3, padding="same", use_bias=False)(inputs)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.Activation("relu")(h)
    h = keras.layers.Conv2D(8, 3, padding="same", use_bias=False)(h)
    h = keras.layers.BatchNormalization()(h)
    return keras.Model(inputs, keras.layers.GlobalAveragePooling2D()(h), name="base")


def transfer_model():
    base = conv_base()
    inputs = keras.Input((8, 8, 3))
    # As the Keras transfer-learning guide: the base runs in inference mode, so that
    # unfreezing it later leaves its BatchNormalization layers in inference mode too.
    h = base(inputs, training=False)
    outputs = keras.layers.Dense(3)(h)
    return keras.Model(inputs, outputs), base


def test_transfer_learning_recipe_equals_model_fit():
    r = np.random.default_rng(1)
    x = r.normal(size=(N, 8, 8, 3)).astype("float32")
    y = r.integers(0, 3, size=(N,)).astype("int32")
    (reference, ref_base), (candidate, cand_base) = transfer_model(), transfer_model()
    candidate.set_weights(reference.get_weights())
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    for base in (ref_base, cand_base):
        base.trainable = False
    compile_all((reference, candidate), optimizer=lambda: keras.optimizers.Adam(0.01),
                loss=loss, metrics=["accuracy"])
    assert_same(reference, candidate, *fit_both(reference, candidate, x, y, epochs=2), 1e-4)
    assert len(candidate.trainable_variables) == 2
    # Fine-tune: unfreeze the base, recompile with a low learning rate, train again.
    # Keras 3 passes the outer training=True through to an unfrozen base, so its
    # BatchNormalization now trains: exact only without a split (k = 1), which still
    # checks that the recompiled step is the right one; split, it must run.
    for base in (ref_base, cand_base):
        base.trainable = True
    compile_all((reference, candidate), optimizer=lambda: keras.optimizers.Adam(1e-5),
                loss=loss, metrics=["accuracy"])
    assert_same(reference, candidate,
                *fit_both(reference, candidate, x, y, epochs=2, micro_batch_size=B), 1e-4)
    assert len(candidate.trainable_variables) > 2
    assert int(candidate.optimizer.iterations) == 2 * N // B
    with pytest.warns(UserWarning, match="BatchNormalization"):
        history = autosplit.fit_large_batch(candidate, x, y, batch_size=B, epochs=2,
                                            micro_batch_size=M, verbose=0)
    assert np.all(np.isfinite(history.history["loss"]))
    assert int(candidate.optimizer.iterations) == 4 * N // B


def test_every_part_of_the_key_gives_a_rebuild():
    x, y = regression_data()
    model = mlp()
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")

    def step():
        autosplit.fit_large_batch(model, x, y, batch_size=B, micro_batch_size=M, verbose=0)
        state = model_state(model)
        (only,) = state.steps.values()
        return state, only

    state, first = step()
    assert step() == (state, first)  # nothing changed: reused
    optimizer = model.optimizer
    changes = {
        "loss": lambda: model.compile(optimizer=optimizer, loss="mae"),
        "loss_weights": lambda: model.compile(optimizer=optimizer, loss="mae",
                                              loss_weights=[0.5]),
        "metrics": lambda: model.compile(optimizer=optimizer, loss="mae", metrics=["mse"]),
        "optimizer": lambda: model.compile(optimizer=keras.optimizers.SGD(0.01),
                                           loss="mae", metrics=["mse"]),
        "trainable": lambda: setattr(model.layers[0], "trainable", False),
        "compile alone": lambda: model.compile(optimizer=model.optimizer, loss=None),
    }
    seen = [first]  # kept alive, so that identity means something
    for name, change in changes.items():
        change()
        new_state, new_step = step()
        assert new_state is not state and all(new_step is not s for s in seen), name
        seen.append(new_step)
        state = new_state
