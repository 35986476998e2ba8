"""The large batches of each epoch (:class:`Epochs`): the iterator kept or made anew as
``model.fit`` keeps it, the step count learnt from the first epoch, the end of the data,
and the callbacks told how batches are split (:func:`publish`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import keras

from autosplit.data.adapter import InputAdapter
from autosplit.data.pipeline import MicroBatches, release, skip_to_end_marker
from autosplit.data.split import split_batch
from autosplit.keras_hooks.custom_step import flat_logs
from autosplit.training.recovery import Recovery
from autosplit.warn import warn_user

if TYPE_CHECKING:
    from autosplit.training.arguments import Args
    from autosplit.training.plan import Plan

__all__ = ["Epochs", "publish", "rebuild"]


class Epochs:
    """The large batches of each epoch: the iterator, the step count and the last logs,
    kept across epochs."""

    def __init__(self, model: keras.Model, adapter: InputAdapter, plan: Plan, args: Args,
                 callback_list: keras.callbacks.CallbackList, recovery: Recovery) -> None:
        self.model, self.adapter, self.plan, self.args = model, adapter, plan, args
        self.callback_list, self.recovery = callback_list, recovery
        self.steps = args.steps_per_epoch or plan.pipeline.steps()  # None: not known yet
        # model.fit keeps one iterator across epochs when steps_per_epoch is given.
        self.keep_iterator = args.steps_per_epoch is not None or not adapter.reiterable
        # Where every epoch's elements are known in advance, one iterator of the pipeline
        # repeated after the cut reads every epoch (each one restarts the cut, shuffled
        # by its own epoch's seed): making an iterator instantiates the pipeline's
        # functions every time (benchmarks.step_costs). Not for several workers or a
        # PyDataset's epoch hooks.
        one_iterator = (args.steps_per_epoch is None and adapter.reiterable
                        and not adapter.epoch_hooks and not plan.layout.multi_worker)
        self.repeat = one_iterator and adapter.rows is not None
        # An input that does not know its length (a batched dataset, a dataset of unknown
        # cardinality) gets the same one iterator, with each epoch's end marked by an
        # element of no real row: the step's loop stops there, and no epoch pays for a
        # new iterator and its slower first large batch.
        self.marked = (one_iterator and adapter.rows is None
                       and plan.pipeline.can_mark())
        # With tokens, the pipeline marks each large batch's end, and its loop stops there.
        self.tokens = bool(plan.pipeline.tokens)
        plan.step.end_marker = self.marked or self.tokens
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
            if self.marked and not self.tokens and plan.step.input_ended():
                ended = True  # this large batch ran up to the epoch's end marker
                break
        if self.marked and not ended and not self.model.stop_training:
            # As many large batches as the first epoch counted: the epoch ends here, as
            # in model.fit, and its marker (after any rows past them) is read.
            skip_to_end_marker(self.iterator, batches_marked=self.tokens)
        self._check_ran(ran)
        if self.rereads and self.known is not None and self.seen >= self.known:
            self.release()  # the next epoch reads the data again, from a new iterator
        if ran and self.steps is None:
            self.steps = ran  # learnt from the first epoch, as model.fit does
            publish(callback_list, recovery, self.args, plan, steps=ran)
        return ran

    def _start(self, epoch: int) -> None:
        """A new iterator for the epoch, unless model.fit would keep the last one or the
        repeated pipeline goes on."""
        if self.iterator is not None and self.keep_iterator:
            return
        if self.recovery.pieces > 1 and self.adapter.reiterable:
            rebuild(self.plan, self.recovery)
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


def rebuild(plan: Plan, recovery: Recovery) -> MicroBatches:
    """After a recovery, a new epoch's pipeline cuts at the size that worked."""
    cut = plan.pipeline.by_length
    rows = recovery.rows
    if cut is not None and cut.tokens:  # a budget as much smaller, the rows as capped
        cut = cut._replace(tokens=max(1, cut.tokens // recovery.pieces))
        rows = plan.pipeline.rows
    split = split_batch(plan.split.batch_size, rows)
    pipeline = MicroBatches(plan.pipeline.adapter, plan.pipeline.batch_size,
                            split.micro_batch_size, plan.layout, by_length=cut)
    recovery.rebind(pipeline.element_spec(), full=pipeline.always_full(), rows=pipeline.rows)
    plan.pipeline, plan.split = pipeline, split
    return pipeline


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
