"""fit_large_batch's traced step: one trace an epoch, a graph that does not grow with k,
the order its control edges impose, how it builds a model."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from _fit import data, make_mlp
from common import assert_weights_close, twin

import autosplit
from autosplit.data.arrays import ArrayInput
from autosplit.data.pipeline import MicroBatches
from autosplit.testing import traced_graph, train_on_large_batch


def _nodes(definition):
    """Every node of a graph and of its functions (while bodies, branches)."""
    return list(definition.node) + [n for f in definition.library.function for n in f.node_def]


def _control_edges(definition):
    return sum(i.startswith("^") for n in _nodes(definition) for i in n.input)


def _fan_in(definition, widest=8):
    """Ops with more than ``widest`` control inputs that are not tokens (``sums.after``'s
    constants, the no-ops that collect a function's stateful ops)."""
    counted = ((n.op, sum(i.startswith("^") for i in n.input)) for n in _nodes(definition))
    return sorted((op, count) for op, count in counted
                  if op not in ("Const", "NoOp") and count > widest)


def _ancestors(op):
    """Every op that ``op`` waits for, through data and control edges."""
    seen, todo = set(), [op]
    while todo:
        current = todo.pop()
        for parent in [t.op for t in current.inputs] + list(current.control_inputs):
            if parent not in seen:
                seen.add(parent)
                todo.append(parent)
    return seen


def test_the_gradient_sums_are_zeroed_after_the_optimizer_wrote_every_variable():
    # The apply zeroes each gradient sum with zeros computed from its own value: a
    # temporary of the sum's size. Ordered after the optimizer's last write to every
    # variable, it never adds to the optimizer's own temporaries at the apply's peak
    # (MLP 784-1024-1024-10 at m=64: up to 23.9 MiB a step where 20.8 before, unordered).
    x, y = data(64)
    model = make_mlp(keras.optimizers.Adam(1e-3))
    _, step = train_on_large_batch(model, x, y, micro_batch_size=16)
    graph = traced_graph(step, iter(MicroBatches(ArrayInput(x, y), 64, 16).dataset()))
    handles = {id(v.handle) for v in model.trainable_variables}
    weights = {internal.ref() for external, internal in graph.captures
               if id(external) in handles}
    writes = [op for op in graph.get_operations() if op.inputs
              and op.inputs[0].ref() in weights
              and op.type.startswith(("Assign", "ResourceApply"))]
    zeroing = [op for op in graph.get_operations() if op.type == "AssignVariableOp"
               and op.inputs[1].op.type == "MulNoNan"]
    assert len(writes) >= len(model.trainable_variables)
    assert len(zeroing) == len(model.trainable_variables)
    for op in zeroing:
        assert set(writes) <= _ancestors(op), op.name


@pytest.mark.slow
def test_one_trace_serves_an_epoch_and_graph_size_does_not_grow_with_k():
    x, y = data(64)
    sizes = {}
    for micro in (32, 4):
        model = make_mlp()
        _, step = train_on_large_batch(model, x, y, micro_batch_size=micro)
        train_on_large_batch(model, x, y, micro_batch_size=micro)
        assert step.tracing_count() == 1  # two full batches: one trace
        # A short batch's input may hold padding: the variant that drops it before the
        # metrics, traced once too (an epoch's pipeline is one or the other throughout).
        train_on_large_batch(model, x[:17], y[:17], micro_batch_size=micro, batch_size=64)
        train_on_large_batch(model, x[:17], y[:17], micro_batch_size=micro, batch_size=64)
        assert step.tracing_count() == 2
        graph = traced_graph(step, iter(MicroBatches(ArrayInput(x, y), 64, micro).dataset()))
        sizes[micro] = len(_nodes(graph.as_graph_def()))
    assert sizes[32] == sizes[4], sizes  # k = 2 and k = 16 give the same graph


class _CountedDense(keras.layers.Dense):
    """A Dense layer that counts the forward passes traced through it."""

    calls = 0

    def call(self, inputs):
        type(self).calls += 1
        return super().call(inputs)


def _compiled(model, loss, metrics, **kwargs):
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss, metrics=metrics, **kwargs)
    return model


def _dict_outputs():
    inputs = keras.Input((6,))
    hidden = _CountedDense(8, activation="relu")(inputs)
    model = keras.Model(inputs, {"kind": keras.layers.Dense(3, name="kind")(hidden),
                                 "size": keras.layers.Dense(1, name="size")(hidden)})
    return _compiled(model, {"kind": keras.losses.SparseCategoricalCrossentropy(
        from_logits=True), "size": "mse"}, {"kind": ["accuracy"], "size": ["mae"]},
        loss_weights={"kind": 1.0, "size": 0.5})


def _list_of_one_output():
    inputs = keras.Input((6,))
    hidden = _CountedDense(8, activation="relu")(inputs)
    model = keras.Model(inputs, [keras.layers.Dense(3)(hidden)])  # call() unpacks it
    return _compiled(model, [keras.losses.SparseCategoricalCrossentropy(from_logits=True)],
                     ["accuracy"])


def _sequential():
    model = keras.Sequential([keras.Input((6,)), _CountedDense(8, activation="relu"),
                              keras.layers.Dense(3)])
    return _compiled(model, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                     ["accuracy", keras.metrics.SparseTopKCategoricalAccuracy(k=2)],
                     weighted_metrics=["accuracy"])


@pytest.mark.slow
@pytest.mark.parametrize("make", [_dict_outputs, _list_of_one_output, _sequential])
def test_a_built_functional_model_is_built_from_its_output_spec_as_keras_builds_it(make):
    # A freshly compiled Functional or Sequential model: Keras's symbolic build would
    # trace a forward pass only to build the compiled loss, its trackers and the metrics;
    # autosplit builds them from the layers' shape inference. Metric for metric, log for
    # log, the result must be model.fit's.
    x, y = data(64)
    targets = {"kind": y, "size": x[:, :1]} if make is _dict_outputs else y
    keras.utils.set_random_seed(0)
    reference = make()
    keras.utils.set_random_seed(0)
    candidate = make()
    reference.fit(x, targets, batch_size=64, epochs=2, shuffle=False, verbose=0)
    _CountedDense.calls = 0
    history = autosplit.fit_large_batch(candidate, x, targets, batch_size=64,
                                        micro_batch_size=16, epochs=2, shuffle=False,
                                        verbose=0)
    # The loss plan's trace and the step's: no other. Keras's own per-example losses
    # need no forward pass on a sample to tell them from a loss over the whole batch.
    assert _CountedDense.calls == 2
    assert [m.name for m in candidate.metrics] == [m.name for m in reference.metrics]
    assert ([v.path for m in candidate.metrics for v in m.variables]
            == [v.path for m in reference.metrics for v in m.variables])
    assert_weights_close(reference.get_weights(), candidate.get_weights(), 1e-5)
    assert sorted(history.history) == sorted(reference.history.history)
    for name, values in reference.history.history.items():
        np.testing.assert_allclose(history.history[name], values, rtol=1e-5, err_msg=name)


def _stack(layers, *, optimizer="adam"):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,))] + [
        keras.layers.Dense(8, activation="relu") for _ in range(layers)] + [
        keras.layers.Dense(3)])
    model.compile(optimizer=optimizer, metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


@pytest.mark.slow
def test_elements_of_real_rows_reach_the_metrics_without_a_padding_check_only_where_all_are():
    # A pipeline whose elements hold real rows only (MicroBatches.all_real) updates
    # the metrics from each whole element: no tf.cond per micro-batch to drop padding
    # (the CNN with accuracy: ~40 ms less to trace a call). The step of a pipeline with
    # a short last batch keeps it, and both runs log what model.fit logs.
    def conds(step, pipeline):
        graph = traced_graph(step, iter(pipeline.dataset())).as_graph_def()
        return sum(n.op in ("If", "StatelessIf") for n in _nodes(graph))

    counted, steps = {}, {}
    for rows in (256, 250):
        x, y = data(rows)
        model = make_mlp()
        pipeline = MicroBatches(ArrayInput(x, y), 64, 16)
        step = autosplit.step.train_step.step_for(model, pipeline)
        assert step.all_real == (rows == 256)
        counted[rows], steps[rows] = conds(step, pipeline), step
        reference, candidate = twin(make_mlp, (x[:16], y[:16], None))
        expected = reference.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
        history = autosplit.fit_large_batch(candidate, (x, y), batch_size=64,
                                            micro_batch_size=16, epochs=2, shuffle=False,
                                            verbose=0)
        assert_weights_close(reference.get_weights(), candidate.get_weights(), 1e-5)
        for name in ("accuracy", "loss"):
            np.testing.assert_allclose(history.history[name], expected.history[name],
                                       rtol=1e-5)
    assert counted[256] == counted[250] - 1, counted
    # A rebind that does not say (an out-of-memory recovery's smaller size) checks again.
    steps[256].rebind(steps[256].update.element_spec)
    assert not steps[256].all_real


@pytest.mark.slow
@pytest.mark.parametrize("known_length", [True, False])
def test_control_edges_grow_with_the_graph_not_the_square_of_the_variables(known_length):
    # Ordering each of the optimizer's ops (some 15 a variable) after every gradient
    # through tf.control_dependencies(list) gave each op one control edge per variable:
    # 622,527 control edges for a Dense stack of 202 variables (8,418 through one token),
    # and a call twice as long. jit_compile=False: on a GPU Keras's "auto" compiles the
    # piece with XLA, one call op whose outputs need one edge each anyway.
    x, y = data(64)

    def graph(layers):
        model = _stack(layers)
        pipeline = MicroBatches(ArrayInput(x, y), 64, 16)
        step = autosplit.step.train_step.step_for(model, pipeline, jit_compile=False)
        return traced_graph(step, iter(pipeline.dataset()),
                            known_length=known_length).as_graph_def()

    definitions = {layers: graph(layers) for layers in (6, 15, 24)}  # 14, 32, 50 variables
    edges = {layers: _control_edges(d) for layers, d in definitions.items()}
    # Equal steps in variables, equal steps in edges: no square term (before: 13,338
    # more edges from 6 to 15 layers, then 23,058 more from 15 to 24).
    first, second = edges[15] - edges[6], edges[24] - edges[15]
    assert abs(second - first) <= 0.05 * first, edges
    # And no op is ordered after a list of tensors: only tokens have many control inputs
    # (before: every op of Adam's apply had one per gradient, 750 ops here). The one
    # exception is TensorFlow's: the optimizer's iteration count is written after each
    # variable's update has read it (automatic control dependencies, one edge a read).
    assert [op for op, _ in _fan_in(definitions[24])] in ([], ["AssignVariableOp"])


def test_an_input_of_many_tensors_is_stashed_through_one_token():
    # Each part of the element in flight is read after the stash holds every part: with
    # tf.control_dependencies(the stash's assigns), each of E parts had E + 3 control
    # inputs (a dict of 200 features: ~40,000 edges in the loop's body).
    names = [f"f{i}" for i in range(12)]
    inputs = {name: keras.Input((1,), name=name) for name in names}
    outputs = keras.layers.Dense(3)(keras.layers.Concatenate()(list(inputs.values())))
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="sgd",
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = data(64)
    features = {name: x[:, :1] + i for i, name in enumerate(names)}
    pipeline = MicroBatches(ArrayInput(features, y), 64, 16)
    step = autosplit.step.train_step.step_for(model, pipeline, jit_compile=False)
    definition = traced_graph(step, iter(pipeline.dataset())).as_graph_def()
    assert _fan_in(definition) == []


@pytest.mark.slow
def test_accumulate_gradients_orders_metrics_after_the_gradients_through_one_token():
    x, y = data(64)

    def graph(layers):
        model = _stack(layers, optimizer="sgd")

        @tf.function
        def loss_and_grads(x, y):
            return autosplit.accumulate_gradients(model, x, y, micro_batch_size=16,
                                                  update_metrics=True)

        return loss_and_grads.get_concrete_function(x, y).graph.as_graph_def()

    # Before: each op of the accuracy's update had one control edge per gradient.
    assert _fan_in(graph(24)) == []
