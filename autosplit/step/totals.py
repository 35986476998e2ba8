"""The sums of one large batch as tensors (:class:`Totals`): what its micro-batches add
up to, per replica or all-reduced, and the loop that adds them as loop-carried tensors
(:func:`sum_loop`), for ``accumulate_gradients``, ``accumulate_iterator`` and
validation. The train step keeps the same sums in variables (``autosplit.step.sums``)
and reads them as a :class:`Totals`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import tensorflow as tf

from autosplit.step.forward import forward_totals

__all__ = ["Totals", "added", "sum_loop", "zero_totals"]


class Totals(NamedTuple):
    """Sums over the micro-batches of one large batch (per replica, or all-reduced)."""

    gradients: list  # per group, per variable (None: no gradient)
    numerators: list
    denominators: list
    forward: tf.Tensor
    rows: tf.Tensor
    # the gradient noise scale's sums (noise_scale.micro_terms); none: empty, or None
    # where nothing was summed into it (a leaf that tf.nest maps, a loop carries)
    noise: Any = None

    def summed_over_replicas(self, context) -> Totals:
        """The scalar sums added up over every replica in one all-reduce; the gradients
        stay this replica's (the optimizer all-reduces those)."""
        numerators, denominators, forward, rows = context.all_reduce(
            tf.distribute.ReduceOp.SUM, (self.numerators, self.denominators, self.forward,
                                         self.rows))
        return Totals(self.gradients, numerators, denominators, forward, rows, self.noise)


def added(totals: Totals, c: Any) -> Totals:
    """``totals`` plus the sums of ``c``, a micro-batch's ``Contribution`` (or another
    :class:`Totals`); a gradient of None adds nothing."""
    part = Totals(c.gradients, c.numerators, c.denominators, c.forward, c.rows,
                  getattr(c, "noise", None))
    return tf.nest.map_structure(lambda a, b: a if b is None else a + b, totals, part)


def zero_totals(terms: int, gradients: list[Any] | None = None, noise: int = 0) -> Totals:
    """Float32 zeros for ``terms`` compiled losses; ``gradients`` the zero gradient sums;
    ``noise``: the gradient noise scale's sums (``noise_scale.noise_slots``), 0: none
    (an empty tensor, which a loop carries and ``tf.nest`` maps as it maps the rest)."""
    zeros = [tf.constant(0.0)] * terms
    return Totals([] if gradients is None else gradients, zeros, zeros, forward_totals(),
                  tf.constant(0.0), tf.zeros([noise]))


def sum_loop(step: Callable[[tf.Tensor, Totals], tuple[Totals, tf.Tensor]],
             count: int | tf.Tensor, start: Totals) -> tuple[Totals, tf.Tensor]:
    """``totals, stop = step(i, totals)`` for micro-batches ``i < count``, until ``stop``.

    The loop of ``accumulate_gradients``, ``accumulate_iterator`` and validation
    (``autosplit.step.evaluate``): the sums are loop-carried tensors, returned with whether a
    step stopped early (its input ran out).
    """
    def body(i: tf.Tensor, totals: Totals, stop: tf.Tensor
             ) -> tuple[tf.Tensor, Totals, tf.Tensor]:
        totals, stop = step(i, totals)
        return i + 1, totals, stop

    # parallel_iterations=1: micro-batches run one after another, so the peak memory
    # is one micro-batch's, not several in flight.
    _, totals, stop = tf.while_loop(
        lambda i, _, stop: tf.logical_and(i < count, tf.logical_not(stop)), body,
        (tf.constant(0), start, tf.constant(False)), parallel_iterations=1)
    return totals, stop
