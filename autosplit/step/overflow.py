"""An overflow decided as the full batch decides it, under ``mixed_float16``.

The full batch's gradient of a variable that a float16 layer uses is one float16 tensor,
summed over all of the batch's rows (a ``MatMul``'s, a ``BiasAddGrad``'s): past float16's
range it is ``inf``, and Keras's ``LossScaleOptimizer`` skips the step, leaves
``iterations`` and halves its scale. A split sums m rows at a time and adds the
micro-batches in float32, where nothing overflows, so it applied steps that ``model.fit``
skips, and its loss scale took another path. Here a large batch is an overflow where
a micro-batch's gradient is not finite (its sum is not), or where a summed gradient that
the full batch computes in float16 (``LossPlan.half``) reaches :data:`HALF_OVERFLOW`:
its gradients are then made ``inf``, and the optimizer's own check (a
``LossScaleOptimizer``'s skip and halving, or ``model.fit``'s ``inf`` without one) does
the rest, once per large batch.

The boundary: float16's largest finite value is 65504, and a sum rounds to ``inf`` from
65520 on. On TensorFlow's CPU kernels the full batch's ``MatMul`` and ``BiasAddGrad``
round their exact sum once; the split's sum of its micro-batches' float16 gradients
differs from that sum by their roundings, each within half a float16 step: at most
2**-11 of 65520 (32) in all, so the two decisions can differ only where the exact sum
lies within 32 of 65520, and measured, within about 2 (``tests/step/test_overflow.py``).
Under ``tf.distribute`` each replica decides on its own rows, as the full batch's
per-replica gradients do, and one all-reduce makes the decision every replica's.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

__all__ = ["HALF_OVERFLOW", "overflowed", "poisoned"]

HALF_OVERFLOW = 65520.0  # float16 rounds a value this large, or larger, to inf


def overflowed(gradients: list, half: tuple[bool, ...], context: Any = None
               ) -> tf.Tensor | None:
    """Whether a large batch's summed ``gradients`` (one per variable, None where it has
    none; the loss scale's, as the full batch's float16 tensors hold them) overflow
    where ``half`` says the full batch sums them in float16; every replica of
    ``context`` (a replica context, or None) agreeing. None where none is float16."""
    summed = [g for g, h in zip(gradients, half, strict=False) if h and g is not None]
    if not summed:
        return None
    over = tf.reduce_any(tf.stack([tf.reduce_max(tf.abs(g)) >= HALF_OVERFLOW
                                   for g in summed]))
    if context is not None:
        over = context.all_reduce(tf.distribute.ReduceOp.SUM, tf.cast(over, tf.float32)) > 0
    return over


def poisoned(gradients: list, overflow: tf.Tensor | None) -> list:
    """``gradients``, made ``inf`` where ``overflow``: the optimizer then finds the large
    batch not finite, as it finds the full batch's."""
    if overflow is None:
        return gradients
    present = [g for g in gradients if g is not None]
    made = tf.cond(overflow, lambda: [g + tf.constant(float("inf"), g.dtype) for g in present],
                   lambda: [tf.identity(g) for g in present])
    it = iter(made)
    return [None if g is None else next(it) for g in gradients]
