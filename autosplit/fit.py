"""``fit_large_batch``: ``model.fit`` with an exact large batch, in micro-batches.

Four phases, each its own function: validate the arguments (nothing changes before
they pass), plan the run (the input adapter, the micro-batch size, from the probe when
``"auto"``, the pipeline and the compiled step, reused across calls), the epoch loop
(Keras's own shape: a ``CallbackList`` with History and the progress bar,
``on_train_batch_begin``, one large batch, ``on_train_batch_end``,
``model.stop_training``), and out-of-memory recovery (``autosplit.recovery``).
Callbacks see one step per large batch.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import types
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal

import keras
import tensorflow as tf

from autosplit import _keras
from autosplit.batchnorm import MODES
from autosplit.compiled import Compilation
from autosplit.custom_step import flat_logs, metrics_or_last
from autosplit.device import check_headroom
from autosplit.distribute import Layout, layout
from autosplit.errors import (
    ArgumentError,
    BatchSizeError,
    DatasetError,
    describe,
)
from autosplit.evaluate import Evaluator, validation_input
from autosplit.host import bfc_enabled
from autosplit.hub import preprocessed, preprocessed_validation, takes_raw_data
from autosplit.inputs import InputAdapter, get_input
from autosplit.isolation import checked_micro_batch, kernels_may_crash
from autosplit.model_state import model_state
from autosplit.pipeline import MicroBatches, release, skip_to_end_marker
from autosplit.recovery import OomRecovery, Recovery
from autosplit.search import OBJECTIVES
from autosplit.split import Split, split_batch
from autosplit.step import TrainStep, step_for
from autosplit.validation import (
    check_choice,
    check_count,
    check_fraction,
    check_initial_epoch,
    check_model,
    check_optional_count,
    check_optional_size,
    check_size,
    check_verbose,
    warn_if_inexact,
)
from autosplit.warn import warn_user

if TYPE_CHECKING:
    from autosplit.trials import ProbeResult

__all__ = ["FitReport", "fit_large_batch"]


@dataclasses.dataclass(frozen=True)
class _Args:
    batch_size: int
    micro_batch_size: int | None  # None: "auto"
    epochs: int
    verbose: int
    initial_epoch: int
    steps_per_epoch: int | None
    validation_steps: int | None
    validation_batch_size: int | None
    validation_freq: int
    validation_split: float
    on_oom: str
    batch_norm: str


@dataclasses.dataclass(frozen=True)
class FitReport:
    """How ``fit_large_batch`` split its batches, and why: ``history.autosplit``.

    Immutable, as :class:`autosplit.ProbeResult` is; ``to_dict()`` gives plain values,
    ready for JSON. Read as the dict it used to be (``history.autosplit["micro_batch_size"]``,
    ``.get``, ``.keys()``, ``.items()``, ``.values()``, ``in``, ``len``, iteration), it
    gives what ``to_dict()`` holds, with a ``DeprecationWarning``: read the attributes
    instead. That mapping protocol leaves in 0.4.0.

    Example:
        >>> history = autosplit.fit_large_batch(  # doctest: +SKIP
        ...     model, x, y, batch_size=4096, epochs=3)
        >>> history.autosplit.micro_batch_size  # doctest: +SKIP
        1366
        >>> history.autosplit.oom_recoveries  # doctest: +SKIP
        ()
    """

    batch_size: int
    """The effective batch B, over every replica."""
    micro_batch_size: int
    """Rows per micro-batch, per replica, at the end (after any out-of-memory recovery)."""
    accumulation_steps: int
    """Micro-batches per large batch, per replica, at ``micro_batch_size``."""
    padded_rows: int
    """Zero-weight rows that even out each replica's micro-batches at that size."""
    micro_batch_reason: str
    """``"given"``, or why the probe chose the size it started with."""
    input: str
    """The kind of input trained on (``"arrays"``, ``"generator"``, ...)."""
    batch_norm: str
    """``"pooled"`` or ``"micro"``: when BatchNormalization's moving statistics move."""
    replicas: int
    """Replicas in sync, over every worker."""
    workers: int
    """Worker processes of the run (1 without ``MultiWorkerMirroredStrategy``)."""
    micro_batch_sizes: tuple[int, ...]
    """Rows per micro-batch at the end of each epoch that ran."""
    oom_recoveries: tuple[OomRecovery, ...]
    """Every out-of-memory error survived, in order."""
    probe: ProbeResult | None
    """The probe's search, with ``micro_batch_size="auto"``; else None."""
    traces: int
    """Compiled functions traced by this call (0: every one was reused)."""

    def to_dict(self) -> dict[str, Any]:
        """Plain values: lists for tuples, dicts for records (the probe's too)."""
        data = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        data["micro_batch_sizes"] = list(self.micro_batch_sizes)
        data["oom_recoveries"] = [record.to_dict() for record in self.oom_recoveries]
        data["probe"] = None if self.probe is None else self.probe.to_dict()
        return data

    # history.autosplit was a dict up to 0.2.0: the whole read-only mapping protocol
    # works on to_dict()'s values until 0.4.0, each use with a DeprecationWarning, so
    # that code written against the dict keeps running and learns what to read instead.

    def _as_dict(self, use: str) -> dict[str, Any]:
        warn_user(f"history.autosplit{use} is deprecated: history.autosplit is a FitReport; "
                  "read its attributes (history.autosplit.micro_batch_size), or .to_dict() "
                  "for a dict.", DeprecationWarning)
        return self.to_dict()

    def __getitem__(self, key: str) -> Any:
        return self._as_dict(f"[{key!r}]")[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self._as_dict(f".get({key!r})").get(key, default)

    def keys(self) -> Any:
        return self._as_dict(".keys()").keys()

    def values(self) -> Any:
        return self._as_dict(".values()").values()

    def items(self) -> Any:
        return self._as_dict(".items()").items()

    def __contains__(self, key: object) -> bool:
        return key in self._as_dict(f": {key!r} in history.autosplit")

    def __iter__(self) -> Iterator[str]:
        return iter(self._as_dict(": iterating over it"))

    def __len__(self) -> int:
        return len(self._as_dict(": len()"))


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
            size), a ``keras.utils.PyDataset``, a Python generator, or a tuple
            ``(x, y[, sample_weight])`` of arrays.
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
            ``x`` takes.
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

    Returns:
        The ``keras.callbacks.History``; ``history.autosplit``, a :class:`FitReport`,
        says how the batch was split, why, and any out-of-memory recoveries.

    Example:
        >>> history = autosplit.fit_large_batch(  # doctest: +SKIP
        ...     model, x, y, batch_size=4096, epochs=3)
        >>> history.autosplit.micro_batch_size  # doctest: +SKIP
        512
    """
    args = _validate(model, locals())
    if args.validation_split:
        x, y, sample_weight, validation_data = _split_off_validation(
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
        _check_input(adapter, args)
        validation = _Validation.make(validation_data, args, model)
        plan = _plan(model, adapter, args, jit_compile=jit_compile, memory_limit=memory_limit,
                     headroom=headroom, cache=cache, objective=objective)
        return _train(model, adapter, plan, validation, args, callbacks)


# ---------------------------------------------------------------- validate


def _validate(model: Any, given: dict[str, Any]) -> _Args:
    """Every argument check, before anything changes."""
    batch_size = check_size("batch_size", given["batch_size"])
    micro = given["micro_batch_size"]
    micro = None if (isinstance(micro, str) and micro == "auto") else check_size(
        "micro_batch_size", micro)
    epochs = check_count("epochs", given["epochs"])
    check_choice("on_oom", given["on_oom"], ("recover", "raise"))
    check_choice("batch_norm", given["batch_norm"], MODES)
    check_choice("objective", given["objective"], OBJECTIVES)
    if given["shuffle"] not in (True, False, "batch"):
        raise ArgumentError(f"Expected `shuffle` to be True, False or 'batch'. Received: "
                            f"shuffle={describe(given['shuffle'])}.")
    if isinstance(given["y"], int) and not isinstance(given["y"], bool):
        raise ArgumentError(
            f"Expected targets as the third argument. Received: y={given['y']}. Pass the "
            "batch size by name: fit_large_batch(model, x, y, batch_size=...).")
    args = _Args(
        batch_size=batch_size,
        micro_batch_size=micro,
        epochs=epochs,
        verbose=check_verbose(given["verbose"]),
        initial_epoch=check_initial_epoch(given["initial_epoch"], epochs),
        steps_per_epoch=check_optional_count("steps_per_epoch", given["steps_per_epoch"]),
        validation_steps=check_optional_count("validation_steps", given["validation_steps"]),
        validation_batch_size=check_optional_size("validation_batch_size",
                                                  given["validation_batch_size"]),
        validation_freq=check_count("validation_freq", given["validation_freq"]),
        validation_split=check_fraction("validation_split", given["validation_split"]),
        on_oom=given["on_oom"],
        batch_norm=given["batch_norm"],
    )
    check_headroom(given["headroom"])
    if given["jit_compile"] not in (None, True, False):
        raise ArgumentError(f"Expected `jit_compile` to be None, True or False. Received: "
                            f"jit_compile={describe(given['jit_compile'])}.")
    if args.validation_split and given["validation_data"] is not None:
        warn_user("Both `validation_split` and `validation_data` were given; "
                  "`validation_data` is used, as in model.fit.")
    check_model(model)
    return args


def _split_off_validation(x: Any, y: Any, sample_weight: Any, fraction: float
                          ) -> tuple[Any, Any, Any, tuple[Any, ...]]:
    """The last ``fraction`` of the arrays as validation data, as ``model.fit`` splits
    them; ``x`` alone (a model whose loss needs no targets: an autoencoder's own
    train_step, RealNVP) is split alone. A tuple ``x`` is read as ``get_input`` reads it:
    ``(x, y[, sample_weight])`` when neither ``y`` nor ``sample_weight`` is given."""
    if isinstance(x, tuple) and y is None and sample_weight is None and len(x) in (2, 3):
        x, y, *rest = x
        sample_weight = rest[0] if rest else None
    if isinstance(x, (tf.data.Dataset, keras.utils.PyDataset, types.GeneratorType)):
        raise DatasetError(
            "Expected arrays with `validation_split` (model.fit only splits arrays). "
            f"Received: x={describe(x)}. Pass `validation_data=` instead.")
    (x, y, sample_weight), (vx, vy, vw) = _keras.train_validation_split(
        (x, y, sample_weight), fraction)
    if vy is None and vw is None:
        return x, y, sample_weight, (vx,)
    return x, y, sample_weight, (vx, vy) if vw is None else (vx, vy, vw)


def _check_input(adapter: InputAdapter, args: _Args) -> None:
    if getattr(adapter, "infinite", False) and args.steps_per_epoch is None:
        raise ArgumentError(
            "Expected `steps_per_epoch` with an infinite (repeated) dataset. Received: "
            "steps_per_epoch=None. Pass steps_per_epoch= or drop the `.repeat()`.")


class _Validation:
    """Validation logs after an epoch, in micro-batches (``autosplit.evaluate``)."""

    def __init__(self, data: Any, args: _Args, model: keras.Model) -> None:
        self.adapter, self.steps = validation_input(data, args.validation_steps, model)
        self.args = args
        self._pipeline: MicroBatches | None = None
        self._own: int | None = None  # the input's own batch size, 0: not used

    @classmethod
    def make(cls, data: Any, args: _Args, model: keras.Model) -> _Validation | None:
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
        """The rows of a validation batch: ``validation_batch_size``, else B; but
        ``model.fit`` scores each batch of a batched dataset as it comes, so where the
        batches' boundaries change the logs (Evaluator.takes_each_batch) and the
        dataset's batch size can be read (InputAdapter.own_batch_rows), its own. Not
        where they do not: batches smaller than the micro-batch would slow validation
        for nothing."""
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


# ---------------------------------------------------------------- plan


@dataclasses.dataclass
class _Plan:
    split: Split  # of this replica's share B / R
    layout: Layout
    pipeline: MicroBatches
    step: TrainStep
    probe: ProbeResult | None
    reason: str
    shuffle_seed: int | None = None  # every epoch's order (arrays); the same on every worker


def _plan(model: keras.Model, adapter: InputAdapter, args: _Args, *, jit_compile: bool | None,
          memory_limit: int | str | None, headroom: float, cache: bool,
          objective: str = "memory") -> _Plan:
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
        from autosplit.trials import search_micro_batch

        probe_result = search_micro_batch(
            model, adapter, args.batch_size, memory_limit=memory_limit, headroom=headroom,
            cache=cache, jit_compile=jit_compile, verbose=args.verbose, objective=objective)
        micro = probe_result.micro_batch_size
        reason = probe_result.reason()
    else:
        micro = args.micro_batch_size
        reason = "given"
        if where.replicas == 1 and kernels_may_crash():
            micro = checked_micro_batch(
                model, adapter.sample(args.batch_size), args.batch_size, micro,
                Compilation.of(model, jit_compile).jit_compile, args.on_oom)
            if micro < args.micro_batch_size:
                reason = (f"given {args.micro_batch_size}; a trial step in a child process "
                          f"ran out of memory, so training starts at {micro}")
    split = split_batch(args.batch_size // where.replicas, micro)
    pipeline = MicroBatches(adapter, args.batch_size, split.micro_batch_size, where)
    step = step_for(model, pipeline, jit_compile=jit_compile, batch_norm=args.batch_norm)
    warn_if_inexact(model, accumulation_steps=split.accumulation_steps, rows=step.rows,
                    batch_size=args.batch_size, pooled=bool(step.update.pool),
                    adds_losses=step.update.plan.forward_losses,
                    per_batch_losses=step.update.plan.per_batch_ratios,
                    sparse_gradients=step.update.plan.sparse_gradients,
                    batch_norm_in_training=any(
                        calls for _, calls in step.update.plan.batch_norm_calls))
    return _Plan(split, where, pipeline, step, probe_result, reason,
                 _shuffle_seed(step, where, adapter))


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


# ---------------------------------------------------------------- the epoch loop


def _train(model: keras.Model, adapter: InputAdapter, plan: _Plan,
           validation: _Validation | None, args: _Args,
           callbacks: Sequence[keras.callbacks.Callback] | None) -> keras.callbacks.History:
    callback_list = keras.callbacks.CallbackList(
        callbacks, add_history=True, add_progbar=args.verbose != 0, verbose=args.verbose,
        epochs=args.epochs, steps=args.steps_per_epoch or plan.pipeline.steps(), model=model)
    recovery = _recovery(plan, adapter, args, callback_list)
    loop = _Batches(model, adapter, plan, args, callback_list, recovery)
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
        adapter.on_epoch_begin()
        callback_list.on_epoch_begin(epoch)
        if loop.epoch(epoch) == 0:
            adapter.on_epoch_end()
            break  # no epoch to report: a 0.0 loss would mislead EarlyStopping and co.
        epoch_logs = _epoch_logs(plan.step, loop.logs)
        if validation is not None and (epoch + 1) % args.validation_freq == 0:
            epoch_logs.update(validation(model, recovery.rows, callback_list))
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
    history.autosplit = _report(plan, adapter, args, recovery, sizes,
                                plan.step.tracing_count() - traces_before)
    return history


def _epoch_logs(step: TrainStep, last: dict[str, Any]) -> dict[str, Any]:
    """The logs of an epoch, as ``model.fit`` picks them (:func:`metrics_or_last`)."""
    if step.update.plan.custom is None:
        return flat_logs(step.model.get_metrics_result())
    return metrics_or_last(step.model, last)


def _recovery(plan: _Plan, adapter: InputAdapter, args: _Args,
              callback_list: keras.callbacks.CallbackList) -> Recovery:
    """The out-of-memory recovery of this call, which tells the callbacks of each shrink."""
    def on_shrink(*_: int) -> None:
        if plan.probe is not None:  # an OOM proved the cached answer wrong
            from autosplit.trials import invalidate_cache

            invalidate_cache(plan.probe)
        _publish(callback_list, recovery, args, plan)

    recovery = Recovery(
        plan.step, on_oom=args.on_oom, multi_worker=plan.layout.multi_worker,
        known_fits=plan.probe.fitting_sizes() if plan.probe is not None else (),
        fused=adapter.rows is not None and args.steps_per_epoch is None,
        on_shrink=on_shrink)
    _publish(callback_list, recovery, args, plan)
    return recovery


class _Batches:
    """The large batches of each epoch: the iterator, the step count and the last logs,
    kept across epochs."""

    def __init__(self, model: keras.Model, adapter: InputAdapter, plan: _Plan, args: _Args,
                 callback_list: keras.callbacks.CallbackList, recovery: Recovery) -> None:
        self.model, self.adapter, self.plan, self.args = model, adapter, plan, args
        self.callback_list, self.recovery = callback_list, recovery
        self.steps = args.steps_per_epoch or plan.pipeline.steps()  # None: not known yet
        # model.fit keeps one iterator across epochs when steps_per_epoch is given.
        self.keep_iterator = args.steps_per_epoch is not None or not adapter.reiterable
        # Where every epoch's elements are known in advance, one iterator of the pipeline
        # repeated after the cut reads every epoch (each one restarts the cut, shuffled
        # by its own epoch's seed): making an iterator instantiates the pipeline's
        # functions, 13 to 20 ms an epoch (benchmarks.step_costs). Not for several
        # workers or a PyDataset's epoch hooks.
        one_iterator = (args.steps_per_epoch is None and adapter.reiterable
                        and not adapter.epoch_hooks and not plan.layout.multi_worker)
        self.repeat = one_iterator and adapter.rows is not None
        # An input that does not know its length (a batched dataset, a dataset of unknown
        # cardinality) gets the same one iterator, with each epoch's end marked by an
        # element of no real row: the step's loop stops there. A new iterator every
        # epoch cost 12 ms, and its first large batch 5-10 ms more (MLP 128, B = 4096,
        # batches of 32): 4% of an epoch of 4 large batches.
        self.marked = (one_iterator and adapter.rows is None
                       and plan.pipeline.can_mark())
        plan.step.end_marker = self.marked
        self.iterator: Any = None
        self.seen = 0  # large batches read from the iterator in use
        # With steps_per_epoch, a reiterable input is read again once its large batches
        # run out, the epoch that reached the end ending early, as model.fit does (Keras
        # 3's EpochIterator counts an input's batches, or learns the count where the
        # data first ends). A generator, read once, stops training there.
        self.rereads = args.steps_per_epoch is not None and adapter.reiterable
        self.known = plan.pipeline.steps()  # large batches in a pass (None: not yet known)
        self.global_step = 0
        self.logs: dict[str, Any] = {}

    def epoch(self, epoch: int) -> int:
        """Train one epoch's large batches; returns how many ran."""
        plan, recovery, callback_list = self.plan, self.recovery, self.callback_list
        self._start(epoch)
        ran = 0
        ended = False  # the input's end (or, marked, the epoch's) was reached
        for index in _steps(self.steps):
            if self.rereads and self.known is not None and self.seen >= self.known:
                break  # every large batch of the data read: this epoch ends early
            if self.rereads:
                count = plan.pipeline.elements(self.seen)
            elif self.args.steps_per_epoch is None:
                count = plan.pipeline.elements(index)
            else:
                count = plan.pipeline.per_batch
            callback_list.on_train_batch_begin(index)
            result = recovery.run(self.iterator, count, self.global_step)
            if result is None and self.rereads and self.seen:
                self.known = self.seen  # the data ended: now its length is known
                if ran == 0:  # with the last epoch: this one reads it again
                    self.release()
                    self._start(epoch)
                    result = recovery.run(self.iterator, count, self.global_step)
            if result is None:
                ended = True
                break
            self.logs = flat_logs(result)
            callback_list.on_train_batch_end(index, self.logs)
            self.global_step += 1
            self.seen += 1
            ran += 1
            if self.model.stop_training:
                break
            if self.marked and plan.step.input_ended():
                ended = True  # this large batch ran up to the epoch's end marker
                break
        if self.marked and not ended and not self.model.stop_training:
            # As many large batches as the first epoch counted: the epoch ends here, as
            # in model.fit, and its marker (after any rows past them) is read.
            skip_to_end_marker(self.iterator)
        self._check_ran(ran)
        if self.rereads and self.known is not None and self.seen >= self.known:
            self.release()  # the next epoch reads the data again, from a new iterator
        if ran and self.steps is None:
            self.steps = ran  # learnt from the first epoch, as model.fit does
            _publish(callback_list, recovery, self.args, plan, steps=ran)
        return ran

    def _start(self, epoch: int) -> None:
        """A new iterator for the epoch, unless model.fit would keep the last one or the
        repeated pipeline goes on."""
        if self.iterator is not None and self.keep_iterator:
            return
        if self.recovery.pieces > 1 and self.adapter.reiterable:
            _rebuild(self.plan, self.recovery)
        elif self.iterator is not None and (self.repeat or self.marked):
            return  # the last epoch pulled all of its elements: this one starts here
        self.release()
        self.seen = 0
        self.iterator = iter(self.plan.pipeline.dataset(
            repeat=self.repeat or self.marked, shuffle_seed=self.plan.shuffle_seed,
            epoch=epoch, marked=self.marked))

    def release(self) -> None:
        """Let go of the iterator (deleted on a thread of its own: ``pipeline.release``)."""
        held = [self.iterator]
        self.iterator = None  # the list holds the only reference
        release(held)

    def _check_ran(self, ran: int) -> None:
        """Warn and stop, as model.fit does, when the input ran out of data."""
        wanted = self.args.steps_per_epoch
        if (self.rereads and wanted is not None and 0 < ran < wanted
                and not self.model.stop_training):
            warn_user(
                f"Your input ran out of data after {ran} of the {wanted} large batches of "
                "this epoch: the epoch ends here and the next one reads the data again, as "
                "model.fit does. Make sure that your input can generate at least "
                "`steps_per_epoch * epochs` large batches; you may need `.repeat()`.")
            return
        if ran == 0 or (wanted is not None and ran < wanted and not self.model.stop_training):
            # Steps per epoch as given, or as the first epoch counted them.
            per_epoch = wanted or self.steps
            here = f" ({per_epoch * self.args.epochs} here)" if per_epoch else ""
            warn_user(
                "Your input ran out of data; interrupting training. Make sure that your "
                "dataset or generator can generate at least `steps_per_epoch * epochs` "
                f"large batches{here}; you may need `.repeat()`.")
            self.model.stop_training = True


def _report(plan: _Plan, adapter: InputAdapter, args: _Args, recovery: Recovery,
            sizes: list[int], traces: int) -> FitReport:
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
    )


def _rebuild(plan: _Plan, recovery: Recovery) -> MicroBatches:
    """After a recovery, a new epoch's pipeline cuts at the size that worked."""
    rows = recovery.rows
    split = split_batch(plan.split.batch_size, rows)
    pipeline = MicroBatches(plan.pipeline.adapter, plan.pipeline.batch_size,
                            split.micro_batch_size, plan.layout)
    recovery.rebind(pipeline.element_spec(), full=pipeline.always_full())
    plan.pipeline, plan.split = pipeline, split
    return pipeline


def _publish(callback_list: keras.callbacks.CallbackList, recovery: Recovery, args: _Args,
             plan: _Plan, steps: int | None = None) -> None:
    """Tell the callbacks how batches are split right now."""
    rows = recovery.rows
    k = split_batch(plan.split.batch_size, rows).accumulation_steps
    params = dict(callback_list.params or {})
    params.update(micro_batch_size=rows, accumulation_steps=k, batch_size=args.batch_size)
    if steps is not None:
        params["steps"] = steps
        for callback in callback_list.callbacks:
            if isinstance(callback, keras.callbacks.ProgbarLogger):
                callback.target = steps
    callback_list.set_params(params)


def _steps(count: int | None) -> Iterator[int]:
    index = 0
    while count is None or index < count:
        yield index
        index += 1
