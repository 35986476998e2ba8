"""Graph helpers every layer shares: where the host's work is pinned (:data:`HOST`), one
token that orders many ops after many others (:func:`after`), and zeros no constant
folding can materialise (:func:`zeros_from`)."""

from __future__ import annotations

import tensorflow as tf

__all__ = ["HOST", "after", "zeros_from"]

# The host CPU: the input pipeline, the stash of the element in flight and every
# variable of the data's own (an epoch's number, the shapes counted) live here, so the
# accelerator sees one micro-batch at a time.
HOST = "/device:CPU:0"


def after(ops: list) -> tf.Tensor:
    """A token that exists once ``ops`` have run.

    Order many ops after many others through one token: ``tf.control_dependencies(ops)``
    gives every op made under it one control edge per entry of ``ops``, so ordering the
    optimizer's apply (some 15 ops a variable) after every variable's gradient grows
    with the square of the variable count, and so does the time TensorFlow's graph
    optimiser spends on the step: on a model of a few hundred variables, the call's
    first large batch would take twice as long.

    >>> @tf.function
    ... def ordered(v):
    ...     with tf.control_dependencies([after([v.assign(2.0)])]):
    ...         return v.read_value()
    >>> float(ordered(tf.Variable(1.0)))
    2.0
    """
    with tf.control_dependencies(ops):
        return tf.constant(True)


def zeros_from(value: tf.Tensor, zero: tf.Tensor | None = None) -> tf.Tensor:
    """Zeros computed from a variable's value (0 even where it holds inf or NaN): unlike
    ``tf.zeros_like``, nothing constant folding could turn into a weight-sized constant:
    under a tight cap that constant's allocation fails inside the folding pass, which a
    process does not survive. ``zero``: a float32 zero to multiply by (one per call)."""
    if zero is None:
        zero = tf.constant(0.0, value.dtype)
    return tf.math.multiply_no_nan(value, zero)
