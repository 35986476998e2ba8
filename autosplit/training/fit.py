"""``fit_large_batch``: ``model.fit`` with an exact large batch, in micro-batches.

Four phases, each its own function: validate the arguments (nothing changes before
they pass), plan the run (the input adapter, the micro-batch size, from the probe when
``"auto"``, the pipeline and the compiled step, reused across calls), the epoch loop
(Keras's own shape: a ``CallbackList`` with History and the progress bar,
``on_train_batch_begin``, one large batch, ``on_train_batch_end``,
``model.stop_training``), and out-of-memory recovery (``autosplit.training.recovery``).
Callbacks see one step per large batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import keras

from autosplit.data.adapter import InputAdapter
from autosplit.data.hub import preprocessed, preprocessed_validation, takes_raw_data
from autosplit.data.inputs import get_input
from autosplit.data.layout import layout
from autosplit.data.markers import Ends
from autosplit.data.pipeline import MicroBatches
from autosplit.data.sequences.stats import cut_stats
from autosplit.data.sharded import sharded_input
from autosplit.data.split import split_batch
from autosplit.keras_hooks import internals as _keras
from autosplit.keras_hooks.custom_step import flat_logs, metrics_or_last
from autosplit.step.evaluate import Evaluator, validation_input
from autosplit.step.model_state import model_state
from autosplit.step.noise_scale import unit_name
from autosplit.step.train_step import Step
from autosplit.step.whole_batch import WholeBatchStep
from autosplit.training.arguments import Args, check_input, split_off_validation, validate_fit
from autosplit.training.epochs import Epochs, iteration_of, publish
from autosplit.training.noise_report import GradientNoiseScale, NoiseLogs
from autosplit.training.plan import Plan, plan_run
from autosplit.training.recovery import Recovery
from autosplit.training.report import FitReport

__all__ = ["FitReport", "fit_large_batch"]


def fit_large_batch(
    model: keras.Model,
    x: Any = None,
    y: Any = None,
    *,
    batch_size: int,
    micro_batch_size: int | Literal["auto"] = "auto",
    epochs: int = 1,
    verbose: Literal["auto", 0, 1, 2] = "auto",
    callbacks: Sequence[keras.callbacks.Callback] | None = None,
    validation_split: float = 0.0,
    validation_data: Any = None,
    shuffle: bool | Literal["batch"] = True,
    class_weight: dict[int, float] | None = None,
    sample_weight: Any = None,
    initial_epoch: int = 0,
    steps_per_epoch: int | None = None,
    validation_steps: int | None = None,
    validation_batch_size: int | None = None,
    validation_freq: int = 1,
    jit_compile: bool | None = None,
    on_oom: Literal["recover", "raise"] = "recover",
    batch_norm: Literal["pooled", "micro"] = "pooled",
    memory_limit: int | str | None = None,
    headroom: float = 0.1,
    cache: bool = True,
    objective: Literal["memory", "speed"] = "memory",
    by_length: bool | Literal["auto"] = "auto",
    micro_batch_tokens: int | Literal["auto"] | None = "auto",
    noise_scale: bool = False,
) -> keras.callbacks.History:
    """Train ``model`` like ``model.fit``, with an effective batch of exactly ``batch_size``.

    Each large batch is pulled from the input as micro-batches that fit in memory; their
    float32 gradients are summed inside one compiled step and the optimizer is applied
    once, so the weights, ``optimizer.iterations``, schedules, weight decay, EMA and
    clipping are those of one full-batch step (the documentation's page "What exact
    means" has the rules).

    Args:
        model: a compiled Keras 3 model (TensorFlow backend).
        x: as in ``model.fit``: arrays (a tensor, list or dict) with targets ``y``; or,
            with ``y=None``, a ``tf.data.Dataset`` (of examples or of batches of any
            size), a ``keras.utils.PyDataset``, a Python generator, a tuple
            ``(x, y[, sample_weight])`` of arrays, or what
            ``strategy.experimental_distribute_dataset`` or
            ``strategy.distribute_datasets_from_function`` returned. Under several
            workers a ``tf.data.Dataset`` is sharded as ``model.fit`` shards it (its
            ``auto_shard_policy``); see the documentation's page on distribution.
        y: the targets when ``x`` is arrays; else None.
        batch_size: the effective batch B (keyword only: it is the point of the call).
        micro_batch_size: the most rows per micro-batch, or ``"auto"`` to find the
            largest that fits by real trial steps (``autosplit.probe``). The rows used
            are balanced: ``ceil(B / ceil(B / m))``. ``>= batch_size``: no split.
        epochs: as in ``model.fit``.
        verbose: as in ``model.fit``.
        callbacks: as in ``model.fit``; they see one step per large batch.
        validation_split: as in ``model.fit``.
        validation_data: as in ``model.fit``: ``(x, y[, sample_weight])`` or any input
            ``x`` takes but a ``tf.distribute`` one.
        shuffle: for arrays, as in ``model.fit``: ``True`` shuffles every row before
            each epoch; ``"batch"`` is Keras's batch-wise shuffle: large batch i keeps
            the rows ``[i*B, (i+1)*B)`` it has with ``False``, in a new order each
            epoch (for data read in blocks, such as HDF5). Every row is used once per
            epoch either way. A large batch's gradient does not depend on the order of
            its rows, so ``"batch"`` trains as ``False`` does, up to float rounding
            (with ``batch_norm="micro"`` the micro-batches differ). A ``PyDataset``
            gets ``shuffle`` as ``model.fit`` passes it; datasets and generators keep
            their own order.
        class_weight: as in ``model.fit``.
        sample_weight: as in ``model.fit``.
        initial_epoch: as in ``model.fit``.
        steps_per_epoch: as in ``model.fit``, counted in large batches.
        validation_steps: as in ``model.fit``.
        validation_batch_size: as in ``model.fit``: the rows of a validation batch
            (default ``batch_size``; a batched dataset's own batches where they change
            the logs, as ``model.fit`` scores them), each run in micro-batches of at
            most the training micro-batch size.
        validation_freq: as in ``model.fit``.
        jit_compile: XLA for the per-micro-batch computation; default ``model.compile``'s.
        on_oom: ``"recover"`` (default) finishes a batch that ran out of memory with
            smaller micro-batches; ``"raise"`` re-raises the error.
        batch_norm: ``"pooled"`` (default): BatchNormalization layers in training mode
            update their moving statistics once per large batch, with the exactly
            pooled statistics of its micro-batches (what the whole batch gives);
            ``"micro"``: once per micro-batch, as Keras's gradient accumulation does.
        memory_limit: passed to ``autosplit.probe`` when ``micro_batch_size="auto"``.
        headroom: passed to ``autosplit.probe`` when ``micro_batch_size="auto"``.
        cache: passed to ``autosplit.probe`` when ``micro_batch_size="auto"``.
        objective: passed to ``autosplit.probe`` when ``micro_batch_size="auto"``;
            ``"speed"`` keeps a smaller size that runs more than 5% faster than the
            largest that fits.
        by_length: for rows that vary in length (``padded_batch``, ragged or
            variable-length examples, a pair's source and target each of its own
            length): ``"auto"`` (default) sorts each large batch's rows by length and
            pads each part of a micro-batch only to its own longest row (rounded up to
            a bucket under XLA: 8, 16, 24, 32, 40, 56, ..., each 1.25x) where a check
            on a few rows, through the step the model trains with, finds that the
            model ignores padding, and pads
            every micro-batch to its large batch's longest row, as ``model.fit`` sees
            it, where not; ``True`` asks for the first and raises if it cannot be
            made; ``False`` asks for the second. ``history.autosplit.padding`` says
            which ran, and why.
        micro_batch_tokens: where rows are cut by length, the most tokens (rows x
            padded length, summed over an example's lengths) per micro-batch: short
            rows then come many to a micro-batch and long rows few. ``"auto"`` (default): with
            ``micro_batch_size="auto"``, the probe finds the budget by real trial
            steps of that cut; with a given ``micro_batch_size``, micro-batches of that
            many rows. An int: that budget (a given ``micro_batch_size`` caps the rows).
            None: micro-batches of ``micro_batch_size`` rows. Several local replicas
            each take one of one device's micro-batches per micro-step, of its own
            shape; several workers take tokens where
            each reads its own share of a ``tf.data`` input (one replica each).
            Under XLA lengths round up to coarser buckets (8, 16, 32, 56, ..., 1.6x) and
            rows to what the budget holds there or half, padded with weightless copies
            of a row (at most 18 programs up to length 512, ``history.autosplit.programs``
            counts them); a model that weighs rows on its own there (a custom
            ``train_step``, a loss from ``add_loss``, BatchNormalization) is refused
            tokens: ``"auto"`` cuts by rows, an int raises.
            ``history.autosplit.tokens`` is the budget in use.
        noise_scale: estimate McCandlish et al.'s gradient noise scale from the
            micro-batches' gradients and the large batch's (no extra forward or
            backward pass; no weight changes): ``gradient_noise_scale`` in the logs
            and ``history.history`` (each epoch's), and
            ``history.autosplit.gradient_noise_scale`` with what their model says of
            B against it, printed (unless ``verbose=0``) where B is 4x or more from it
            either way. Absent with one micro-batch per large batch. Off by default:
            its k squared norms per large batch cost 0.9-2.2% of the step of a wide
            MLP on a CPU, more than the 1% a default may cost
            (``benchmarks/noise_scale.py``); turn it on for the runs that choose B.

    Returns:
        The ``keras.callbacks.History``; ``history.autosplit``, a :class:`FitReport`,
        says how the batch was split, why, and any out-of-memory recoveries.

    Example:
        >>> history = autosplit.fit_large_batch(  # doctest: +SKIP
        ...     model, x, y, batch_size=4096, epochs=3)
        >>> history.autosplit.micro_batch_size  # doctest: +SKIP
        512
    """
    args = validate_fit(model, locals())
    if args.validation_split:
        x, y, sample_weight, validation_data = split_off_validation(
            x, y, sample_weight, args.validation_split)
    if takes_raw_data(model):  # a keras_hub Task: its preprocessor mapped, as in its fit
        x, y, sample_weight = preprocessed(model, x, y, sample_weight, args.batch_size)
        if validation_data is not None:
            validation_data = preprocessed_validation(
                model, validation_data, args.validation_batch_size or args.batch_size)
    # Called inside `with strategy.scope():` (as model.fit may be), it runs as outside.
    with _keras.outside_strategy_scope():
        adapter = get_input(x, y, sample_weight, shuffle=shuffle, class_weight=class_weight,
                            model=model)
        strategy = model.distribute_strategy
        adapter = sharded_input(adapter, strategy, layout(strategy), args.batch_size)
        check_input(adapter, args)
        validation = _Validation.make(validation_data, args, model)
        plan = plan_run(model, adapter, args, jit_compile=jit_compile, memory_limit=memory_limit,
                     headroom=headroom, cache=cache, objective=objective)
        # Sequences cut by length are sharded once the cut is known (plan_run).
        return _train(model, plan.pipeline.adapter, plan, validation, args, callbacks)


class _Validation:
    """Validation logs after an epoch, in micro-batches (``autosplit.step.evaluate``)."""

    def __init__(self, data: Any, args: Args, model: keras.Model) -> None:
        self.adapter, self.steps = validation_input(data, args.validation_steps, model)
        self.args = args
        self._pipeline: MicroBatches | None = None
        self._own: int | None = None  # the input's own batch size, 0: not used

    @classmethod
    def make(cls, data: Any, args: Args, model: keras.Model) -> _Validation | None:
        return None if data is None else cls(data, args, model)

    def __call__(self, model: keras.Model, rows: int,
                 callbacks: keras.callbacks.CallbackList | None = None) -> dict[str, Any]:
        # One evaluator per compiled model, like the train step: a second fit traces
        # nothing new, a compile() in between gives a fresh one.
        state = model_state(model)
        if state.evaluator is None:
            state.evaluator = Evaluator(model)
        evaluator = state.evaluator
        # One pipeline for the call (its tf.data functions traced once), rebuilt only
        # when an out-of-memory recovery changed the rows.
        batch_size = self._batch_size(evaluator, rows, callbacks)
        rows = min(rows, batch_size)
        if self._pipeline is None or self._pipeline.rows != rows:
            self._pipeline = MicroBatches(self.adapter, batch_size, rows)
        logs = evaluator(self._pipeline, steps=self.steps, callbacks=callbacks)
        return {f"val_{name}": value for name, value in logs.items()}

    def _batch_size(self, evaluator: Evaluator, rows: int,
                    callbacks: keras.callbacks.CallbackList | None) -> int:
        """The rows of a validation batch: ``validation_batch_size``, else B; a batched
        dataset's own where its batches' boundaries change the logs, as ``model.fit``
        scores each batch as it comes."""
        given = self.args.validation_batch_size or self.args.batch_size
        if self.args.validation_batch_size is not None:
            return given
        if self._own is None:  # decided once per call: the model and callbacks are fixed
            self._own = 0
            own = self.adapter.own_batch_rows()
            if own not in (None, given):
                pipeline = MicroBatches(self.adapter, given, min(rows, given))
                if evaluator.takes_each_batch(pipeline, callbacks):
                    self._own = own
                else:
                    self._pipeline = pipeline  # the one __call__ would build: kept
        return self._own or given


# ---------------------------------------------------------------- the epoch loop


def _train(model: keras.Model, adapter: InputAdapter, plan: Plan,
           validation: _Validation | None, args: Args,
           callbacks: Sequence[keras.callbacks.Callback] | None) -> keras.callbacks.History:
    callback_list = keras.callbacks.CallbackList(
        callbacks, add_history=True, add_progbar=args.verbose != 0, verbose=args.verbose,
        epochs=args.epochs, steps=args.steps_per_epoch or plan.pipeline.steps(), model=model)
    mode = iteration_of(adapter, plan, args)
    recovery = _recovery(plan, adapter, args, callback_list, mode.ends)
    noise = _noise_logs(plan, args)
    loop = Epochs(model, adapter, plan, args, callback_list, recovery, mode, noise)
    traces_before = plan.step.tracing_count()
    model.stop_training = False
    callback_list.on_train_begin()
    # keras.callbacks.BackupAndRestore restores the weights in on_train_begin and says
    # where to resume, as model.fit reads it.
    first_epoch = _keras.resume_epoch(model) or args.initial_epoch
    epoch_logs: dict[str, Any] = {}
    sizes: list[int] = []
    for epoch in range(first_epoch, args.epochs):
        model.reset_metrics()
        noise.begin_epoch()
        adapter.on_epoch_begin()
        callback_list.on_epoch_begin(epoch)
        if loop.epoch(epoch) == 0:
            adapter.on_epoch_end()
            break  # no epoch to report: a 0.0 loss would mislead EarlyStopping and co.
        epoch_logs = {**_epoch_logs(plan.step, loop.logs), **noise.end_epoch()}
        if validation is not None and (epoch + 1) % args.validation_freq == 0:
            epoch_logs.update(validation(model, loop.plan.validation_rows(recovery.rows),
                                         callback_list))
        adapter.on_epoch_end()
        sizes.append(recovery.rows)
        callback_list.on_epoch_end(epoch, epoch_logs)
        if model.stop_training:
            break
    loop.release()
    # As model.fit does: swap the averaged weights in (a no-op without use_ema).
    model.optimizer.finalize_variable_values(model.trainable_variables)
    callback_list.on_train_end(logs=epoch_logs or loop.logs)
    recovery.on_shrink = None  # it closes over the recovery itself: no cycle to keep
    history = model.history
    history.autosplit = _report(loop.plan, adapter, args, recovery, sizes,
                                plan.step.tracing_count() - traces_before,
                                noise.report(args.batch_size))
    said = history.autosplit.gradient_noise_scale
    if args.verbose != 0 and said is not None and said.far:
        print(f"autosplit: {said.advice}", flush=True)
    return history


def _noise_logs(plan: Plan, args: Args) -> NoiseLogs:
    """The call's gradient noise scale, or why it has none (decided once: the logs keep
    their keys over every epoch)."""
    step = plan.step
    noise = step.noise
    unit = unit_name(step.update.plan) if noise is not None else "rows"
    if not args.noise_scale:
        why = "not asked for (noise_scale=False, the default; pass noise_scale=True)"
    elif isinstance(step, WholeBatchStep):
        why = ("the loss is over the whole batch, so no micro-batch's gradient estimates "
               "the large batch's on its own")
    elif noise is None:
        why = ("the model's own train_step computes the gradients, and what each "
               "micro-batch's loss is a mean over is its own")
    elif plan.split.accumulation_steps < 2 and plan.pipeline.cut.by != "tokens":
        why = ("one micro-batch per large batch (per replica): there is no second batch "
               "size to compare its gradient with")
    else:
        why = None
    return NoiseLogs(noise, unit, why)


def _epoch_logs(step: Step, last: dict[str, Any]) -> dict[str, Any]:
    """The logs of an epoch, as ``model.fit`` picks them (:func:`metrics_or_last`)."""
    if step.update.plan.custom is None:
        return flat_logs(step.model.get_metrics_result())
    return metrics_or_last(step.model, last)


def _recovery(plan: Plan, adapter: InputAdapter, args: Args,
              callback_list: keras.callbacks.CallbackList, ends: Ends) -> Recovery:
    """The out-of-memory recovery of this call, which tells the callbacks of each shrink
    (``ends``: where its large batches end, ``Iteration.ends``)."""
    def on_shrink(*_: int) -> None:
        if plan.probe is not None:  # an OOM proved the cached answer wrong
            from autosplit.search.probe import invalidate_cache

            invalidate_cache(plan.probe)
        publish(callback_list, recovery, args, plan)

    recovery = Recovery(
        plan.step, on_oom=args.on_oom, multi_worker=plan.layout.multi_worker,
        known_fits=plan.probe.fitting_sizes() if plan.probe is not None else (),
        ends=ends, on_shrink=on_shrink,
        most_rows=args.batch_size if adapter.shares else None)
    publish(callback_list, recovery, args, plan)
    return recovery


def _report(plan: Plan, adapter: InputAdapter, args: Args, recovery: Recovery,
            sizes: list[int], traces: int, noise: GradientNoiseScale) -> FitReport:
    """``history.autosplit``: the split in use at the end, and how the run got there."""
    split = split_batch(plan.split.batch_size, recovery.rows)
    return FitReport(
        batch_size=args.batch_size,
        micro_batch_size=recovery.rows,
        accumulation_steps=split.accumulation_steps,
        padded_rows=split.padded_rows,
        micro_batch_reason=plan.reason,
        input=adapter.kind,
        batch_norm=args.batch_norm,
        replicas=plan.layout.replicas,
        workers=plan.layout.workers,
        micro_batch_sizes=tuple(sizes),
        oom_recoveries=tuple(recovery.records),
        probe=plan.probe,
        traces=traces,
        padding=plan.pipeline.cut.why,
        tokens=plan.pipeline.tokens,
        programs=None if plan.pipeline.shapes is None else plan.pipeline.shapes.count(),
        cut=cut_stats(plan.pipeline) if plan.pipeline.cut.by != "rows" else None,
        gradient_noise_scale=noise,
        **({} if not isinstance(plan.step, WholeBatchStep) else {"step": (
            f"outputs first, the loss over the whole batch, then the gradients: "
            f"{plan.step.why}")}),
    )


