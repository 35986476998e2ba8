"""The state of one large batch in flight: its float32 sums, and the element being worked.

:class:`Sums` holds, per replica, the gradient sums of each loss group and the scalar
sums of every loss's numerator and denominator, of the losses added in ``call()`` and
of the real rows (``autosplit.step.contribution``). :class:`Stash` holds, on the host, a copy of the
element being processed and how far it got, so that an out-of-memory error can resume
exactly. Both live in variables, created once and reused for every large batch; only
the train step's graph code (``autosplit.step.update``, ``autosplit.step.loop``) changes
them, inside its compiled functions.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from autosplit.graph import HOST, after, zeros_from
from autosplit.keras_hooks.batchnorm import Pool
from autosplit.step.contribution import Contribution
from autosplit.step.loss_plan import LossPlan
from autosplit.step.noise_scale import noise_slots
from autosplit.step.totals import Totals

__all__ = ["Stash", "Sums"]


class Sums:
    """Per-replica sums of the micro-batches committed since the last apply.

    Every commit adds (one ``assign_add`` a sum, no branch); the apply zeroes the sums
    once the optimizer has written the weights (:meth:`zero`; ``autosplit.step.update``
    orders it), with zeros computed from each sum's own value
    (``graph.zeros_from``): a zeroing constant of a variable's shape is one TensorFlow's
    constant folding materialises when it instantiates the function, and under a tight
    cap that allocation can fail inside the folding pass, which does not survive it.

    No branch overwrites the sums at a large batch's first commit: a ``tf.cond`` per
    commit would be traced, optimised and instantiated with every step, and run with
    every micro-batch.
    """

    def __init__(self, model: keras.Model, plan: LossPlan, strategy, pool: list | tuple = (),
                 noise: bool = False) -> None:
        replicated = strategy.num_replicas_in_sync > 1
        kwargs = dict(synchronization=tf.VariableSynchronization.ON_READ,
                      aggregation=tf.VariableAggregation.SUM) if replicated else {}

        def var(shape, name):
            return tf.Variable(tf.zeros(shape, tf.float32), trainable=False,
                               name=f"autosplit_{name}", **kwargs)

        self.groups = plan.groups
        with strategy.scope():
            self.gradients = [[var(v.shape, "sum") if has else None
                               for v, has in zip(model.trainable_variables, plan.has_grad,
                                                 strict=True)]
                              for _ in plan.groups]
            self.numerators = [var([], "numerator") for _ in plan.kinds]
            self.denominators = [var([], "denominator") for _ in plan.kinds]
            self.in_call = var([2], "in_call")  # contribution.Contribution.forward
            self.rows = var([], "rows")
            # The gradient noise scale's per-micro-batch numbers (step.noise_scale).
            self.noise = var([noise_slots(plan)], "noise") if noise else None
            # BatchNormalization statistics pooled over the large batch (keras_hooks/batchnorm.py).
            calls = {id(layer): n for layer, n in plan.batch_norm_calls}
            self.pool = Pool(list(pool), [calls[id(layer)] for layer in pool],
                             var) if pool else None

    def add(self, c: Contribution) -> tf.Tensor:
        """Per replica: add one micro-batch's contribution; returns a token of the additions."""
        ops = [s.assign_add(g)
               for sums, grads in zip(self.gradients, c.gradients, strict=True)
               for s, g in zip(sums, grads, strict=True) if s is not None and g is not None]
        ops += [v.assign_add(t) for v, t in zip(self.numerators, c.numerators, strict=True)]
        ops += [v.assign_add(t) for v, t in
                zip(self.denominators, c.denominators, strict=True)]
        ops += [self.in_call.assign_add(c.forward), self.rows.assign_add(c.rows)]
        if self.noise is not None:
            ops.append(self.noise.assign_add(c.noise))
        if self.pool is not None:
            ops += self.pool.add(c.moments)
        return after(ops)

    def read(self) -> Totals:
        """Per replica: what was summed (zeros where nothing was committed: a worker whose
        share of a short last batch is empty)."""
        return Totals([[None if s is None else s.read_value() for s in sums]
                       for sums in self.gradients],
                      [v.read_value() for v in self.numerators],
                      [v.read_value() for v in self.denominators],
                      self.in_call.read_value(), self.rows.read_value(),
                      None if self.noise is None else self.noise.read_value())

    def zero(self, read: Totals | None = None) -> None:
        """Per replica: start the next large batch (in a graph, ordered by the caller: after
        the sums were read and the optimizer wrote the weights).

        ``read``: what :meth:`read` gave for the apply (read here when None). The
        gradient sums are zeroed from those values (one read less a variable: 102 on a
        Dense stack of 50 layers); a read tensor shares its variable's buffer, so holding
        it to the zeroing costs no memory."""
        if read is None:
            read = self.read()
        zero = tf.constant(0.0, tf.float32)
        for sums, read_sums in zip(self.gradients, read.gradients, strict=True):
            for s, value in zip(sums, read_sums, strict=True):
                if s is not None:
                    s.assign(zeros_from(value, zero))
        for v in [*self.numerators, *self.denominators, self.in_call, self.rows,
                  *([] if self.noise is None else [self.noise])]:
            v.assign(tf.zeros_like(v))
        if self.pool is not None:
            self.pool.zero()


class Stash:
    """On the host: the element being processed, how many were pulled, how far it got."""

    def __init__(self, element_spec: Any) -> None:
        self.spec = element_spec
        with tf.device(HOST):
            self.pulled = tf.Variable(0, dtype=tf.int64, trainable=False)
            self.exhausted = tf.Variable(False, trainable=False)
            self.pending = tf.Variable(False, trainable=False)
            self.done_rows = tf.Variable(0, dtype=tf.int32, trainable=False)
            # One micro-batch of inputs; the shape follows whatever size is in use.
            self.values = tf.nest.map_structure(
                lambda s: tf.Variable(tf.zeros([d or 1 for d in s.shape.as_list()], s.dtype),
                                      trainable=False, shape=tf.TensorShape(None)),
                element_spec)

    def fits(self, element_spec: Any) -> bool:
        """Whether elements of ``element_spec`` can be stashed here (same structure)."""
        try:
            tf.nest.assert_same_structure(self.values, element_spec)
        except (ValueError, TypeError):
            return False
        return all(v.dtype == s.dtype for v, s in zip(
            tf.nest.flatten(self.values), tf.nest.flatten(element_spec), strict=True))

    def put(self, element: Any) -> list:
        """Ops that record a newly pulled element (its rows not yet done)."""
        return [self.pulled.assign_add(1), self.done_rows.assign(0),
                self.pending.assign(True)] + [
            v.assign(t) for v, t in zip(tf.nest.flatten(self.values),
                                        tf.nest.flatten(element), strict=True)]

    def get(self, element_spec: Any) -> Any:
        """The stashed element, with the static shapes of ``element_spec``."""
        return tf.nest.map_structure(lambda v, s: tf.ensure_shape(v.read_value(), s.shape),
                                     self.values, element_spec)

    def record(self, end_row, rows: int) -> tf.Tensor:
        """The rows up to ``end_row`` of the element are in the sums."""
        return after([self.done_rows.assign(end_row), self.pending.assign(end_row < rows)])


# Loop-carried sums: accumulate_gradients, accumulate_iterator and validation.


