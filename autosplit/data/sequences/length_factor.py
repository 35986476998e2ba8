"""The length factor of a micro-batch cut short of its large batch: per model output,
the large batch's padded length over the micro-batch's, in the length the output
follows (1 for an output that follows none).

A micro-batch cut by length (``autosplit.data.sequences.by_length``) is padded less
than its large batch. A loss divided by every cell along a length
(``sum_over_batch_size`` without a Keras mask) must still count the large batch's
cells, and a metric averaged over the length must weigh each row as the large batch
does: the denominator is multiplied by the factor (``autosplit.step.reduction``), the
metric's weights divided by it (:func:`metric_weight`). The micro-batch's inputs come as
:class:`Shortened`, which carries it.

Where several workers each cut their own share, a share's length is not the large
batch's: they agree on the longest before its first micro-step, and :class:`ShareFactor`
scales each micro-batch's factor by the large batch's length over the share's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import keras
import tensorflow as tf

from autosplit.data.sequences.lengths import Lengths
from autosplit.graph import HOST

__all__ = ["ShareFactor", "Shortened", "inputs_of", "metric_weight", "output_length_factors",
           "own_shape", "own_size"]


class Shortened(NamedTuple):
    """A micro-batch's inputs padded to its own longest row, not its large batch's."""

    inputs: Any  # x, as the model takes it
    # float32 (rows, outputs): per model output (Cut.outputs), the large batch's padded
    # length over this micro-batch's in the length the output follows (1: none)
    length_factor: tf.Tensor
    # On several local replicas (else ()): int32 (rows, lengths per example), per row
    # the lengths its micro-batch is padded to; 0 in a row that only stacks the
    # replicas' micro-batches side by side (:func:`own_shape`)
    extent: Any = ()


def inputs_of(x: Any) -> Any:
    """The model's inputs, from ``x`` or from a :class:`Shortened`."""
    return x.inputs if isinstance(x, Shortened) else x


def own_shape(element: tuple, lengths: Lengths | None, *, rows_vary: bool) -> tuple:
    """One replica's micro-batch ``(x, y, w, valid)``, taken from the element that stacks
    every local replica's side by side (each padded there to the most rows and lengths
    of any), cut back to its own rows and lengths (:attr:`Shortened.extent`), so that a
    replica computes on its own shape: the rows up to the last of its own, each part
    that has a length (``lengths``: the input's) as long as its micro-batch in it. The
    stack pads at the end, so a micro-batch padded at its front keeps its own padding.
    ``rows_vary``: micro-batches of any row count (in tokens); of a static count every
    row is the replica's own (copies of its rows pad each), and stays. An element
    without an extent is returned as it is."""
    x, y, w, valid = element
    if not isinstance(x, Shortened) or isinstance(x.extent, tuple):
        return element
    assert lengths is not None, "a stack of micro-batches cut by length needs their lengths"
    rows, length = own_size(x.extent, None if rows_vary else tf.shape(valid)[0])

    def cut(i: int, t: tf.Tensor) -> tf.Tensor:
        found = lengths.of(i)
        size = tf.unstack(tf.shape(t))
        size[0] = rows
        shape = t.shape.as_list()
        if rows_vary:
            shape[0] = None
        if found is not None:
            size[found[0]] = length[found[1]]
            shape[found[0]] = None
        cut_t = tf.slice(t, tf.zeros([t.shape.rank], tf.int32), tf.stack(size))
        cut_t.set_shape(shape)
        return cut_t

    parts = (x.inputs, y, w)
    leaves = [cut(i, t) for i, t in enumerate(tf.nest.flatten(parts))]
    inputs, y, w = tf.nest.pack_sequence_as(parts, leaves)
    if not rows_vary:
        return Shortened(inputs, x.length_factor, x.extent), y, w, valid
    return Shortened(inputs, x.length_factor[:rows], x.extent[:rows]), y, w, valid[:rows]


def own_size(extent: tf.Tensor, rows: tf.Tensor | None = None) -> tuple[tf.Tensor, tf.Tensor]:
    """Per micro-batch of ``extent`` (its :attr:`Shortened.extent`, rows and lengths on
    its last two axes, any before), the rows and lengths it is computed at
    (:func:`own_shape`): ``rows`` where their count is static, else up to its last own
    row; each length its own; at least 1 each."""
    if rows is None:
        rows = tf.maximum(tf.reduce_sum(tf.cast(extent[..., 0] > 0, tf.int32), axis=-1), 1)
    else:
        rows = tf.fill(tf.shape(extent)[:-2], rows)
    return rows, tf.maximum(tf.reduce_max(extent, axis=-2), 1)


def output_length_factors(length_factor: tf.Tensor | None, y_pred: Any) -> Any:
    """``length_factor`` (a row of :attr:`Shortened.length_factor`: one entry per flat
    model output) in ``y_pred``'s structure, each output its own; None without one."""
    if length_factor is None or not length_factor.shape[-1]:
        return None
    outputs = keras.tree.flatten(y_pred)
    columns = int(length_factor.shape[-1])
    return keras.tree.pack_sequence_as(y_pred, [length_factor[k] if k < columns else None
                                                for k in range(len(outputs))])


def metric_weight(sample_weight: Any, y_pred: Any, length_factor: Any) -> dict:
    """The weights of one output's metrics: ``sample_weight`` (ones if None) over its
    ``length_factor`` where the output has a length axis; else nothing to add.

    A Keras metric averages each row's values over its length before it weighs rows,
    so a row padded to ``P`` weighs ``L / P`` times what it weighs in the large batch
    of length ``L``."""
    rank = y_pred.shape.rank
    if length_factor is None or rank is None or rank < 2 or y_pred.shape[1] is not None:
        return {}
    shrink = 1.0 / tf.cast(length_factor, tf.float32)
    if sample_weight is None:
        # (rows, 1): a Keras mask of (rows, length) multiplies it
        return {"sample_weight": tf.fill([tf.shape(y_pred)[0], 1], shrink)}
    return {"sample_weight": tf.cast(sample_weight, tf.float32) * shrink}


class ShareFactor:
    """Per model output, the large batch's length over this worker's share's, in a
    variable on the host: ones, until the workers agree (:meth:`agree`)."""

    def __init__(self) -> None:
        self.variable: tf.Variable | None = None

    def bind(self, x: Any) -> None:
        """Ones for micro-batches of ``x``'s spec (a :class:`Shortened`'s: one per
        output), none otherwise: a step reused by a later run forgets the last
        agreement."""
        if not isinstance(x, Shortened):
            return
        outputs = x.length_factor.shape[-1:]
        if self.variable is None or self.variable.shape != outputs:
            with tf.init_scope(), tf.device(HOST):
                self.variable = tf.Variable(tf.ones(outputs), trainable=False)
        else:
            self.variable.assign(tf.ones(outputs))

    def applied(self, x: Any) -> Any:
        """``x`` with its length factors scaled to the large batch's length."""
        if not isinstance(x, Shortened) or self.variable is None:
            return x
        return Shortened(x.inputs, x.length_factor * self.variable, x.extent)

    def agree(self, local: tf.Tensor,
              bounds: Callable[[tf.Tensor], tuple[tf.Tensor, tf.Tensor]]) -> tf.Tensor:
        """Per model output, the large batch's length: the most of every worker's
        ``local`` (its share's, 0 for none: a share's header), through ``bounds`` (a
        collective: most and least over every replica), kept as this worker's factor.
        Returns the least of every worker's: below 0 where one could not read its
        header (it gave up)."""
        assert self.variable is not None
        most, least = bounds(local)
        scale = tf.where(local > 0, most / tf.maximum(local, 1.0), 1.0)
        with tf.control_dependencies([self.variable.assign(scale)]):
            return tf.reduce_min(least)
