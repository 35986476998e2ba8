"""How a pipeline of sequences fills its micro-batches (:func:`cut_stats`): what
``FitReport.cut`` reports and ``benchmarks/sequences.py`` measures."""

from __future__ import annotations

from typing import NamedTuple

import tensorflow as tf

from autosplit.data.markers import is_end_marker, is_header
from autosplit.data.pipeline import MicroBatches
from autosplit.data.sequences.length_factor import inputs_of, own_shape
from autosplit.data.sequences.lengths import Lengths, group_lengths

__all__ = ["CutStats", "cut_stats"]


class CutStats(NamedTuple):
    """How the first large batches of an epoch were cut (``cut_stats``)."""

    large_batches: int  # read (at most the number asked for)
    micro_batches: float  # per large batch, on average
    padding_share: float  # of the token cells fed: 1 - real tokens / cells
    tokens: int  # real tokens read


def cut_stats(pipeline: MicroBatches, large_batches: int = 4) -> CutStats | None:
    """Micro-batches per large batch of ``pipeline`` and the share of padding they feed,
    over the first ``large_batches`` of an epoch in the input's own order, read on the host
    (no step runs); None for an input read once (a generator) or without lengths. A row's
    tokens are its lengths (``lengths.group_lengths``), summed over an example's
    lengths, its cells the micro-batch's padded lengths (arrays padded at their front are
    read so where cut by length, which knows it), times its real rows (under XLA's
    buckets, every row of its shape)."""
    cut = pipeline.cut
    lengths = cut.lengths if cut.lengths is not None else pipeline.adapter.lengths()
    if not pipeline.adapter.reiterable or lengths is None or lengths.number == 0:
        return None
    pre = cut.arrays is not None and cut.arrays.pre
    read = pieces = real = cells = 0
    # of this large batch; None where markers end each (tokens, shares)
    left = None if pipeline.ends().marks_batches else pipeline.elements(0)
    for x, y, w, valid in pipeline.dataset(autotune=False, counted=False):
        if is_header((valid,)):  # a share's, which the workers agree on
            continue
        if is_end_marker((valid,)):  # with tokens, a large batch's end
            read += 1
        else:
            for part in _replica_parts((x, y, w, valid), pipeline, lengths):
                real_part, cells_part = _tokens_and_cells(part, lengths, pre, cut.buckets)
                real, cells = real + real_part, cells + cells_part
            pieces += 1
            if left is not None:
                left -= 1
                if left == 0:
                    read, left = read + 1, pipeline.elements(read + 1)
        if read == large_batches:
            break
    if left is not None and read < large_batches and left != pipeline.elements(read):
        read += 1  # a short last large batch, of an input that does not tell its length
    return CutStats(read, pieces / max(read, 1), 1 - real / cells if cells else 0.0, real)


def _replica_parts(element: tuple, pipeline: MicroBatches, lengths: Lengths) -> list[tuple]:
    """Each local replica's micro-batch of ``element`` at the shape it is computed at."""
    if pipeline.local_replicas == 1:
        return [element]
    return [own_shape(tf.nest.map_structure(lambda t, r=r: t[r], element), lengths,
                      rows_vary=pipeline.element_rows is None)
            for r in range(pipeline.local_replicas)]


def _tokens_and_cells(part: tuple, lengths: Lengths, pre: bool, buckets: bool
                      ) -> tuple[int, int]:
    """A micro-batch's real tokens and the cells it feeds (under XLA's buckets every row
    of its shape is computed, copies included)."""
    x, y, w, valid = part
    leaves = tf.nest.flatten((inputs_of(x), y, w))
    rows = valid > 0
    real = int(tf.reduce_sum(tf.boolean_mask(group_lengths(leaves, lengths, pre=pre), rows)))
    count = int(tf.size(valid)) if buckets else int(tf.reduce_sum(tf.cast(rows, tf.int64)))
    return real, count * sum(int(tf.shape(leaves[lengths.members(g)[0]])[
        lengths.axes[lengths.members(g)[0]]]) for g in range(lengths.number))
