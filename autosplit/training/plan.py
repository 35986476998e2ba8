"""The plan of a ``fit_large_batch`` call: the micro-batch size (given, or the probe's),
the pipeline and the compiled step, and the seed of every epoch's shuffle."""

from __future__ import annotations

import dataclasses
import gc
import os
from typing import TYPE_CHECKING

import keras
import tensorflow as tf

from autosplit.data.adapter import InputAdapter
from autosplit.data.layout import Layout, layout
from autosplit.data.pipeline import MicroBatches
from autosplit.data.sequences.lengths import costliest_row
from autosplit.data.sharded import sharded_input
from autosplit.data.split import Split, split_batch
from autosplit.errors import BatchSizeError
from autosplit.memory.host import bfc_enabled
from autosplit.search.isolation import (
    checked_micro_batch,
    crash_prone_layers,
    kernels_may_crash,
)
from autosplit.step.compiled import Compilation
from autosplit.step.cut_choice import choose_cut
from autosplit.step.train_step import Step, step_for
from autosplit.step.whole_batch import WholeBatchStep
from autosplit.training.arguments import Args, warn_if_inexact

if TYPE_CHECKING:
    from autosplit.search.probe import ProbeResult

__all__ = ["Plan", "plan_run"]


@dataclasses.dataclass(frozen=True)
class Plan:
    """How a ``fit_large_batch`` call trains: decided once, before its first step; an
    out-of-memory recovery's next epoch gets a new one (``epochs.rebuild``)."""

    split: Split  # of this replica's share B / R
    layout: Layout
    pipeline: MicroBatches
    step: Step
    probe: ProbeResult | None
    reason: str
    shuffle_seed: int | None = None  # every epoch's order (arrays); the same on every worker
    length: int | None = None  # in tokens: the costliest row sampled, which validation's rows fit

    def validation_rows(self, rows: int) -> int:
        """Rows of a validation micro-batch: training's ``rows``, or in tokens as many
        rows of the longest row sampled as the budget holds (validation is cut by rows)."""
        tokens = self.pipeline.tokens
        return rows if not tokens or self.length is None else max(1, min(
            rows, tokens // self.length))


def plan_run(model: keras.Model, adapter: InputAdapter, args: Args, *, jit_compile: bool | None,
          memory_limit: int | str | None, headroom: float, cache: bool,
          objective: str = "memory") -> Plan:
    if (args.micro_batch_size is None or memory_limit is not None
            or bfc_enabled(os.environ) or tf.config.list_logical_devices("GPU")):
        # Earlier pipelines and dropped models sit in reference cycles: free them before
        # memory is measured or capped (on a plain CPU Python's collector does, in time).
        gc.collect()
    where = layout(model.distribute_strategy)
    if args.batch_size % where.replicas:
        raise BatchSizeError(
            f"Expected `batch_size` to divide evenly across the {where.replicas} replicas "
            f"of {type(model.distribute_strategy).__name__}. Received: "
            f"batch_size={args.batch_size}. Use a multiple of {where.replicas}, e.g. "
            f"{args.batch_size - args.batch_size % where.replicas or where.replicas}.")
    jit = Compilation.of(model, jit_compile).jit_compile
    local = args.batch_size // where.replicas
    # How every large batch is cut, and why: decided once, here.
    cut = choose_cut(model, adapter, args.batch_size, where, by_length=args.by_length, jit=jit,
                     tokens=args.micro_batch_tokens,
                     rows_given=args.micro_batch_size is not None, verbose=args.verbose)
    probe_result = None
    if args.micro_batch_size is None and cut.tokens is None:
        from autosplit.search.probe import search_micro_batch

        probe_result = search_micro_batch(
            model, adapter, args.batch_size, memory_limit=memory_limit, headroom=headroom,
            cache=cache, jit_compile=jit_compile, verbose=args.verbose, objective=objective,
            cut=cut)
        micro = probe_result.micro_batch_size
        reason = probe_result.reason()
        if cut.by == "tokens":  # the budget found; or rows, where the trials ran in rows
            cut = (cut.with_budget(probe_result.tokens) if probe_result.tokens
                   else cut.in_rows())
    elif args.micro_batch_size is None:
        micro, reason = local, f"micro_batch_tokens={cut.tokens} given"
    else:
        micro, reason = _given_size(model, adapter, args, where, jit)
    length = None  # of the sample's costliest row, where micro-batches are sized in tokens
    if cut.by == "tokens":  # of up to `tokens` tokens and the rows given, or of B's
        assert cut.lengths is not None
        micro = min(args.micro_batch_size or local, local)
        length = (probe_result.reference_length if probe_result is not None else
                  costliest_row(adapter.sample(local), cut.lengths, cut.arrays, cut.buckets,
                                 tokens=True))
    split = split_batch(local, micro)
    sharded = sharded_input(adapter, model.distribute_strategy, where, args.batch_size, cut=cut)
    if sharded is not adapter:  # sequences cut by length: each worker its own share
        adapter = sharded
        cut = cut.shared(where.workers)
    pipeline = MicroBatches(adapter, args.batch_size, split.micro_batch_size, where, cut=cut)
    step = step_for(model, pipeline, jit_compile=jit_compile, batch_norm=args.batch_norm,
                    noise_scale=args.noise_scale)
    # In tokens, a large batch has as many micro-batches as it needs: it may be split.
    steps = max(split.accumulation_steps, 2) if cut.by == "tokens" else split.accumulation_steps
    warn_if_inexact(model, accumulation_steps=steps, rows=step.rows,
                    batch_size=args.batch_size, pooled=bool(step.update.pool),
                    adds_losses=step.update.plan.forward_losses,
                    # the whole-batch step computes such a loss on the whole batch
                    per_batch_losses=(step.update.plan.per_batch_ratios
                                      and not isinstance(step, WholeBatchStep)),
                    sparse_gradients=step.update.plan.sparse_gradients,
                    batch_norm_in_training=any(
                        calls for _, calls in step.update.plan.batch_norm_calls))
    return Plan(split, where, pipeline, step, probe_result, reason,
                 _shuffle_seed(step, where, adapter), length)


def _given_size(model: keras.Model, adapter: InputAdapter, args: Args, where: Layout,
                jit: bool) -> tuple[int, str]:
    """The given micro-batch size and why; smaller where a trial step of it in a child
    process ran out of memory (kernels that may crash under a CPU cap)."""
    micro = given = args.micro_batch_size
    assert given is not None
    if where.replicas == 1 and kernels_may_crash() and crash_prone_layers(model):
        micro = checked_micro_batch(model, adapter.sample(args.batch_size), args.batch_size,
                                    given, jit, args.on_oom)
        if micro < given:
            return micro, (f"given {given}; a trial step in a child process ran out of "
                           f"memory, so training starts at {micro}")
    return given, "given"


def _shuffle_seed(step: Step, where: Layout, adapter: InputAdapter) -> int | None:
    """The seed of every epoch's shuffle of arrays (epoch e ordered by (seed, e) alone),
    drawn once from TensorFlow's random state, so that ``set_random_seed`` makes a run
    reproducible, a recovered run keeps its orders, and every worker uses worker 0's
    draw (one all-reduce); None for other inputs."""
    if not adapter.shuffles:
        return None
    drawn = int(tf.random.uniform((), 1, 2**24, dtype=tf.int64)) if where.worker == 0 else 0
    if not where.multi_worker:
        return drawn
    _, seed = step.agree(True, float(drawn))
    return int(seed)
