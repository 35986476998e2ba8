"""A custom ``train_step``'s logs and trackers over a large batch (:class:`CustomLogs`):
what the step returns, combined over the micro-batches as each value combines; its
trackers updated once with the large batch's value; its metric variables kept after
each committed micro-batch, for a redo to restore.

The step runs once per micro-batch, so what it returns describes that micro-batch. The
throwaway trace of ``autosplit.keras_hooks.custom_step`` read how each logged value is
made (``CustomFacts.log_kinds``): a weighed mean combines by its weight, a sum adds, a
maximum keeps the maximum, a norm of the applied gradients is taken of the large
batch's (:meth:`CustomLogs.gradient_norms`), a tracker's result is read as it stands.
Graph code only, called from ``autosplit.step.update``.
"""

from __future__ import annotations

from typing import Any

import keras
import tensorflow as tf

from autosplit.graph import after
from autosplit.keras_hooks import internals as _keras
from autosplit.keras_hooks.custom_step import CustomFacts
from autosplit.keras_hooks.interception import defers
from autosplit.step.contribution import Contribution

__all__ = ["CustomLogs"]


def _combined(state: list, parts: list, kinds: tuple, first: tf.Tensor) -> tuple:
    """A logged value combined over the micro-batches of a large batch so far, part by
    part (``target.log_parts``): ``state`` per part (its value so far, the weight its mean
    has gathered), ``parts`` this piece's ``(value, weight)``. Returns (value, assigns)."""
    ops, values = [], []
    for (so_far, gathered), (t, weight), kind in zip(state, parts, kinds, strict=True):
        t = tf.cast(t, tf.float32)
        if kind in ("last", "fixed"):
            value = t
        elif kind in ("sum", "max", "min"):
            both = {"sum": tf.add, "max": tf.maximum, "min": tf.minimum}[kind](so_far, t)
            value = tf.where(first, t, both)
        else:  # a weighed mean: by rows, or by a ratio's divisor
            total = tf.where(first, weight, gathered + weight)
            share = tf.math.divide_no_nan(weight, total)
            value = tf.where(first, t, so_far + (t - so_far) * share)
            ops.append(gathered.assign(total))
        ops.append(so_far.assign(value))
        values.append(value)
    return tf.add_n(values), ops


def _scalar() -> tf.Variable:
    return tf.Variable(0.0, trainable=False)


class CustomLogs:
    """The variables of a custom step's logs over the large batch in flight.

    Args:
        model: the model whose ``train_step`` runs per micro-batch.
        facts: what the step's throwaway trace read (``custom_step.custom_facts``).

    One replica: ``autosplit.step.update`` refuses a custom step on several.
    """

    def __init__(self, model: keras.Model, facts: CustomFacts) -> None:
        self.model = model
        self.facts = facts
        # The metric variables as the last committed micro-step left them: the step's
        # trackers count a micro-batch inside the step, before an error in the backward
        # pass can stop it, so a redo restores them first (pull(resume=True)).
        self.copies = [(v, tf.Variable(tf.convert_to_tensor(v), trainable=False))
                       for m in _keras.all_metrics(model) for v in m.variables]
        # What the step returned, combined over the large batch's micro-batches so far,
        # and the weight each weighed mean has gathered.
        self.values = tf.nest.map_structure(
            lambda s: tf.Variable(tf.zeros([d or 1 for d in s.shape.as_list()], s.dtype),
                                  trainable=False, shape=tf.TensorShape(None)), facts.logs)
        self.parts = [[(_scalar(), _scalar()) for _ in kinds] for kinds in facts.log_kinds]
        # per deferred tracker update: its parts' running values and weights, the row
        # count gathered, and its metric's variables as the large batch found them
        metrics = _keras.all_metrics(model)
        self.trackers = [
            (kinds, metrics[index], [(_scalar(), _scalar()) for _ in kinds], _scalar(),
             [tf.Variable(tf.convert_to_tensor(v), trainable=False)
              for v in metrics[index].variables])
            for kinds, index in facts.tracker_kinds if defers(kinds)]

    def combine(self, contribution: Contribution, first: tf.Tensor) -> tf.Tensor:
        """The step's logs, combined over the large batch so far as each combines; a large
        batch's ``first`` micro-batch replaces the last one's values (a NaN there
        included). After this micro-batch's sums are committed."""
        tracked = after(self._combine_trackers(contribution, first))
        ops = [tracked]
        metrics = _keras.all_metrics(self.model)
        for v, state, parts, kinds in zip(
                tf.nest.flatten(self.values), self.parts, contribution.log_parts,
                self.facts.log_kinds, strict=True):
            if kinds[0] == "result":  # as the trackers stand now, deferred updates made
                with tf.control_dependencies([tracked]):
                    ops.append(v.assign(tf.cast(metrics[kinds[1]].result(), v.dtype)))
                continue
            if kinds == ("last",) or kinds[0] == "gradient_norm":
                ops.append(v.assign(tf.cast(parts[0][0], v.dtype)))
                continue
            value, assigns = _combined(state, parts, kinds, first)
            ops += [*assigns, v.assign(tf.cast(value, v.dtype))]
        return after(ops)

    def _combine_trackers(self, contribution: Contribution, first: tf.Tensor) -> list:
        """The step's deferred tracker updates (a masked mean given to a ``Mean``): each
        metric is put back as the large batch found it and updated once with the value
        combined over its micro-batches so far, with the row count gathered, so that
        after the last one it holds one update with the large batch's value."""
        ops = []
        for (kinds, metric, state, count, kept), (parts, given) in zip(
                self.trackers, contribution.tracker_parts, strict=True):
            value, assigns = _combined(state, parts, kinds, first)
            now = [tf.convert_to_tensor(v) for v in metric.variables]
            start = [tf.where(first, n, k.read_value()) for n, k in zip(now, kept, strict=True)]
            weight = None
            if given is not None:
                weight = tf.where(first, given, count + given)
                assigns.append(count.assign(weight))
            restored = [k.assign(s) for k, s in zip(kept, start, strict=True)] + [
                v.assign(s) for v, s in zip(metric.variables, start, strict=True)]
            with tf.control_dependencies([after(assigns + restored)]):
                metric.update_state(value, sample_weight=weight)
                # read after the update (a tf.function orders a variable's reads and writes)
                ops.append(after([tf.convert_to_tensor(v) for v in metric.variables]))
        return ops

    def keep(self) -> tf.Tensor:
        """Copy the metric variables as they stand (after a committed micro-batch)."""
        return after([copy.assign(tf.convert_to_tensor(v)) for v, copy in self.copies])

    def restore(self) -> tf.Tensor:
        """Put back the metric variables as the last committed micro-batch left them."""
        return after([v.assign(copy.read_value()) for v, copy in self.copies])

    def gradient_norms(self, gradients: list) -> list:
        """The logs of the norm of the step's gradients, as the large batch's
        (``CustomFacts.log_kinds``)."""
        return [v.assign(tf.cast(tf.linalg.global_norm([gradients[i] for i in kinds[1]]),
                                 v.dtype))
                for v, kinds in zip(tf.nest.flatten(self.values), self.facts.log_kinds,
                                    strict=True) if kinds[0] == "gradient_norm"]

    def read(self) -> Any:
        """The logs as they stand."""
        return tf.nest.map_structure(lambda v: v.read_value(), self.values)
