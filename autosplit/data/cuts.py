"""How a large batch of rows that vary in shape is cut into micro-batches: the decision
(:class:`Cut`) and its pipelines.

Rows of varying length come padded (``padded_batch``, a ragged input autosplit pads). A
large batch cut as it comes pads every micro-batch to the large batch's longest row
(``autosplit.data.longest``): exact for every model, and mostly padding on a heavy-tailed
corpus. Sorted by length first (:func:`cut_by_length`), the short rows share
micro-batches and the long ones theirs, and every part of a micro-batch is padded only to
its own longest row in its own length (``autosplit.data.example_lengths``): a source to
the micro-batch's longest source, its target to its longest target. Under XLA each
length is rounded up to a bucket (``example_lengths``), and in tokens each micro-batch's
rows to what the budget holds there or half, with copies of a row that weigh nothing:
a bounded set of programs (:meth:`Cut.programs`). Without XLA any length runs as is.

That is exact only for a model whose losses and gradients ignore padding
(``autosplit.step.padding`` checks it), and only if every denominator that counts padded
cells counts the large batch's: each micro-batch's inputs come as :class:`Trimmed`, whose
``stretch`` holds, per model output, the large batch's padded length over the
micro-batch's in the length that output follows.

Arrays of one shape that hold padded sequences (``keras.utils.pad_sequences``, at the
front by default or at the end) are cut alike (:func:`cut_rows_by_length`): their row
numbers sorted by each row's length, each micro-batch gathered and cut to its longest row
(:func:`trim`); their large batch is as long as the arrays.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

import tensorflow as tf

from autosplit.data.example_lengths import Lengths, Padded, bucket_up, buckets_to, row_costs
from autosplit.data.packing import Packing, padded_row_count, rows_within, token_pieces
from autosplit.data.split import Piece
from autosplit.data.structure import unnumbered

__all__ = ["Cut", "CutBy", "Trimmed", "cut_by_length", "cut_rows_by_length",
           "inputs_of", "trim"]

CutBy = Literal["rows", "longest", "length", "tokens"]


class Cut(NamedTuple):
    """How a run cuts each large batch into micro-batches, decided once before its first
    step (``autosplit.step.cut_choice``); the pipeline, the probe and ``FitReport`` read it.

    ``by``: ``"rows"``, rows of one shape as they come; ``"longest"``, each micro-batch
    padded to its large batch's longest row, as ``model.fit`` sees it; ``"length"``, each
    large batch's rows sorted by length and each micro-batch padded to its own longest
    row; ``"tokens"``, the same in micro-batches of up to ``tokens`` tokens (the cells
    of every length a row has), not of a fixed row count, cut for the least work
    (``"least_work"``) or each filled to the budget (``"fullest"``: the probe's trials,
    which must meet the budget's peak).
    """

    by: CutBy = "rows"
    why: str | None = None  # FitReport.padding: how and why; None for rows of one shape
    lengths: Lengths | None = None  # the lengths of an example, where it has any
    buckets: bool = False  # XLA: lengths rounded up to buckets, rows in tokens padded
    padded: Padded | None = None  # arrays of one shape that hold padded sequences
    tokens: int | None = None  # with by="tokens": the budget (None: the probe finds it)
    packing: Packing = "least_work"
    replicas: int = 1  # local replicas: each takes row r of every run of R sorted rows
    # Per model output (keras.tree.flatten's order): the length group its second axis
    # follows, whose stretch its loss and metrics take; None: no length.
    outputs: tuple[int | None, ...] = ()

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
            most *= buckets_to(length, tokens) + (self.padded is not None)
        return most


class Trimmed(NamedTuple):
    """A micro-batch's inputs padded to its own longest row, not its large batch's."""

    inputs: Any  # x, as the model takes it
    # float32 (rows, outputs): per model output (Cut.outputs), the large batch's padded
    # length over this micro-batch's in the length the output follows (1: none)
    stretch: tf.Tensor


def inputs_of(x: Any) -> Any:
    """The model's inputs, from ``x`` or from a :class:`Trimmed`."""
    return x.inputs if isinstance(x, Trimmed) else x


def _front(t: tf.Tensor, axis: int) -> tf.Tensor:
    """One row's ``t`` with its ``axis`` (counted with the rows) first."""
    order = [axis - 1] + [a for a in range(t.shape.rank) if a != axis - 1]
    return t if axis == 1 else tf.transpose(t, order)


def _back(t: tf.Tensor, axis: int) -> tf.Tensor:
    """:func:`_front` undone on a batch of rows."""
    rank = t.shape.rank
    order = [0, *range(2, axis + 1), 1, *range(axis + 1, rank)]
    return t if axis == 1 else tf.transpose(t, order)


def _ragged_lengths(rt: tf.RaggedTensor) -> tf.Tensor:
    """Per row of one ragged part (rows, (length), ...): one past its last non-zero entry."""
    values = rt.values
    nonzero = tf.not_equal(values, tf.zeros([], values.dtype))
    if values.shape.rank > 1:
        nonzero = tf.reduce_any(nonzero, axis=list(range(1, values.shape.rank)))
    rows = rt.value_rowids()
    column = tf.range(1, tf.size(rows, out_type=tf.int64) + 1) - tf.gather(rt.row_starts(), rows)
    return tf.math.unsorted_segment_max(tf.where(nonzero, column, 0), rows, rt.nrows())


def cut_by_length(ds: tf.data.Dataset, pattern: list[Piece], cut: Cut, *,
                  cap: int | None = None, shares: bool = False) -> tf.data.Dataset:
    """The kept pieces of ``pattern`` from every large batch of ``ds`` (batches of rows,
    of any size), each large batch's kept rows sorted by what they cost
    (``example_lengths.row_costs``) first; each piece ``(rows, stretch, valid)``, each of
    its parts padded with zeros to the piece's longest row in the part's length (at most
    the large batch's longest; under XLA its bucket, see :func:`_sorted_pieces`),
    ``stretch`` per model output the large batch's length over that (:class:`Trimmed`),
    ``valid`` 1.0 per real row.

    The large batch's length, in each of an example's lengths, is what its denominators
    that count padded cells count (``stretch``): its longest row's as the input gives
    it, an example as long as it is, a row of a user's ``padded_batch`` as long as its
    batch, a row a map pads to a fixed length that long (as ``padded_batch(B)`` of the
    same examples pads it where the input's batches tile the large batches). A batch
    of the input that spans two large batches, and a share (padded by TensorFlow's
    rebatch of each worker's batches), says nothing of which rows its length is
    for: their rows count as long as they are without trailing zeros. The pieces are
    cut short of it, to their rows' lengths without trailing zeros, which the check of
    padding (``autosplit.step.padding``) has shown the model ignores.

    A short last large batch gives the pieces ``rebatch`` would: those that start
    before its last row. The host holds one large batch's rows, unpadded (a ragged
    batch; a part whose length is not on its first axis after the rows has that axis
    moved there, and back in the piece), and stacks no more than a piece. With
    ``cut.tokens``, the pieces are :func:`token_pieces` of at most ``cap`` rows, each
    large batch's last an empty one.

    ``shares``: each element of ``ds`` is a large batch of its own (a worker's share of
    a step, ``autosplit.data.sharded``), padded: its pieces come after a header, a row
    of zeros whose ``valid`` is -1 and whose ``stretch`` holds, per model output, the
    share's length (0 for a share of no row), for the workers to agree on the large
    batch's; in rows, they end with a row of zeros whose ``valid`` is 0 (a marker).
    """
    lengths = cut.lengths
    assert lengths is not None
    period = sum(p.rows for p in pattern)
    bounds = _kept_bounds(pattern, cut.replicas)

    def row(whole, *element):
        leaves = tf.nest.flatten(element[0] if len(element) == 1 else element)
        moved = []
        for i, t in enumerate(leaves):
            found = lengths.of(i)
            moved.append(t if found is None else _front(t, found[0]))
        return (whole, *moved)

    def measured(whole, *leaves):
        n = _rows_of(leaves[0])
        given, real = [], []
        for group in range(lengths.number):
            members = [leaves[i] for i in lengths.members(group)]
            given.append(tf.reduce_max(tf.stack([t.row_lengths() for t in members]), axis=0))
            real.append(tf.reduce_max(tf.stack([_ragged_lengths(t) for t in members]), axis=0))
        real_lengths = tf.stack(real, axis=1)
        # A row as long as the input gives it where its batch lies in this large batch
        # (its longest row is then here, as long as it is); a row of a batch that spans
        # two large batches, or of a share, without its trailing zeros.
        own = tf.where(whole[:, None], tf.stack(given, axis=1), real_lengths)
        return leaves, n, real_lengths, tf.reduce_max(own, axis=0)

    def pieces(leaves, n, real_lengths, longest, ceiling):
        def piece(index, length, stretch, valid):
            def take(i, t):
                found = lengths.of(i)
                if found is None:
                    return tf.gather(t, index)
                kept = tf.gather(t, index)
                shape = tf.concat([tf.stack([tf.size(index, out_type=tf.int64),
                                             length[found[1]]]),
                                   tf.constant(t.shape[2:].as_list(), tf.int64)], 0)
                dense = tf.ensure_shape(kept.to_tensor(shape=shape), [None, *t.shape[1:]])
                return _back(dense, found[0])

            return tf.nest.pack_sequence_as(structure, [take(i, t) for i, t in enumerate(
                leaves)]), stretch, valid

        cut_up = _sorted_pieces(real_lengths, n, longest, bounds, cut, cap,
                                ceiling=ceiling).map(piece)
        return _with_header(cut_up, leaves, n, longest, structure, cut) if shares else cut_up

    structure = ds.element_spec  # of a row, once unbatched

    @tf.autograph.experimental.do_not_convert
    def large_batch(_, window):
        return window.map(unnumbered).ragged_batch(period)

    def running(most, batch):
        most = tf.maximum(most, batch[3])
        return most, (*batch, most)

    def within(start, *batch):  # per row: its batch lies in one large batch
        n = tf.shape(tf.nest.flatten(batch)[0], out_type=tf.int64)[0]
        whole = start // period == (start + n - 1) // period
        return start + n, (tf.fill([n], whole), *batch)

    if shares:
        batches = ds.map(lambda *parts: _ragged_share(parts, lengths)).map(
            lambda *leaves: measured(tf.zeros([_rows_of(leaves[0])], tf.bool), *leaves))
    else:
        batches = ds.scan(tf.constant(0, tf.int64), within).unbatch().map(row).enumerate(
        ).group_by_window(lambda index, *_: index // period, large_batch,
                          window_size=period).map(measured)
    if cut.buckets:  # XLA's buckets reach no further than the longest row met so far
        batches = batches.scan(tf.zeros([lengths.number], tf.int64), running)
    else:
        batches = batches.map(lambda *batch: (*batch, batch[3]))
    return batches.flat_map(pieces)


def _rows_of(t: Any) -> tf.Tensor:
    """A dense or ragged batch's row count, int64."""
    return t.nrows() if isinstance(t, tf.RaggedTensor) else tf.shape(t, out_type=tf.int64)[0]


def _ragged_share(parts: tuple, lengths: Lengths) -> tuple:
    """A padded batch (a share) as :func:`cut_by_length`'s ragged batch of its rows: its
    leaves, each with a length moved to the first axis after the rows."""
    leaves = tf.nest.flatten(parts[0] if len(parts) == 1 else parts)
    moved = []
    for i, t in enumerate(leaves):
        found = lengths.of(i)
        if found is not None:
            axis = found[0]
            t = tf.RaggedTensor.from_tensor(tf.transpose(t, [0, axis, *(
                a for a in range(1, t.shape.rank) if a != axis)]) if axis > 1 else t)
        moved.append(t)
    return tuple(moved)


def _with_header(pieces: tf.data.Dataset, leaves: tuple, n: tf.Tensor, longest: tf.Tensor,
                 structure: Any, cut: Cut) -> tf.data.Dataset:
    """A share's ``pieces`` after its header and, in rows, before its end
    (:func:`cut_by_length` with ``shares``)."""
    lengths = cut.lengths
    assert lengths is not None
    longest = tf.where(n > 0, tf.maximum(longest, 1), 0)

    def zeros(i, t):  # a row of zeros at the share's lengths
        found = lengths.of(i)
        if found is None:
            return tf.zeros(tf.concat([[1], tf.shape(t, out_type=tf.int64)[1:]], 0), t.dtype)
        shape = tf.concat([[1, longest[found[1]]], tf.constant(t.shape[2:].as_list(),
                                                               tf.int64)], 0)
        return _back(tf.zeros(shape, t.dtype), found[0])

    row = tf.nest.pack_sequence_as(structure, [zeros(i, t) for i, t in enumerate(leaves)])
    ratio = tf.cast(longest, tf.float32)
    header = tf.stack([tf.constant(1.0) if g is None or g >= lengths.number else ratio[g]
                       for g in cut.outputs]) if cut.outputs else tf.zeros([0])
    share = tf.data.Dataset.from_tensors((row, header[None, :], -tf.ones([1]))).concatenate(
        pieces)
    if cut.tokens is not None:  # token_pieces end each share with an empty piece
        return share
    end = (row, tf.ones_like(header)[None, :], tf.zeros([1]))
    return share.concatenate(tf.data.Dataset.from_tensors(end))


def trim(rows: Any, padded: Padded, length: tf.Tensor) -> Any:
    """``rows`` (a gathered micro-batch of ``(x, y, sample_weight)``) with every input
    as long as the arrays along its second axis cut to ``length``, on the side without
    data."""
    def cut(t):
        if t is None or t.shape.rank < 2 or t.shape[1] != padded.length:
            return t
        return t[:, padded.length - length:] if padded.pre else t[:, :length]

    return tf.nest.map_structure(cut, rows)


def cut_rows_by_length(ds: tf.data.Dataset, pattern: list[Piece], cut: Cut, *,
                       cap: int | None = None) -> tf.data.Dataset:
    """:func:`cut_by_length` for batches of row numbers (arrays, gathered later): each
    kept piece ``(row numbers, length, stretch, valid)``, the rows of each large batch
    sorted by their length in ``cut.padded``, its length the longest (under XLA its
    bucket), at most the arrays', ``stretch`` the arrays' length over it."""
    padded = cut.padded
    assert padded is not None
    period = sum(p.rows for p in pattern)
    bounds = _kept_bounds(pattern, cut.replicas)
    table = tf.constant(padded.lengths)
    full = tf.constant([padded.length], tf.int64)

    def pieces(numbers):
        n = tf.size(numbers, out_type=tf.int64)
        return _sorted_pieces(tf.gather(table, numbers)[:, None], n, full, bounds, cut, cap,
                              static_longest=True).map(lambda index, length, stretch, valid: (
                                  tf.gather(numbers, index), length[0], stretch, valid))

    return ds.unbatch().batch(period).flat_map(pieces)


def _kept_bounds(pattern: list[Piece], replicas: int = 1
                 ) -> tuple[tf.Tensor, tf.Tensor, int, int]:
    """The kept pieces' (starts, ends) in ranks of ``replicas`` rows counted from the
    first row kept (each run of ``replicas`` kept pieces one piece of ranks: the
    pattern's pieces of a run are equal, so it divides), and the first and last row kept."""
    bounds, start = [], 0
    for p in pattern:
        if p.keep:
            bounds.append((start, start + p.rows))
        start += p.rows
    first = bounds[0][0]
    runs = [(bounds[i][0], bounds[min(i + replicas, len(bounds)) - 1][1])
            for i in range(0, len(bounds), replicas)]
    assert all((a - first) % replicas == 0 and (b - first) % replicas == 0
               for a, b in runs[:-1]), runs
    return (tf.constant([(a - first) // replicas for a, _ in runs], tf.int64),
            tf.constant([-(-(b - first) // replicas) for _, b in runs], tf.int64),
            first, bounds[-1][1])


def _sorted_pieces(lengths: tf.Tensor, n: tf.Tensor, longest: tf.Tensor,
                   bounds: tuple[tf.Tensor, tf.Tensor, int, int], cut: Cut,
                   cap: int | None = None, *, static_longest: bool = False,
                   ceiling: tf.Tensor | None = None) -> tf.data.Dataset:
    """The kept pieces of a large batch of ``n`` rows whose lengths are ``lengths``
    (rows, groups): its kept rows sorted by cost, each piece ``(positions, lengths,
    stretch, valid)`` for those that start before row ``n``; its lengths its rows'
    longest in each group, at most ``longest`` (the large batch's), ``stretch`` per
    model output ``longest`` over it in the output's group, ``valid`` 1.0 per real row.

    With ``cut.replicas`` = R local replicas, the sorted rows are taken in ranks of R
    and a piece is a run of ranks: replica r's micro-batch holds row r of each (a copy
    of the rank's first, ``valid`` 0.0, where the last rank is short), all R padded to
    the run's longest lengths, so they stack into one element and every replica gets
    rows of about the same lengths. In tokens a rank costs, per length, what its
    longest row there does.

    With ``cut.buckets`` (XLA) each length is rounded up to its bucket, capped at a
    ``static_longest`` ``longest`` (the arrays'), else at the ``ceiling``, the longest
    row met so far per length (not a program per large batch's longest, nor past what
    the model may take: a table of 512 positions). In tokens each piece is then padded
    to the rows the budget holds at its lengths with copies of its last (``valid`` 0).
    With ``cut.tokens``, the pieces are :func:`token_pieces`' (of at most ``cap`` rows)
    instead of ``bounds``'."""
    starts, ends, first, last = bounds
    count = tf.maximum(tf.minimum(tf.constant(last, tf.int64), n) - first, 0)
    longest = tf.maximum(longest, 1)  # a length whose every part is zeros: one column
    order = first + tf.cast(tf.argsort(row_costs(lengths[first:first + count]), stable=True),
                            tf.int64)
    groups = int(lengths.shape[1])
    padded_rows = cut.buckets and cut.tokens is not None
    replicas = cut.replicas
    ranks = (count + replicas - 1) // replicas
    if replicas == 1:
        rank_lengths = tf.gather(lengths, order)
    else:
        at = tf.reshape(tf.range(ranks * replicas), [-1, replicas])
        rank_lengths = tf.reduce_max(tf.gather(lengths, tf.gather(
            order, tf.minimum(at, count - 1))), axis=1)

    def length_of(most):
        most = tf.maximum(most, 1)
        if not cut.buckets:
            return tf.minimum(most, longest)
        rounded = bucket_up(most, cut.tokens is not None)
        if static_longest:
            return tf.minimum(rounded, longest)
        return rounded if ceiling is None else tf.minimum(rounded, ceiling)

    def piece(a, b, replica):
        b = tf.minimum(b, ranks)
        at = tf.range(a, b) * replicas + replica
        real_row = at < count
        index = tf.gather(order, tf.where(real_row, at, at - replica))
        valid = tf.cast(real_row, tf.float32)
        length = length_of(tf.reduce_max(rank_lengths[a:b], axis=0))
        real = b - a
        if padded_rows:
            assert cut.tokens is not None
            rows = padded_row_count(real, rows_within(cut.tokens, tf.reduce_sum(length), cap))
            copies = tf.minimum(tf.range(rows), real - 1)
            index, valid = tf.gather(index, copies), tf.gather(valid, copies) * tf.cast(
                tf.range(rows) < real, tf.float32)
        ratio = tf.cast(longest, tf.float32) / tf.cast(length, tf.float32)
        stretch = tf.stack([tf.constant(1.0) if g is None or g >= groups else ratio[g]
                            for g in cut.outputs]) if cut.outputs else tf.zeros([0])
        return index, length, tf.tile(stretch[None, :], tf.stack([tf.size(index), 1])), valid

    if cut.tokens is not None:
        starts, ends = token_pieces(length_of(rank_lengths), cut.tokens, cap, cut.packing,
                                    padded_rows=padded_rows)
    else:
        reached = starts < ranks
        starts, ends = tf.boolean_mask(starts, reached), tf.boolean_mask(ends, reached)
    if replicas == 1:
        return tf.data.Dataset.from_tensor_slices((starts, ends)).map(
            lambda a, b: piece(a, b, tf.constant(0, tf.int64)))
    # Each piece of ranks once per replica, in turn: the pipeline stacks each R.
    return tf.data.Dataset.from_tensor_slices((
        tf.repeat(starts, replicas), tf.repeat(ends, replicas),
        tf.tile(tf.range(replicas, dtype=tf.int64), tf.shape(starts)))).map(piece)
