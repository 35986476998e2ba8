"""Split arithmetic: how a large batch of B rows becomes micro-batches, and who gets which.

Pure integer functions, no TensorFlow. ``micro_batch_size`` is an upper bound: a batch
of B rows needs k = ceil(B/m) micro-batches, and those are cut as evenly as possible,
ceil(B/k) rows each, so fewer than k padding rows are ever added (B=250, m=64 runs
4 micro-batches of 63 rows with 2 padding rows, not 4 of 64 with 6).

Under ``tf.distribute`` with W workers of R_w local replicas each (R replicas in all),
worker w owns the rows ``[w*B/W, (w+1)*B/W)`` of every large batch in the order the
input yields them, and cuts its share into k*R_w pieces that go to its local replicas
in turn. Each worker can use its own micro-batch size: the pieces only have to add up
to its own share. :func:`piece_pattern` writes that down for one worker as the list
of row counts the input pipeline cuts, in order, and which of them it keeps.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from autosplit.errors import BatchSizeError, describe

__all__ = ["Piece", "Split", "balanced_sizes", "check_size", "piece_pattern", "split_batch"]


def check_size(name: str, value: Any) -> int:
    """Return ``value`` as an int if it is a positive whole number, else raise ``BatchSizeError``.

    >>> check_size("batch_size", 64)
    64
    """
    if not isinstance(value, bool) and hasattr(value, "__index__"):
        try:
            as_int = value.__index__()
        except TypeError:
            as_int = None
        if as_int is not None and as_int >= 1:
            return int(as_int)
    raise BatchSizeError(
        f"Expected `{name}` to be a positive integer. Received: {name}={describe(value)}. "
        f"Pass a whole number of examples such as {name}=256."
    )


class Split(NamedTuple):
    """How one large batch is cut: k micro-batches of ``micro_batch_size`` rows."""

    batch_size: int  # B, examples per large batch
    micro_batch_size: int  # rows per micro-batch actually used: ceil(B / k) <= the bound asked
    accumulation_steps: int  # k = ceil(B / bound)
    padded_rows: int  # k * micro_batch_size - B < k: zero-weight rows


def split_batch(batch_size: int, micro_batch_size: int) -> Split:
    """Cut ``batch_size`` rows into balanced micro-batches of at most ``micro_batch_size``.

    ``micro_batch_size >= batch_size`` means no split (k = 1), not an error.

    >>> split_batch(4096, 256)
    Split(batch_size=4096, micro_batch_size=256, accumulation_steps=16, padded_rows=0)
    >>> split_batch(250, 64)
    Split(batch_size=250, micro_batch_size=63, accumulation_steps=4, padded_rows=2)
    >>> split_batch(4096, 3000)
    Split(batch_size=4096, micro_batch_size=2048, accumulation_steps=2, padded_rows=0)
    """
    batch_size = check_size("batch_size", batch_size)
    bound = min(check_size("micro_batch_size", micro_batch_size), batch_size)
    k = math.ceil(batch_size / bound)
    rows = math.ceil(batch_size / k)
    return Split(batch_size, rows, k, k * rows - batch_size)


def balanced_sizes(rows: int, pieces: int) -> list[int]:
    """``rows`` cut into ``pieces`` contiguous parts whose sizes differ by at most one.

    >>> balanced_sizes(250, 4)
    [63, 63, 62, 62]
    """
    base, extra = divmod(rows, pieces)
    return [base + 1] * extra + [base] * (pieces - extra)


class Piece(NamedTuple):
    """One contiguous run of rows in the input, as the pipeline cuts it."""

    rows: int
    keep: bool  # False: another worker's rows, read and dropped


def piece_pattern(batch_size: int, rows: int, *, workers: int = 1, worker: int = 0,
                  local_replicas: int = 1) -> list[Piece]:
    """The runs of rows one worker cuts from each large batch, in input order.

    Args:
        batch_size: B, the global large batch.
        rows: the worker's micro-batch rows (``split_batch(B / R, m).micro_batch_size``).
        workers, worker: W and this worker's index; B must divide by W * local_replicas.
        local_replicas: R_w; the kept pieces go to the local replicas in turn.

    Returns:
        Pieces summing to B; the kept ones are this worker's micro-batches, k * R_w of
        them, none longer than ``rows``. Dropped runs are cut to at most ``rows`` too, so
        the pipeline never holds more than a micro-batch of rows at once.

    >>> piece_pattern(10, 3)
    [Piece(rows=3, keep=True), Piece(rows=3, keep=True), Piece(rows=2, keep=True), \
Piece(rows=2, keep=True)]
    >>> [p.rows for p in piece_pattern(8, 2, workers=2, worker=1) if p.keep]
    [2, 2]
    """
    share = batch_size // workers
    k = math.ceil(share / local_replicas / rows)
    kept = [Piece(n, True) for n in balanced_sizes(share, k * local_replicas) if n]

    def skip(n: int) -> list[Piece]:
        return [Piece(s, False) for s in balanced_sizes(n, math.ceil(n / rows))] if n else []

    return skip(worker * share) + kept + skip((workers - worker - 1) * share)
