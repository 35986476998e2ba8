"""fit_large_batch: model.fit behaviour, traces, graph size, callbacks and bad input."""

from __future__ import annotations

import dataclasses
import json
import math
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from common import assert_weights_close, twin

import autosplit
from autosplit.data.arrays import ArrayInput
from autosplit.data.pipeline import MicroBatches
from autosplit.errors import (
    ArgumentError,
    BatchSizeError,
    DatasetError,
    MemoryLimitError,
    ModelNotReadyError,
    UnsupportedModelError,
)
from autosplit.testing import traced_graph, train_on_large_batch


def make_mlp(optimizer=None, metrics=("accuracy",)):
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(3)])
    model.compile(optimizer=optimizer or keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=list(metrics))
    return model


def data(n=230, seed=0):
    r = np.random.default_rng(seed)
    x = r.normal(size=(n, 6)).astype("float32")
    y = (x[:, 0] > 0).astype("int32") + (x[:, 1] > 1).astype("int32")
    return x, y


def test_fit_equals_model_fit_over_epochs_with_a_short_last_batch():
    x, y = data(230)  # 230 = 3 * 64 + 38: a short last large batch each epoch
    reference, candidate = twin(make_mlp, (x[:16], y[:16], None))
    reference.fit(x, y, batch_size=64, epochs=3, shuffle=False, verbose=0)
    history = autosplit.fit_large_batch(candidate, (x, y), batch_size=64, micro_batch_size=16,
                                        epochs=3, shuffle=False, verbose=0)
    assert_weights_close(reference.get_weights(), candidate.get_weights(), 1e-5)
    assert int(candidate.optimizer.iterations) == 3 * math.ceil(230 / 64)
    assert history.autosplit.micro_batch_size == 16
    assert history.autosplit.accumulation_steps == 4
    assert history.autosplit.traces == 1  # the padded last batch reuses the trace
    assert history.autosplit.micro_batch_sizes == (16, 16, 16)
    assert history.autosplit.oom_recoveries == ()
    assert len(history.history["loss"]) == 3


@pytest.mark.parametrize("kind", ["arrays", "examples", "generator"])
def test_one_iterator_reads_every_epoch_where_the_epoch_is_known(kind, monkeypatch):
    # Making an iterator instantiates the pipeline's functions (13-20 ms an epoch): where
    # each epoch's elements are known, one iterator of the repeated pipeline reads them
    # all, and the weights are model.fit's; a generator's epoch ends when it does.
    x, y = data(230)
    made = []
    original = MicroBatches.dataset

    def dataset(self, **kwargs):
        made.append(kwargs.get("repeat", False))
        return original(self, **kwargs)

    monkeypatch.setattr(MicroBatches, "dataset", dataset)
    reference, candidate = twin(make_mlp, (x[:16], y[:16], None))
    if kind == "generator":
        def batches():
            for start in range(0, 230, 23):
                yield x[start:start + 23], y[start:start + 23]
        reference.fit(x, y, batch_size=230, epochs=1, shuffle=False, verbose=0)
        given = {"x": batches(), "batch_size": 230, "epochs": 1}  # one pass: one epoch
    else:
        reference.fit(x, y, batch_size=64, epochs=3, shuffle=False, verbose=0)
        given = {"x": tf.data.Dataset.from_tensor_slices((x, y)) if kind == "examples"
                 else x, "y": None if kind == "examples" else y, "batch_size": 64, "epochs": 3}
    autosplit.fit_large_batch(candidate, **given, micro_batch_size=16, shuffle=False,
                              verbose=0)
    # The first call gives the step its element spec; then one per iterator made.
    assert made == ([False, False] if kind == "generator" else [False, True])
    assert_weights_close(reference.get_weights(), candidate.get_weights(), 1e-5)


def test_a_full_collection_only_where_memory_is_measured_or_capped(monkeypatch):
    # gc.collect() frees an earlier call's pipelines before the probe measures, under a
    # cap and on a GPU; on a plain CPU it is left to Python, as after model.fit (it cost
    # 0.1-0.3 s a call in a process with a few models).
    import autosplit.training.plan as plan_module

    calls = []
    monkeypatch.setattr(plan_module.gc, "collect", lambda *a: calls.append(a) or 0)
    monkeypatch.delenv("TF_CPU_ALLOCATOR_USE_BFC", raising=False)
    monkeypatch.setattr(plan_module.tf.config, "list_logical_devices", lambda kind=None: [])
    # The variable alone, set after TensorFlow made its allocator, caps nothing: no
    # trial of the given size in a child process (autosplit.search.isolation).
    monkeypatch.setattr(plan_module, "kernels_may_crash", lambda: False)
    x, y = data(64)
    autosplit.fit_large_batch(make_mlp(), x, y, batch_size=32, micro_batch_size=16, verbose=0)
    assert calls == []
    monkeypatch.setenv("TF_CPU_ALLOCATOR_USE_BFC", "true")
    autosplit.fit_large_batch(make_mlp(), x, y, batch_size=32, micro_batch_size=16, verbose=0)
    assert len(calls) == 1


def test_the_report_is_immutable_its_dict_plain_and_indexing_it_deprecated():
    report = autosplit.FitReport(
        batch_size=64, micro_batch_size=8, accumulation_steps=8, padded_rows=0,
        micro_batch_reason="given", input="arrays", batch_norm="pooled", replicas=1,
        workers=1, micro_batch_sizes=(16, 8), oom_recoveries=(autosplit.OomRecovery(3, 16, 8),),
        probe=None, traces=2)
    plain = report.to_dict()
    assert plain["oom_recoveries"] == [{"step": 3, "failed": 16, "retry": 8}]
    assert plain["micro_batch_sizes"] == [16, 8] and plain["probe"] is None
    assert json.loads(json.dumps(plain)) == plain
    assert list(plain) == [f.name for f in dataclasses.fields(report)]
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.traces = 0
    with pytest.warns(DeprecationWarning, match=r"read history.autosplit.oom_recoveries"):
        assert report["oom_recoveries"] == plain["oom_recoveries"]


def test_dataset_of_examples_with_dict_inputs_and_weights():
    x, y = data(100)
    w = np.linspace(0.5, 1.5, 100).astype("float32")
    inputs = {"a": keras.Input((3,), name="a"), "b": keras.Input((3,), name="b")}
    out = keras.layers.Dense(3)(keras.layers.Concatenate()([inputs["a"], inputs["b"]]))

    def make():
        model = keras.Model(inputs, out)
        model.compile(optimizer=keras.optimizers.SGD(0.1),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    ref = make()
    ref.build({"a": (None, 3), "b": (None, 3)})
    features = {"a": x[:, :3], "b": x[:, 3:]}
    initial = ref.get_weights()
    ref.fit(features, y, sample_weight=w, batch_size=40, shuffle=False, verbose=0)
    model = make()
    model.set_weights(initial)
    ds = tf.data.Dataset.from_tensor_slices((features, y, w))
    autosplit.fit_large_batch(model, ds, batch_size=40, micro_batch_size=8, verbose=0)
    assert_weights_close(ref.get_weights(), model.get_weights(), 1e-5)


def test_learning_rate_schedule_sees_large_batch_steps():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=1, decay_rate=0.5)
    model = make_mlp(keras.optimizers.SGD(schedule))
    x, y = data(200)
    autosplit.fit_large_batch(model, (x, y), batch_size=50, micro_batch_size=10, epochs=2,
                              verbose=0)
    assert int(model.optimizer.iterations) == 8
    np.testing.assert_allclose(float(model.optimizer.learning_rate), 0.1 * 0.5**8, rtol=1e-6)


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
    assert _CountedDense.calls == 2  # the loss plan's trace and the step's: no other
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


def test_whole_elements_reach_the_metrics_without_a_padding_check_only_where_none_comes():
    # A pipeline whose elements hold real rows only (MicroBatches.always_full) updates
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
        assert step.full == (rows == 256)
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
    assert not steps[256].full


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


def test_initial_epoch_at_or_past_epochs_trains_nothing_as_model_fit():
    # A resumed script run again after its last epoch: model.fit returns quietly.
    x, y = data(128)
    reference, candidate = twin(make_mlp, (x[:16], y[:16], None))
    expected = reference.fit(x, y, batch_size=64, epochs=2, initial_epoch=2, verbose=0)
    seen = []
    record = keras.callbacks.LambdaCallback(on_train_begin=lambda logs: seen.append("begin"),
                                            on_train_end=lambda logs: seen.append("end"))
    history = autosplit.fit_large_batch(candidate, x, y, batch_size=64, micro_batch_size=16,
                                        epochs=2, initial_epoch=2, verbose=0,
                                        callbacks=[record])
    assert history.history == expected.history == {}
    assert history.epoch == expected.epoch == []
    assert seen == ["begin", "end"]
    assert int(candidate.optimizer.iterations) == 0
    assert_weights_close(reference.get_weights(), candidate.get_weights(), 0)


def test_callbacks_see_large_batches_and_stop_training():
    x, y = data(300)
    seen = []

    class Recorder(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append((batch, self.params["micro_batch_size"], sorted(logs)))
            if len(seen) == 5:
                self.model.stop_training = True

    model = make_mlp()
    history = autosplit.fit_large_batch(model, (x, y), batch_size=100, micro_batch_size=25,
                                        epochs=4, callbacks=[Recorder()], verbose=0)
    assert [b for b, _, _ in seen] == [0, 1, 2, 0, 1]
    assert seen[0][1] == 25 and seen[0][2] == ["accuracy", "loss"]
    assert len(history.history["loss"]) == 2
    assert int(model.optimizer.iterations) == 5


def test_early_stopping_checkpoint_tensorboard_and_validation(tmp_path):
    x, y = data(200)
    model = make_mlp()
    callbacks = [
        keras.callbacks.EarlyStopping(monitor="val_loss", patience=0, min_delta=10.0),
        keras.callbacks.ModelCheckpoint(str(tmp_path / "best.keras"), monitor="val_loss"),
        keras.callbacks.TensorBoard(str(tmp_path / "tb")),
    ]
    history = autosplit.fit_large_batch(
        model, (x, y), batch_size=100, micro_batch_size=20, epochs=5,
        validation_data=(x[:50], y[:50]), callbacks=callbacks, verbose=0)
    assert len(history.history["val_loss"]) == 2  # patience 0 with an impossible delta
    assert (tmp_path / "best.keras").exists()
    assert any((tmp_path / "tb").rglob("*tfevents*"))
    evaluated = model.evaluate(x[:50], y[:50], verbose=0, return_dict=True)
    np.testing.assert_allclose(history.history["val_loss"][-1], evaluated["loss"], rtol=1e-5)


def test_progress_bar_is_shown(capsys):
    x, y = data(100)
    autosplit.fit_large_batch(make_mlp(), (x, y), batch_size=50, micro_batch_size=10,
                              verbose=1)
    out = capsys.readouterr().out
    assert "2/2" in out and "loss" in out


def test_steps_per_epoch_with_repeated_dataset():
    x, y = data(100)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).repeat()
    model = make_mlp()
    autosplit.fit_large_batch(model, ds, batch_size=30, micro_batch_size=10, epochs=2,
                              steps_per_epoch=3, verbose=0)
    assert int(model.optimizer.iterations) == 6


@pytest.mark.parametrize(("steps", "epochs", "iterations"), [(3, 4, 8), (2, 3, 6), (5, 2, 8)])
def test_steps_per_epoch_past_the_data_ends_the_epoch_and_reads_it_again(steps, epochs,
                                                                        iterations):
    # Keras 3 counts an input's batches: an epoch that reaches the end of the data ends
    # there with a warning, and the next one reads the data again. autosplit stopped
    # training (5 large batches where model.fit ran 8, weights 0.70 apart).
    x, y = data(230)  # 4 large batches of 64: 64, 64, 64, 38
    reference, candidate = twin(make_mlp, (x[:16], y[:16], None))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Keras's own "ran out of data"
        reference.fit(x, y, batch_size=64, epochs=epochs, steps_per_epoch=steps,
                      shuffle=False, verbose=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = autosplit.fit_large_batch(candidate, x, y, batch_size=64, micro_batch_size=16,
                                            epochs=epochs, steps_per_epoch=steps,
                                            shuffle=False, verbose=0)
    assert int(candidate.optimizer.iterations) == int(reference.optimizer.iterations)
    assert int(candidate.optimizer.iterations) == iterations
    assert len(history.epoch) == epochs
    assert_weights_close(reference.get_weights(), candidate.get_weights(), 1e-5)
    short = [w for w in caught if "the next one reads the data again" in str(w.message)]
    assert bool(short) == (4 % steps != 0)  # an epoch ended early


def test_batch_norm_warns_once_per_step_build():
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8),
                              keras.layers.BatchNormalization(), keras.layers.Dense(3)])
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(True))
    x, y = data(64)
    with pytest.warns(UserWarning, match="ghost batch norm"):
        autosplit.fit_large_batch(model, (x, y), batch_size=64, micro_batch_size=16, verbose=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        autosplit.fit_large_batch(model, (x, y), batch_size=64, micro_batch_size=64, verbose=0)


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("value", [0, -4, 2.5, "64", None, True, np.float32(8)])
@pytest.mark.parametrize("name", ["batch_size", "micro_batch_size"])
def test_bad_sizes(name, value):
    model = make_mlp()
    model.build((None, 6))
    before = [w.copy() for w in model.get_weights()]
    kwargs = {"batch_size": 64, "micro_batch_size": 16, name: value}
    with pytest.raises(BatchSizeError, match=rf"Expected `{name}` to be a positive integer"):
        autosplit.fit_large_batch(model, data(), verbose=0, **kwargs)
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights(), strict=True))


def test_numpy_integer_sizes_are_accepted():
    x, y = data(40)
    h = autosplit.fit_large_batch(make_mlp(), (x, y), batch_size=np.int64(20),
                                  micro_batch_size=np.int32(10), verbose=0)
    assert h.autosplit.accumulation_steps == 2


def test_micro_batch_at_least_batch_means_no_split():
    x, y = data(40)
    h = autosplit.fit_large_batch(make_mlp(), (x, y), batch_size=20, micro_batch_size=500,
                                  verbose=0)
    assert h.autosplit.accumulation_steps == 1 and h.autosplit.micro_batch_size == 20


def test_uncompiled_model():
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
    with pytest.raises(ModelNotReadyError, match=r"model\.compile"):
        autosplit.fit_large_batch(model, data(), batch_size=8, micro_batch_size=4)


def test_model_without_loss():
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
    model.compile(optimizer="sgd")
    with pytest.raises(ModelNotReadyError, match="loss"):
        autosplit.fit_large_batch(model, data(), batch_size=8, micro_batch_size=4)


def test_not_a_model():
    with pytest.raises(ModelNotReadyError, match="Received: model="):
        autosplit.fit_large_batch("resnet", data(), batch_size=8, micro_batch_size=4)


def test_model_without_trainable_weights():
    model = make_mlp()
    for layer in model.layers:
        layer.trainable = False
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ModelNotReadyError, match="trainable"):
        autosplit.fit_large_batch(model, data(), batch_size=8, micro_batch_size=4, verbose=0)


def test_custom_train_step_calling_keras_own_equals_model_fit():
    class Custom(keras.Model):
        def train_step(self, data):
            return super().train_step(data)

    def make():
        inputs = keras.Input((6,))
        model = Custom(inputs, keras.layers.Dense(3)(inputs))
        model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
        return model

    x = np.random.default_rng(0).normal(size=(40, 6)).astype("float32")
    y = np.random.default_rng(1).normal(size=(40, 3)).astype("float32")
    reference, model = make(), make()
    model.set_weights(reference.get_weights())
    expected = reference.fit(x, y, batch_size=20, shuffle=False, verbose=0)
    got = autosplit.fit_large_batch(model, x, y, batch_size=20, micro_batch_size=8,
                                    shuffle=False, verbose=0)
    assert_weights_close(reference.get_weights(), model.get_weights(), 1e-5)
    for name, values in expected.history.items():
        np.testing.assert_allclose(got.history[name], values, rtol=1e-5, err_msg=name)


class FixedBatchReshape(keras.layers.Layer):
    """keras-io's Switch Transformer: a reshape to a fixed batch_size * tokens."""

    def call(self, x):
        return keras.ops.reshape(x, (16 * 3, 2))


def test_a_model_that_fixes_the_batch_size_fails_with_the_reason_noted():
    inputs = keras.Input((3, 2))
    hidden = FixedBatchReshape()(keras.layers.Dense(2)(inputs))
    outputs = keras.layers.Dense(1)(keras.layers.Reshape((3 * 2,))(
        keras.ops.reshape(hidden, (16, 3, 2))))
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="sgd", loss="mse")
    r = np.random.default_rng(0)
    x, y = r.normal(size=(32, 3, 2)).astype("float32"), r.normal(size=(32, 1)).astype("float32")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)  # model.fit at its batch size: fine
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(ValueError, match="reshape") as info:
        autosplit.fit_large_batch(model, x, y, batch_size=16, micro_batch_size=6, verbose=0)
    [note] = info.value.__notes__
    assert "micro-batches of 6 rows (batch_size=16)" in note and "ops.shape(x)[0]" in note
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights(), strict=True))


def test_unreduced_loss_is_refused():
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)])
    model.compile(optimizer="sgd", loss=keras.losses.MeanSquaredError(reduction="none"))
    x = np.zeros((8, 6), "float32")
    with pytest.raises(UnsupportedModelError, match="reduction"):
        autosplit.fit_large_batch(model, (x, x[:, :3]), batch_size=8, micro_batch_size=4,
                                  verbose=0)


def test_batched_dataset_is_rebatched_not_refused():
    """A pipeline ending in .batch(n), whatever n, trains exactly like its examples."""
    x, y = data(230)
    examples = tf.data.Dataset.from_tensor_slices((x, y))
    reference = make_mlp()
    reference.build((None, 6))
    initial = reference.get_weights()
    autosplit.fit_large_batch(reference, examples, batch_size=64, micro_batch_size=16,
                              epochs=2, verbose=0)
    for batched in (examples.batch(32), examples.batch(7).map(lambda a, b: (a, b))):
        model = make_mlp()
        model.build((None, 6))
        model.set_weights(initial)
        history = autosplit.fit_large_batch(model, batched, batch_size=64, micro_batch_size=16,
                                            epochs=2, verbose=0)
        assert history.autosplit.input == "batched tf.data.Dataset"
        assert int(model.optimizer.iterations) == 8
        assert_weights_close(reference.get_weights(), model.get_weights(), 1e-5)


@pytest.mark.parametrize(("bad", "message"), [
    # x alone is how models whose loss is added in call() are fed; with a compiled
    # loss it lacks the targets.
    (lambda x, y: tf.data.Dataset.from_tensor_slices(x), "Expected targets `y`"),
    (lambda x, y: tf.data.Dataset.from_tensor_slices({"x": x, "y": y}), "Expected targets"),
    (lambda x, y: tf.data.Dataset.from_tensor_slices((x, y, y, y)),
     r"\(x, y\), \(x, y, sample_weight\) or x alone"),
], ids=["x-only", "dict", "four-items"])
def test_dataset_elements_must_be_x_y_w(bad, message):
    x, y = data(40)
    with pytest.raises(DatasetError, match=message):
        autosplit.fit_large_batch(make_mlp(), bad(x, y), batch_size=16, micro_batch_size=4)


def test_empty_dataset():
    x, y = data(40)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).take(0)
    with pytest.raises(DatasetError, match="non-empty"):
        autosplit.fit_large_batch(make_mlp(), ds, batch_size=16, micro_batch_size=4)
    with pytest.raises(DatasetError, match="non-empty"):
        autosplit.fit_large_batch(make_mlp(), (x[:0], y[:0]), batch_size=16, micro_batch_size=4)


def test_mismatched_array_lengths():
    x, y = data(40)
    with pytest.raises(DatasetError, match="same number of rows"):
        autosplit.fit_large_batch(make_mlp(), (x, y[:39]), batch_size=16, micro_batch_size=4)


def test_not_data_at_all():
    with pytest.raises(DatasetError, match=r"Expected `x` to be arrays or a dataset"):
        autosplit.fit_large_batch(make_mlp(), "data.csv", batch_size=16, micro_batch_size=4)


def test_errors_are_builtin_subclasses():
    assert issubclass(ArgumentError, ValueError)
    assert issubclass(BatchSizeError, ValueError)
    assert issubclass(DatasetError, ValueError)
    assert issubclass(MemoryLimitError, ValueError)
    assert issubclass(ModelNotReadyError, ValueError)
    assert issubclass(UnsupportedModelError, TypeError)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"verbose": 3}, "Expected `verbose` to be 'auto', 0, 1 or 2"),
    ({"on_oom": "ignore"}, "Expected `on_oom` to be one of"),
    ({"shuffle": "yes"}, "Expected `shuffle` to be True, False or 'batch'. Received: "
                         "shuffle='yes'"),
    ({"jit_compile": "xla"}, "Expected `jit_compile` to be None, True or False"),
    ({"validation_split": 1.0}, r"Expected `validation_split` to be a number in \[0, 1\)"),
    ({"epochs": 0}, r"Expected `epochs` to be a positive integer. Received: epochs=0 "
                    r"\(type int\). Pass a whole number such as epochs=1"),
    ({"epochs": 2.0}, "Expected `epochs` to be a positive integer"),
    ({"validation_freq": 0}, "Expected `validation_freq` to be a positive integer"),
    ({"steps_per_epoch": -1}, "Expected `steps_per_epoch` to be a positive integer"),
    ({"validation_steps": True}, "Expected `validation_steps` to be a positive integer"),
    ({"initial_epoch": -1, "epochs": 3}, r"Expected `initial_epoch` to be an int >= 0 "
                                         r"\(epochs=3\). Received: initial_epoch=-1"),
    ({"y": 64}, "Expected targets as the third argument"),
])
def test_bad_arguments_raise_argument_error(kwargs, message):
    """Epochs, steps and choices are not batch sizes: ArgumentError, still a ValueError."""
    model = make_mlp()
    model.build((None, 6))
    before = [w.copy() for w in model.get_weights()]
    x, y = data(16)
    kwargs = {"y": y, **kwargs}
    with pytest.raises(ArgumentError, match=message) as info:
        autosplit.fit_large_batch(model, x, batch_size=8, micro_batch_size=4, **kwargs)
    assert isinstance(info.value, ValueError) and not isinstance(info.value, BatchSizeError)
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights(), strict=True))


@pytest.mark.parametrize("headroom", [1.0, -0.1, "0.1", True])
def test_bad_headroom_is_a_memory_limit_error_in_fit_and_probe(headroom):
    x, y = data(16)
    match = r"Expected `headroom` to be a fraction in \[0, 1\)"
    with pytest.raises(MemoryLimitError, match=match):
        autosplit.fit_large_batch(make_mlp(), x, y, batch_size=8, headroom=headroom)
    with pytest.raises(MemoryLimitError, match=match):
        autosplit.probe(make_mlp(), x, y, batch_size=8, headroom=headroom)


def test_shuffle_batch_keeps_each_large_batch_so_it_trains_as_unshuffled():
    """Keras's shuffle="batch": large batch i holds rows [i*B, (i+1)*B) in a new order
    each epoch; a large batch's gradient does not depend on that order. (A full shuffle,
    what "batch" used to become, moves rows between large batches and fails this.)"""
    x, y = data(230)
    reference, candidate = twin(make_mlp, (x[:16], y[:16], None))
    reference.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
    autosplit.fit_large_batch(candidate, x, y, batch_size=64, micro_batch_size=16, epochs=2,
                              shuffle="batch", verbose=0)
    assert_weights_close(reference.get_weights(), candidate.get_weights(), 1e-5)


class HookLog(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.events = []

    def on_test_begin(self, logs=None):
        self.events.append(("begin",))

    def on_test_batch_begin(self, batch, logs=None):
        self.events.append(("batch_begin", batch))

    def on_test_batch_end(self, batch, logs=None):
        self.events.append(("batch_end", batch, round(logs["loss"], 5)))

    def on_test_end(self, logs=None):
        self.events.append(("end", round(logs["loss"], 5), round(logs["accuracy"], 5)))


@pytest.mark.parametrize("kind", ["arrays", "batched"])
def test_validation_calls_the_test_hooks_as_model_fit_does(kind):
    # model.fit validates through model.evaluate with its callbacks: on_test_begin, a
    # batch's begin and end for each validation batch (running logs), on_test_end with
    # the logs. autosplit called none of them (TensorBoard lacked its evaluation_*
    # curves). Batches of B = 64 rows: 64 and 36 of 100.
    x, y = data(128)
    vx, vy = data(100, seed=1)

    def validation():
        return (vx, vy) if kind == "arrays" else tf.data.Dataset.from_tensor_slices(
            (vx, vy)).batch(64)

    reference, candidate = twin(make_mlp, (x[:16], y[:16], None))
    expected, got = HookLog(), HookLog()
    reference.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0,
                  validation_data=validation(), callbacks=[expected])
    autosplit.fit_large_batch(candidate, x, y, batch_size=64, micro_batch_size=16, epochs=2,
                              shuffle=False, verbose=0, validation_data=validation(),
                              callbacks=[got])
    assert [e[:2] for e in got.events] == [e[:2] for e in expected.events]
    np.testing.assert_allclose([e[1:] for e in got.events if e[0] == "end"],
                               [e[1:] for e in expected.events if e[0] == "end"], rtol=1e-5)
    np.testing.assert_allclose([e[2] for e in got.events if e[0] == "batch_end"],
                               [e[2] for e in expected.events if e[0] == "batch_end"],
                               rtol=1e-4)


def test_a_loss_that_overflows_logs_inf_as_model_fit_with_padding_rows():
    # m = 12 does not divide B = 32: padding rows copy real rows. Multiplied by 0, a
    # copy's inf loss made the sum NaN; TerminateOnNaN's logs then read nan, not inf.
    r = np.random.default_rng(0)
    x = (r.normal(size=(96, 4)) * 100).astype("float32")
    y = (r.normal(size=(96, 1)) * 1e18).astype("float32")

    def make():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(1e6), loss="mse")
        return model

    reference, candidate = twin(make, (x[:8], y[:8], None))
    stop = [keras.callbacks.TerminateOnNaN()]
    expected = reference.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0,
                             callbacks=stop)
    got = autosplit.fit_large_batch(candidate, x, y, batch_size=32, micro_batch_size=12,
                                    epochs=3, shuffle=False, verbose=0, callbacks=stop)
    assert np.isinf(expected.history["loss"]).all()
    np.testing.assert_array_equal(got.history["loss"], expected.history["loss"])
    assert int(candidate.optimizer.iterations) == int(reference.optimizer.iterations)


def test_rereading_shuffled_arrays_every_epoch_builds_the_cut_once(monkeypatch):
    # With steps_per_epoch each pass over the data is a new iterator. Cut per epoch and
    # cached, shuffled arrays grew by 47 MB over 300 epochs; one cut, whose epoch is a
    # variable, serves them all.
    x, y = data(64)
    built = []
    original = MicroBatches._build

    def counting(self, **kwargs):
        built.append(kwargs["shuffle_seed"])
        return original(self, **kwargs)

    monkeypatch.setattr(MicroBatches, "_build", counting)
    model = make_mlp()
    autosplit.fit_large_batch(model, x, y, batch_size=32, micro_batch_size=16, epochs=12,
                              steps_per_epoch=2, verbose=0)
    assert int(model.optimizer.iterations) == 24
    assert len(built) <= 2  # the element spec's unseeded cut, and the seeded one


@pytest.mark.parametrize("batched", [True, False])
def test_steps_per_epoch_past_an_input_of_unknown_length_reads_it_again(batched):
    # Keras learns the count of batches where the data first ends and reads the data
    # again in the next epoch; autosplit stopped training there (2 epochs of 4). 160
    # rows, B = 32: 5 large batches a pass, 3 + 2 + 3 + 2 over 4 epochs.
    x, y = data(160)
    reference, candidate = twin(make_mlp, (x[:16], y[:16], None))

    def unknown():  # a filter hides the length (cardinality unknown)
        ds = tf.data.Dataset.from_tensor_slices((x, y)).filter(lambda a, b: True)
        return ds.batch(32) if batched else ds

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = reference.fit(unknown() if batched else unknown().batch(32),
                                 steps_per_epoch=3, epochs=4, verbose=0)
        got = autosplit.fit_large_batch(candidate, unknown(), batch_size=32,
                                        micro_batch_size=16, steps_per_epoch=3, epochs=4,
                                        verbose=0)
    assert len(got.history["loss"]) == len(expected.history["loss"]) == 4
    # Keras also counts its steps that found the data ended (12); 10 large batches ran.
    assert int(candidate.optimizer.iterations) == 10
    assert_weights_close(reference.get_weights(), candidate.get_weights(), 1e-5)
    np.testing.assert_allclose(got.history["loss"], expected.history["loss"], rtol=1e-5)
