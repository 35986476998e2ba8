"""Every warning autosplit gives names the user's line, not one of autosplit's own.

Python shows a warning at the frame ``stacklevel`` names, and its default filter shows
it once per location: a warning pinned inside autosplit points the user at the wrong
code and is shown once per process, whatever line called. ``autosplit.warn`` finds the
first frame outside the package; these tests call each warning from here and check
that it names this file and the calling line.
"""

from __future__ import annotations

import inspect
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from common import TwoViews, classifier, labelled, relative_error

import autosplit
from autosplit.memory.device import read_device
from autosplit.testing import inject_oom


def caught(call, category=Warning, match=""):
    """The warnings ``call()`` gives that match, and the line that made the call."""
    line = inspect.currentframe().f_back.f_lineno
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        call()
    found = [w for w in seen if issubclass(w.category, category) and match in str(w.message)]
    assert found, f"no {category.__name__} matching {match!r}: {[str(w.message) for w in seen]}"
    return found, line


def assert_here(found, line):
    for w in found:
        assert (w.filename, w.lineno) == (__file__, line), (w.filename, w.lineno, str(w.message))


def warns_at_the_call(match, *args, **kwargs):
    """``fit_large_batch(*args, **kwargs)`` warns with ``match``, naming its call's line;
    returns the warnings."""
    found, line = caught(lambda: autosplit.fit_large_batch(*args, **kwargs), match=match)
    assert_here(found, line)
    return found


def quiet_and_exact(make, x, y, *, batch_size, micro_batch_size, quiet_about, rtol):
    """``model.fit`` and ``fit_large_batch`` on twins from ``make`` (2 epochs, in
    order): no warning mentions ``quiet_about`` and the weights agree to ``rtol``."""
    reference, candidate = make(), make()
    reference.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        autosplit.fit_large_batch(candidate, x, y, batch_size=batch_size,
                                  micro_batch_size=micro_batch_size, epochs=2,
                                  shuffle=False, verbose=0)
    assert not [w for w in seen if quiet_about in str(w.message)]
    assert relative_error(reference.get_weights(), candidate.get_weights()) < rtol


@pytest.mark.slow
def test_fit_warnings_name_the_callers_line():
    x, y = labelled(64, 8, 3)
    model = classifier(8, 16, 3)
    warns_at_the_call("Both `validation_split`", model, x, y, batch_size=32,
                      micro_batch_size=16, validation_split=0.25, validation_data=(x, y),
                      verbose=0)

    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16),
                              keras.layers.BatchNormalization(), keras.layers.Dense(3)])
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(True))
    warns_at_the_call("BatchNormalization", model, x, y, batch_size=32, micro_batch_size=16,
                      verbose=0)


@pytest.mark.slow
def test_running_out_of_data_names_the_callers_line():
    x, y = labelled(64, 8, 3)

    def batches():
        for start in range(0, 64, 16):
            yield x[start:start + 16], y[start:start + 16]

    model = classifier(8, 16, 3)
    found = warns_at_the_call("ran out of data", model, batches(), batch_size=32,
                              micro_batch_size=16, epochs=2, verbose=0)
    # 2 large batches in the first epoch, 2 epochs asked: 4 (it said 0).
    assert "(4 here)" in str(found[0].message)


@pytest.mark.slow
def test_an_out_of_memory_recovery_names_the_callers_line():
    # The error is injected (autosplit.testing): where the warning points does not depend
    # on where the error came from; recovery from real ones is tested under a real cap
    # in test_oom_recovery.py.
    x, y = labelled(64, 8, 3)
    model = classifier(8, 16, 3)
    with inject_oom(at_steps={1}):
        warns_at_the_call("Out of memory in step 1", model, x, y, batch_size=32,
                          micro_batch_size=16, verbose=0)


@pytest.mark.slow
def test_deprecations_and_device_warnings_name_the_callers_line():
    x, y = labelled(64, 8, 3)
    history = autosplit.fit_large_batch(classifier(8, 16, 3), x, y, batch_size=32,
                                        micro_batch_size=16, verbose=0)
    found, line = caught(lambda: history.autosplit["micro_batch_size"], DeprecationWarning)
    assert_here(found, line)
    found, line = caught(lambda: autosplit.TrainStep, DeprecationWarning)
    assert_here(found, line)
    found, line = caught(lambda: read_device("GPU:0"), RuntimeWarning, match="no GPU")
    assert_here(found, line)


def test_the_old_dict_reads_as_a_mapping_with_a_deprecation_warning_each_time():
    x, y = labelled(64, 8, 3)
    history = autosplit.fit_large_batch(classifier(8, 16, 3), x, y, batch_size=32,
                                        micro_batch_size=16, verbose=0)
    report, expected = history.autosplit, history.autosplit.to_dict()
    uses = {
        "get": (lambda: report.get("micro_batch_size"), 16),
        "get default": (lambda: report.get("nope", 3), 3),
        "keys": (lambda: list(report.keys()), list(expected)),
        "items": (lambda: dict(report.items()), expected),
        "values": (lambda: list(report.values()), list(expected.values())),
        "in": (lambda: "oom_recoveries" in report, True),
        "iter": (lambda: list(report), list(expected)),
        "len": (lambda: len(report), len(expected)),
        "index": (lambda: report["accumulation_steps"], 2),
    }
    for name, (use, value) in uses.items():
        with pytest.warns(DeprecationWarning, match="history.autosplit.*FitReport"):
            assert use() == value, name


def _tokens(optimizer, loss="sparse_categorical_crossentropy"):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((6,), dtype="int32"), keras.layers.Embedding(5, 4),
                              keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(3)])
    model.compile(optimizer=optimizer, loss=loss)
    return model


@pytest.mark.slow
def test_sparse_gradients_with_a_nonlinear_optimizer_are_named_and_differ_from_model_fit():
    # Keras's Adam squares each occurrence's gradient of an Embedding row (tf.IndexedSlices
    # values), where autosplit's dense sums give the square of the batch's gradient: the
    # two differ even at m = B, which the warning says. With SGD they agree and it is quiet,
    # unless SGD clips: Keras clips the slices' values, each occurrence on its own
    # (clipvalue) or counted in the norm apart (clipnorm, global_clipnorm).
    r = np.random.default_rng(0)
    x, y = r.integers(0, 5, size=(64, 6)).astype("int32"), r.integers(0, 3, 64)
    optimizers = {"adam": lambda: "adam", "sgd": lambda: "sgd",
                  "clipvalue": lambda: keras.optimizers.SGD(0.5, clipvalue=0.01),
                  "clipnorm": lambda: keras.optimizers.SGD(0.5, clipnorm=0.05),
                  "global_clipnorm": lambda: keras.optimizers.SGD(0.5, global_clipnorm=0.05)}
    results = {}
    for name, optimizer in optimizers.items():
        reference, candidate = _tokens(optimizer()), _tokens(optimizer())
        reference.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            line = inspect.currentframe().f_lineno + 1
            autosplit.fit_large_batch(candidate, x, y, batch_size=32, micro_batch_size=32,
                                      epochs=2, shuffle=False, verbose=0)
        sparse = [w for w in seen if "sparse gradients" in str(w.message)]
        results[name] = (sparse, relative_error(reference.get_weights(), candidate.get_weights()))
        assert_here(sparse, line)
    assert results["adam"][0] and "Adam" in str(results["adam"][0][0].message)
    assert results["adam"][1] > 1e-3
    assert not results["sgd"][0] and results["sgd"][1] < 1e-5
    for name in ("clipvalue", "clipnorm", "global_clipnorm"):
        assert results[name][0] and name in str(results[name][0][0].message), name
        assert results[name][1] > 1e-3, (name, results[name][1])


class PatchesAndPositions(keras.layers.Layer):
    """keras-io's ViT PatchEncoder: a position Embedding looked up on a fixed arange,
    from a static size or from the input's shape."""

    def __init__(self, from_shape, **kwargs):
        super().__init__(**kwargs)
        self.from_shape = from_shape
        self.position = keras.layers.Embedding(6, 4)

    def call(self, patches):
        count = keras.ops.shape(patches)[1] if self.from_shape else 6
        return patches + self.position(keras.ops.expand_dims(keras.ops.arange(0, count), 0))


@pytest.mark.slow
@pytest.mark.parametrize("from_shape", [False, True])
def test_a_position_embedding_names_each_row_once_and_is_not_warned_about(from_shape):
    # Its gradient is tf.IndexedSlices of indices 0..5, once each: applied per occurrence
    # or densely, the same update (before: the sparse-gradient warning on every ViT).
    def make():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((6, 4))
        hidden = PatchesAndPositions(from_shape)(keras.layers.Dense(4)(inputs))
        model = keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Flatten()(hidden)))
        model.compile(optimizer=keras.optimizers.Adam(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    r = np.random.default_rng(0)
    x, y = r.normal(size=(64, 6, 4)).astype("float32"), r.integers(0, 3, 64)
    quiet_and_exact(make, x, y, batch_size=32, micro_batch_size=12,
                    quiet_about="sparse gradients", rtol=1e-4)


@pytest.mark.slow
def test_a_loss_of_one_value_per_batch_trains_over_the_whole_batch_quietly():
    # keras-io NER's CustomNonPaddingTokenLoss form: a mean over the batch's unmasked
    # tokens, one value per batch, which a split weighed by rows did not reproduce (and
    # warned): the whole-batch step computes it on the whole batch, exactly.
    def token_mean(y_true, y_pred):
        losses = keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True)
        mask = keras.ops.cast(y_true > 0, "float32")
        return keras.ops.sum(losses * mask) / keras.ops.maximum(keras.ops.sum(mask), 1.0)

    r = np.random.default_rng(1)
    x, y = r.integers(0, 5, size=(64, 6)).astype("int32"), r.integers(0, 3, 64)
    quiet_and_exact(lambda: _tokens("sgd", token_mean), x, y, batch_size=32,
                    micro_batch_size=8, quiet_about="one value per batch", rtol=1e-5)


def _contrastive_mean(y_true, y_pred):  # keras-io siamese_contrastive's loss, as written
    y_true = keras.ops.cast(y_true, "float32")
    losses = (1 - y_true) * keras.ops.square(y_pred) + y_true * keras.ops.square(
        keras.ops.maximum(1.0 - y_pred, 0.0))
    return keras.ops.mean(losses)


@pytest.mark.slow
@pytest.mark.parametrize("loss", [
    _contrastive_mean,
    lambda y_true, y_pred: 0.5 * keras.ops.mean(keras.ops.square(y_pred - y_true)),
    lambda y_true, y_pred: -keras.ops.mean(keras.ops.sum(y_true * y_pred, axis=-1)) / 4.0,
    # The Keras guide's CustomMSE: a mean plus a constant times another mean.
    lambda y_true, y_pred: (keras.ops.mean(keras.ops.square(y_true - y_pred))
                            + 0.1 * keras.ops.mean(keras.ops.square(0.5 - y_pred))),
], ids=["mean", "constant_times_mean", "negated_mean_of_row_sums", "mean_plus_penalty"])
def test_a_mean_over_the_rows_returned_as_one_value_is_exact_and_quiet(loss):
    # A plain mean over the batch's rows is the rows-weighed mean of its micro-batches'
    # means: exact, so the per-batch-loss warning (given for ratios) stays quiet.
    r = np.random.default_rng(2)
    x, y = r.normal(size=(60, 4)).astype("float32"), r.uniform(size=(60, 2)).astype("float32")

    def make():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
        return model

    quiet_and_exact(make, x, y, batch_size=30, micro_batch_size=8,
                    quiet_about="one value per batch", rtol=1e-5)


@pytest.mark.slow
def test_a_mean_of_values_that_mix_rows_trains_over_the_whole_batch_quietly():
    # keras-io's supervised-contrastive loss takes a mean over a similarity matrix of
    # the batch's rows (y_pred @ y_pred.T): one value per batch that no weighing of the
    # micro-batches' values reproduced (0.89 relative off model.fit, warned); computed
    # over the whole batch, it is model.fit's.
    def similarity_loss(y_true, y_pred):
        logits = keras.ops.matmul(y_pred, keras.ops.transpose(y_pred))
        return -keras.ops.mean(keras.ops.log_softmax(logits, axis=-1))

    r = np.random.default_rng(2)
    x, y = r.normal(size=(60, 4)).astype("float32"), r.uniform(size=(60, 2)).astype("float32")

    def make():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=similarity_loss)
        return model

    quiet_and_exact(make, x, y, batch_size=30, micro_batch_size=8,
                    quiet_about="one value per batch", rtol=1e-5)


@pytest.mark.slow
def test_a_custom_step_that_differentiates_a_ratio_trains_as_model_fit_quietly():
    # keras-io image captioning: a custom train_step whose loss is a mean over the
    # unmasked tokens, sum(l * mask) / sum(mask). Weighed by rows it was 0.28 relative
    # off model.fit; each micro-batch's gradient is now weighed by its own token count
    # and the sum divided once by the large batch's.
    class TokenMean(keras.Model):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                losses = keras.losses.sparse_categorical_crossentropy(
                    y, self(x, training=True), from_logits=True)
                mask = keras.ops.cast(y > 0, "float32")
                loss = keras.ops.sum(losses * mask) / keras.ops.sum(mask)
            grads = tape.gradient(loss, self.trainable_variables)
            self.optimizer.apply_gradients(zip(grads, self.trainable_variables, strict=True))
            return {"loss": loss}

    r = np.random.default_rng(1)
    x, y = r.integers(0, 5, size=(64, 6)).astype("int32"), r.integers(0, 3, (64, 6))

    def make():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((6,), dtype="int32")
        model = TokenMean(inputs, keras.layers.Dense(3)(keras.layers.Embedding(5, 4)(inputs)))
        model.compile(optimizer=keras.optimizers.SGD(0.1))
        return model

    quiet_and_exact(make, x, y, batch_size=32, micro_batch_size=8, quiet_about="autosplit",
                    rtol=1e-5)


@pytest.mark.slow
def test_the_ghost_batch_norm_note_only_for_layers_that_normalise_with_batch_statistics():
    """SimSiam's and the siamese example's steps call their encoder without
    ``training=True``: Keras 3 then runs BatchNormalization in inference mode, the split
    changes nothing, and the note would be false. Called with ``training=True`` it is
    true."""

    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    for training, expected in ((None, False), (True, True)):
        model = TwoViews(training=training)
        model.compile(optimizer=keras.optimizers.SGD(0.1))
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            autosplit.fit_large_batch(model, x, x + 1.0, batch_size=32, micro_batch_size=16,
                                      verbose=0)
        noted = any("ghost batch norm" in str(w.message) for w in seen)
        assert noted is expected, (training, [str(w.message) for w in seen])
