"""What a traced graph says about a scalar a step computes: how it adds up over rows.

A micro-batch's value of a loss or a tracker's input must be weighed so that the
micro-batches of a large batch add up to the large batch's value. That depends on what
the value is, which the graph a trace builds tells, before anything runs:

- :func:`row_reduction`: a ``Mean`` over every axis of per-row values (a loss function
  returning ``ops.mean(losses)``) is the rows-weighed mean of its micro-batches' means;
  a ``Sum`` over every axis (``ops.sum(losses)``, keras-io's masked language model) is
  the sum of its micro-batches' sums. A ratio (``sum(l * m) / sum(m)``, a mean over
  unmasked tokens), or a mean of values that mix rows (``x @ transpose(x)``, a
  supervised-contrastive loss), is neither.
- :func:`counts_rows`: a value computed from shapes alone is a count of the rows.
- :func:`repeats_rows`: whether a sparse gradient (an ``Embedding``'s
  ``tf.IndexedSlices``) can name a row twice; a position embedding looked up on a fixed
  ``arange`` never does.
- :func:`summed_in_float16`: whether a gradient is a float16 tensor cast up, which the
  full batch sums over its rows in float16 (``mixed_float16``).

The walks read ops and static values; they run nothing of the batch. A value that
constants and static shapes alone compute, which ``tf.get_static_value`` does not fold
(Keras's count of a loss's elements, a position embedding's indices), is computed once
from the traced graph (:func:`evaluate`). AutoGraph must not convert them (they are called
while a step is traced).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import tensorflow as tf

from autosplit.keras_hooks import internals as _keras

__all__ = ["ancestors", "counts_rows", "evaluate", "full_reduction_input", "mixes_rows",
           "repeats_rows", "row_reduction", "summed_in_float16", "trace"]

_PASS_THROUGH = frozenset({"Identity", "Cast", "CheckNumerics"})
_REDUCTIONS = {"Mean": "mean", "Sum": "sum"}
# Ops that combine rows with one another (where axis 0 is the rows).
_MATMULS = frozenset({"MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum"})
_TOP_K = frozenset({"TopKV2", "TopK"})  # tf.sort and argsort too
_AXIS_REDUCTIONS = frozenset({"Sum", "Mean", "Max", "Min", "Prod", "All", "Any", "ArgMax",
                              "ArgMin", "Cumsum", "Cumprod", "EuclideanNorm"})
_SHAPE_OPS = frozenset({"Shape", "ShapeN", "Size"})


@tf.autograph.experimental.do_not_convert
def row_reduction(value: Any, sources: Any = None, rows: int | None = None) -> str | None:
    """How ``value``, a scalar in a graph being traced, adds up over the batch's rows:

    - ``"mean"``: a ``Mean`` over every axis of per-row values (``ops.mean(losses)``),
      or a ``Sum`` of them divided by a count of their elements (Keras's own reduction),
      maybe cast, negated, multiplied or divided by a constant, or added to another
      mean or to a term that reads no batch (a weight penalty: Keras's
      ``compute_loss`` stacks the loss and the penalty and sums them);
    - ``"sum"``: a ``Sum`` over every axis of per-row values (``ops.sum(losses)``);
    - ``"ratio"``: a division by a value computed from the batch's values
      (``sum(l * mask) / sum(mask)``, a mean over unmasked tokens);
    - None: anything else.

    Per-row values have ``rows`` rows (the batch's static row count) or an unknown
    number. ``sources``: tensors whose rows are the batch's rows (a loss function's
    ``y_true`` and ``y_pred``); with them, the values reduced must keep the rows apart
    on their way from the sources (none may come out of a matrix product or of a
    reduction over the rows: a supervised-contrastive loss's similarity matrix).
    Without them (a tape target, reached through the whole model) that is not checked.
    """
    if tf.executing_eagerly() or not hasattr(value, "op") or value.shape.rank != 0:
        return None
    stop = {t.op for t in tf.nest.flatten(sources) if hasattr(t, "op")}
    kind = _reduction(value.op, _Walk(stop, sources is not None, rows))
    return None if kind == "const" else kind


class _Walk:
    def __init__(self, stop: set, check_rows: bool, rows: int | None) -> None:
        self.stop, self.check_rows, self.rows = stop, check_rows, rows


def _reduction(op, walk: _Walk) -> str | None:
    while True:
        if _divides_by_its_count(op, walk):  # before a constant divisor is peeled off
            return "mean"
        inner = _peeled(op)
        if inner is None:
            break
        op = inner
    if op.type in ("AddV2", "Add", "Sub"):
        return _combined([_reduction(t.op, walk) for t in op.inputs])
    if op.type in ("RealDiv", "DivNoNan") and _reduction(op.inputs[0].op, walk) == "sum":
        divisor = op.inputs[1]
        if counts_rows(divisor):  # the count of the summed elements, from shapes
            return "mean"
        return "ratio" if _reads_batch(divisor.op) else None
    if op.type in _REDUCTIONS:
        kind = _full_reduction(op, walk)
        if kind is not None:
            return kind
    return None if _reads_batch(op) else "const"


def _divides_by_its_count(op, walk: _Walk) -> bool:
    """A ``Sum`` of per-row values divided by their count where the trace knows the
    count as a constant (static shapes: ``ops.shape(x)[0]`` is a number there): by the
    rows, or by the elements summed. Another constant only scales the sum."""
    if op.type not in ("RealDiv", "DivNoNan"):
        return False
    divisor = evaluate(op.inputs[1])
    dividend = op.inputs[0].op
    while (inner := _peeled(dividend)) is not None:  # an L2 penalty's 0.01 keeps a sum
        dividend = inner
    if divisor is None or np.ndim(divisor) or dividend.type != "Sum":
        return False
    shape = dividend.inputs[0].shape
    if not shape.is_fully_defined() or _full_reduction(dividend, walk) != "sum":
        return False
    return float(divisor) in (float(shape[0]), float(np.prod(shape.as_list())))


def _full_reduction(op, walk: _Walk) -> str | None:
    """The kind of a Mean or Sum ``op`` over every axis: of per-row values, or of a
    stack of scalars (each of which has its own kind)."""
    reduced_input = op.inputs[0]
    shape = reduced_input.shape
    axes = tf.get_static_value(op.inputs[1])
    if shape.rank is None or shape.rank < 1 or axes is None:
        return None
    reduced = {int(a) % shape.rank for a in tf.nest.flatten(axes.tolist())}
    if reduced != set(range(shape.rank)) or None in shape[1:].as_list():
        return None
    if reduced_input.op.type == "Pack" and shape.rank == 1:
        kinds = [_reduction(t.op, walk) for t in reduced_input.op.inputs]
        if op.type == "Sum":
            return _combined(kinds)
        return _combined(kinds) if "sum" not in kinds else None  # a mean of means
    if shape[0] not in (None, walk.rows):
        return None  # not the batch's rows
    if walk.check_rows and mixes_rows(reduced_input.op, walk.stop) is not None:
        return None
    return _REDUCTIONS[op.type]


def full_reduction_input(op, rows: int | None) -> Any:
    """The input of ``op`` where it reduces every axis of per-row values (its rows
    ``rows``, or any number where None; the other axes of any size: a sequence's length
    may be unknown), else None."""
    reduced = op.inputs[0]
    shape = reduced.shape
    axes = tf.get_static_value(op.inputs[1]) if len(op.inputs) > 1 else None
    if shape.rank is None or shape.rank < 1 or axes is None:
        return None
    if {int(a) % shape.rank for a in tf.nest.flatten(axes.tolist())} != set(range(shape.rank)):
        return None
    return reduced if rows is None or shape[0] in (None, rows) else None


def _combined(kinds: list) -> str | None:
    """The kind of a sum of terms of ``kinds``: terms that read no batch ("const") add
    to a mean exactly (each micro-batch's share of them adds up to one), not to a sum."""
    if None in kinds or "ratio" in kinds:
        return "ratio" if "ratio" in kinds else None
    varying = set(kinds) - {"const"}
    if not varying:
        return "const"
    if varying == {"mean"}:
        return "mean"
    if varying == {"sum"} and "const" not in kinds:
        return "sum"
    return None


def _reads_batch(top) -> bool:
    """Whether a value of the batch reaches ``top``: a function input or captured tensor
    (a ``Placeholder`` that is not a variable's handle), not through a shape alone."""
    return any(op.type == "Placeholder" and op.outputs[0].dtype != tf.resource
               for op in ancestors(top))


def ancestors(top, stop: frozenset | set = frozenset(), *,
              shape_ops: frozenset = _SHAPE_OPS, dynamic_shapes: bool = False) -> Iterator[Any]:
    """``top`` and every op it is computed from, once each, depth first; not through
    ``stop``'s ops, nor through a shape op's input (its values do not reach the
    output), unless ``dynamic_shapes`` and that shape is not static (the batch's size
    reaches it)."""
    seen, stack = set(), [top]
    while stack:
        op = stack.pop()
        if op in seen or op in stop:
            continue
        seen.add(op)
        yield op
        if op.type not in shape_ops or (
                dynamic_shapes and tf.get_static_value(op.outputs[0]) is None):
            stack.extend(t.op for t in op.inputs)


def _peeled(op) -> Any:
    """The op under ``op`` where ``op`` changes no kind: a pass-through, a sum of a
    scalar (Keras sums each added loss), a constant factor; None for any other op."""
    if op.type in _PASS_THROUGH or (op.type in _REDUCTIONS and op.inputs[0].shape.rank == 0):
        return op.inputs[0].op
    operand = _scaled_operand(op)
    return None if operand is None else operand.op


def _scaled_operand(op) -> Any:
    """The one operand of ``op`` that is not a scalar constant (a ``Neg``'s only one),
    or None (another op). A division must divide by the constant, not into it."""
    if op.type == "Neg":
        return op.inputs[0]
    if op.type not in ("Mul", "RealDiv"):
        return None
    constant = [tf.get_static_value(t) is not None and t.shape.rank == 0 for t in op.inputs]
    if constant == [False, True]:
        return op.inputs[0]
    if constant == [True, False] and op.type == "Mul":
        return op.inputs[1]
    return None


def mixes_rows(top, stop: set) -> Any:
    """The first op between ``stop`` (the sources' ops) and ``top`` combines rows: a
    product that contracts the rows or pairs them (``x @ transpose(x)``, a similarity
    matrix; ``transpose(z) @ z``, a cross-correlation), a reduction over axis 0 (or over
    axes not known), a transpose that moves axis 0, ``top_k`` or a sort of a vector of
    per-row values; None where none does. A product with weights (a ``Dense``
    layer's ``x @ W``) or batched over axis 0 (attention) keeps rows apart, and so do
    shapes (``eye(batch_size)`` alone mixes nothing). BatchNormalization's moments
    (under a ``moments`` name scope) are left to its own warning and pooling."""
    batch = _BatchValues(stop)
    return next((op for op in ancestors(top, stop) if _combines_rows(op, batch)), None)


class _BatchValues:
    """Which ops compute from the batch's values: ``stop``'s (the sources), a function
    input that is not a variable's handle, and what reads them (not through a shape)."""

    def __init__(self, stop: set) -> None:
        self.stop = stop
        self.known: dict = {}

    def __call__(self, tensor) -> bool:
        top = tensor.op
        stack = [(top, False)]
        while stack:
            op, ready = stack.pop()
            if op in self.known:
                continue
            if op in self.stop or (op.type == "Placeholder" and op.outputs[0].dtype != tf.resource):
                self.known[op] = True
                continue
            inputs = [] if op.type in _SHAPE_OPS else [t.op for t in op.inputs]
            if ready:
                self.known[op] = any(self.known.get(i, False) for i in inputs)
                continue
            stack.append((op, True))
            stack.extend((i, False) for i in inputs if i not in self.known)
        return self.known[top]


def _combines_rows(op, batch: _BatchValues) -> bool:
    if op.type in _MATMULS:
        return _product_mixes(op, batch)
    if op.type in _AXIS_REDUCTIONS and len(op.inputs) > 1:
        if "/moments/" in f"/{op.name}/" or not batch(op.inputs[0]):
            return False
        axes = tf.get_static_value(op.inputs[1])
        rank = op.inputs[0].shape.rank
        return axes is None or rank is None or 0 in {int(a) % max(rank, 1)
                                                     for a in tf.nest.flatten(axes.tolist())}
    if op.type in _TOP_K:
        return op.inputs[0].shape.rank in (None, 1) and batch(op.inputs[0])
    if op.type == "Transpose":
        perm = tf.get_static_value(op.inputs[1])
        return batch(op.inputs[0]) and (perm is None or int(perm[0]) != 0)
    return False


def _product_mixes(op, batch: _BatchValues) -> bool:
    """A matrix product mixes rows where it contracts a batch operand's axis 0, or pairs
    the rows of two batch operands; batched products keep axis 0 apart."""
    read = [batch(t) for t in op.inputs[:2]]
    if op.type == "Einsum":
        try:
            operands, output = op.get_attr("equation").decode().replace(" ", "").split("->")
        except (ValueError, AttributeError):
            return any(read)
        firsts = {spec.replace("...", ".")[:1]
                  for spec, reads in zip(operands.split(","), read, strict=False) if reads}
        output = output.replace("...", ".")
        return len(firsts) > 1 or any(first not in output for first in firsts)
    ranks = [t.shape.rank for t in op.inputs[:2]]
    if op.type != "MatMul" and None not in ranks and min(ranks) > 2:
        return False  # batched over axis 0
    flip = ("transpose_a", "transpose_b") if op.type == "MatMul" else ("adj_x", "adj_y")
    try:
        first_contracted = op.get_attr(flip[0])  # a's axis 0 is summed over
        second_contracted = not op.get_attr(flip[1])  # b's axis 0 is summed over
    except ValueError:
        return any(read)
    return (read[0] and read[1]) or (read[0] and first_contracted) or (
        read[1] and second_contracted)


@tf.autograph.experimental.do_not_convert
def counts_rows(tensor: Any) -> bool:
    """Whether ``tensor`` (a scalar, in a graph being traced) is computed from tensors'
    shapes and constants alone: no value of the batch or of a variable reaches it (a
    function's inputs, captured tensors and variables are ``Placeholder`` ops). In a
    micro-batch of real rows, whose row count is dynamic, that is a count of the rows
    (or of their tokens); a loss or a metric's input reads values."""
    if tf.executing_eagerly() or not hasattr(tensor, "op"):
        return False
    shapes = False
    for op in ancestors(tensor.op):
        if op.type == "Placeholder":
            return False
        shapes |= op.type in _SHAPE_OPS  # its input's values do not reach the output
    return shapes


def repeats_rows(gradient: tf.IndexedSlices) -> bool:
    """Whether the traced sparse ``gradient`` may name a row more than once.

    Keras applies such a gradient per occurrence of a row, which differs from the dense
    sum where the optimizer is not linear in it (Adam squares each occurrence). Indices
    computed from the batch (token ids), a variable or a random draw may repeat; indices
    computed from constants and static shapes alone (a position embedding over
    ``ops.arange(num_patches)``) are the same every step and are computed here, once.
    """
    values = evaluate(gradient.indices)
    return values is None or np.unique(values).size < values.size


def summed_in_float16(gradient: Any) -> bool:
    """Whether the traced ``gradient`` of a float32 variable is a float16 tensor cast up:
    a float16 layer's (``mixed_float16``), which sums it over the batch's rows in float16
    (a ``MatMul``'s, a ``BiasAddGrad``'s), so that a full batch overflows where its
    micro-batches need not; also a position embedding's sparse gradient, looked up at
    fixed indices and so summed over every row. Several uses of a variable add up their
    parts (checked on their sum: see ``autosplit.step.overflow``); a scalar factor (a
    custom step's, a ratio's divisor) keeps it. Not: a float32 layer's gradient,
    BatchNormalization's, a token Embedding's sparse one (per occurrence of a row, never
    summed over rows), nor a recurrent layer's, which its loop adds up over time steps in
    float32."""
    if isinstance(gradient, tf.IndexedSlices):
        return evaluate(gradient.indices) is not None and summed_in_float16(gradient.values)
    if not isinstance(gradient, tf.Tensor) or not hasattr(gradient, "op"):
        return False
    op = gradient.op
    while op.type in ("Identity", "Reshape"):
        op = op.inputs[0].op
    if op.type in ("AddN", "AddV2", "Add"):
        return any(summed_in_float16(t) for t in op.inputs)
    if op.type == "Mul" and any(t.shape.rank == 0 for t in op.inputs):  # times a scalar
        return any(summed_in_float16(t) for t in op.inputs if t.shape.rank != 0)
    return op.type == "Cast" and op.inputs[0].dtype == tf.float16


def evaluate(tensor) -> np.ndarray | None:
    """``tensor``'s value where constants and static shapes alone compute it (None where
    the batch, a variable or a random draw reaches it): ``tf.get_static_value``, else
    the traced graph run up to it once, with its shape ops fed their static values."""
    value = tf.get_static_value(tensor)
    if value is not None:
        return np.asarray(value)
    feeds = {}
    for op in ancestors(tensor.op):
        if op.type in _SHAPE_OPS:
            shape = tf.get_static_value(op.outputs[0])
            if shape is None:
                return None
            feeds[op.outputs[0]] = shape
        elif op.type == "Placeholder" or op._is_stateful or op.control_inputs:
            return None  # the batch, a variable, a draw; or what else would run with it
    try:
        with tf.compat.v1.Session(graph=tensor.graph) as session:
            return np.asarray(session.run(tensor, feed_dict=feeds))
    except (tf.errors.OpError, ValueError, TypeError, RuntimeError):
        return None


def trace(fn: Callable, *specs: Any) -> Any:
    """Trace ``fn`` once on ``specs`` without running it (autograph off); returns the
    concrete function. What ``fn`` records while it is traced is the point: Keras state
    it makes on first use stays unmade (``_keras.global_seed_generator_kept``)."""
    with _keras.global_seed_generator_kept():
        return tf.function(fn, autograph=False).get_concrete_function(*specs)
