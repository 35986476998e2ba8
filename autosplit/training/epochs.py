"""The large batches of each epoch (:class:`Epochs`): the iterator kept or made anew as
``model.fit`` keeps it, the step count learnt from the first epoch, the end of the data,
and the callbacks told how batches are split (:func:`publish`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import keras

from autosplit.data.adapter import InputAdapter
from autosplit.data.markers import Ends, skip_to_end_marker
from autosplit.data.pipeline import MicroBatches, release
from autosplit.data.split import split_batch
from autosplit.keras_hooks.custom_step import flat_logs
from autosplit.training.recovery import Recovery
from autosplit.warn import warn_user

if TYPE_CHECKING:
    from autosplit.training.arguments import Args
    from autosplit.training.noise_report import NoiseLogs
    from autosplit.training.plan import Plan

__all__ = ["Epochs", "Iteration", "iteration_of", "publish", "rebuild"]


@dataclasses.dataclass(frozen=True)
class Iteration:
    """How a call reads its epochs from the pipeline: chosen once (:func:`iteration_of`)."""

    keep_iterator: bool  # one iterator across epochs, as model.fit keeps it
    repeat: bool  # one iterator of the pipeline repeated, every epoch's elements known
    rereads: bool  # with steps_per_epoch, the data read again once it runs out
    ends: Ends  # where each large batch's elements end, and each epoch's

    @property
    def one_iterator(self) -> bool:
        """One iterator of the pipeline read over every epoch (repeated, or ended by
        markers)."""
        return self.repeat or self.ends.epoch == "marker"


def iteration_of(adapter: InputAdapter, plan: Plan, args: Args) -> Iteration:
    """The :class:`Iteration` of a call.

    ``model.fit`` keeps one iterator across epochs when ``steps_per_epoch`` is given or
    the input is read once. Where every epoch's elements are known in advance, one
    iterator of the pipeline repeated after the cut reads every epoch (each one restarts
    the cut, shuffled by its own epoch's seed): making an iterator instantiates the
    pipeline's functions every time (benchmarks.step_costs). Not for several workers or
    a PyDataset's epoch hooks. An input that does not know its length gets the same one
    iterator, with each epoch's end marked by an element of no real row: the step's loop
    stops there. With steps_per_epoch, a reiterable input is read again once its large
    batches run out, the epoch that reached the end ending early, as model.fit does.
    """
    one_iterator = (args.steps_per_epoch is None and adapter.reiterable
                    and not adapter.epoch_hooks and not plan.layout.multi_worker)
    steps_given = args.steps_per_epoch is not None
    return Iteration(
        keep_iterator=steps_given or not adapter.reiterable,
        repeat=one_iterator and adapter.rows is not None,
        rereads=steps_given and adapter.reiterable,
        ends=plan.pipeline.ends(one_iterator=one_iterator, steps_given=steps_given))


class Epochs:
    """The large batches of each epoch: the iterator, the step count and the last logs,
    kept across epochs, read as ``mode`` says."""

    def __init__(self, model: keras.Model, adapter: InputAdapter, plan: Plan, args: Args,
                 callback_list: keras.callbacks.CallbackList, recovery: Recovery,
                 mode: Iteration, noise: NoiseLogs | None = None) -> None:
        self.model, self.adapter, self.plan, self.args = model, adapter, plan, args
        self.callback_list, self.recovery, self.mode = callback_list, recovery, mode
        self.noise = noise  # the gradient noise scale, into each large batch's logs
        self.steps = args.steps_per_epoch or plan.pipeline.steps()  # None: not known yet
        self.iterator: Any = None
        self.seen = 0  # large batches read from the iterator in use
        self.known = plan.pipeline.steps()  # large batches in a pass (None: not yet known)
        self.global_step = 0
        self.logs: dict[str, Any] = {}

    def epoch(self, epoch: int) -> int:
        """Train one epoch's large batches; returns how many ran."""
        recovery, callback_list, mode = self.recovery, self.callback_list, self.mode
        self._start(epoch)
        plan = self.plan  # as this epoch's start left it (a recovery's rebuilt one)
        ran = 0
        ended = False  # the input's end (or, marked, the epoch's) was reached
        for index in _steps(self.steps):
            if mode.rereads and self.known is not None and self.seen >= self.known:
                break  # every large batch of the data read: this epoch ends early
            if mode.rereads:
                count = plan.pipeline.elements(self.seen)
            elif self.args.steps_per_epoch is None:
                count = plan.pipeline.elements(index)
            else:
                count = plan.pipeline.per_batch
            callback_list.on_train_batch_begin(index)
            result = recovery.run(self.iterator, count, self.global_step)
            if result is None and mode.rereads and self.seen:
                self.known = self.seen  # the data ended: now its length is known
                if ran == 0:  # with the last epoch: this one reads it again
                    self.release()
                    self._start(epoch)
                    plan = self.plan
                    result = recovery.run(self.iterator, count, self.global_step)
            if result is None:
                ended = True
                break
            self.logs = flat_logs(result)
            if self.noise is not None:
                self.logs.update(self.noise.logs())
            callback_list.on_train_batch_end(index, self.logs)
            self.global_step += 1
            self.seen += 1
            ran += 1
            if self.model.stop_training:
                break
            if (mode.ends.epoch == "marker" and not mode.ends.marks_batches
                    and plan.step.input_ended()):
                ended = True  # this large batch ran up to the epoch's end marker
                break
        if mode.ends.epoch == "marker" and not ended and not self.model.stop_training:
            # As many large batches as the first epoch counted: the epoch ends here, as
            # in model.fit, and its marker (after any rows past them) is read.
            skip_to_end_marker(self.iterator, mode.ends)
        self._check_ran(ran)
        if mode.rereads and self.known is not None and self.seen >= self.known:
            self.release()  # the next epoch reads the data again, from a new iterator
        if ran and self.steps is None:
            self.steps = ran  # learnt from the first epoch, as model.fit does
            publish(callback_list, recovery, self.args, plan, steps=ran)
        return ran

    def _start(self, epoch: int) -> None:
        """A new iterator for the epoch, unless model.fit would keep the last one or the
        repeated pipeline goes on."""
        mode = self.mode
        if self.iterator is not None and mode.keep_iterator:
            return
        if self.recovery.slices > 1 and self.adapter.reiterable:
            self.plan = rebuild(self.plan, self.recovery)
        elif self.iterator is not None and mode.one_iterator:
            return  # the last epoch pulled all of its elements: this one starts here
        self.release()
        self.seen = 0
        self.iterator = iter(self.plan.pipeline.dataset(
            repeat=mode.one_iterator, shuffle_seed=self.plan.shuffle_seed,
            epoch=epoch, ends=mode.ends))

    def release(self) -> None:
        """Let go of the iterator (deleted on a thread of its own: ``pipeline.release``)."""
        held = [self.iterator]
        self.iterator = None  # the list holds the only reference
        release(held)

    def _check_ran(self, ran: int) -> None:
        """Warn and stop, as model.fit does, when the input ran out of data."""
        wanted = self.args.steps_per_epoch
        if (self.mode.rereads and wanted is not None and 0 < ran < wanted
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


def rebuild(plan: Plan, recovery: Recovery) -> Plan:
    """After a recovery, ``plan`` with a new epoch's pipeline, cut at the size that
    worked (the recovery's step rebound to it)."""
    cut = plan.pipeline.cut
    rows = recovery.rows
    if cut.tokens:  # a budget as much smaller, the rows as capped
        cut = cut.shrunk(recovery.slices)
        rows = plan.pipeline.rows
    split = split_batch(plan.split.batch_size, rows)
    pipeline = MicroBatches(plan.pipeline.adapter, plan.pipeline.batch_size,
                            split.micro_batch_size, plan.layout, cut=cut,
                            shapes=plan.pipeline.shapes)
    recovery.rebind(pipeline.element_spec(), all_real=pipeline.all_real(), rows=pipeline.rows)
    return dataclasses.replace(plan, pipeline=pipeline, split=split)


def publish(callback_list: keras.callbacks.CallbackList, recovery: Recovery, args: Args,
             plan: Plan, steps: int | None = None) -> None:
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
