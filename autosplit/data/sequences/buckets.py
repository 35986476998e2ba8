"""XLA's buckets of length: under ``jit_compile``, which compiles a program per shape, a
micro-batch cut by length has its every length rounded up to a bucket
(:func:`bucket_up`), so a run compiles a bounded set of programs (``Cut.programs``)."""

from __future__ import annotations

import bisect
import math
from typing import Any

import numpy as np
import tensorflow as tf

__all__ = ["LENGTH_BUCKETS", "TOKEN_BUCKETS", "bucket_up", "buckets_to", "described",
           "round_up"]


def round_up(n: Any, multiple: int) -> Any:
    """``n`` rounded up to a multiple of ``multiple`` (ints or tensors)."""
    return (n + multiple - 1) // multiple * multiple


def _buckets(growth: float, limit: int = 2**24) -> tuple[int, ...]:
    found = [8]
    while found[-1] < limit:
        found.append(round_up(math.ceil(found[-1] * growth), 8))
    return tuple(found)


# Under XLA, which compiles a program per shape, a micro-batch's every length is rounded
# up to a bucket (tensor2tensor's geometric buckets, on multiples of 8): each the next
# multiple of 8 at least ``growth`` times the last. Rows cut by length take
# LENGTH_BUCKETS (8, 16, 24, 32, 40, 56, 72, 96, 120, ..., 1.25x: a length padded by at
# most a quarter past the first few; 16 up to 512). Micro-batches in tokens also round
# their rows, to two counts per length (``autosplit.data.sequences.pieces``), so they
# take coarser ones, TOKEN_BUCKETS (8, 16, 32, 56, 96, 160, 256, 416, ..., 1.6x; 9 up to 512): as
# few programs as the rows cut for less padding than one row count per length would
# leave (measured in ``benchmarks/README.md``).
LENGTH_BUCKETS = _buckets(1.25)


TOKEN_BUCKETS = _buckets(1.6)


def bucket_up(n: Any, tokens: bool = False) -> Any:
    """The least of :data:`LENGTH_BUCKETS` (``tokens``: :data:`TOKEN_BUCKETS`) at least
    ``n`` (an int, or an int64 tensor of any shape); past the last, ``n`` itself."""
    buckets = TOKEN_BUCKETS if tokens else LENGTH_BUCKETS
    if isinstance(n, (int, np.integer)):
        at = bisect.bisect_left(buckets, int(n))
        return buckets[at] if at < len(buckets) else int(n)
    n = tf.convert_to_tensor(n, tf.int64)
    table = tf.constant(buckets, tf.int64)
    flat = tf.reshape(n, [-1])
    at = tf.searchsorted(table, flat, side="left", out_type=tf.int64)
    found = tf.where(at < len(buckets), tf.gather(table, tf.minimum(at, len(buckets) - 1)), flat)
    return tf.reshape(found, tf.shape(n))


def buckets_to(longest: int, tokens: bool = False) -> int:
    """How many buckets (:func:`bucket_up`'s) a length of up to ``longest`` may take."""
    return bisect.bisect_left(TOKEN_BUCKETS if tokens else LENGTH_BUCKETS,
                              max(int(longest), 1)) + 1


def described(tokens: bool = False) -> str:
    """How XLA's buckets round a micro-batch cut by length (in tokens: its rows too), as
    ``FitReport.padding`` says it.

    >>> described()
    'under XLA each length rounded up to a bucket: 8, 16, 24, 32, 40, 56, ... each 1.25x'
    """
    buckets = TOKEN_BUCKETS if tokens else LENGTH_BUCKETS
    shown = ", ".join(str(b) for b in buckets[:6])
    rows = "; rows to what the budget holds there, or half" if tokens else ""
    return (f"under XLA each length rounded up to a bucket: {shown}, ... each "
            f"{1.6 if tokens else 1.25}x{rows}")
