"""Train twin models, one with ``model.fit`` and one with ``fit_large_batch``, and compare.

Each example program builds a compiled model with ``make()``; :func:`twins` builds two
from the same seed and copies the first one's weights into the second, so both start
identical. :func:`fit_both` trains the reference with ``model.fit(batch_size=B)`` and the
candidate with ``fit_large_batch(batch_size=B, micro_batch_size=m)`` (m does not divide
B in any example: the split is uneven, with padding rows), on the same data in the same
order (``shuffle=False``). :func:`assert_same_training` then checks what must be equal:
the weights, the optimizer's variables (``iterations`` included) and the History logs.
"""

from __future__ import annotations

import math

import keras
import numpy as np
from common import dense_gradients, relative_error  # noqa: F401 (the examples import it here)

import autosplit

SGD_RTOL = 1e-5  # README "What exact means": SGD to 1e-5 relative
ADAM_RTOL = 1e-4  # the Adam family (Adam, AdamW, RMSprop) to 1e-4


def twins(make, build=None, seed=1234):
    """Two compiled models from ``make`` with the same initial weights.

    ``build(model)`` builds a model whose weights are created lazily (subclassed models):
    it calls it once on a sample. Functional and Sequential models are built already.
    """
    models = []
    for _ in range(2):
        keras.utils.set_random_seed(seed)
        model = make()
        if build is not None:
            build(model)
        models.append(model)
    reference, candidate = models
    candidate.set_weights(reference.get_weights())
    return reference, candidate


def fit_both(reference, candidate, x, y=None, *, batch_size, micro_batch_size, epochs=1,
             **kwargs):
    """The reference's and the candidate's History dicts, same data, same order."""
    assert batch_size % micro_batch_size, "the examples test an uneven split"
    # A tf.data input is already batched at batch_size for model.fit (which then ignores
    # batch_size); fit_large_batch rebatches it into micro-batches of the same large batch.
    keras.utils.set_random_seed(7)
    expected = reference.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False,
                             verbose=0, **kwargs).history
    keras.utils.set_random_seed(7)
    history = autosplit.fit_large_batch(candidate, x, y, batch_size=batch_size,
                                        micro_batch_size=micro_batch_size, epochs=epochs,
                                        shuffle=False, verbose=0, **kwargs)
    assert history.autosplit.accumulation_steps == math.ceil(batch_size / micro_batch_size)
    return expected, history.history


def optimizer_values(model):
    return [np.asarray(v) for v in model.optimizer.variables]


def assert_logs_close(expected, got, rtol):
    assert set(got) == set(expected), (sorted(got), sorted(expected))
    for name, values in expected.items():
        np.testing.assert_allclose(got[name], values, rtol=rtol, atol=rtol * 1e-2,
                                   err_msg=f"History log {name!r}")


def assert_same_training(reference, candidate, expected, got, *, rtol, steps):
    """Weights, optimizer variables, ``iterations`` and the History logs as model.fit's."""
    assert int(reference.optimizer.iterations) == steps
    assert int(candidate.optimizer.iterations) == steps
    err = relative_error(reference.get_weights(), candidate.get_weights())
    assert err <= rtol, f"weights: relative error {err:.2e} > {rtol:.0e}"
    ref_opt, cand_opt = optimizer_values(reference), optimizer_values(candidate)
    assert [v.shape for v in cand_opt] == [v.shape for v in ref_opt]
    err = relative_error(ref_opt, cand_opt)
    assert err <= rtol, f"optimizer variables: relative error {err:.2e} > {rtol:.0e}"
    assert_logs_close(expected, got, rtol)


def assert_runs(model, history, *, steps):
    """For models that cannot be exact (BatchNormalization in training mode, random
    layers): the training ran, its losses are finite, one optimizer step per large batch."""
    assert int(model.optimizer.iterations) == steps
    assert history["loss"], history
    for name, values in history.items():
        assert np.all(np.isfinite(values)), (name, values)
    for weight in model.get_weights():
        assert np.all(np.isfinite(weight))


def assert_exact(make, x, y=None, *, n, batch_size, micro_batch_size, rtol, epochs=2,
                 **kwargs):
    """:func:`twins`, :func:`fit_both`, :func:`assert_same_training`: the program trains
    under ``fit_large_batch`` exactly as under ``model.fit``; returns (reference, candidate)."""
    reference, candidate = twins(make)
    expected, got = fit_both(reference, candidate, x, y, batch_size=batch_size,
                             micro_batch_size=micro_batch_size, epochs=epochs, **kwargs)
    assert_same_training(reference, candidate, expected, got, rtol=rtol,
                         steps=steps(n, batch_size, epochs))
    return reference, candidate


def steps(n, batch_size, epochs=1):
    """Optimizer steps for ``epochs`` over ``n`` examples in large batches."""
    return epochs * math.ceil(n / batch_size)
