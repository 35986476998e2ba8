"""Shared by the gradient noise scale's tests: linear regression, whose noise scale has a
closed form, and the estimate as fit_large_batch reports it."""

from __future__ import annotations

import keras
import numpy as np

import autosplit

DIM = 8


def regression(rows: int, noise: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray, float]:
    """``y = x . w + eps`` with ``x ~ N(0, I)`` and ``eps ~ N(0, noise^2)``, and the
    exact ``B_simple`` of the mean squared error at the weights 0 (:func:`line`'s).

    With ``u = 0 - w``, one example's gradient is ``2 x (x . u - eps)``: its mean is
    ``G = 2u``, and by Isserlis' theorem its covariance is
    ``4 ((|u|^2 + noise^2) I + u u^T)``, so
    ``B_simple = tr(Sigma) / |G|^2 = d + 1 + d noise^2 / |u|^2``.
    """
    rng = np.random.default_rng(seed)
    w = rng.normal(size=DIM).astype("float32")
    x = rng.normal(size=(rows, DIM)).astype("float32")
    y = (x @ w + noise * rng.normal(size=rows)).astype("float32")[:, None]
    u = float(w @ w)
    return x, y, DIM + 1 + DIM * noise ** 2 / u


def line() -> keras.Model:
    """``x . v`` from ``v = 0``, trained at a learning rate of 0: every large batch's
    gradient is at the same weights."""
    model = keras.Sequential([keras.Input((DIM,)), keras.layers.Dense(
        1, use_bias=False, kernel_initializer="zeros")])
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    return model


def fitted_noise_scale(model: keras.Model, x, y, batch_size: int, micro_batch_size: int,
                       **options) -> float:
    """The epoch's gradient noise scale, as ``fit_large_batch`` logs it."""
    history = autosplit.fit_large_batch(model, x, y, batch_size=batch_size,
                                        micro_batch_size=micro_batch_size, shuffle=False,
                                        verbose=0, noise_scale=True, **options)
    return history.history["gradient_noise_scale"][-1]
