"""Helpers for the ``(x, y, sample_weight)`` structures every layer passes around:
``None`` where a part is absent, ``()`` where ``tf.data`` and ``tf.nest`` need a
placeholder for it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import tensorflow as tf

__all__ = ["empty_to_none", "map_present", "none_to_empty", "unnumbered"]


def map_present(fn: Callable[[Any], Any], structure: Any) -> Any:
    """``tf.nest.map_structure`` that leaves ``None`` (no sample weight) alone."""
    return tf.nest.map_structure(lambda t: None if t is None else fn(t), structure)


def none_to_empty(w: Any) -> Any:
    return () if w is None else w


def empty_to_none(w: Any) -> Any:
    return None if isinstance(w, tuple) and not w else w


def unnumbered(_: Any, *row: Any) -> Any:
    """An ``enumerate``d element without its number: the row (its parts as a tuple)."""
    return row[0] if len(row) == 1 else row
