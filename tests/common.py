"""Plain helpers shared by the tests and their child processes (no pytest, no TensorFlow)."""

from __future__ import annotations

import numpy as np


def labelled(n, features, classes, seed=0):
    """Normal inputs and uniform integer labels, from a fixed seed."""
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(n, features)).astype("float32"),
            rng.integers(0, classes, size=(n,)).astype("int32"))


def tensor_relative_error(expected, actual) -> float:
    """Largest absolute difference over the expected tensor's largest entry."""
    e, a = np.asarray(expected, np.float64), np.asarray(actual, np.float64)
    if not e.size:
        return 0.0
    return float(np.max(np.abs(e - a))) / max(float(np.max(np.abs(e))), 1e-12)


def relative_error(expected, actual) -> float:
    """The largest :func:`tensor_relative_error` over lists of weights."""
    assert len(expected) == len(actual)
    return max(tensor_relative_error(e, a) for e, a in zip(expected, actual, strict=True))
