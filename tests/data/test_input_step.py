"""What the traced step holds of the input (nothing of B rows; the iterator on the host),
class weights and validation batches counted as ``model.fit`` counts them."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from _inputs import B, Batches, M, batches, candidate, data, make
from common import assert_weights_close

import autosplit
from autosplit.data.inputs import get_input
from autosplit.data.pipeline import MicroBatches
from autosplit.errors import DatasetError
from autosplit.graph import HOST
from autosplit.step.train_step import step_for
from autosplit.testing import traced_graph


def walk(graph, seen=None):
    """The graph and every function graph it calls (loop bodies, conds, XLA bodies)."""
    seen = set() if seen is None else seen
    yield graph
    for op in graph.get_operations():
        for attr in op.node_def.attr.values():
            names = ([attr.func.name] if attr.HasField("func") else []) + [
                f.name for f in attr.list.func]
            for name in names:
                if name not in seen:
                    seen.add(name)
                    function = graph._get_function(name)
                    if function is not None and hasattr(function, "graph"):
                        yield from walk(function.graph, seen)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["arrays", "examples", "batched"])
def test_the_traced_step_holds_no_tensor_of_b_rows_and_reads_input_on_the_host(kind):
    batch, micro, rows = 4096, 64, 5000
    r = np.random.default_rng(0)
    x = r.normal(size=(rows, 8)).astype("float32")
    y = r.integers(0, 3, size=(rows,)).astype("int32")
    source = {"arrays": (x, y), "examples": tf.data.Dataset.from_tensor_slices((x, y)),
              "batched": tf.data.Dataset.from_tensor_slices((x, y)).batch(100)}[kind]
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(3)])
    model.compile(optimizer="adam", metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    adapter = get_input(source) if kind != "arrays" else get_input(x, y)
    pipeline = MicroBatches(adapter, batch, micro)
    step = step_for(model, pipeline)
    iterator = iter(pipeline.dataset())
    assert "CPU" in iterator._iterator_resource.device
    assert all("CPU" in v.device for v in tf.nest.flatten(step.update.stash.values))
    # Both pulls: counted (an input that knows its length) and until the input ends.
    for known_length, read_types in ((True, {"IteratorGetNext"}),
                                     (False, {"IteratorGetNextAsOptional", "OptionalGetValue"})):
        graph = traced_graph(step, iterator, known_length=known_length)
        operations = [op for g in walk(graph) for op in g.get_operations()]
        assert len(operations) > 100
        for op in operations:
            for tensor in op.outputs:
                assert not (tensor.shape.rank and tensor.shape[0] in (batch, rows)), (
                    f"{op.type} {op.name} has shape {tensor.shape}")
        reads = [op for op in operations if "Iterator" in op.type or "Optional" in op.type]
        assert {op.type for op in reads} >= read_types
        for op in reads:
            # Ops on an iterator handle are colocated with it: on the host.
            assert op.device in ("", HOST) and (op.device == HOST or any(
                b"loc:@" in group for group in op.colocation_groups())
                or op.inputs[0].dtype in (tf.resource, tf.variant)), op


@pytest.mark.parametrize("kind", ["arrays", "dataset"])
def test_class_weight_with_nested_targets_is_refused_up_front(kind):
    # model.fit refuses class_weight for several outputs. Raised from the pipeline's map,
    # it came wrapped in TensorFlow's StagingError: `except DatasetError` missed it.
    x, y, _ = data()
    targets = {"a": y, "b": y}
    source = (dict(x=x, y=targets) if kind == "arrays"
              else dict(x=tf.data.Dataset.from_tensor_slices((x, targets)).batch(10)))
    with pytest.raises(DatasetError, match="Expected one target for `class_weight`"):
        autosplit.fit_large_batch(make(), batch_size=B, micro_batch_size=M,
                                  class_weight={0: 2.0}, verbose=0, **source)


@pytest.mark.slow
def test_class_weight_is_exact():
    x, y, _ = data()
    class_weight = {0: 0.5, 1: 2.0, 2: 1.0}
    reference = make()
    reference.build((None, 6))
    initial = reference.get_weights()
    reference.fit(x, y, batch_size=B, class_weight=class_weight, shuffle=False, verbose=0)
    for source in (dict(x=x, y=y, shuffle=False),
                   dict(x=tf.data.Dataset.from_tensor_slices((x, y)).batch(10))):
        model = candidate(initial)
        autosplit.fit_large_batch(model, batch_size=B, micro_batch_size=M,
                                  class_weight=class_weight, verbose=0, **source)
        assert_weights_close(reference.get_weights(), model.get_weights(), 1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["batched", "PyDataset", "generator", "arrays"])
def test_validation_steps_count_batches_as_model_fit_does(kind):
    # model.fit counts validation_steps in the input's own batches (here of 20 rows);
    # arrays in batches of validation_batch_size, else B. Counted in large batches of
    # B everywhere, a batched input was scored on 2 * 64 rows instead of 2 * 20.
    x, y, _ = data()
    vx, vy, vw = data(100)

    def validation():
        return {"batched": lambda: tf.data.Dataset.from_tensor_slices((vx, vy, vw)).batch(20),
                "PyDataset": lambda: Batches(vx, vy, vw, 20),
                "generator": lambda: batches(vx, vy, vw, 20),
                "arrays": lambda: (vx, vy, vw)}[kind]()

    reference = make()
    reference.build((None, 6))
    initial = reference.get_weights()
    expected = reference.fit(x, y, batch_size=B, validation_data=validation(), shuffle=False,
                             validation_steps=2, verbose=0)
    model = candidate(initial)
    got = autosplit.fit_large_batch(model, x, y, batch_size=B, micro_batch_size=M,
                                    validation_data=validation(), validation_steps=2,
                                    shuffle=False, verbose=0)
    for name in ("val_loss", "val_accuracy"):
        np.testing.assert_allclose(got.history[name], expected.history[name], rtol=1e-5,
                                   err_msg=name)
