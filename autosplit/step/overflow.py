"""An overflow decided as the full batch decides it, under ``mixed_float16``.

The full batch's gradient of a variable that a float16 layer uses is one float16 tensor,
summed over all of the batch's rows (a ``MatMul``'s, a ``BiasAddGrad``'s, a position
embedding's): past float16's range it is ``inf``, and Keras's ``LossScaleOptimizer``
skips the step, leaves ``iterations`` and halves its scale. A split sums m rows at a time
and adds the micro-batches in float32, where nothing overflows, so it applied steps that
``model.fit`` skips, and its loss scale took another path. Here a large batch is an
overflow where a micro-batch's gradient is not finite (its sum is not), or where a summed
gradient that the full batch computes in float16 (``LossPlan.half``,
``keras_hooks.traced.summed_in_float16``) reaches :data:`HALF_OVERFLOW`: its gradients are
then made ``inf``, and the optimizer's own check (a ``LossScaleOptimizer``'s skip and
halving) does the rest, once per large batch. A ratio's micro-batch (a masked mean over
tokens) is differentiated as its own mean, as large in float16 as the full batch's, then
multiplied by its divisor in float32 (``step.contribution``; a custom step's in
``keras_hooks.gradients``): differentiated whole, its numerator overflowed where the
full batch's mean did not.

The boundary: float16's largest finite value is 65504, and a sum rounds to ``inf`` from
65520 on. The decisions agree but within the micro-batches' roundings, each within half a
float16 step: within 2**-11 of 65520 (32) of the boundary they may differ (measured
within about 2, ``tests/step/test_overflow.py``). That holds where:

- the full batch's kernel rounds its exact sum once: TensorFlow's CPU ``MatMul`` and
  ``BiasAddGrad`` (measured), cuBLAS and cuDNN, which accumulate in float32 by default.
  On the CPU, a convolution's filter gradient (``Conv2DBackpropFilter``) accumulates in
  float16 itself, so the full batch's sum rounds, and may overflow, along the way;
- the micro-batches' partial sums do not cancel: opposite partial sums each past the
  range overflow a micro-batch where the full batch's sum is small (counted an
  overflow, as any micro-batch that is not finite);
- the variable is used once: the parts of a variable used twice (a shared layer, a
  float16 and a float32 use) are checked on their float32 total, where the full batch
  overflows on one part.

A recurrent layer's gradients are not decided so: its loop adds each time step's float16
sum in float32, and the full batch overflows on one step's, which no sum of the
micro-batches tells (``fit_large_batch`` warns). Under ``tf.distribute`` each replica
decides on its own rows, as the full batch's per-replica gradients do, and one all-reduce
makes the decision every replica's (and every worker's: the same collective).
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
    # The largest magnitude of each: NaN where a micro-batch's was (a replica's NaN, then
    # every replica's decision).
    largest = tf.stack([tf.reduce_max(tf.abs(g)) for g in summed])
    over = tf.reduce_any((largest >= HALF_OVERFLOW) | tf.math.is_nan(largest))
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
