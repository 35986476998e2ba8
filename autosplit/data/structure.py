"""Helpers for the ``(x, y, sample_weight)`` structures every layer passes around:
``None`` where a part is absent, ``()`` where ``tf.data`` and ``tf.nest`` need a
placeholder for it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf

__all__ = ["PARTS", "empty_to_none", "leaves_named", "map_present", "none_to_empty",
           "unnumbered"]

PARTS = ("x", "y", "sample_weight")  # an element's parts, as messages name them


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


def leaves_named(parts: Any) -> list[tuple[str, Any]]:
    """``[("x[0]", leaf), ("y", leaf), ...]``: every leaf of ``parts`` (``(x, y[,
    sample_weight])``, or ``x`` alone), in ``tf.nest.flatten``'s order, named as messages
    name it (None leaves kept, named too).

    >>> [name for name, _ in leaves_named(({"ids": 1, "mask": 2}, 3))]
    ["x['ids']", "x['mask']", 'y']
    """
    if not isinstance(parts, tuple):
        parts = (parts,)
    return [(PARTS[path[0]] + "".join(f"[{p!r}]" for p in path[1:]) if path else "x", leaf)
            for path, leaf in keras.tree.flatten_with_path(parts)]
