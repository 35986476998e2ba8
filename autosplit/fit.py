"""``fit_large_batch``: ``model.fit`` with an exact large batch, in micro-batches.

The loop is Keras's own shape: a ``CallbackList`` with History and the progress bar,
``on_train_batch_begin``, one call of the compiled step, ``on_train_batch_end``, and
``model.stop_training``. Callbacks see one step per large batch. What is autosplit's:
the data arrive as single examples and are batched here (``autosplit.data``), the
step splits each large batch (``autosplit.step``), and a ``ResourceExhaustedError``
inside a step restores what the attempt touched, shrinks the micro-batch and redoes
the same large batch, so nothing is lost or counted twice.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal

import keras
import tensorflow as tf

from autosplit import _keras
from autosplit.data import LargeBatches, batched_ancestor
from autosplit.errors import (
    BatchSizeError,
    NothingFitsError,
    UnsupportedModelError,
    WorkerLostError,
    describe,
)
from autosplit.step import TrainStep, check_model, check_size, split_batch

__all__ = ["fit_large_batch"]

# Testing hook: called as hook(step_number, micro_batch_size) before each attempt of a
# step; it may raise tf.errors.ResourceExhaustedError to exercise OOM recovery
# deterministically (see autosplit.testing.inject_oom). None in normal use.
_FAULT_HOOK: Callable[[int, int], None] | None = None


def _check_verbose(verbose: Any) -> int:
    if verbose == "auto":
        return 1
    if verbose in (0, 1, 2) and not isinstance(verbose, bool):
        return int(verbose)
    raise ValueError(
        f"Expected `verbose` to be 'auto', 0, 1 or 2. Received: verbose={describe(verbose)}."
    )


def _check_on_oom(on_oom: Any) -> str:
    if on_oom not in ("recover", "raise"):
        raise ValueError(
            f"Expected `on_oom` to be 'recover' or 'raise'. Received: on_oom={describe(on_oom)}."
        )
    return on_oom


def shrink_micro_batch(failed: int, fits: Sequence[int] = ()) -> int:
    """The next micro-batch to try after ``failed`` ran out of memory.

    The largest size below ``failed`` already known to fit, if any; else half of it,
    rounded down to a multiple of 8 once it is at least 8.
    """
    below = [m for m in fits if m < failed]
    if below:
        return max(below)
    half = failed // 2
    if half >= 8:
        half -= half % 8
    return max(half, 1) if failed > 1 else 0


def agree_on_micro_batch(strategy: tf.distribute.Strategy, micro_batch_size: int) -> int:
    """The smallest micro-batch any replica (on any worker) found: all use the same.

    Each worker probes its own device; a worker whose device is fuller (or smaller)
    decides for all, so no replica runs a size another one could not.
    """
    if strategy.num_replicas_in_sync == 1:
        return micro_batch_size

    def gather():
        context = tf.distribute.get_replica_context()
        return context.all_gather(tf.constant([micro_batch_size], tf.int32), axis=0)

    gathered = strategy.experimental_local_results(strategy.run(tf.function(gather)))
    return int(tf.reduce_min(gathered[0]))


def _validation_data(validation_data: Any, batch_size: int) -> tuple[Any, dict]:
    """``(x, kwargs)`` for ``model.evaluate`` at a batch size that fits."""
    if isinstance(validation_data, tf.data.Dataset):
        if batched_ancestor(validation_data) is not None:
            return validation_data, {}
        return validation_data.batch(batch_size), {}
    if isinstance(validation_data, (tuple, list)) and len(validation_data) in (2, 3):
        x, y, *rest = validation_data
        kwargs = {"y": y, "batch_size": batch_size}
        if rest and rest[0] is not None:
            kwargs["sample_weight"] = rest[0]
        return x, kwargs
    raise ValueError(
        "Expected `validation_data` to be a tf.data.Dataset or a tuple (x, y) or "
        f"(x, y, sample_weight). Received: validation_data={describe(validation_data)}."
    )


def fit_large_batch(
    model: keras.Model,
    dataset: Any,
    batch_size: int,
    *,
    micro_batch_size: int | Literal["auto"] = "auto",
    epochs: int = 1,
    steps_per_epoch: int | None = None,
    validation_data: Any = None,
    validation_freq: int = 1,
    callbacks: Sequence[keras.callbacks.Callback] | None = None,
    verbose: Literal["auto", 0, 1, 2] = "auto",
    shuffle: bool = True,
    initial_epoch: int = 0,
    jit_compile: bool | None = None,
    on_oom: Literal["recover", "raise"] = "recover",
    memory_limit: int | str | None = None,
    headroom: float = 0.1,
    cache: bool = True,
    streaming: bool | Literal["auto"] = "auto",
) -> keras.callbacks.History:
    """Train ``model`` like ``model.fit``, with an effective batch of exactly ``batch_size``.

    Each large batch is split into micro-batches that fit in memory; their float32
    gradients are accumulated inside one compiled step and the optimizer is applied
    once, so the weights, ``optimizer.iterations``, schedules, weight decay, EMA and
    clipping are those of one full-batch step (see the README for the exact rules).

    Args:
        model: a compiled Keras 3 model (TensorFlow backend).
        dataset: a ``tf.data.Dataset`` of single examples ``(x, y[, sample_weight])``
            (nested structures allowed), or a tuple of arrays ``(x, y[, sample_weight])``.
        batch_size: the effective batch B.
        micro_batch_size: rows per micro-batch, or ``"auto"`` to find the largest that
            fits by real trial steps (``autosplit.probe``). ``>= batch_size``: no split.
        epochs, steps_per_epoch, validation_data, validation_freq, callbacks, verbose,
        shuffle, initial_epoch: as in ``model.fit``. Validation runs at the micro-batch.
        jit_compile: XLA for the step; default what ``model.compile`` resolved.
        on_oom: ``"recover"`` (default) shrinks the micro-batch after an out-of-memory
            error and redoes the same large batch; ``"raise"`` re-raises it.
        memory_limit, headroom, cache: passed to the probe when ``micro_batch_size="auto"``.
        streaming: gather each micro-batch from the arrays inside the compiled loop
            instead of materialising the whole large batch (arrays only). ``"auto"``
            streams whenever the data are arrays and no multi-replica strategy is in
            use: it keeps the peak flat in B and costs no memory.

    Returns:
        The ``keras.callbacks.History``; ``history.autosplit`` holds the batch size,
        micro-batch size, accumulation steps and any OOM recoveries.

    Example:
        >>> history = autosplit.fit_large_batch(model, (x, y), batch_size=4096, epochs=3)
        >>> history.autosplit["micro_batch_size"]
        512
    """
    batch_size = check_size("batch_size", batch_size)
    auto = micro_batch_size == "auto"
    if not auto:
        micro_batch_size = check_size("micro_batch_size", micro_batch_size)
    epochs = check_size("epochs", epochs)
    if steps_per_epoch is not None:
        steps_per_epoch = check_size("steps_per_epoch", steps_per_epoch)
    validation_freq = check_size("validation_freq", validation_freq)
    verbose = _check_verbose(verbose)
    on_oom = _check_on_oom(on_oom)
    if isinstance(initial_epoch, bool) or not isinstance(initial_epoch, int) or not (
            0 <= initial_epoch < epochs):
        raise BatchSizeError(
            f"Expected `initial_epoch` to be an int in [0, epochs={epochs}). "
            f"Received: initial_epoch={describe(initial_epoch)}."
        )
    check_model(model)
    batches = LargeBatches(dataset, batch_size, shuffle=shuffle)
    if batches.infinite and steps_per_epoch is None:
        raise ValueError(
            "Expected `steps_per_epoch` with an infinite (repeated) dataset. Received: "
            "steps_per_epoch=None. Pass steps_per_epoch= or drop the `.repeat()`."
        )
    if validation_data is not None:
        _validation_data(validation_data, 1)
    if streaming not in (True, False, "auto"):
        raise ValueError(
            f"Expected `streaming` to be True, False or 'auto'. Received: "
            f"streaming={describe(streaming)}.")
    if streaming is True:
        batches.source  # noqa: B018 -- raises DatasetError unless the data are arrays

    strategy = model.distribute_strategy
    if auto and isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) and (
            strategy.num_replicas_in_sync > 1):
        # Each worker's trials would issue collectives in its own order: a deadlock.
        raise UnsupportedModelError(
            "Expected an explicit `micro_batch_size` under MultiWorkerMirroredStrategy. "
            "Received: micro_batch_size='auto'. Find it once on one worker's hardware "
            "(`autosplit probe ...` or autosplit.probe without the strategy) and pass it "
            "to every worker.")
    probe_result = None
    if auto:
        from autosplit.probe import probe

        probe_result = probe(model, dataset, batch_size, memory_limit=memory_limit,
                             headroom=headroom, cache=cache, streaming=streaming,
                             _batches=batches)
        micro_batch_size = agree_on_micro_batch(model.distribute_strategy,
                                                probe_result.micro_batch_size)
        streaming = probe_result.streaming
    elif streaming == "auto":
        from autosplit.probe import stream_by_default

        streaming = stream_by_default(batches, model)
    split = split_batch(batch_size, micro_batch_size)
    with model.distribute_strategy.scope():
        _keras.build_model(model, batches.sample(split.micro_batch_size))
    check_model(model)
    source = batches.source if streaming else None
    step = TrainStep(model, split, jit_compile=jit_compile, source=source)
    known_fits = list(probe_result.fitting_sizes()) if probe_result is not None else []

    steps = steps_per_epoch or batches.steps_per_epoch
    callback_list = keras.callbacks.CallbackList(
        callbacks, add_history=True, add_progbar=verbose != 0, verbose=verbose,
        epochs=epochs, steps=steps, model=model,
    )
    info: dict[str, Any] = {
        "batch_size": batch_size,
        "micro_batch_size": split.micro_batch_size,
        "accumulation_steps": split.accumulation_steps,
        "micro_batch_sizes": [],
        "oom_recoveries": [],
        "probe": probe_result.to_dict() if probe_result is not None else None,
        "streaming": bool(streaming),
    }

    def publish() -> None:
        params = dict(callback_list.params or {})
        params.update(micro_batch_size=step.split.micro_batch_size,
                      accumulation_steps=step.split.accumulation_steps,
                      batch_size=batch_size)
        callback_list.set_params(params)
        info["micro_batch_size"] = step.split.micro_batch_size
        info["accumulation_steps"] = step.split.accumulation_steps

    publish()
    model.stop_training = False
    callback_list.on_train_begin()
    global_step = 0
    iterator = None
    logs: dict = {}
    for epoch in range(initial_epoch, epochs):
        model.reset_metrics()
        callback_list.on_epoch_begin(epoch)
        if iterator is None:
            # Known epoch length: one endless, reshuffling iterator for the whole run.
            # An explicit steps_per_epoch keeps one iterator too, as model.fit does.
            endless = steps_per_epoch is None and steps is not None
            iterator = batches.iterate(repeat=endless, streaming=bool(streaming))
        elif steps is None:
            iterator = batches.iterate(streaming=bool(streaming))
        for index in range(steps) if steps is not None else _count():
            try:
                x, y, w, n_valid = next(iterator)
            except StopIteration:
                if steps_per_epoch is not None:
                    warnings.warn(
                        "Your input ran out of data; interrupting training. Make sure the "
                        f"dataset can give steps_per_epoch * epochs = {steps_per_epoch * epochs}"
                        " large batches (you may need `.repeat()`).",
                        stacklevel=2,
                    )
                    model.stop_training = True
                break
            callback_list.on_train_batch_begin(index)
            while True:
                try:
                    if _FAULT_HOOK is not None:
                        _FAULT_HOOK(global_step, step.split.micro_batch_size)
                    logs = step(x, y, w, n_valid)
                    break
                except (tf.errors.UnavailableError, tf.errors.DeadlineExceededError) as error:
                    if step.replicas == 1:
                        raise
                    raise WorkerLostError(
                        f"A worker of the {type(step.strategy).__name__} run stopped "
                        f"answering during step {global_step} ({type(error).__name__}); this "
                        "worker stops too instead of waiting forever. Restart the job; "
                        "keras.callbacks.BackupAndRestore resumes it from the last epoch. "
                        "Collective timeouts are set with tf.distribute.experimental."
                        "CommunicationOptions(timeout_seconds=...)."
                    ) from error
                except tf.errors.ResourceExhaustedError as error:
                    step.restore()  # undoes only what this attempt changed
                    failed = step.split.micro_batch_size
                    if on_oom == "raise":
                        raise
                    smaller = shrink_micro_batch(failed, known_fits)
                    if smaller < 1:
                        raise NothingFitsError(
                            "Out of memory during training with a micro-batch of 1 example: "
                            "nothing smaller can be tried. Free memory or use a smaller model."
                        ) from error
                    warnings.warn(
                        f"Out of memory in step {global_step} with micro_batch_size={failed}; "
                        f"redoing the same batch with micro_batch_size={smaller}.",
                        stacklevel=2,
                    )
                    if probe_result is not None:
                        from autosplit.probe import invalidate_cache

                        invalidate_cache(probe_result)
                    # A size the probe saw fit has just failed: memory is tighter than
                    # at probe time, so its other measurements are not trusted either.
                    known_fits = []
                    info["oom_recoveries"].append(
                        {"step": global_step, "failed": failed, "retry": smaller})
                    step = TrainStep(model, split_batch(batch_size, smaller),
                                     jit_compile=jit_compile, source=source)
                    publish()
            logs = {name: float(value) for name, value in logs.items()}
            callback_list.on_train_batch_end(index, logs)
            global_step += 1
            if model.stop_training:
                break
        epoch_logs = {name: float(value) for name, value in model.get_metrics_result().items()}
        if validation_data is not None and (epoch + 1) % validation_freq == 0:
            val_x, val_kwargs = _validation_data(validation_data, step.split.micro_batch_size)
            val_logs = model.evaluate(val_x, verbose=0, return_dict=True, **val_kwargs)
            epoch_logs.update({f"val_{name}": float(v) for name, v in val_logs.items()})
        info["micro_batch_sizes"].append(step.split.micro_batch_size)
        callback_list.on_epoch_end(epoch, epoch_logs)
        if model.stop_training:
            break
    callback_list.on_train_end(logs=epoch_logs if epochs > initial_epoch else logs)
    info["traces"] = step.tracing_count()
    history = model.history
    history.autosplit = info
    return history


def _count():
    index = 0
    while True:
        yield index
        index += 1

