"""An example's lengths: which parts of an example vary in length, along which axis, and
which of them share one length.

A translation pair has two lengths, its source's and its target's; a token classifier's
tokens and tags have one, as have a model's ids and their padding mask. Each length is a
*group* of parts (:class:`Lengths`). Parts share a group where the data says so
(:func:`tie`): their lengths agree in every one of the first examples read (256 rows),
or, for batches a user padded (``padded_batch``), in every one of its first batches.
Parts that must agree never come apart. Parts that agree there by chance and differ
later are padded together, each to the longer: exact for a model that ignores padding,
but a loss divided by every cell of one of them (``sum_over_batch_size`` over a
``sample_weight`` mask) then counts the longer one's cells.

Sequences come padded with zeros (``padded_batch``'s default, ``pad_sequences``), so an
example's length in a group is one past its last non-zero entry in any part of the group
(:func:`group_lengths`): trailing zeros are padding to a model that ignores padding. Arrays
of one shape that hold padded sequences, at the front or at the end, are
:class:`PaddedArrays`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

import numpy as np
import tensorflow as tf

from autosplit.data.sequences.buckets import bucket_up
from autosplit.data.structure import leaves_named

__all__ = ["Lengths", "PaddedArrays", "costliest_row", "group_lengths", "lengths_of",
           "padded_lengths", "padded_sequences", "real_lengths", "row_costs", "tie"]



class Lengths(NamedTuple):
    """The lengths of an element's parts: per leaf of ``tf.nest.flatten((x, y,
    sample_weight))`` (an input's own element ``(x, y[, sample_weight])`` flattens to the
    same leaves, in the same places), the axis along which it varies and its group."""

    axes: tuple[int | None, ...]  # per leaf: its axis of varying length (1: after the rows)
    groups: tuple[int | None, ...]  # per leaf: its length, 0..number - 1; None: fixed
    names: tuple[str, ...]  # per leaf, as messages name it: x[0], x['ids'], y
    # Why the element cannot be cut by length (a part that varies along two axes, a
    # ragged part); () where it can.
    uncut: tuple[str, ...] = ()

    @property
    def number(self) -> int:
        """How many lengths an example has."""
        return 1 + max((g for g in self.groups if g is not None), default=-1)

    def members(self, group: int) -> list[int]:
        """The leaves of ``group``."""
        return [i for i, g in enumerate(self.groups) if g == group]

    def described(self, group: int) -> str:
        """``group`` as messages name it: ``x[0]``, ``x['ids'] and x['mask']``."""
        return " and ".join(self.names[i] for i in self.members(group))

    def of(self, leaf: int) -> tuple[int, int] | None:
        """``(axis, group)`` of ``leaf`` where it has a length, else None (a leaf past
        :attr:`axes` is one the input's own element lacks: a class weight)."""
        if leaf >= len(self.axes):
            return None
        axis, group = self.axes[leaf], self.groups[leaf]
        return None if axis is None or group is None else (axis, group)


def lengths_of(spec: Any) -> Lengths | None:
    """The parts of ``spec`` (``(x, y_or_(), sample_weight_or_())`` specs, rows first)
    that vary in length, each a group of its own until :func:`tie` joins them; None where
    none varies."""
    axes: list[int | None] = []
    groups: list[int | None] = []
    names: list[str] = []
    uncut: list[str] = []
    for name, leaf in leaves_named(spec):
        names.append(name)
        varying = _varying_axes(leaf)
        if varying is None:
            uncut.append(f"{name} is {type(leaf).__name__}")
        elif len(varying) > 1:
            uncut.append(f"{name} varies in length along {len(varying)} axes "
                         f"({', '.join(map(str, varying))})")
        axis = varying[0] if varying is not None and len(varying) == 1 else None
        axes.append(axis)
        groups.append(None if axis is None else len([g for g in groups if g is not None]))
    if not any(g is not None for g in groups) and not uncut:
        return None
    return Lengths(tuple(axes), tuple(groups), tuple(names), tuple(uncut))


def _varying_axes(leaf: Any) -> list[int] | None:
    """The axes after the rows of unknown size; None for a part that is not a plain
    tensor of known rank (ragged, sparse)."""
    if type(leaf) is not tf.TensorSpec or leaf.shape.rank is None:
        return None
    return [axis for axis in range(1, leaf.shape.rank) if leaf.shape[axis] is None]


def tie(lengths: Lengths, elements: Iterable[Any]) -> Lengths:
    """``lengths`` with the parts whose lengths agree in every one of ``elements`` (an
    input's own elements: its examples, or the batches a user padded) in one group."""
    varying = [i for i, g in enumerate(lengths.groups) if g is not None]
    seen = [[int(tf.shape(leaves[i])[lengths.axes[i] or 0]) for i in varying]
            for leaves in (tf.nest.flatten(e) for e in elements)]
    if not seen:
        return lengths
    columns = np.asarray(seen).T  # per varying leaf, its length in each element
    groups: list[int | None] = [None] * len(lengths.groups)
    firsts: list[int] = []  # a leaf of each group so far
    for index, column in zip(varying, columns, strict=True):
        same = [g for g, first in enumerate(firsts) if np.array_equal(columns[
            varying.index(first)], column)]
        if same:
            groups[index] = same[0]
        else:
            groups[index] = len(firsts)
            firsts.append(index)
    return lengths._replace(groups=tuple(groups))


def group_lengths(leaves: list[Any], lengths: Lengths, *, pre: bool = False) -> tf.Tensor:
    """Per row of a batch's ``leaves`` (dense, padded with zeros, flattened as
    ``lengths`` counts them) and per group: one past its last non-zero entry along its
    axis in any leaf of the group (``pre``: padded at the front, counted from its end),
    int64 (rows, groups)."""
    per_group = []
    for group in range(lengths.number):
        found = []
        for index in lengths.members(group):
            t, axis = leaves[index], lengths.axes[index]
            if axis is not None and t is not None:
                found.append(real_lengths(t, axis, pre))
        per_group.append(tf.reduce_max(tf.stack(found), axis=0))
    return tf.stack(per_group, axis=1)


def real_lengths(t: Any, axis: int = 1, pre: bool = False) -> tf.Tensor:
    """Per row of ``t`` (dense, or ragged along ``axis`` = 1): one past its last non-zero
    entry along ``axis`` (counted from the end where ``pre``: padded at the front),
    int64 (rows,). The one place a sequence's length without its padding is read.

    >>> real_lengths(tf.constant([[3, 1, 0, 0], [0, 2, 0, 5]])).numpy().tolist()
    [2, 4]
    >>> real_lengths(tf.constant([[0, 0, 3, 1]]), pre=True).numpy().tolist()
    [2]
    >>> real_lengths(tf.ragged.constant([[4, 0], [0, 0, 7, 0]])).numpy().tolist()
    [1, 3]
    """
    if isinstance(t, tf.RaggedTensor):  # as dense as its longest row, padded with zeros
        t = t.to_tensor()
    nonzero = tf.not_equal(t, tf.zeros([], t.dtype)) if t.dtype != tf.bool else t
    others = [a for a in range(1, t.shape.rank) if a != axis]
    if others:
        nonzero = tf.reduce_any(nonzero, axis=others)
    if pre:
        nonzero = nonzero[:, ::-1]
    columns = tf.range(1, tf.shape(nonzero, out_type=tf.int64)[1] + 1)
    return tf.reduce_max(tf.where(nonzero, columns[None, :], 0), axis=1)


def row_costs(lengths: tf.Tensor) -> tf.Tensor:
    """What each row of ``lengths`` (rows, groups) costs a micro-batch: the sum of its
    lengths, the cells of its every part (a pair's source and target)."""
    return tf.reduce_sum(lengths, axis=-1)


def costliest_row(sample: tuple, lengths: Lengths | None, padded: PaddedArrays | None,
                  buckets: bool = False, tokens: bool = False) -> int:
    """What the costliest row of ``sample`` (``(x, y, sample_weight)`` padded to its
    longest, as ``InputAdapter.sample`` gives it) costs (:func:`row_costs`), each length
    rounded up to its bucket where ``buckets`` (XLA; ``tokens``: a cut in tokens'); for
    arrays that hold ``padded`` sequences, their longest."""
    def rounded(n):
        return bucket_up(n, tokens) if buckets else n

    if padded is not None:
        return int(min(rounded(max(int(padded.lengths.max()), 1)), padded.length))
    assert lengths is not None, "sequences that are not arrays have their lengths"
    leaves = tf.nest.flatten(tuple(() if part is None else part for part in sample))
    found = rounded(tf.maximum(group_lengths(leaves, lengths), 1))
    return max(int(tf.reduce_max(row_costs(found))), 1)


class PaddedArrays(NamedTuple):
    """Arrays of one shape that hold sequences padded with zeros to one length
    (``keras.utils.pad_sequences``)."""

    length: int  # the arrays' length L: what model.fit pads every batch to
    pre: bool  # padded at the front (pad_sequences' default), not at the end
    lengths: np.ndarray  # int64 (rows,): each row's length without its padding


def padded_sequences(arrays: tuple, takes_any_length: bool) -> PaddedArrays | None:
    """How ``arrays`` = ``(x, y, sample_weight)`` hold padded sequences, or None.

    Sequences are integer inputs of rank 2 or more (token ids) whose second axis some
    rows end (or start) with zeros along, fed to a model that ``takes_any_length``
    (its inputs' second axis is unknown). Every array as long along its second axis
    counts as padded with them: targets and a ``sample_weight`` mask per token.
    """
    leaves = tf.nest.flatten(arrays)
    tokens = [t for t in tf.nest.flatten(arrays[0]) if t is not None and t.shape.rank >= 2
              and t.dtype.is_integer]
    if not takes_any_length or not tokens:
        return None
    length = int(tokens[0].shape[1])
    varying = tuple(t is not None and t.shape.rank >= 2 and int(t.shape[1]) == length
                    for t in leaves)
    nonzero = np.zeros((int(tokens[0].shape[0]), length), bool)
    for t, v in zip(leaves, varying, strict=True):
        if v:
            held = np.asarray(t) != 0
            nonzero |= held.any(axis=tuple(range(2, held.ndim))) if held.ndim > 2 else held
    post = real_lengths(tf.constant(nonzero)).numpy()
    pre = real_lengths(tf.constant(nonzero), pre=True).numpy()
    if min(post.sum(), pre.sum()) >= length * len(post):
        return None  # no row is padded
    front = bool(pre.sum() < post.sum())
    return PaddedArrays(length, front, (pre if front else post).astype(np.int64))


def padded_lengths(spec: Any, padded: PaddedArrays | int) -> Lengths:
    """The one length of arrays that hold ``padded`` sequences (or sequences padded to
    that many columns): every part as long as they are along its second axis (``spec``:
    ``(x, y, sample_weight)``'s, rows first)."""
    length = padded if isinstance(padded, int) else padded.length
    axes, names = [], []
    for name, leaf in leaves_named(spec):
        names.append(name)
        axes.append(1 if leaf.shape.rank >= 2 and leaf.shape[1] in (None, length) else None)
    return Lengths(tuple(axes), tuple(None if a is None else 0 for a in axes), tuple(names))
