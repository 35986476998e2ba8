"""The plan of a ``fit_large_batch`` call: the micro-batch size (given, or the probe's),
the pipeline and the compiled step, and the seed of every epoch's shuffle."""

from __future__ import annotations

import dataclasses
import gc
import os
from typing import TYPE_CHECKING

import keras
import tensorflow as tf

from autosplit.data.adapter import InputAdapter, varying_shapes
from autosplit.data.layout import Layout, layout
from autosplit.data.lengths import LENGTH_MULTIPLE, LengthCut, Padded, sorts_by_length
from autosplit.data.pipeline import MicroBatches
from autosplit.data.split import Split, split_batch
from autosplit.errors import BatchSizeError, DatasetError, UnsupportedModelError
from autosplit.memory.host import bfc_enabled
from autosplit.search.isolation import (
    checked_micro_batch,
    crash_prone_layers,
    kernels_may_crash,
)
from autosplit.step.compiled import Compilation
from autosplit.step.padding import check_padding
from autosplit.step.train_step import TrainStep, build_for, step_for
from autosplit.training.arguments import Args, warn_if_inexact

if TYPE_CHECKING:
    from autosplit.search.trials import ProbeResult

__all__ = ["Plan", "plan_run"]


@dataclasses.dataclass
class Plan:
    split: Split  # of this replica's share B / R
    layout: Layout
    pipeline: MicroBatches
    step: TrainStep
    probe: ProbeResult | None
    reason: str
    shuffle_seed: int | None = None  # every epoch's order (arrays); the same on every worker
    padding: str | None = None  # FitReport.padding


def plan_run(model: keras.Model, adapter: InputAdapter, args: Args, *, jit_compile: bool | None,
          memory_limit: int | str | None, headroom: float, cache: bool,
          objective: str = "memory") -> Plan:
    if (args.micro_batch_size is None or memory_limit is not None
            or bfc_enabled(os.environ) or tf.config.list_logical_devices("GPU")):
        # An earlier call's pipelines (their traced functions hold the arrays) and a
        # dropped model's variables live in reference cycles until a collection: free
        # them before the search measures memory, on an accelerator, and under
        # TensorFlow's CPU cap (where host arrays count). On a plain CPU Python's own
        # collector frees them, as after model.fit: a full collection costs 0.1-0.3 s
        # in a process that has built a few models, a tenth of a short call.
        gc.collect()
    where = layout(model.distribute_strategy)
    if args.batch_size % where.replicas:
        raise BatchSizeError(
            f"Expected `batch_size` to divide evenly across the {where.replicas} replicas "
            f"of {type(model.distribute_strategy).__name__}. Received: "
            f"batch_size={args.batch_size}. Use a multiple of {where.replicas}, e.g. "
            f"{args.batch_size - args.batch_size % where.replicas or where.replicas}.")
    probe_result = None
    if args.micro_batch_size is None:
        from autosplit.search.trials import search_micro_batch

        probe_result = search_micro_batch(
            model, adapter, args.batch_size, memory_limit=memory_limit, headroom=headroom,
            cache=cache, jit_compile=jit_compile, verbose=args.verbose, objective=objective)
        micro = probe_result.micro_batch_size
        reason = probe_result.reason()
    else:
        micro = args.micro_batch_size
        reason = "given"
        if where.replicas == 1 and kernels_may_crash() and crash_prone_layers(model):
            micro = checked_micro_batch(
                model, adapter.sample(args.batch_size), args.batch_size, micro,
                Compilation.of(model, jit_compile).jit_compile, args.on_oom)
            if micro < args.micro_batch_size:
                reason = (f"given {args.micro_batch_size}; a trial step in a child process "
                          f"ran out of memory, so training starts at {micro}")
    split = split_batch(args.batch_size // where.replicas, micro)
    pipeline = MicroBatches(adapter, args.batch_size, split.micro_batch_size, where)
    pipeline, padding = _cut_by_length(model, pipeline, args,
                                       Compilation.of(model, jit_compile).jit_compile)
    step = step_for(model, pipeline, jit_compile=jit_compile, batch_norm=args.batch_norm)
    warn_if_inexact(model, accumulation_steps=split.accumulation_steps, rows=step.rows,
                    batch_size=args.batch_size, pooled=bool(step.update.pool),
                    adds_losses=step.update.plan.forward_losses,
                    per_batch_losses=step.update.plan.per_batch_ratios,
                    sparse_gradients=step.update.plan.sparse_gradients,
                    batch_norm_in_training=any(
                        calls for _, calls in step.update.plan.batch_norm_calls))
    return Plan(split, where, pipeline, step, probe_result, reason,
                 _shuffle_seed(step, where, adapter), padding)


def _cut_by_length(model: keras.Model, pipeline: MicroBatches, args: Args, jit: bool
                   ) -> tuple[MicroBatches, str | None]:
    """The pipeline that cuts by length where the rows vary in length and the model
    ignores padding (``args.by_length``), with ``FitReport.padding``'s account: lengths
    rounded up to a multiple of 8 under XLA (``jit``), unrounded otherwise."""
    spec = pipeline.element_spec()
    padded = pipeline.adapter.padded_sequences(_takes_any_length(model))
    if not varying_shapes(spec) and padded is None:
        if args.by_length:
            raise DatasetError(
                "Expected rows that vary in length with by_length=True. Received: an input "
                f"whose rows all have one shape ({pipeline.adapter.kind}) and hold no "
                "padded sequences for a model that takes any length. Pass them as a "
                "padded_batch, a ragged tensor, variable-length examples or arrays padded "
                "with zeros (pad_sequences) to a model whose inputs take any length "
                "(keras.Input((None,))), or leave by_length='auto'.")
        return pipeline, None
    if args.by_length is False:
        why = "by_length=False"
    elif pipeline.local_replicas > 1:
        why = f"{pipeline.local_replicas} replicas on this worker"
    elif padded is None and not sorts_by_length(pipeline.adapter.rows_dataset().element_spec):
        why = "its inputs vary in more than one length"
    else:
        build_for(model, spec)  # the compiled loss and metrics, as the step builds them
        found = check_padding(model, pipeline.adapter.sample(min(pipeline.batch_size, 16)),
                              _length_spec(spec[:3], padded),
                              pre=padded is not None and padded.pre)
        if found.ignores_padding:
            rounded = f" (lengths rounded up to a multiple of {LENGTH_MULTIPLE} for XLA)"
            cut = LengthCut(LENGTH_MULTIPLE if jit else 1, padded)
            return (MicroBatches(pipeline.adapter, pipeline.batch_size, pipeline.rows,
                                 pipeline.where, by_length=cut),
                    f"by length{rounded if jit else ''}: the model ignores padding "
                    f"({found.reason})")
        why = f"the model does not ignore padding: {found.reason}"
    if args.by_length:
        raise UnsupportedModelError(
            f"Expected a model and input that can be cut by length with by_length=True. "
            f"Received: {why}. Pass by_length='auto' to pad every micro-batch to its "
            "large batch's longest row instead, exactly as model.fit sees it.")
    if args.verbose and args.by_length is None:
        print(f"autosplit: micro-batches padded to their large batch's longest row: {why}.",
              flush=True)
    return pipeline, f"to the large batch's longest row: {why}"


def _takes_any_length(model: keras.Model) -> bool:
    """Whether the model's declared inputs (a functional or Sequential model's) of rank 2
    or more take any length along their second axis."""
    try:
        inputs = model.inputs
    except (AttributeError, ValueError):
        return False
    ranked = [t for t in tf.nest.flatten(inputs or []) if len(t.shape) >= 2]
    return bool(ranked) and all(t.shape[1] is None for t in ranked)


def _length_spec(spec: tuple, padded: Padded | None) -> tuple:
    """``spec`` with the length axis unknown on the arrays as long as ``padded``'s."""
    if padded is None:
        return spec
    return tf.nest.map_structure(
        lambda s: tf.TensorSpec([s.shape[0], None, *s.shape[2:]], s.dtype)
        if s.shape.rank >= 2 and s.shape[1] == padded.length else s, spec)


def _shuffle_seed(step: TrainStep, where: Layout, adapter: InputAdapter) -> int | None:
    """The seed of every epoch's shuffle, for an input whose order is ours (arrays):
    epoch e is ordered by (seed, e) alone (``MicroBatches.dataset``). None otherwise.

    Drawn once, from TensorFlow's random state: ``keras.utils.set_random_seed`` (or
    ``tf.random.set_seed``) makes a run reproducible, and a run that recovered from an
    out-of-memory error (a pipeline built again, at a smaller size) goes on with the
    orders of the run that did not. Each worker of a multi-worker job reads the whole
    input and keeps its share of every large batch, so all of them use worker 0's draw
    (one all-reduce shares it; exact in float32 below 2**24).
    """
    if not adapter.shuffles:
        return None
    drawn = int(tf.random.uniform((), 1, 2**24, dtype=tf.int64)) if where.worker == 0 else 0
    if not where.multi_worker:
        return drawn
    _, seed = step.agree(True, float(drawn))
    return int(seed)
