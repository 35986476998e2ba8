"""Canaries: what autosplit relies on in Keras and TensorFlow beyond their public API,
each checked directly, so that a release that changes one fails here, by name, instead
of somewhere deep in a training run. Every reliance is reached through one function of
``autosplit.keras_hooks`` (named in each message); ``internals.CHECKED_ON`` gives the
versions they were last checked on.
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from autosplit.keras_hooks import internals


def _broken(what: str, where: str) -> str:
    return (f"Keras {keras.__version__} / TensorFlow {tf.__version__}: {what}. autosplit "
            f"relies on it in {where} (checked on {internals.CHECKED_ON}); update that "
            "function for this release.")


def test_batch_normalization_computes_its_moments_in_one_method_and_assigns_its_moving_ones():
    layer = keras.layers.BatchNormalization()
    layer.build((None, 3))
    calls, assigned = [], []
    original = layer._moments
    object.__setattr__(layer, "_moments", lambda *a, **k: calls.append(1) or original(*a, **k))
    for variable in (layer.moving_mean, layer.moving_variance):
        assign = variable.assign
        object.__setattr__(variable, "assign",
                           lambda value, assign=assign, **k: assigned.append(1) or assign(value))
    layer(np.ones((4, 3), "float32"), training=True)
    assert calls, _broken("BatchNormalization no longer computes its batch statistics in "
                          "`_moments`", "keras_hooks.batchnorm.recording")
    assert len(assigned) == 2, _broken(
        "BatchNormalization no longer updates moving_mean and moving_variance through their "
        "`assign`", "keras_hooks.batchnorm.pooled_layers")


def test_the_default_train_step_applies_through_the_model_s_optimizer():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    applied = []
    apply = model.optimizer.apply
    object.__setattr__(model.optimizer, "apply",
                       lambda *a, **k: applied.append(1) or apply(*a, **k))
    model.train_on_batch(np.ones((2, 2), "float32"), np.ones((2, 1), "float32"))
    assert applied, _broken("the train step no longer applies gradients through "
                            "`model.optimizer.apply`", "keras_hooks.interception.intercept")
    for name in ("apply_gradients", "apply"):
        assert callable(getattr(keras.optimizers.Optimizer, name, None)), _broken(
            f"Optimizer.{name} is gone", "keras_hooks.interception.intercept")


def test_tensorflow_s_tape_and_variables_have_the_methods_that_are_watched():
    from tensorflow.python.ops import resource_variable_ops

    assert callable(getattr(tf.GradientTape, "gradient", None)), _broken(
        "tf.GradientTape.gradient is gone", "keras_hooks.interception.watch_targets")
    for name in ("assign", "assign_add", "assign_sub"):
        assert callable(getattr(resource_variable_ops.BaseResourceVariable, name, None)), \
            _broken(f"BaseResourceVariable.{name} is gone",
                    "keras_hooks.interception.watch_writes")


def test_the_compiled_loss_metrics_and_trackers_are_where_internals_reads_them():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss=keras.losses.MeanSquaredError(), metrics=["mae"])
    x, y = np.ones((4, 2), "float32"), np.ones((4, 2), "float32")
    internals.symbolic_build(model, (x, y, None))
    readings = {
        "flat_losses": lambda: internals.flat_losses(model),
        "has_compiled_loss": lambda: internals.has_compiled_loss(model),
        "compile_loss_built": lambda: internals.compile_loss_built(model),
        "metric_lists": lambda: internals.metric_lists(model),
        "all_metrics": lambda: internals.all_metrics(model),
        "loss_tracker": lambda: internals.loss_tracker(model),
        "output_loss_trackers": lambda: internals.output_loss_trackers(model),
        "call_has_training_arg": lambda: internals.call_has_training_arg(model),
        "flatten_layers": lambda: internals.flatten_layers(model),
        "user_losses": lambda: internals.user_losses(model),
    }
    for name, read in readings.items():
        try:
            read()
        except (AttributeError, KeyError, TypeError) as error:
            raise AssertionError(_broken(f"{type(error).__name__}: {error}",
                                         f"keras_hooks.internals.{name}")) from error
    (flat,) = internals.flat_losses(model)
    assert isinstance(flat.loss, keras.losses.MeanSquaredError), _broken(
        "the compiled loss no longer lists its losses", "keras_hooks.internals.flat_losses")
    assert internals.loss_tracker(model) is not None, _broken(
        "the model's loss tracker moved", "keras_hooks.internals.loss_tracker")


def test_backup_and_restore_says_where_to_resume_on_the_model(tmp_path):
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.ones((4, 2), "float32"), np.ones((4, 1), "float32")
    backup = keras.callbacks.BackupAndRestore(str(tmp_path), delete_checkpoint=False)
    model.fit(x, y, epochs=2, verbose=0, callbacks=[backup])
    backup.set_model(model)
    backup.on_train_begin()
    assert internals.resume_epoch(model) == 2, _broken(
        "BackupAndRestore no longer sets `model._initial_epoch`",
        "keras_hooks.internals.resume_epoch")


def test_the_global_seed_generator_lives_in_keras_global_state():
    from keras.src.backend.common import global_state
    from keras.src.random import seed_generator

    generator = seed_generator.global_seed_generator()
    assert global_state.get_global_attribute("global_seed_generator") is generator, _broken(
        "the global SeedGenerator is no longer kept as global_state's "
        "'global_seed_generator'", "keras_hooks.internals.global_seed_generator_kept")


def test_a_compile_makes_new_state_where_compile_state_reads_it():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile("sgd", "mse", metrics=["mae"])
    first = internals.compile_state(model)
    assert all(part is not None for part in first), _broken(
        "the model's loss tracker, compiled loss or compiled metrics moved",
        "keras_hooks.internals.compile_state")
    model.compile("sgd", "mse", metrics=["mae"])
    assert all(a is not b for a, b in zip(first, internals.compile_state(model), strict=True)), (
        _broken("a second compile() keeps its compile state objects",
                "keras_hooks.internals.compile_state"))


def test_tensorflow_says_whether_onednn_runs():
    assert internals.onednn_enabled() in (True, False), _broken(
        "_pywrap_util_port.IsMklEnabled is gone", "keras_hooks.internals.onednn_enabled")


def test_tf_data_graphs_hold_what_tf_data_reads():
    from autosplit.keras_hooks import tf_data

    examples = tf.data.Dataset.range(10)
    batched = examples.batch(4, drop_remainder=True)
    assert type(batched).__name__ in tf_data._BATCHES and type(
        examples.padded_batch(4)).__name__ in tf_data._BATCHES, _broken(
        "batch() and padded_batch() datasets have other class names", "keras_hooks.tf_data")
    assert (int(batched._batch_size), bool(batched._drop_remainder),
            batched._input_dataset) == (4, True, examples), _broken(
        "a batch dataset no longer holds _batch_size, _drop_remainder, _input_dataset",
        "keras_hooks.tf_data.counted_rows")
    assert tf_data.counted_rows(batched.prefetch(1).cache().shuffle(2)) == 8, _broken(
        "prefetch, cache or shuffle datasets have other class names or inputs",
        "keras_hooks.tf_data._KEEP_ROWS")
    zipped = tf.data.Dataset.zip((batched, batched))
    assert list(zipped._inputs()) == [batched, batched], _broken(
        "a dataset's _inputs() no longer lists its inputs", "keras_hooks.tf_data._dataset_inputs")
    assert tf_data.batch_rows(tf.data.Dataset.from_tensors(np.zeros((5, 2)))) == 5, _broken(
        "from_tensors has another class name", "keras_hooks.tf_data.batch_rows")
    assert tf_data.draws_randomness(examples.map(lambda x: x + tf.random.uniform([], 0, 2,
                                                                                 tf.int64))), (
        _broken("a map dataset no longer holds its function's graph",
                "keras_hooks.tf_data.draws_randomness"))
    assert not tf_data.draws_randomness(examples.map(lambda x: x + 1))
    assert tf_data.counted_rows(batched.cache("/tmp/autosplit-canary-cache")) is None, _broken(
        "a cache in a file no longer holds _filename", "keras_hooks.tf_data._batching")


def test_distributed_datasets_keep_one_tf_data_pipeline_per_input_worker():
    from autosplit.keras_hooks.distribute import worker_pipeline

    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    batches = tf.data.Dataset.range(10).batch(4)
    fitted = strategy.experimental_distribute_dataset(batches)
    pipeline = worker_pipeline(fitted)
    assert pipeline is not None and [len(b) for b in pipeline] == [4, 4, 2], _broken(
        "experimental_distribute_dataset no longer keeps its per-worker pipelines in "
        "`_cloned_datasets`", "keras_hooks.distribute.worker_pipeline")
    built = strategy.distribute_datasets_from_function(
        lambda context: tf.data.Dataset.range(6).batch(context.get_per_replica_batch_size(4)))
    pipeline = worker_pipeline(built)
    assert pipeline is not None and [len(b) for b in pipeline] == [4, 2], _broken(
        "distribute_datasets_from_function no longer keeps its per-worker pipelines in "
        "`_datasets`", "keras_hooks.distribute.worker_pipeline")
