"""The probe's on-disk cache: one JSON file per (device, model, settings) fingerprint.

Results live in ``$XDG_CACHE_HOME/autosplit`` (else ``~/.cache/autosplit``), keyed on
what decides the answer: the device (identity and total memory), TensorFlow and Keras
versions, the model (architecture, dtype policy, input signature), the optimizer,
``jit_compile``, the memory limit, the headroom, the batch size and the replica
layout. An out-of-memory error during training deletes the entry it came from.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import keras
import tensorflow as tf

__all__ = ["cache_dir", "fingerprint", "invalidate", "load", "store"]


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/autosplit``, else ``~/.cache/autosplit``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "autosplit"


def fingerprint(model: keras.Model, input_spec: Any, **settings: Any) -> str:
    """A 32-hex-digit key for the model, its inputs and the search's settings."""
    spec = tf.nest.map_structure(
        lambda s: None if s is None else (tuple(s.shape[1:]), str(s.dtype)), input_spec)
    try:
        architecture = model.to_json()
    except Exception:  # subclassed models without get_config
        architecture = repr([(v.path, tuple(v.shape), str(v.dtype)) for v in model.variables])
    optimizer = model.optimizer
    parts = {
        "versions": [tf.__version__, keras.__version__],
        "architecture": architecture,
        "dtype_policy": str(keras.mixed_precision.global_policy().name),
        "inputs": repr(spec),
        "optimizer": [type(optimizer).__name__,
                      json.dumps(optimizer.get_config(), sort_keys=True, default=str)],
        **settings,
    }
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


def _path(key: str) -> Path:
    return cache_dir() / f"probe-{key}.json"


def load(key: str) -> dict | None:
    """The stored result for ``key``, or None (missing or unreadable)."""
    try:
        return json.loads(_path(key).read_text())
    except (FileNotFoundError, ValueError, OSError):
        return None


def store(key: str, data: dict) -> None:
    """Write ``data`` for ``key``; a read-only cache directory is not an error."""
    with contextlib.suppress(OSError):
        path = _path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2, sort_keys=True))


def invalidate(key: str) -> None:
    """Forget the entry for ``key`` (an OOM during training proved it wrong)."""
    with contextlib.suppress(FileNotFoundError):
        _path(key).unlink()
