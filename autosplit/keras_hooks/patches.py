"""Patches that last for one block: an attribute set on an object or a class, and put
back (or removed) after it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

__all__ = ["class_patches", "object_patches"]


@contextlib.contextmanager
def object_patches(patches: list[tuple[Any, str, Any]]) -> Iterator[None]:
    """Set each ``(object, name, value)`` on the instance for the block (shadowing its
    class's attribute), then remove it."""
    for obj, name, value in patches:
        object.__setattr__(obj, name, value)
    try:
        yield
    finally:
        for obj, name, _ in patches:
            with contextlib.suppress(AttributeError):
                object.__delattr__(obj, name)


@contextlib.contextmanager
def class_patches(patches: list[tuple[type, str, Any]]) -> Iterator[None]:
    """Set each ``(class, name, value)`` for the block, then put back what the class
    itself had, or remove the attribute where it only inherited one."""
    saved = [(cls, name, vars(cls).get(name)) for cls, name, _ in patches]
    for cls, name, value in patches:
        setattr(cls, name, value)
    try:
        yield
    finally:
        for cls, name, original in saved:
            if original is None:
                delattr(cls, name)
            else:
                setattr(cls, name, original)
