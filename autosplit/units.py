"""Memory sizes: parsing what people write ("6GiB", "512MB", "2g") and printing bytes.

Pure functions, no TensorFlow and no device access.
"""

from __future__ import annotations

import math
import numbers
import re
from fractions import Fraction

from autosplit.errors import MemoryLimitError

__all__ = ["MIB", "format_bytes", "memory_error", "parse_memory"]

# Decimal units are SI; bare K/M/G/T are binary, as Docker (`--memory 2g`) and
# TensorFlow's own logs use them.
_UNITS: dict[str, int] = {
    "": 1, "b": 1, "byte": 1, "bytes": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_MEMORY_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)(e[+-]?\d+)?\s*([a-z]*)\s*$", re.I)
MIB = 2**20


def parse_memory(value: str | int | float | None, *, name: str = "memory_limit") -> int | None:
    """Parses a memory size into bytes.

    ``KB``/``MB``/``GB``/``TB`` are powers of 1000 and ``KiB``/``MiB``/``GiB``/``TiB``
    powers of 1024. A bare ``K``/``M``/``G``/``T`` is a power of 1024, as in
    ``docker run --memory 2g`` and TensorFlow's logs. Units are case-insensitive, so
    ``"512mb"`` is 512 MB (there is no bit unit). A fractional number of bytes is
    rounded down.

    Args:
        value: ``None`` (no limit), a positive number of bytes, or a string such as
            ``"6GiB"``, ``"512MB"``, ``"1.5 GiB"``, ``"2g"`` or ``"1024"``.
        name: The argument's name, used in error messages.

    Returns:
        The size in bytes, or ``None`` when ``value`` is ``None``.

    Raises:
        MemoryLimitError: ``value`` is not positive, is a bool, NaN or infinite, or is
            a string that is not a number followed by a known unit.

    Example:
        >>> parse_memory("1.5 GiB")
        1610612736
        >>> parse_memory("512MB")
        512000000
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise memory_error(name, value)
    if isinstance(value, numbers.Integral):
        size = int(value)
    elif isinstance(value, numbers.Real):
        if not math.isfinite(value):
            raise memory_error(name, value)
        size = math.floor(value)
    elif isinstance(value, str):
        match = _MEMORY_RE.match(value)
        if match is None:
            raise memory_error(name, value)
        number, exponent, unit = match.groups()
        if unit.lower() not in _UNITS:
            raise memory_error(
                name, value,
                f" Unknown unit {unit!r}: use B, KB, MB, GB, TB (powers of 1000), "
                "KiB, MiB, GiB, TiB or K, M, G, T (powers of 1024).")
        # Fraction keeps "0.3GB" exact; float arithmetic would give 299999999.
        size = math.floor(Fraction(number + (exponent or "")) * _UNITS[unit.lower()])
    else:
        raise memory_error(name, value)
    if size < 1:
        raise memory_error(name, value)
    return size


def memory_error(name: str, value: object, hint: str = "") -> MemoryLimitError:
    return MemoryLimitError(
        f"Expected `{name}` to be a positive number of bytes or a string like '6GiB' "
        f"or '512MB'. Received: {name}={value!r}.{hint}")


def format_bytes(n: int) -> str:
    """Formats a byte count with the largest binary unit that keeps it at least 1.

    Args:
        n: A number of bytes.

    Returns:
        A short string with two decimals, or whole bytes below 1 KiB.

    Example:
        >>> format_bytes(1610612736)
        '1.50 GiB'
        >>> format_bytes(512)
        '512 B'
    """
    n = int(n)
    for unit, factor in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= factor:
            return f"{n / factor:.2f} {unit}"
    return f"{n} B"
