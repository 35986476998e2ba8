"""autosplit.units: memory sizes parsed and formatted."""

from __future__ import annotations

import numpy as np
import pytest
from _memory import GiB, MiB

from autosplit.errors import MemoryLimitError
from autosplit.units import format_bytes, parse_memory

# ------------------------------------------------------------------ parse_memory


@pytest.mark.parametrize(("value", "expected"), [
    (None, None),
    (1024, 1024),
    (np.int64(4096), 4096),
    (2.5e9, 2_500_000_000),
    ("1024", 1024),
    ("10 B", 10),
    ("6GiB", 6 * GiB),
    ("512MB", 512 * 10**6),
    ("1.5 GiB", 3 * GiB // 2),
    ("2g", 2 * GiB),
    ("800 MiB", 800 * MiB),
    ("1KB", 1000),
    ("1KiB", 1024),
    ("1K", 1024),
    ("3T", 3 * 2**40),
    ("1TB", 10**12),
    (" 4 gib ", 4 * GiB),
    ("512mb", 512 * 10**6),
    ("0.3GB", 300_000_000),  # exact: float arithmetic would give 299999999
    (".5KiB", 512),
    ("1.5e3MB", 1_500_000_000),
])
def test_parse_memory_valid(value, expected):
    assert parse_memory(value) == expected


@pytest.mark.parametrize("value", [
    -1, 0, True, False, 0.5, float("nan"), float("inf"), -2.0,
    "", "abc", "6 gigs", "6 XB", "-5GiB", "0", "0GiB", "0.1B", "1.5.3GB", "nan", "inf",
    "GiB", b"1GB", [1],
])
def test_parse_memory_invalid_says_expected_received_and_example(value):
    with pytest.raises(MemoryLimitError) as info:
        parse_memory(value)
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert "Received: memory_limit=" in message
    assert "'6GiB'" in message


def test_parse_memory_error_wording_and_name():
    with pytest.raises(MemoryLimitError, match="Unknown unit 'gigs'") as info:
        parse_memory("6 gigs")
    assert str(info.value).startswith(
        "Expected `memory_limit` to be a positive number of bytes or a string like '6GiB' "
        "or '512MB'. Received: memory_limit='6 gigs'")
    with pytest.raises(MemoryLimitError, match="Received: budget=-3"):
        parse_memory(-3, name="budget")


@pytest.mark.parametrize(("n", "text"), [
    (0, "0 B"), (512, "512 B"), (1536, "1.50 KiB"), (3 * GiB // 2, "1.50 GiB"),
    (800 * MiB, "800.00 MiB"), (2**40, "1.00 TiB"), (-2 * GiB, "-2.00 GiB"),
])
def test_format_bytes(n, text):
    assert format_bytes(n) == text
