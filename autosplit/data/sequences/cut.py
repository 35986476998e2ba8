"""How a run cuts each large batch into micro-batches (:class:`Cut`), decided once before
its first step (``autosplit.step.cut_choice``) and changed only through its own methods."""

from __future__ import annotations

from typing import Literal, NamedTuple

from autosplit.data.sequences.buckets import buckets_to, described
from autosplit.data.sequences.lengths import Lengths, PaddedArrays
from autosplit.data.sequences.packing import Packing

__all__ = ["Cut", "CutBy"]


CutBy = Literal["rows", "longest", "length", "tokens"]


class Cut(NamedTuple):
    """How a run cuts each large batch into micro-batches, decided once before its first
    step (``autosplit.step.cut_choice``); the pipeline, the probe and ``FitReport`` read it,
    and only its methods make another (a budget found, a budget shrunk, the shares).

    ``by``: ``"rows"``, rows of one shape as they come; ``"longest"``, each micro-batch
    padded to its large batch's longest row, as ``model.fit`` sees it; ``"length"``, each
    large batch's rows sorted by length and each micro-batch padded to its own longest
    row; ``"tokens"``, the same in micro-batches of up to ``tokens`` tokens (the cells
    of every length a row has), not of a fixed row count, cut for the least work
    (``"least_work"``) or each filled to the budget (``"fullest"``: the probe's trials,
    which must meet the budget's peak). :attr:`why` says which, and why.
    """

    by: CutBy = "rows"
    lengths: Lengths | None = None  # the lengths of an example, where it has any
    buckets: bool = False  # XLA: lengths rounded up to buckets, rows in tokens padded
    arrays: PaddedArrays | None = None  # arrays of one shape that hold padded sequences
    tokens: int | None = None  # with by="tokens": the budget (None: the probe finds it)
    packing: Packing = "least_work"
    replicas: int = 1  # local replicas: each micro-step's R pieces, each its own shape
    # Per model output (keras.tree.flatten's order): the length group its second axis
    # follows, whose length factor its loss and metrics take; None: no length.
    outputs: tuple[int | None, ...] = ()
    # What the check of padding found (by length), or why the rows are not cut so
    # (padded to the longest row)
    found: str = ""
    workers: int = 1  # workers that each read and cut their own share (data.sharded)

    @property
    def why(self) -> str | None:
        """``FitReport.padding``: how the large batches are cut, and why (None for rows
        of one shape).

        >>> Cut("longest", found="by_length=False").why
        "to the large batch's longest row: by_length=False"
        >>> Cut("tokens", found="the same loss", tokens=512, workers=2).why
        'by length: the model ignores padding (the same loss); micro-batches of up to 512 \
tokens; each of 2 workers reads and cuts its own share'
        """
        if self.by == "rows":
            return None
        if self.by == "longest":
            return f"to the large batch's longest row: {self.found}"
        rounded = f" ({described(self.by == 'tokens')})" if self.buckets else ""
        on = (f" on {self.replicas} replicas, each a micro-batch of its own shape"
              if self.replicas > 1 else "")
        number = 0 if self.lengths is None else self.lengths.number
        several = f"{number} lengths per example, " if number > 1 else ""
        why = f"by length{rounded}{on}: {several}the model ignores padding ({self.found})"
        if self.by == "tokens" and self.tokens is not None:
            why += f"; micro-batches of up to {self.tokens} tokens"
        if self.workers > 1:
            why += f"; each of {self.workers} workers reads and cuts its own share"
        return why

    def in_tokens(self, tokens: int | None) -> Cut:
        """Cut by length in micro-batches of up to ``tokens`` tokens (None: the probe's
        budget, not found yet)."""
        return self._replace(by="tokens", tokens=tokens)

    def in_rows(self) -> Cut:
        """Cut by length in micro-batches of a row count (the probe's trials ran in rows)."""
        return self._replace(by="length", tokens=None)

    def with_budget(self, tokens: int, packing: Packing = "least_work") -> Cut:
        """In tokens, with a budget of ``tokens`` (``packing``: ``"fullest"``, each
        micro-batch filled to it, as the probe's trials cut)."""
        return self._replace(tokens=tokens, packing=packing)

    def shrunk(self, slices: int) -> Cut:
        """After an out-of-memory error that cut each element into ``slices``: a budget
        as much smaller (a cut in rows is as it was)."""
        if self.tokens is None:
            return self
        return self._replace(tokens=max(1, self.tokens // slices))

    def shared(self, workers: int) -> Cut:
        """Each of ``workers`` workers reads and cuts its own share (``data.sharded``)."""
        return self._replace(workers=workers)

    def of_arrays(self, arrays: PaddedArrays, lengths: Lengths) -> Cut:
        """The cut of arrays of one shape that hold padded sequences, of ``lengths``."""
        return self._replace(arrays=arrays, lengths=lengths)

    @property
    def sorted(self) -> bool:
        """Whether each large batch's rows are sorted by length (``"length"``, ``"tokens"``)."""
        return self.by in ("length", "tokens")

    def programs(self, longest: int | tuple[int, ...]) -> int | None:
        """With ``buckets``, the most shapes of micro-batch (programs XLA compiles) on
        lengths up to ``longest`` per length group: a bucket per length (or the arrays'
        own length) combined; in tokens, times two row counts. Not counted: one more
        each time a large batch's longest row passes every earlier one's inside the top
        bucket (a bucket reaches no further than the longest row met), and in rows one
        more per bucket for a model that averages on its own (given its real rows only;
        ``FitReport.programs`` leaves that out too). None without buckets.

        >>> Cut("tokens", buckets=True, tokens=4096).programs(512)
        18
        >>> rows = Cut("length", buckets=True)
        >>> rows.programs(512), rows.programs((60, 60))
        (16, 49)
        """
        if not self.buckets:
            return None
        tokens = self.by == "tokens"
        most = 2 if tokens else 1
        for length in (longest,) if isinstance(longest, int) else longest:
            most *= buckets_to(length, tokens) + (self.arrays is not None)
        return most
