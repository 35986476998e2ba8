"""How a run cuts each large batch, decided once before its first step
(:func:`choose_cut`): rows as they come, padded to the large batch's longest row, by
length, or by length in micro-batches of a token budget, and why.

The decision reads the input's lengths (``autosplit.data.sequences.lengths``) and the
check of padding (``autosplit.step.padding``) once, and every refusal is raised here,
with its reason, before anything changes; the pipeline, the probe and ``FitReport`` read
the :class:`~autosplit.data.sequences.cut.Cut` it returns.
"""

from __future__ import annotations

import functools
from typing import Any

import keras
import tensorflow as tf

from autosplit.data.adapter import InputAdapter
from autosplit.data.layout import Layout
from autosplit.data.pipeline import MicroBatches
from autosplit.data.sequences.cut import Cut
from autosplit.data.sequences.lengths import Lengths, PaddedArrays, padded_lengths
from autosplit.data.sharded import shards_by_length
from autosplit.data.structure import empty_to_none
from autosplit.errors import DatasetError, UnsupportedModelError
from autosplit.keras_hooks.batchnorm import pooled_layers
from autosplit.keras_hooks.custom_step import has_custom_step
from autosplit.step.loss_plan import step_plan
from autosplit.step.mixing import loss_over_whole_batch
from autosplit.step.padding import PaddingCheck, check_padding
from autosplit.step.replicas import without_replica_axis
from autosplit.step.train_step import build_for

__all__ = ["choose_cut", "tokens_refused"]

_SAMPLE = 64  # rows read for the check, of which it runs on the shortest


def tokens_refused(where: Layout, jit: bool, averages: bool, sharded: bool = False
                   ) -> str | None:
    """Why micro-batches cannot be sized in tokens here, or None: their row counts vary,
    so several workers need each their own share (``sharded``,
    ``autosplit.data.sharded.shards_by_length``), not a slice of one pattern (the local
    replicas' micro-batches of a piece have one row count); under XLA each is padded to
    the rows the budget holds at its lengths, which a model that ``averages`` on its own
    over its rows would see (``autosplit.step.contribution.without_padding`` gives it its
    real rows, a shape and a program per row count)."""
    if where.workers > 1 and not sharded:
        return (f"{where.workers} workers that each read the whole input and keep a slice "
                "of every large batch (sharded and sized in tokens is a tf.data.Dataset "
                "whose auto_shard_policy is not OFF)")
    if jit and averages:
        return ("jit_compile with a model that averages over a micro-batch's rows on its "
                "own (its own train_step, a loss added in call(), BatchNormalization): "
                "under XLA each count of real rows would compile a program of its own")
    return None


def _averages_on_its_own(model: keras.Model, element: tuple) -> bool:
    """Whether the step gives ``model`` its micro-batches' real rows alone
    (``LossPlan.real_rows_only``, or BatchNormalization's pooled statistics)."""
    if has_custom_step(model) or pooled_layers(model):
        return True
    x, y, w = (empty_to_none(part) for part in element[:3])
    return step_plan(model, (x, y, w)).real_rows_only


def choose_cut(model: keras.Model, adapter: InputAdapter, batch_size: int, where: Layout, *,
               by_length: bool | None, jit: bool, tokens: int | str | None = None,
               rows_given: bool = False, verbose: int = 0) -> Cut:
    """How ``adapter``'s large batches are cut for ``model`` (see the module's docstring).

    Args:
        by_length: True asks for the cut by length (raising where it cannot be), False
            refuses it, None (``"auto"``) lets the check of padding decide.
        jit: the step runs under XLA: lengths are rounded up to XLA's buckets
            (``buckets.LENGTH_BUCKETS``), and in tokens rows to what the budget
            holds at those lengths.
        tokens: ``micro_batch_tokens``: an int budget, ``"auto"`` (the probe's budget,
            or rows where ``rows_given``) or None (rows).
        rows_given: a ``micro_batch_size`` was given.
        verbose: say so where ``"auto"`` settles for less.

    Raises:
        DatasetError: ``by_length=True`` on rows of one shape.
        UnsupportedModelError: ``by_length=True`` or an int ``tokens`` where the rows
            cannot be cut by length, or an int ``tokens`` where they cannot be sized in
            tokens; each says why.
    """
    padded = adapter.padded_sequences(_takes_any_length(model))
    lengths = adapter.lengths() if padded is None else None
    if padded is None and (lengths is None or (lengths.number == 0 and not lengths.uncut)):
        _refuse_rows(adapter, by_length, tokens)
        return Cut()
    element = MicroBatches(adapter, batch_size, min(batch_size // where.replicas, 8),
                           where).element_spec()
    if where.local_replicas > 1:
        element = without_replica_axis(element)  # a replica's micro-batch
    if padded is not None:
        lengths = padded_lengths(element[:3], padded)
    assert lengths is not None
    why, cut = _by_length(model, adapter, batch_size, element, lengths, padded, where,
                          by_length, jit)
    if cut is None:
        if by_length:
            raise UnsupportedModelError(
                f"Expected a model and input that can be cut by length with by_length=True. "
                f"Received: {why}. Pass by_length='auto' to pad every micro-batch to its "
                "large batch's longest row instead, exactly as model.fit sees it.")
        if isinstance(tokens, int):
            raise UnsupportedModelError(
                f"Expected rows cut by length with micro_batch_tokens={tokens}. Received: "
                f"rows that are padded to their large batch's longest row, because {why}. "
                "Pass micro_batch_tokens=None to cut micro-batches by rows.")
        if verbose and by_length is None:
            print(f"autosplit: micro-batches padded to their large batch's longest row: "
                  f"{why}.", flush=True)
        return Cut("longest", lengths, arrays=padded, found=why)
    if tokens is None or (tokens == "auto" and rows_given):
        return cut
    refused = tokens_refused(where, jit, jit and _averages_on_its_own(model, element),
                             shards_by_length(adapter, where))
    if refused is not None:
        if isinstance(tokens, int):
            fix = ("jit_compile=False to fit_large_batch, or " if where.workers == 1 else "")
            raise UnsupportedModelError(
                f"Expected one worker or each its own share of the input, and under XLA "
                f"a model whose micro-batches may hold padding rows, with "
                f"micro_batch_tokens={tokens}. Received: {refused}. "
                f"Pass {fix}micro_batch_tokens=None to cut micro-batches by rows.")
        if verbose:
            print(f"autosplit: micro-batches sized in rows, not tokens: {refused}.", flush=True)
        return cut
    return cut.in_tokens(tokens if isinstance(tokens, int) else None)


def _refuse_rows(adapter: InputAdapter, by_length: bool | None, tokens: Any) -> None:
    """Refuse what asks for a cut by length of rows of one shape."""
    what = (f"an input whose rows all have one shape ({adapter.kind}) and hold no padded "
            "sequences for a model that takes any length")
    if by_length:
        raise DatasetError(
            f"Expected rows that vary in length with by_length=True. Received: {what}. Pass "
            "them as a padded_batch, a ragged tensor, variable-length examples or arrays "
            "padded with zeros (pad_sequences) to a model whose inputs take any length "
            "(keras.Input((None,))), or leave by_length='auto'.")
    if isinstance(tokens, int):
        raise UnsupportedModelError(
            f"Expected rows that vary in length with micro_batch_tokens={tokens}. Received: "
            f"{what}. Pass micro_batch_tokens=None to cut micro-batches by rows.")


def _by_length(model: keras.Model, adapter: InputAdapter, batch_size: int, element: tuple,
               lengths: Lengths, padded: PaddedArrays | None, where: Layout,
               by_length: bool | None, jit: bool) -> tuple[str, Cut | None]:
    """The cut by length, or None with why not (``element``: the pipeline's spec)."""
    if by_length is False:
        return "by_length=False", None
    if lengths.uncut:
        return f"its inputs cannot be cut by length ({'; '.join(lengths.uncut)})", None
    build_for(model, element)  # the compiled loss and metrics, as the step builds them
    # One read of the input for both checks: each read is an iterator more over it.
    sample = functools.cache(lambda: adapter.sample(min(batch_size, _SAMPLE)))
    whole = loss_over_whole_batch(model, adapter, element, sample)
    if whole is not None:  # the whole-batch step keeps a large batch's rows as they come
        return f"the loss is computed over the whole batch ({whole})", None
    spec = _length_spec(element[:3], lengths)
    pre = padded is not None and padded.pre
    found = check_padding(model, sample(), spec, lengths, pre=pre)
    if not found.ignores_padding:
        return _not_ignored(found), None
    return "", Cut("length", lengths, buckets=jit, arrays=padded,
                   replicas=where.local_replicas, outputs=found.outputs, found=found.reason)


def _not_ignored(found: PaddingCheck) -> str:
    return f"the model does not ignore padding: {found.reason}"


def _takes_any_length(model: keras.Model) -> bool:
    """Whether the model's declared inputs (a functional or Sequential model's) of rank 2
    or more take any length along their second axis."""
    try:
        inputs = model.inputs
    except (AttributeError, ValueError):
        return False
    ranked = [t for t in tf.nest.flatten(inputs or []) if len(t.shape) >= 2]
    return bool(ranked) and all(t.shape[1] is None for t in ranked)


def _length_spec(spec: tuple, lengths: Lengths) -> tuple:
    """``spec`` with each part that has a length of unknown size along its axis."""
    leaves = tf.nest.flatten(spec)
    return tf.nest.pack_sequence_as(spec, [
        s if lengths.of(i) is None else tf.TensorSpec(
            [None if a == lengths.axes[i] else d for a, d in enumerate(s.shape)], s.dtype)
        for i, s in enumerate(leaves)])
