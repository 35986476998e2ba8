"""What the benchmarks' tests share: the repository's root, a unit, a PNG's signature."""

from __future__ import annotations

from benchmarks import (
    harness,
)

ROOT = harness.ROOT


MiB = 2**20


PNG = b"\x89PNG\r\n\x1a\n"
