"""Out-of-memory recovery and the multi-worker lockstep as pure control flow, driven by a
fake step (as ``test_search.py`` drives the search with fake trials): exact row ids,
micro-batch sizes and agreements, in milliseconds, with no model.

``FakeStep`` keeps ``TrainStep``'s contract (``autosplit.step.loop``): elements are pulled
one by one and stashed; each is cut into ``slices`` micro-batches of
``ceil(rows / slices)`` rows; a micro-batch is committed only if it did not run out of
memory, and then the stash records the rows of the element done so far; ``resume``
redoes the stashed element from its first row not done, starting with the piece that
holds it. It refuses to apply while an element is half done, so a recovery that loses
rows fails here as it would lose them in ``TrainStep``.
"""

from __future__ import annotations

import threading
import warnings
from concurrent.futures import ThreadPoolExecutor

import pytest
import tensorflow as tf

from autosplit.data.markers import Ends
from autosplit.errors import NothingFitsError, WorkerLostError
from autosplit.testing import FaultyStep, inject_oom
from autosplit.training import fit as _fit
from autosplit.training.recovery import OomRecovery, RecoverableStep, Recovery


@pytest.fixture(autouse=True)
def _seed():
    """No model here: nothing for conftest's clear_session to free (~0.4 s a test)."""
    yield


class FakeStrategy:
    """Stands for the model's tf.distribute strategy (only its name is read)."""


class FakeStep:
    """``TrainStep`` in Python, over elements that are lists of row ids (None: padding).

    Args:
        rows: rows per element.
        fail_at: micro-batch attempts (0-based, counting every attempt) that run out of
            memory.
        fits: the most rows a micro-batch can have; more run out of memory.
        collective: the agreement shared by the workers of a lockstep run.
        worker: this worker's index in ``collective``.
    """

    def __init__(self, rows, *, fail_at=(), fits=None, collective=None, worker=0):
        self.rows = rows
        self.replicas = 1 if collective is None else collective.workers
        self.strategy = FakeStrategy()
        self.fail_at, self.fits = set(fail_at), fits
        self.collective, self.worker = collective, worker
        self.attempts: list[int] = []  # rows of every micro-batch tried, in order
        self.committed: list[list[int]] = []  # real row ids of each micro-batch committed
        self.applied: list[list[int]] = []  # the row ids of each apply, sorted
        self.calls: list[tuple] = []  # (count, resume, slices) of each run_local
        self.errors: list[Exception] = []  # every out-of-memory error raised
        # The stash.
        self.element, self.done_rows, self.pending = None, 0, False
        self.pulled, self.exhausted = 0, False
        self.since_apply = 0  # micro-batches committed since the last apply

    # ------------------------------------------------------------ the contract

    def rebind(self, element_spec, *, all_real=False, rows=None):
        self.rows = element_spec  # here the "spec" is the new rows per element

    def run(self, iterator, count):
        self.run_local(iterator, count)
        return self.finish()

    def run_if_any(self, iterator, count, *, ends=None):
        self.run_local(iterator, count)
        return self.finish() if self.local_rows() else None

    def run_local(self, iterator, count, *, resume=False, slices=1, ends=None):
        self.calls.append((count, resume, slices))
        self.pulled, self.exhausted = 0, False
        if resume and self.pending:
            self._process(self.element, slices, first_row=self.done_rows)
        for _ in range(count):
            element = next(iterator, None)
            if element is None:
                self.exhausted = True
                break
            self.pulled += 1
            self.element, self.done_rows, self.pending = element, 0, True
            self._process(element, slices)
        return self.pulled

    def finish(self):
        assert not self.pending, "applied with an element half done: its other rows are lost"
        rows = sorted(r for part in self.committed[len(self.committed) - self.since_apply:]
                      for r in part)
        self.applied.append(rows)
        self.since_apply = 0
        return {"rows": len(rows)}

    def agree(self, ok, rows):
        return self.collective.agree(self.worker, ok, rows)

    def local_rows(self):
        return float(sum(len(part) for part in self.committed[
            len(self.committed) - self.since_apply:]))

    def progress(self):
        return self.pulled, self.pending, self.exhausted

    def discard(self):
        del self.committed[len(self.committed) - self.since_apply:]
        self.since_apply = 0
        self.pending = False

    # ------------------------------------------------------------ one element

    def _process(self, element, slices, first_row=None):
        size = -(-self.rows // slices)
        start = 0 if first_row is None else first_row // size
        for p in range(start, slices):
            self._attempt(size)
            end = min((p + 1) * size, self.rows)
            self.committed.append([r for i, r in enumerate(element[p * size:end], p * size)
                                   if r is not None and i >= (first_row or 0)])
            self.since_apply += 1
            self.done_rows, self.pending = end, end < self.rows

    def _attempt(self, size):
        index = len(self.attempts)
        self.attempts.append(size)
        if index in self.fail_at or (self.fits is not None and size > self.fits):
            error = tf.errors.ResourceExhaustedError(None, None, f"fake OOM, attempt {index}")
            self.errors.append(error)
            raise error


class Collective:
    """An all-reduce between fake workers in threads: each call waits for all of them."""

    def __init__(self, workers):
        self.workers = workers
        self.given: dict[int, tuple[bool, float]] = {}
        self.rounds: list[dict[int, tuple[bool, float]]] = []
        self.result = None
        self.barrier = threading.Barrier(workers, action=self._reduce, timeout=5)

    def _reduce(self):
        self.rounds.append(dict(self.given))
        failed = sum(not ok for ok, _ in self.given.values())
        self.result = (failed == 0, sum(rows for _, rows in self.given.values()))

    def agree(self, worker, ok, rows):
        self.given[worker] = (ok, rows)
        self.barrier.wait()  # the next _reduce needs this worker again: result is safe
        return self.result


def elements(first, count, rows, real=None):
    """``count`` elements of ``rows`` row ids from ``first``; rows past ``real`` padded."""
    ids = list(range(first, first + count * rows))
    if real is not None:
        ids = [i if i < first + real else None for i in ids]
    return iter([ids[e * rows:(e + 1) * rows] for e in range(count)])


def bad_record():
    """An input whose first record is bad (a worker's own shard)."""
    raise tf.errors.InvalidArgumentError(None, None, "a bad record")
    yield  # a generator


def lockstep(steps, recoveries, batches):
    """Each worker's ``batches`` (iterator, count) in a thread of its own: its results,
    or the error it stopped with."""
    def worker(index):
        out = []
        try:
            for number, (iterator, count) in enumerate(batches[index]):
                out.append(recoveries[index].run(iterator, count, number))
        except Exception as error:  # the test checks which
            return error
        return out

    with ThreadPoolExecutor(len(steps)) as pool:
        return list(pool.map(worker, range(len(steps))))


# ---------------------------------------------------------------- one process


def test_the_fake_is_a_recoverable_step():
    step: RecoverableStep = FakeStep(4)  # what a type checker checks, said here once
    assert callable(step.run_local) and step.rows == 4


@pytest.mark.filterwarnings("ignore:Out of memory")
def test_rows_remaining_after_a_partial_element_are_committed_once():
    # Step 0: the third element fails whole and is redone in 2 slices. Step 1 runs in
    # slices of 4 and fails in the second slice of its second element: rows 32-35 are
    # in the sums, so the redo (slices of 2) starts at row 36, not 32.
    step = FakeStep(8, fail_at={2, 8})
    recovery = Recovery(step)
    iterator = elements(0, 6, 8, real=46)  # the last element: 6 real rows, 2 padding
    assert recovery.run(iterator, 3, 0) == {"rows": 24}
    assert recovery.run(iterator, 3, 1) == {"rows": 22}
    assert step.applied == [list(range(24)), list(range(24, 46))]
    assert step.attempts == [8, 8, 8, 4, 4, 4, 4, 4, 4, 2, 2, 2, 2, 2, 2]
    assert step.committed[4:] == [[24, 25, 26, 27], [28, 29, 30, 31], [32, 33, 34, 35],
                                  [36, 37], [38, 39], [40, 41], [42, 43], [44, 45], []]
    assert step.calls == [(3, False, 1), (0, True, 2), (3, False, 2), (1, True, 4)]
    assert recovery.records == [OomRecovery(0, 8, 4), OomRecovery(1, 4, 2)]
    assert recovery.rows == 2


def test_an_oom_during_the_redo_resumes_where_the_redo_stopped():
    step = FakeStep(8, fail_at={0, 2})
    recovery = Recovery(step)
    with pytest.warns(UserWarning, match="Out of memory in step 0") as caught:
        assert recovery.run(elements(0, 2, 8), 2, 0) == {"rows": 16}
    assert [str(w.message).split(";")[1] for w in caught] == [
        " finishing the same batch with micro-batches of 4 rows.",
        " finishing the same batch with micro-batches of 2 rows."]
    # The redo's first slice (rows 0-3) is kept; its second fails; slices of 2 go on
    # from row 4, then the element not yet pulled.
    assert step.attempts == [8, 4, 4, 2, 2, 2, 2, 2, 2]
    assert step.committed == [[0, 1, 2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13],
                              [14, 15]]
    assert step.calls == [(2, False, 1), (1, True, 2), (1, True, 4)]
    assert step.applied == [list(range(16))]
    assert recovery.records == [OomRecovery(0, 8, 4), OomRecovery(0, 4, 2)]


@pytest.mark.filterwarnings("ignore:Out of memory")
def test_sizes_the_probe_saw_fit_are_tried_first_then_forgotten():
    # 40 rows fit at probe time: tried first (as 2 slices of 32). Once 32 fails too,
    # the probe's 24 is not trusted: half of 32, 16, is next (24 would give 22).
    step = FakeStep(64, fits=16)
    recovery = Recovery(step, known_fits=[40, 24])
    assert recovery.run(elements(0, 1, 64), 1, 0) == {"rows": 64}
    assert step.attempts == [64, 32, 16, 16, 16, 16]
    assert recovery.records == [OomRecovery(0, 64, 32), OomRecovery(0, 32, 16)]


@pytest.mark.filterwarnings("ignore:Out of memory")
def test_a_size_the_probe_saw_fit_far_below_is_not_taken_half_is():
    # The probe's first trials (8 rows) fit; after 64 fails, 32 rows is the next try,
    # not 8: the rest of the run would pay for eight micro-steps where two do.
    step = FakeStep(64, fits=40)
    recovery = Recovery(step, known_fits=[8])
    assert recovery.run(elements(0, 1, 64), 1, 0) == {"rows": 64}
    assert step.attempts == [64, 32, 32]
    assert recovery.records == [OomRecovery(0, 64, 32)]


@pytest.mark.parametrize("batch", ["counted", "input"])
def test_on_oom_raise_reraises_the_error_and_forgets_the_partial_batch(batch, recwarn):
    step = FakeStep(4, fail_at={1})
    recovery = Recovery(step, on_oom="raise", ends=Ends(batch))
    with pytest.raises(tf.errors.ResourceExhaustedError) as raised:
        recovery.run(elements(0, 3, 4), 3, 0)
    assert raised.value is step.errors[0]
    assert step.attempts == [4, 4]
    assert step.committed == [] and not step.pending and step.applied == []
    assert recovery.records == [] and recovery.slices == 1 and not recwarn.list


@pytest.mark.filterwarnings("ignore:Out of memory")
def test_out_of_memory_at_one_row_is_nothing_fits():
    step = FakeStep(8, fits=0)
    shrinks = []
    recovery = Recovery(step, on_shrink=lambda *args: shrinks.append(args))
    with pytest.raises(NothingFitsError, match="micro-batch of 1 example") as raised:
        recovery.run(elements(0, 2, 8), 2, 5)
    assert isinstance(raised.value.__cause__, tf.errors.ResourceExhaustedError)
    assert step.attempts == [8, 4, 2, 1]
    assert shrinks == [(5, 8, 4), (5, 4, 2), (5, 2, 1)]
    assert step.committed == [] and not step.pending and step.applied == []


def test_an_input_that_ended_before_the_batch_gives_none_and_applies_nothing():
    step = FakeStep(4)
    assert Recovery(step, ends=Ends("input")).run(iter([]), 2, 0) is None
    assert step.calls == [(2, False, 1)] and step.exhausted and step.applied == []


@pytest.mark.filterwarnings("ignore:Out of memory")
def test_a_faulty_step_fails_before_it_pulls_anything():
    # Step 1 fails before the real step runs: the fake still says it pulled 2 (in
    # step 0), so the wrapper must say 0, or step 1 would apply nothing.
    faulty = FaultyStep(FakeStep(8), at_steps={1})
    recovery = Recovery(faulty)
    iterator = elements(0, 4, 8)
    assert recovery.run(iterator, 2, 0) == {"rows": 16}
    assert recovery.run(iterator, 2, 1) == {"rows": 16}
    assert faulty.raised == [(1, 8)]
    assert faulty.step.applied == [list(range(16)), list(range(16, 32))]
    assert faulty.step.calls == [(2, False, 1), (2, True, 2)]
    assert recovery.records == [OomRecovery(1, 8, 4)]


def test_inject_oom_replaces_the_recovery_of_fit_only_inside_the_block():
    with inject_oom(at_steps={0}) as raised:
        faulty = _fit.Recovery(FakeStep(4), on_oom="raise")
        assert isinstance(faulty.step, FaultyStep)
        with pytest.raises(tf.errors.ResourceExhaustedError, match="injected OOM at step 0"):
            faulty.run(elements(0, 1, 4), 1, 0)
        # Once per block: a second fit_large_batch in the block does not fail again.
        again = _fit.Recovery(FakeStep(4), on_oom="raise")
        assert again.run(elements(0, 1, 4), 1, 0) == {"rows": 4}
    assert raised == [(0, 4)]
    assert _fit.Recovery is Recovery


# ---------------------------------------------------------------- lockstep


@pytest.mark.filterwarnings("ignore:Out of memory")
def test_workers_that_disagree_apply_together_each_at_its_own_size():
    # Worker 0 runs out of memory in its second element; worker 1 has finished and
    # only joins the next agreement while worker 0 redoes that element in slices.
    collective = Collective(2)
    steps = [FakeStep(4, fail_at={1}, collective=collective, worker=0),
             FakeStep(4, collective=collective, worker=1)]
    recoveries = [Recovery(step, multi_worker=True) for step in steps]
    data = [elements(0, 4, 4), elements(100, 4, 4)]
    results = lockstep(steps, recoveries, [[(data[w], 2), (data[w], 2)] for w in range(2)])
    assert results == [[{"rows": 8}, {"rows": 8}]] * 2
    assert collective.rounds == [
        {0: (False, 4.0), 1: (True, 8.0)},  # step 0: worker 0 failed in its 2nd element
        {0: (True, 8.0), 1: (True, 8.0)},  # worker 0 redid it; worker 1 pulled nothing
        {0: (True, 8.0), 1: (True, 8.0)}]  # step 1
    assert steps[0].calls == [(2, False, 1), (0, True, 2), (2, False, 2)]
    assert steps[1].calls == [(2, False, 1), (0, False, 1), (2, False, 1)]
    assert steps[0].attempts == [4, 4, 2, 2, 2, 2, 2, 2]
    assert steps[1].attempts == [4, 4, 4, 4]
    assert steps[0].applied == [list(range(8)), list(range(8, 16))]
    assert steps[1].applied == [list(range(100, 108)), list(range(108, 116))]
    assert recoveries[0].records == [OomRecovery(0, 4, 2)] and recoveries[1].records == []


@pytest.mark.parametrize("give_up", ["raise", "one row"])
def test_a_worker_that_gives_up_stops_the_others_instead_of_leaving_them_waiting(give_up):
    collective = Collective(2)
    failing = (FakeStep(4, fail_at={0}, collective=collective, worker=0) if give_up == "raise"
               else FakeStep(4, fits=0, collective=collective, worker=0))
    steps = [failing, FakeStep(4, collective=collective, worker=1)]
    on_oom = "raise" if give_up == "raise" else "recover"
    recoveries = [Recovery(step, multi_worker=True, on_oom=on_oom) for step in steps]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = lockstep(steps, recoveries, [[(elements(0, 2, 4), 2)],
                                               [(elements(100, 2, 4), 2)]])
    assert len(caught) == (0 if give_up == "raise" else 2)  # 4 -> 2 -> 1 rows, then none
    expected = tf.errors.ResourceExhaustedError if give_up == "raise" else NothingFitsError
    assert isinstance(results[0], expected)
    assert isinstance(results[1], WorkerLostError), results[1]
    assert "Another worker of the FakeStrategy run stopped in step 0" in str(results[1])
    assert collective.rounds[-1] == {0: (False, float("-inf")), 1: (True, 8.0)}
    assert len(collective.rounds) == (1 if give_up == "raise" else 3)
    for step in steps:
        assert step.committed == [] and not step.pending and step.applied == []


@pytest.mark.filterwarnings("ignore:Out of memory")
def test_two_workers_failing_in_the_same_round_both_shrink():
    collective = Collective(2)
    steps = [FakeStep(8, fail_at={1}, collective=collective, worker=0),
             FakeStep(8, fits=2, collective=collective, worker=1)]
    recoveries = [Recovery(step, multi_worker=True) for step in steps]
    results = lockstep(steps, recoveries, [[(elements(0, 2, 8), 2)],
                                           [(elements(100, 2, 8), 2)]])
    assert results == [[{"rows": 16}]] * 2
    assert collective.rounds == [{0: (False, 8.0), 1: (False, 0.0)},
                                 {0: (True, 16.0), 1: (False, 0.0)},
                                 {0: (True, 16.0), 1: (True, 16.0)}]
    assert [r.records for r in recoveries] == [
        [OomRecovery(0, 8, 4)], [OomRecovery(0, 8, 4), OomRecovery(0, 4, 2)]]
    assert steps[1].attempts == [8, 4, 2, 2, 2, 2, 2, 2, 2, 2]
    assert steps[1].applied == [list(range(100, 116))]



def test_a_worker_whose_input_fails_stops_the_others_instead_of_leaving_them_waiting():
    # Sharded, each worker reads its own records: a bad one fails one worker alone. It
    # gives up at the agreement, so the other stops there too, rather than wait in it.
    collective = Collective(2)
    steps = [FakeStep(4, collective=collective, worker=w) for w in range(2)]
    recoveries = [Recovery(step, multi_worker=True) for step in steps]
    results = lockstep(steps, recoveries, [[(bad_record(), 2)], [(elements(100, 2, 4), 2)]])
    assert isinstance(results[0], tf.errors.InvalidArgumentError)
    assert isinstance(results[1], WorkerLostError) and "its input failed" in str(results[1])
    assert collective.rounds == [{0: (False, float("-inf")), 1: (True, 8.0)}]
    assert steps[1].applied == []


class HeaderStep(FakeStep):
    """:class:`FakeStep` over shares that begin with a header (sequences sharded and cut
    by length): it pulls it and joins the lengths' agreement as
    ``TrainStep.agree_lengths`` does, one whose input failed too, then raising."""

    def agree_lengths(self, iterator):
        failure = None
        try:
            assert next(iterator, "header") == "header"
        except tf.errors.OpError as error:
            failure = error
        every, _ = self.collective.agree(self.worker, failure is None, 0.0)
        if failure is not None:
            raise failure
        return every


def test_a_worker_whose_share_fails_before_its_header_stops_the_others_there():
    # The share is read whole before its header comes: a bad record fails the header's
    # pull. That worker still joins the lengths' agreement, so the other stops there.
    collective = Collective(2)
    steps = [HeaderStep(4, collective=collective, worker=w) for w in range(2)]
    recoveries = [Recovery(step, multi_worker=True, ends=Ends("header")) for step in steps]
    share = iter(["header", *elements(100, 2, 4)])
    results = lockstep(steps, recoveries, [[(bad_record(), 2)], [(share, 2)]])
    assert isinstance(results[0], tf.errors.InvalidArgumentError)
    assert isinstance(results[1], WorkerLostError) and "its input failed" in str(results[1])
    assert collective.rounds == [{0: (False, 0.0), 1: (True, 0.0)}]
    assert steps[0].calls == steps[1].calls == []  # neither began its share
    assert steps[1].applied == []
