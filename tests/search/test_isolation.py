"""Probe trials in a child process (autosplit.search.isolation): a kernel that crashes when an
allocation fails under TensorFlow's CPU cap costs one trial, never the run.

The real-cap test keeps oneDNN on, as a user's TensorFlow has it: its convolution,
pooling and batch normalization kernels end the process (SIGSEGV) on an allocation
failure, and the test needs them to.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
from common import classifier, labelled, run_child

import autosplit
from autosplit.search.isolation import kernels_may_crash


def test_isolate_takes_a_bool_or_none():
    x, y = labelled(64, 6, 3)
    model = classifier(6, 8, 3)
    with pytest.raises(autosplit.ArgumentError, match=r"`isolate`.*Received: isolate='yes'"):
        autosplit.probe(model, x, y, batch_size=64, isolate="yes")


def test_no_cap_no_crash_no_child():
    # The test process has TensorFlow's plain CPU allocator: nothing can fail to allocate.
    assert kernels_may_crash() is False


@pytest.mark.slow
def test_an_isolated_probe_finds_what_the_in_process_probe_finds():
    x, y = labelled(256, 6, 3)
    model = classifier(6, 8, 3, keras.optimizers.Adam(1e-3))
    autosplit.keras_hooks.internals.symbolic_build(model, (x[:8], y[:8], None))
    before = [w.copy() for w in model.get_weights()]
    isolated = autosplit.probe(model, x, y, batch_size=256, isolate=True, cache=False)
    here = autosplit.probe(model, x, y, batch_size=256, isolate=False, cache=False)
    assert isolated.micro_batch_size == here.micro_batch_size == 256
    assert [t.fits for t in isolated.trials] == [True] * len(isolated.trials)
    assert not any(t.crashed for t in isolated.trials)
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights(), strict=True))
    assert int(model.optimizer.iterations) == 0


@pytest.mark.slow
def test_a_model_the_child_cannot_load_is_probed_here_with_a_warning():
    class Unregistered(keras.layers.Layer):  # keras.saving.load_model cannot find it
        def call(self, x):
            return x

    x, y = labelled(64, 6, 3)
    model = keras.Sequential([keras.Input((6,)), Unregistered(), keras.layers.Dense(3)])
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    with pytest.warns(UserWarning, match="trials run in this process.*register_keras_serializable"):
        result = autosplit.probe(model, x, y, batch_size=64, isolate=True, cache=False)
    assert result.micro_batch_size == 64


def test_a_crashed_trial_is_an_out_of_memory_one():
    trial = autosplit.Trial(512, False, True, None, 1.0, crashed=True)
    assert autosplit.search.probe.format_trial(trial, 2**20).split()[2] == "crashed"


@pytest.mark.slow
def test_under_a_real_cap_a_trial_that_ends_its_process_costs_one_trial(tmp_path):
    """A wide CNN under a 600 MiB cap. Its trial at 512 rows runs out of memory in a child
    process: with oneDNN on, its convolution ends the child (SIGSEGV); without oneDNN (the
    default on x86 CPUs without AVX512_VNNI, AVX512_BF16 or AMX, as many AMD EPYC hosts
    are), the kernel raises, and a step first run near the cap can still end the child in
    TensorFlow's constant folding. Either way the process lives on, the probe ends with a
    size, leaving the model as it was, and fit_large_batch given 512 rows starts at a size
    whose trial ran and trains as a run given that size does (the CNN has no bias
    before its batch normalization, whose gradient nearly cancels:
    ``capped_child.wide_cnn``)."""
    report, _ = run_child("cnn", tmp_path, 600)
    assert report["may_crash"], report
    too_big, small = report["direct"]
    assert too_big["oom"] and not too_big["fits"] and too_big["peak_bytes"] is None
    assert small["fits"] and not small["crashed"]
    assert 1 <= report["probe"]["micro_batch_size"] < 512
    assert report["unchanged"]
    fit = report["fit"]
    assert fit["micro_batch_size"] < 512 and report["warnings"], report
    assert all(("ended its process" in w) != ("ran out of memory" in w)
               for w in report["warnings"]), report["warnings"]
    assert fit["oom_recoveries"] == [], fit  # the checked size ran here too
    assert report["iterations"] == 2
    # the same micro-batches (BatchNormalization normalises each with its own statistics)
    assert report["reference_sizes"] == [fit["micro_batch_size"], 0], report
    assert report["error"] <= 1e-5, report["error"]
