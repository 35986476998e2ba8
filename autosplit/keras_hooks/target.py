"""What a custom step differentiates, read term by term, so that the large batch's
gradient comes exactly from its micro-batches' or the step is refused.

A scalar handed to ``tape.gradient`` is read (:func:`read`) as a sum of terms, each a
batch-independent factor times one of:

- ``SUM``: a sum over the rows of per-row values (``reduce_sum(loss)``; a sum divided
  by a constant, ``compute_average_loss(l, global_batch_size=B)``). Micro-batches'
  gradients add up.
- ``COUNT``: a mean over the rows, or over every element of per-row values of a static
  shape (``reduce_mean``, a sum over the count of rows): weighed by each micro-batch's
  rows, divided once by the large batch's.
- ``RATIO``: a sum divided by a value of the batch that no weight reaches (a count of
  real tokens, a sum of sample weights, ``reduce_mean(boolean_mask(l, m))``): each
  micro-batch's gradient weighed by its own divisor, the sum divided once by the sum of
  the divisors.
- ``FIXED``: a term that reads no batch (a weight penalty,
  ``scale_regularization_loss``): counted once per large batch, in the share of a term
  beside it.

Anything else (a maximum over the batch, ``top_k`` or a sort of per-row losses, a loss
divided by a value the model computes, a product of two batch values, an op the reading
does not know) has no exact split: :func:`read` raises :class:`Unreadable`, naming the
op. A target with one value per row (``tape.gradient`` sums it) is one ``SUM`` term.

The walk reads ops and static values only; it runs nothing of the batch. AutoGraph must
not convert it (it is called while a step is traced).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import tensorflow as tf

from autosplit.keras_hooks.traced import ancestors, evaluate, full_reduction_input, mixes_rows

__all__ = ["COUNT", "FIXED", "RATIO", "SUM", "LogPart", "Term", "Unreadable",
           "gradient_norm", "log_parts", "read", "replayed"]

SUM, COUNT, RATIO, FIXED = "sum", "count", "ratio", "fixed"

_PASS_THROUGH = frozenset({"Identity", "Cast", "CheckNumerics", "StopGradient"})
_DIVISIONS = frozenset({"RealDiv", "DivNoNan", "Div"})
_EXTREMES = frozenset({"Max", "Min"})
_SHAPES = frozenset({"Shape", "Size", "Rank"})


class Term(NamedTuple):
    """One term of a scalar: ``coefficient * tensor``, of ``kind``."""

    tensor: Any
    coefficient: Any  # a float, or a scalar tensor that reads no batch
    kind: str
    denominator: Any = None  # RATIO: the divisor (a scalar tensor of the batch)


class Unreadable(Exception):
    """A scalar whose split into micro-batches is not exact; ``op`` says where."""

    def __init__(self, op: Any, why: str) -> None:
        super().__init__(f"{why} (op {op.type!r}, {op.name!r})")
        self.op, self.why = op, why


class _Reader:
    def __init__(self, rows: int | None, stop: set) -> None:
        self.rows, self.stop = rows, stop


@tf.autograph.experimental.do_not_convert
def read(value: Any, rows: int | None = None, stop: Any = ()) -> list[Term]:
    """The terms of ``value``, a target a step differentiates, in a graph being traced.

    Args:
        value: a scalar (or a tensor of one value per row) in a graph being traced.
        rows: the batch's static row count, or None.
        stop: ops whose outputs are per-row values the step computed (its layers'
            outputs, its inputs): between them and ``value`` no op may mix rows.

    Raises:
        Unreadable: a part of ``value`` has no exact split into micro-batches.
    """
    value = tf.convert_to_tensor(value)
    reader = _Reader(rows, set(stop))
    if value.shape.rank != 0:
        if value.shape.rank is None or value.shape[0] not in (None, rows):
            raise Unreadable(value.op, "a target that is neither a scalar nor one value "
                                       "per row")
        return [Term(value, 1.0, SUM)]
    terms: list[Term] = []
    _read(value, 1.0, reader, terms)
    return terms


class LogPart(NamedTuple):
    """One part of a logged scalar: ``value`` combines over the micro-batches as ``kind``
    says; ``divisor`` is a ``RATIO`` part's (a scalar tensor of the batch)."""

    kind: str
    value: Any
    divisor: Any = None

    def weight(self, rows: Any) -> tf.Tensor:
        """This part's weight in its running mean over the micro-batches: its divisor for
        a ratio, the micro-batch's ``rows`` for a mean (or a value no rule combines), 1
        otherwise (a sum, a maximum: they do not average)."""
        if self.kind == RATIO:
            return tf.cast(self.divisor, tf.float32)
        return tf.cast(rows, tf.float32) if self.kind in (COUNT, "other") else tf.constant(1.0)


def log_parts(value: Any, rows: int | None = None, stop: Any = ()) -> list[LogPart]:
    """How a logged value combines over the micro-batches, as parts that add up to it.

    One part ``"last"`` where it reads no batch (a tracker's ``result()``), or is not a
    floating scalar; ``"max"`` or ``"min"`` for a maximum or minimum over the batch;
    ``"other"`` where no rule combines it (weighed by rows, with a warning). Otherwise
    its terms (:func:`read`) grouped by how they combine, in the order met: a ``SUM``
    adds up, a ``COUNT`` is weighed by rows, a ``RATIO`` by its divisor (one part per
    divisor), ``FIXED`` is the same for every micro-batch. ``mean + 1e-3 * sum`` is two
    parts, each combined as itself, then added.
    """
    value = tf.convert_to_tensor(value)
    if value.shape.rank != 0 or not value.dtype.is_floating or not _reads_batch(value, set(stop)):
        return [LogPart("last", value)]
    op = _peel(value.op)
    if op.type in _EXTREMES and full_reduction_input(op, rows) is not None:
        return [LogPart("max" if op.type == "Max" else "min", value)]
    try:
        terms = read(value, rows, stop)
    except Unreadable:
        return [LogPart("other", value)]
    groups: dict[Any, list[Term]] = {}
    for t in terms:
        groups.setdefault((t.kind, id(t.denominator) if t.kind == RATIO else None), []).append(t)
    return [LogPart(kind, tf.add_n([_times(t.coefficient, t.tensor) for t in group]),
                    group[0].denominator)
            for (kind, _), group in groups.items()]


def gradient_norm(value: Any, applied: list[tuple[Any, int]]) -> tuple[int, ...] | None:
    """The indices of the variables whose gradients ``value`` is the norm of, where it is
    one: ``tf.linalg.global_norm`` (or ``clip_by_global_norm``'s norm) of gradients the
    step applies, or ``tf.norm`` of one. ``applied``: ``(gradient, variable index)`` as
    the step handed them to ``apply_gradients``. None for anything else."""
    by_op = {_peel(g.op): i for g, i in applied if hasattr(g, "op")}
    op = _peel(tf.convert_to_tensor(value).op)
    if op.type == "Squeeze":
        op = _peel(op.inputs[0].op)
    if op.type != "Sqrt":
        return None
    inner = _peel(op.inputs[0].op)
    if inner.type == "Sum":  # tf.norm: sqrt(sum(g * g))
        square = _peel(inner.inputs[0].op)
        if square.type == "Mul" and square.inputs[0] is square.inputs[1]:
            index = by_op.get(_peel(square.inputs[0].op))
            return None if index is None else (index,)
        return None
    if inner.type != "Mul":  # global_norm: sqrt(sum(stack(l2_loss(g))) * 2)
        return None
    total = next((_peel(t.op) for t in inner.inputs if _peel(t.op).type == "Sum"), None)
    if total is None or _peel(total.inputs[0].op).type != "Pack":
        return None
    losses = [_peel(t.op) for t in _peel(total.inputs[0].op).inputs]
    indices = [by_op.get(_peel(loss.inputs[0].op)) if loss.type == "L2Loss" else None
               for loss in losses]
    return None if None in indices else tuple(indices)  # type: ignore[arg-type]


def replayed(parts: list[LogPart], kinds: tuple[str, ...]) -> list[LogPart] | None:
    """``parts`` of a value read in a trace of dynamic rows, as a trace of static rows read
    the same value (``kinds``); None where they do not match. With the rows dynamic, a
    mean over them reads as a ratio of their count, one part per count: where the static
    reading found no ratio, those are means, and one part."""
    if RATIO not in kinds:
        merged: dict[str, list] = {}
        for p in parts:
            merged.setdefault(COUNT if p.kind == RATIO else p.kind, []).append(p.value)
        parts = [LogPart(kind, tf.add_n(values)) for kind, values in merged.items()]
    return parts if tuple(p.kind for p in parts) == tuple(kinds) else None


def _peel(op) -> Any:
    while op.type in _PASS_THROUGH:
        op = op.inputs[0].op
    return op


def _times(coefficient: Any, factor: Any) -> Any:
    if isinstance(coefficient, float) and coefficient == 1.0:
        return factor
    return coefficient * tf.cast(factor, tf.float32)


def _read(tensor, coefficient, reader: _Reader, out: list) -> None:
    op = tensor.op
    kind = op.type
    inputs = list(op.inputs)
    if kind in _PASS_THROUGH or (kind in ("Sum", "Mean") and inputs[0].shape.rank == 0):
        return _read(inputs[0], coefficient, reader, out)
    if kind in ("AddV2", "Add", "AddN"):
        for t in inputs:
            _read(t, coefficient, reader, out)
        return None
    if kind == "Sub":
        _read(inputs[0], coefficient, reader, out)
        return _read(inputs[1], _times(coefficient, -1.0), reader, out)
    if kind == "Neg":
        return _read(inputs[0], _times(coefficient, -1.0), reader, out)
    if kind in ("Sum", "Mean") and inputs[0].op.type == "Pack" and inputs[0].shape.rank == 1:
        stacked = list(inputs[0].op.inputs)  # Keras's compute_loss: a stack of scalars
        share = 1.0 if kind == "Sum" else 1.0 / len(stacked)
        for t in stacked:
            _read(t, _times(coefficient, share), reader, out)
        return None
    if not _reads_batch(tensor, reader.stop):
        out.append(Term(tensor, coefficient, FIXED))
        return None
    if kind == "Mul":
        for this, other in ((inputs[0], inputs[1]), (inputs[1], inputs[0])):
            if not _reads_batch(other, reader.stop):
                return _read(this, _times(coefficient, other), reader, out)
        raise Unreadable(op, "a product of two values of the batch")
    if kind in _DIVISIONS:
        return _read_division(tensor, coefficient, reader, out)
    if kind in ("Sum", "Mean"):
        reduced = _rows_reduced(op, reader)
        if kind == "Sum":
            out.append(Term(tensor, coefficient, SUM))
        elif reduced.shape.is_fully_defined() and reduced.shape[0] == reader.rows:
            out.append(Term(tensor, coefficient, COUNT))
        else:  # a mean over a count the batch decides (the unmasked tokens)
            size = tf.cast(tf.size(reduced), tf.float32)
            out.append(Term(tensor, coefficient, RATIO, size))
        return None
    if kind in _EXTREMES:
        raise Unreadable(op, "a maximum or minimum over the batch")
    raise Unreadable(op, "an operation the reading does not know how to split")


def _read_division(tensor, coefficient, reader: _Reader, out: list) -> None:
    op = tensor.op
    numerator, divisor = op.inputs[0], op.inputs[1]
    if not _reads_batch(divisor, reader.stop):
        if _is_count_of(numerator, evaluate(divisor), reader):
            out.append(Term(tensor, coefficient, COUNT))
            return
        return _read(numerator, _times(coefficient, 1.0 / tf.cast(divisor, tf.float32)),
                     reader, out)
    if _reads_variables(divisor):
        raise Unreadable(op, "a division by a value the model computes from the batch "
                             "(a per-batch normalisation of the loss)")
    inner: list[Term] = []
    _read(numerator, 1.0, reader, inner)
    if any(t.kind not in (SUM, FIXED) for t in inner) or not any(t.kind == SUM for t in inner):
        raise Unreadable(op, "a division of something other than a sum over the rows "
                             "by a value of the batch")
    out.append(Term(tensor, coefficient, RATIO, tf.cast(divisor, tf.float32)))
    return None


def _is_count_of(numerator, divisor, reader: _Reader) -> bool:
    """Whether a static ``divisor`` counts the rows, or the elements, that
    ``numerator`` (a sum over every axis, maybe scaled) sums."""
    if divisor is None or divisor.ndim:
        return False
    op = _peel(numerator.op)
    while op.type == "Mul" and any(evaluate(t) is not None for t in op.inputs):
        op = _peel(next(t for t in op.inputs if evaluate(t) is None).op)
    if op.type != "Sum":
        return False
    reduced = full_reduction_input(op, reader.rows)
    if reduced is None or not reduced.shape.is_fully_defined():
        return False
    return float(divisor) in (float(reduced.shape[0]), float(reduced.shape.num_elements()))


def _rows_reduced(op, reader: _Reader) -> Any:
    """The per-row values a full ``Sum`` or ``Mean`` reduces, checked: no op between
    them and the step's own values mixes rows."""
    reduced = full_reduction_input(op, None)
    if reduced is None:
        raise Unreadable(op, "a reduction over some axes of the batch only, or over "
                             "values whose shape is not known")
    mixing = mixes_rows(reduced.op, reader.stop)
    if mixing is not None:
        raise Unreadable(mixing, "an operation that mixes the batch's rows (a sort, top_k, "
                                 "a reduction or a product over the rows)")
    return reduced


def _reads_batch(tensor, batch: set) -> bool:
    """Whether a value of the batch, or its dynamic shape, reaches ``tensor``: one of
    ``batch``'s ops (the step's inputs, its layers' outputs); without them, a function
    input or captured tensor that is not a variable's handle."""
    if batch:
        return any(op in batch for op in _walk(tensor.op))
    return any(op.type == "Placeholder" and op.outputs[0].dtype != tf.resource
               for op in _walk(tensor.op))


def _reads_variables(tensor) -> bool:
    return any(op.type == "ReadVariableOp" for op in ancestors(tensor.op, shape_ops=_SHAPES))


def _walk(top) -> Any:
    """``top`` and the ops it is computed from, through a shape op whose shape is
    dynamic: the batch's size reaches it, no value does."""
    return ancestors(top, shape_ops=_SHAPES, dynamic_shapes=True)
