"""The gradient noise scale of McCandlish et al., "An Empirical Model of Large-Batch
Training" (2018, arXiv 1812.06162), from the gradients a split step computes anyway.

A split step has each large batch's gradient at two batch sizes, at no extra forward or
backward pass: every micro-batch's and the large batch's. With ``G`` the true gradient
and ``Sigma`` the covariance of one example's, a batch of ``b`` examples has
``E|g_b|^2 = |G|^2 + tr(Sigma) / b``, and two sizes give both terms, unbiased (the
paper's Appendix A): ``B_simple = tr(Sigma) / |G|^2`` estimates the noise scale.

The micro-batches of a large batch need not be of one size (a short last one, the slices
after an out-of-memory error, micro-batches cut in tokens), so the small batch's term is
their mean weighed by size: with micro-batch ``i`` of ``n_i`` units (``N`` in all, ``k``
micro-batches) and ``g_i`` the large batch's gradient as that micro-batch alone
estimates it, ``sum_i (n_i / N) |g_i|^2`` has the expectation ``|G|^2 + k tr(Sigma) / N``
whatever the sizes, and the large batch's ``|g_N|^2`` has ``|G|^2 + tr(Sigma) / N``:

- ``tr(Sigma) ~ N (mean_small - big) / (k - 1)``;
- ``|G|^2 ~ (k big - mean_small) / (k - 1)``,

which for equal sizes ``b = N / k`` are the paper's two estimators. Per micro-batch the
step keeps one number per pair of loss groups: ``c_g . c_h / n_i``, with ``c_g`` the
group's gradient sum as the micro-step adds it (:func:`micro_terms`), each a dot product
over every gradient (``k`` squared norms a large batch, where one loss group trains); the
apply scales them by each group's divisor, known only then, and reads the large batch's
norm from the gradients it applies (:func:`estimate`). The weight regularisers' gradient
(counted once, noiseless) is part of every estimate, as of the loss.

Units: the examples a loss counts. ``rows`` where a loss is a mean over the rows or a
sum (Keras's ``sum_over_batch_size`` without a mask, ``reduction="sum"``, the losses of
``call()``); where the only loss divides by what the model decides, its denominator's
unit: unmasked tokens (a Keras mask), or the sample weights' sum. With several losses of
several units the estimate is counted in rows, and a token's noise is then spread over
its rows (an approximation, said in the docs).

The gradients are the unscaled ones: a loss scale (``mixed_float16``) divides out, and
a large batch whose gradients overflow gives no estimate. Under ``tf.distribute`` every
replica estimates from its own micro-batches and its own share of the large batch,
before any all-reduce, and the epoch sums every replica's estimates (:class:`NoiseEpoch`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import tensorflow as tf

from autosplit.step.loss_plan import COUNT_GROUP, SUM_GROUP, LossPlan
from autosplit.step.reduction import WEIGHT

__all__ = [
    "GradientNoise",
    "NoiseEpoch",
    "estimate",
    "micro_terms",
    "noise_slots",
    "unit_name",
    "unit_of",
]


class GradientNoise(NamedTuple):
    """One large batch's estimates (per replica), unscaled, in the unit of the loss."""

    noise: tf.Tensor  # shape=(), float32: tr(Sigma), one example's gradient variance
    signal: tf.Tensor  # shape=(), float32: |G|^2, the true gradient's squared norm
    batch: tf.Tensor  # shape=(), float32: the large batch's examples (all replicas')
    counted: tf.Tensor  # shape=(), float32: 1 where the estimate exists, else 0 (all 0)


def unit_of(plan: LossPlan) -> int | None:
    """The compiled loss whose denominator counts the examples, or None for rows."""
    if len(plan.groups) == 1 and plan.groups[0] not in (COUNT_GROUP, SUM_GROUP):
        return plan.groups[0][1]
    return None


def unit_name(plan: LossPlan) -> str:
    """What the estimate's examples are (:func:`unit_of`), in words."""
    j = unit_of(plan)
    if j is None:
        return "rows"
    # A mean whose denominator the model decides: over the loss elements a Keras mask
    # keeps (a sequence's tokens), or over the sample weights' sum.
    return "sample weight" if plan.kinds[j] == WEIGHT else "tokens"


def noise_slots(plan: LossPlan) -> int:
    """The per-micro-batch numbers summed: one per pair of loss groups, and a count."""
    return len(plan.groups) ** 2 + 1


def _dot(a: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
    # One kernel each, no temporary of the gradient's size (a * b would be one).
    if a is b:
        return 2.0 * tf.nn.l2_loss(a)
    return tf.tensordot(tf.reshape(a, [-1]), tf.reshape(b, [-1]), 1)


def _dots(left: list, right: list) -> tf.Tensor:
    """The dot product of two lists of per-variable gradients (None: no gradient)."""
    parts = [_dot(tf.cast(a, tf.float32), tf.cast(b, tf.float32))
             for a, b in zip(left, right, strict=True) if a is not None and b is not None]
    return tf.add_n(parts) if parts else tf.constant(0.0)


def micro_terms(plan: LossPlan, gradients: list, rows: tf.Tensor, denominators: list
                ) -> tf.Tensor:
    """One micro-batch's numbers (per replica): ``c_g . c_h / n`` for every pair of its
    loss groups' gradient sums ``c`` (as the micro-step adds them: loss scale
    included), then 1 where it holds an example (0 for padding alone)."""
    j = unit_of(plan)
    n = tf.cast(rows if j is None else denominators[j], tf.float32)
    groups = len(plan.groups)
    pairs: dict = {}
    for g in range(groups):
        for h in range(g, groups):
            pairs[g, h] = pairs[h, g] = _dots(gradients[g], gradients[h])
    flat = [tf.math.divide_no_nan(pairs[g, h], n) for g in range(groups) for h in range(groups)]
    return tf.stack([*flat, tf.cast(n > 0, tf.float32)])


def _factors(plan: LossPlan, total: Any, correction: tf.Tensor) -> tf.Tensor:
    """Per loss group, what the apply multiplies its gradient sum by (``contribution.
    combine``): the rows' correction, 1 for sums, 1 over a deferred denominator."""
    out = []
    for group in plan.groups:
        if group == COUNT_GROUP:
            out.append(correction)
        elif group == SUM_GROUP:
            out.append(tf.constant(1.0))
        else:
            out.append(tf.math.divide_no_nan(1.0, total.denominators[group[1]]))
    return tf.stack(out)


def estimate(plan: LossPlan, local: Any, total: Any, gradients: list, regularization: list,
             correction: tf.Tensor, *, scale: tf.Tensor, replicas: int) -> GradientNoise:
    """Per replica: the large batch's :class:`GradientNoise`.

    ``local`` and ``total``: the sums (``totals.Totals``) of this replica and of every
    replica; ``gradients``: the ones this replica applies (its share, with its share of
    the regularisers' ``regularization``; both loss-scaled by ``scale``, ``inf`` where
    the large batch overflows); ``correction``: the apply's factor on the rows' group.
    """
    j = unit_of(plan)
    n_local = local.rows if j is None else local.denominators[j]
    n = total.rows if j is None else total.denominators[j]
    groups = len(plan.groups)
    terms = local.noise
    k = terms[-1]
    factors = _factors(plan, total, correction)
    gram = tf.reshape(terms[:-1], [groups, groups])
    # sum_i |c_i|^2 / n_i, c_i the micro-batch's part of this replica's data gradient
    micro = tf.reduce_sum(gram * factors[:, None] * factors[None, :])
    applied = _dots(gradients, gradients)
    crossed = _dots(gradients, regularization)
    penalty = _dots(regularization, regularization)
    data = applied - 2.0 * crossed + penalty  # |this replica's data gradient|^2
    data_penalty = crossed - penalty
    share = tf.math.divide_no_nan(n, n_local)  # the whole batch over this replica's share
    r = float(replicas)
    # |the large batch's gradient as this replica's share estimates it|^2, and the mean
    # over its micro-batches of the same from each: the regularisers' gradient (each
    # replica applies 1 / replicas of it) in both.
    common = 2.0 * share * r * data_penalty + r * r * penalty
    big = share * share * data + common
    small = tf.math.divide_no_nan(n * n, n_local) * micro + common
    unscale = tf.math.divide_no_nan(1.0, scale * scale)
    noise = (small - big) * n_local / (k - 1.0) * unscale
    signal = (k * big - small) / (k - 1.0) * unscale
    ok = (k >= 2.0) & (n_local > 0) & tf.math.is_finite(noise) & tf.math.is_finite(signal)
    zero = tf.constant(0.0)
    return GradientNoise(tf.where(ok, noise, zero), tf.where(ok, signal, zero),
                         tf.where(ok, tf.cast(n, tf.float32), zero), tf.cast(ok, tf.float32))


class NoiseEpoch:
    """An epoch's sums of every large batch's :class:`GradientNoise` (of every local
    replica: sync-on-read variables under a strategy), and their ratio.

    The epoch's figure is the ratio of its two means (the paper's advice: a ratio of
    means, not a mean of ratios, which one noisy large batch would dominate).
    """

    def __init__(self, strategy: tf.distribute.Strategy) -> None:
        kwargs = dict(synchronization=tf.VariableSynchronization.ON_READ,
                      aggregation=tf.VariableAggregation.SUM
                      ) if strategy.num_replicas_in_sync > 1 else {}
        self._strategy = strategy
        with strategy.scope():
            self.sums = tf.Variable(tf.zeros([4]), trainable=False,
                                    name="autosplit_noise_epoch", **kwargs)

    def add(self, estimate: GradientNoise) -> tf.Tensor:
        """Per replica, in the apply's graph: add one large batch's estimate."""
        return self.sums.assign_add(tf.stack(list(estimate)))

    def reset(self) -> None:
        """Start an epoch (eagerly, from the fit loop)."""
        self.sums.assign(tf.zeros([4]))

    def read(self) -> tuple[float, float, float, float]:
        """(noise, signal, batch, counted) summed over this process's replicas."""
        values = self._strategy.experimental_local_results(self.sums)
        total = sum(v.numpy().astype("float64") for v in values)
        return tuple(float(t) for t in total)  # type: ignore[return-value]

    def scale(self) -> float:
        """The epoch's noise scale so far (:func:`ratio`)."""
        noise, signal, _, counted = self.read()
        return ratio(noise, signal, counted)


def ratio(noise: float, signal: float, counted: float) -> float:
    """``B_simple`` from sums of ``counted`` estimates: NaN where none was counted;
    ``inf`` where the squared gradient's estimate is not positive (the gradient lost in
    its noise: the noise scale is past what this batch size measures)."""
    if counted == 0:
        return float("nan")
    return noise / signal if signal > 0 else float("inf")
