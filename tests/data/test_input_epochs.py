"""Where an epoch of an input ends: one iterator with marked epochs, a batched dataset
counted before training, a length learnt at the end of the first epoch."""

from __future__ import annotations

import math

import keras
import numpy as np
import pytest
import tensorflow as tf
from _inputs import B, M, N, data, make
from common import assert_weights_close

import autosplit
from autosplit.data.inputs import get_input
from autosplit.data.markers import Ends, skip_to_end_marker
from autosplit.data.pipeline import MicroBatches


def _fit_batched(dataset, *, epoch_markers, epochs=3):
    """(weights, losses, iterators made) of a fit on ``dataset()``, with or without the
    one iterator whose epochs end at a marker. The dataset is made after the seed is
    set: a seeded shuffle's seeds depend on the global seed at its creation."""
    made = []
    dataset_of = MicroBatches.dataset

    def spy(self, **kwargs):
        made.append(kwargs)
        return dataset_of(self, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(MicroBatches, "dataset", spy)
        if not epoch_markers:
            patch.setattr(MicroBatches, "can_mark", lambda self: False)
        keras.utils.set_random_seed(3)
        model = make()
        history = autosplit.fit_large_batch(model, dataset(), batch_size=B, micro_batch_size=M,
                                            epochs=epochs, verbose=0)
    return model.get_weights(), history.history["loss"], [k for k in made if "repeat" in k]


@pytest.mark.slow
@pytest.mark.parametrize("rows", [N, 4 * B])  # a short last batch, or an exact end
def test_an_input_of_unknown_length_is_read_by_one_iterator_with_marked_epochs(rows):
    # A new iterator every epoch cost 12 ms and a slower first large batch; one
    # iterator of the repeated pipeline, each epoch ending at an element of no real
    # row, trains exactly as they did, reshuffling (a seeded shuffle) every epoch.
    x, y, w = data(rows)

    def dataset():
        return (tf.data.Dataset.from_tensor_slices((x, y, w))
                .shuffle(rows, seed=5, reshuffle_each_iteration=True).batch(10)
                .filter(lambda *e: True))  # of unknown length

    weights, losses, iterators = _fit_batched(dataset, epoch_markers=True)
    assert [k["ends"].epoch for k in iterators] == ["marker"]
    expected, expected_losses, fresh = _fit_batched(dataset, epoch_markers=False)
    assert len(fresh) == 3
    assert_weights_close(expected, weights, 1e-6)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-6)


@pytest.mark.slow
def test_a_marked_epoch_longer_than_the_first_ends_where_model_fit_ends_it():
    # model.fit runs the large batches its first epoch counted and leaves the rest of a
    # longer epoch: the marked iterator drops those rows up to the epoch's marker.
    x, y, w = data()
    calls = []

    def rows_this_epoch():
        # 150 rows (3 large batches) the first two times the generator runs, 230 (4)
        # after: get_input reads one batch of a dataset of batches to check its rows,
        # so the first epoch may be the second run; a later epoch is longer either way.
        calls.append(None)
        n = 150 if len(calls) <= 2 else N
        yield from zip(x[:n], y[:n], w[:n], strict=True)

    spec = (tf.TensorSpec((6,), tf.float32), tf.TensorSpec((), tf.int32),
            tf.TensorSpec((), tf.float32))

    def dataset():
        calls.clear()
        return tf.data.Dataset.from_generator(rows_this_epoch, output_signature=spec).batch(10)

    weights, losses, _ = _fit_batched(dataset, epoch_markers=True)
    expected, expected_losses, _ = _fit_batched(dataset, epoch_markers=False)
    assert_weights_close(expected, weights, 1e-6)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-6)


class _Events(keras.callbacks.Callback):
    """What a callback sees: the step count at on_train_begin, then each batch and epoch."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_begin(self, logs=None):
        self.seen.append(("steps", self.params.get("steps")))

    def on_train_batch_begin(self, batch, logs=None):
        self.seen.append(("begin", batch))

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append(("end", batch))

    def on_epoch_end(self, epoch, logs=None):
        self.seen.append(("epoch", epoch))


@pytest.mark.slow
@pytest.mark.parametrize(("pipeline", "rows"), [
    (lambda ds: ds.batch(30), 260),
    (lambda ds: ds.batch(30, drop_remainder=True), 240),  # 4 large batches, not 5
    (lambda ds: ds.batch(30, num_parallel_calls=2).shuffle(9, seed=1).cache().prefetch(2),
     260),
    (lambda ds: ds.padded_batch(30), 260),
    (lambda ds: tf.data.Dataset.from_tensors(next(iter(ds.batch(260)))), 260),
], ids=["batch", "drop_remainder", "shuffled-cached-prefetched", "padded_batch",
        "from_tensors"])
def test_a_batched_dataset_of_known_length_is_counted_from_the_first_epoch(pipeline, rows):
    # model.fit knows a .batch(30) dataset's length before it starts; autosplit learnt
    # it at the end of the first epoch: params["steps"] was None at on_train_begin and
    # the first epoch's progress bar had no total. Counted from the batch() and the
    # examples under it, the events are those of the same rows as examples.
    x, y, w = data(260)
    examples = tf.data.Dataset.from_tensor_slices((x, y, w))
    seen = {}
    for name, dataset in (("batched", pipeline(examples)), ("examples", examples.take(rows))):
        events = _Events()
        model = make()
        autosplit.fit_large_batch(model, dataset, batch_size=B, micro_batch_size=M, epochs=2,
                                  callbacks=[events], verbose=0)
        seen[name] = events.seen
        assert int(model.optimizer.iterations) == 2 * math.ceil(rows / B)
    assert seen["batched"] == seen["examples"]
    assert seen["batched"][0] == ("steps", math.ceil(rows / B))


@pytest.mark.slow
def test_a_pipeline_ending_in_batch_is_not_read_before_training():
    # Its parts stack the same examples, so they share a row count: the look at its
    # first batch (an iterator more, 7-25 ms a call) is left to pipelines that do not
    # end in a batch(). Told by a generator under the batch: no run before training.
    x, y, w = data(100)
    runs = []

    def examples():
        runs.append(None)
        yield from zip(x, y, w, strict=True)

    spec = (tf.TensorSpec((6,), tf.float32), tf.TensorSpec((), tf.int32),
            tf.TensorSpec((), tf.float32))
    dataset = tf.data.Dataset.from_generator(examples, output_signature=spec).batch(10)
    before = keras.callbacks.LambdaCallback(
        on_train_begin=lambda logs: runs.append("training begins"))
    autosplit.fit_large_batch(make(), dataset, batch_size=B, micro_batch_size=M, verbose=0,
                              callbacks=[before])
    assert runs[0] == "training begins"


@pytest.mark.slow
def test_a_map_after_the_batch_leaves_the_length_to_the_first_epoch():
    # A map may change a batch's rows (augmented copies appended): the count is learnt
    # where the first epoch ends, as for a generator. 260 rows, doubled: 9 large batches.
    x, y, w = data(260)
    doubled = tf.data.Dataset.from_tensor_slices((x, y, w)).batch(30).map(
        lambda *e: tuple(tf.concat([part, part], 0) for part in e))
    events = _Events()
    autosplit.fit_large_batch(make(), doubled, batch_size=B, micro_batch_size=M, epochs=2,
                              callbacks=[events], verbose=0)
    assert events.seen[0] == ("steps", None)
    assert events.seen.count(("end", 8)) == 2 and ("end", 9) not in events.seen


@pytest.mark.slow
def test_a_miscounted_batched_dataset_stops_rather_than_borrow_the_next_epoch(monkeypatch):
    # Every epoch boundary of the repeated pipeline rests on the count: one too large
    # must stop training, not read the next epoch's rows into this one.
    monkeypatch.setattr(autosplit.data.datasets, "counted_rows", lambda dataset: 260 + B)
    x, y, w = data(260)
    model = make()
    with pytest.raises(tf.errors.FailedPreconditionError, match="expected to contain"):
        autosplit.fit_large_batch(model, tf.data.Dataset.from_tensor_slices((x, y, w)).batch(30),
                                  batch_size=B, micro_batch_size=M, epochs=2, verbose=0)


def test_skip_to_end_marker_drops_the_rest_of_an_epoch_and_its_marker():
    x, y, w = data()  # 230 rows: 15 micro-batches of 16 (the last of 6 rows) an epoch
    pipeline = MicroBatches(get_input(tf.data.Dataset.from_tensor_slices((x, y, w)).batch(10)),
                            B, M)
    ends = Ends("input", "marker")
    elements = iter(pipeline.dataset(repeat=True, ends=ends))
    first = [next(elements) for _ in range(4)]
    assert skip_to_end_marker(elements, ends) == 15 - 4
    np.testing.assert_array_equal(next(elements)[0], first[0][0])  # the next epoch
