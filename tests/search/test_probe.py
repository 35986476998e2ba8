"""The micro-batch search: real trials, bitwise-restored state, cache, real caps."""

from __future__ import annotations

import gc
import json

import keras
import numpy as np
import pytest
import tensorflow as tf
from common import classifier, labelled, run_child

import autosplit
from autosplit.data.inputs import get_input
from autosplit.errors import MemoryLimitError
from autosplit.memory.peak_meter import PeakMeter
from autosplit.search.probe import ProbeResult, invalidate_cache, probe


def small_model():
    return classifier(16, 64, 4, keras.optimizers.Adam(1e-3))


def data(n=512):
    return labelled(n, 16, 4)


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path / "autosplit"


def state(model):
    return ([np.array(v.numpy(), copy=True) for v in model.variables]
            + [np.array(v.numpy(), copy=True) for v in model.optimizer.variables]
            + [np.array(v.numpy(), copy=True) for v in model.metrics_variables])


@pytest.mark.slow
def test_probe_leaves_state_bitwise_unchanged_and_round_trips(cache_home):
    model = small_model()
    autosplit.keras_hooks.internals.symbolic_build(model, (data()[0][:8], data()[1][:8], None))
    before = state(model)
    result = probe(model, data(), batch_size=256, cache=False)
    after = state(model)
    assert all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))
    assert int(model.optimizer.iterations) == 0
    assert 1 <= result.micro_batch_size <= 256
    assert result.accumulation_steps == -(-256 // result.micro_batch_size)
    assert result.trials and all(t.seconds >= 0 for t in result.trials)
    assert result.peak_source == PeakMeter().source
    again = ProbeResult.from_dict(json.loads(result.to_json()))
    assert again == result


@pytest.mark.slow
def test_trials_scan_only_new_objects_and_the_collector_is_left_as_found(cache_home):
    # Between trials what survived the last collection is frozen (gc.freeze), so each
    # collection scans only that trial's objects; afterwards nothing stays frozen.
    assert gc.get_freeze_count() == 0
    frozen = []
    probe(small_model(), data(), batch_size=256, cache=False,
          on_trial=lambda trial, budget: frozen.append(gc.get_freeze_count()))
    assert frozen and all(count > 0 for count in frozen)
    assert gc.get_freeze_count() == 0
    # A process that froze its own objects keeps its freeze: none added, none released
    # (a frozen object whose last reference goes is still freed: a few fewer).
    gc.freeze()
    try:
        mine = gc.get_freeze_count()
        frozen.clear()
        probe(small_model(), data(), batch_size=256, cache=False,
              on_trial=lambda trial, budget: frozen.append(gc.get_freeze_count()))
        assert all(mine - 100 <= count <= mine
                   for count in [*frozen, gc.get_freeze_count()])
    finally:
        gc.unfreeze()


@pytest.mark.slow
def test_trials_pull_trainings_elements_with_autotuning_off(cache_home, monkeypatch):
    # A trial is too short for tf.data's autotuning to tune anything: its thread only
    # took CPU from the step, and deleting a trial's iterator waited up to 1.2 s for it.
    # Training on this CPU machine runs the same pipeline: autotuning's buffers would
    # be memory the trials never saw.
    from autosplit.search import runner

    made = []

    def spy(cut):
        made.append((cut, trials_dataset(cut)))
        return made[-1][1]

    trials_dataset = runner.trial_dataset
    monkeypatch.setattr(runner, "trial_dataset", spy)
    result = probe(small_model(), data(), batch_size=256, cache=False)
    assert len(made) == len(result.trials) >= 2
    for cut, pulled in made:
        training = cut.dataset(repeat=True, shuffle_seed=runner.TRIAL_SHUFFLE_SEED)
        assert pulled.options().autotune.enabled is False
        assert training.options().autotune.enabled is False
        for a, b in zip(pulled.take(3), training.take(3), strict=True):
            assert all(np.array_equal(p, q) for p, q in
                       zip(tf_flat(a), tf_flat(b), strict=True))


@pytest.mark.slow
def test_a_trial_over_the_budget_after_one_measured_step_stops_there(monkeypatch):
    # Real trial steps and a real meter; only the budget is chosen: 1 byte (every
    # measured step is over it) or unbounded.
    from autosplit.data.layout import ALONE
    from autosplit.data.pipeline import MicroBatches
    from autosplit.search.trials import TrialRunner
    from autosplit.step.snapshot import Snapshot
    from autosplit.step.train_step import build_for, step_for

    model, adapter = small_model(), get_input(*data(256), shuffle=False)
    pipeline = MicroBatches(adapter, 256, 8)
    build_for(model, pipeline.element_spec(), 1)
    step = step_for(model, pipeline)
    runs, original = [], TrialRunner._step
    monkeypatch.setattr(TrialRunner, "_step",
                        lambda self, *a, **k: runs.append(1) or original(self, *a, **k))
    before = state(model)
    for budget, steps in ((1, 2), (2**62, 3)):
        runner = TrialRunner(step, Snapshot(model), PeakMeter("CPU:0"), budget, adapter,
                             256, ALONE, lambda trial: None)
        runs.clear()
        trial = runner.trial(64)
        runner.collector.close()
        assert len(runs) == steps  # the warm-up, then one measured step or both
        assert trial.fits == (budget > 1) and not trial.oom and trial.peak_bytes > 1
        assert trial.samples_per_second > 0
    assert all(np.array_equal(a, b) for a, b in zip(before, state(model), strict=True))


def test_training_autotunes_its_pipeline_only_when_the_step_runs_on_a_gpu(monkeypatch):
    # On a GPU autotuning's buffers are host memory, outside the budget the probe
    # measured; on the CPU they are the step's own memory.
    from autosplit.data import pipeline

    cut = pipeline.MicroBatches(get_input(*data(64), shuffle=False), 32, 16)
    assert cut.dataset().options().autotune.enabled is False
    gpu = [tf.config.LogicalDevice("/device:GPU:0", "GPU")]
    monkeypatch.setattr(tf.config, "list_logical_devices",
                        lambda kind=None: gpu if kind == "GPU" else [])
    assert pipeline.host_autotune()
    on_gpu = cut.dataset(repeat=True)
    assert on_gpu.options().autotune.enabled is True
    assert cut.dataset(repeat=True, autotune=False).options().autotune.enabled is False
    assert cut.dataset(repeat=True) is on_gpu  # each variant built once


def tf_flat(element):
    return [np.asarray(t) for t in keras.tree.flatten(element)]


@pytest.mark.slow
def test_whole_batch_fits_means_no_split(cache_home):
    result = probe(small_model(), data(), batch_size=64, cache=False)
    assert result.micro_batch_size == 64 and result.accumulation_steps == 1


@pytest.mark.slow
def test_cache_hit_bypass_and_invalidation(cache_home):
    model = small_model()
    first = probe(model, data(), batch_size=128)
    assert not first.from_cache and list(cache_home.glob("probe-*.json"))
    second = probe(model, data(), batch_size=128)
    assert second.from_cache and second.micro_batch_size == first.micro_batch_size
    assert second.seconds == first.seconds  # nothing re-measured
    assert not probe(model, data(), batch_size=128, cache=False).from_cache
    invalidate_cache(second)
    assert not list(cache_home.glob("probe-*.json"))
    # A different budget is a different entry.
    other = probe(model, data(), batch_size=128, headroom=0.2)
    assert other.cache_key != first.cache_key


def test_limit_below_what_the_process_holds_is_refused(cache_home):
    with pytest.raises(MemoryLimitError, match="above what the process already holds"):
        probe(small_model(), data(), batch_size=64, memory_limit="1KiB", cache=False)


@pytest.mark.parametrize("bad", ["6 gigs", "-1GiB", 0, "GiB"])
def test_bad_memory_strings(bad, cache_home):
    with pytest.raises(MemoryLimitError, match="Received"):
        probe(small_model(), data(), batch_size=64, memory_limit=bad, cache=False)


@pytest.mark.slow
def test_fit_with_auto_micro_batch(cache_home):
    x, y = data(300)
    history = autosplit.fit_large_batch(small_model(), (x, y), batch_size=100, verbose=0)
    report = history.autosplit
    assert report.probe.micro_batch_size == report.micro_batch_size
    assert report.accumulation_steps == -(-100 // report.micro_batch_size)
    assert report.to_dict()["probe"] == report.probe.to_dict()
    json.dumps(report.to_dict())


@pytest.mark.slow
@pytest.mark.parametrize("rows", [300, 290])
def test_training_runs_the_step_its_probe_traced_at_the_chosen_size(cache_home, rows):
    # A trial traces the step as training at its size will run it (whole elements where
    # the input has no padding row, the padding check where it may): training after a
    # probe traces nothing more.
    x, y = data(rows)
    history = autosplit.fit_large_batch(small_model(), (x, y), batch_size=100,
                                        shuffle=False, verbose=0)
    report = history.autosplit
    assert report.micro_batch_size in [t.micro_batch_size for t in report.probe.trials]
    assert report.traces == 0


@pytest.mark.slow
def test_a_seeded_fit_that_probes_shuffles_as_one_given_its_micro_batch(cache_home):
    # keras.utils.set_random_seed fixes TensorFlow's sequence of op seeds, and the
    # training shuffle takes one. The probe's trial pipelines must take none, or the
    # order would depend on how many trials memory noise made the search run.
    x, y = data(300)

    def trained(micro_batch_size):
        keras.utils.set_random_seed(7)
        model = small_model()
        history = autosplit.fit_large_batch(model, x, y, batch_size=100, epochs=2,
                                            verbose=0, micro_batch_size=micro_batch_size,
                                            cache=False)
        return history.autosplit, [w.numpy() for w in model.weights]

    searched, got = trained("auto")
    assert searched.probe is not None and len(searched.probe.trials) >= 2
    given, expected = trained(searched.micro_batch_size)
    assert given.probe is None
    assert all(np.array_equal(a, b) for a, b in zip(got, expected, strict=True))


@pytest.mark.slow
def test_under_a_real_cap_the_choice_trains_and_twice_it_does_not(tmp_path):
    report, _ = run_child("probe", tmp_path, 72)
    result = report["result"]
    assert result["peak_source"] == "tf-allocator"
    assert result["device"]["limit_source"] == "tf-bfc-cap"
    assert report["weights_unchanged"] and report["optimizer_unchanged"]
    assert report["chosen_trained"]
    assert 1 < result["micro_batch_size"] < 4096
    if result["accumulation_steps"] > 1:  # within 2x of the true maximum
        assert report["bigger"] >= 2 * result["micro_batch_size"]
        assert report["bigger_fits"] is False, report
    assert result["measured_peak_bytes"] <= result["budget_bytes"]
    # Every trial read what was held around it (the search's last check uses them).
    assert all(0 < t["held_before"] <= t["peak_bytes"] for t in result["trials"] if t["fits"])
    assert all(t["held_after"] > 0 for t in result["trials"])


@pytest.mark.slow
def test_nothing_fits_raises_with_what_one_example_needs(tmp_path):
    """Real trials under a real cap, with a budget just above what the model holds."""
    report, _ = run_child("nothing", tmp_path, 128)
    assert report["error"] == "NothingFitsError"
    assert "Not even a micro-batch of 1 example fits" in report["message"]
    assert report["budget_bytes"] > 0
    assert report["weights_unchanged"]


@pytest.mark.slow
def test_the_choice_on_arrays_trains_from_every_input_kind(tmp_path):
    """Under a real cap: the probe (on arrays, as `autosplit probe` runs) picks m with its
    default 10% headroom, and an epoch at m fits with arrays, a dataset of examples and a
    batched one (each holds its own copy of the 4 MiB of data, on top of the model)."""
    report, _ = run_child("kinds", tmp_path, 72)
    m = report["micro_batch_size"]
    assert 1 < m < 4096, report
    for kind in ("arrays", "examples", "batched"):
        assert report["kinds"][kind]["trained"], (kind, report)
        assert report["kinds"][kind]["micro_batch_size"] == m


@pytest.mark.slow
def test_objective_speed_times_real_trials_and_says_why(cache_home):
    model = small_model()
    autosplit.keras_hooks.internals.symbolic_build(model, (data()[0][:8], data()[1][:8], None))
    before = state(model)
    result = probe(model, data(), batch_size=256, objective="speed")
    assert all(np.array_equal(a, b) for a, b in zip(before, state(model), strict=True))
    fitting = [t for t in result.trials if t.fits]
    assert fitting and all(t.samples_per_second > 0 for t in fitting)
    assert result.objective == "speed" and "samples/s" in result.speed_reason
    assert result.micro_batch_size in {t.micro_batch_size for t in fitting}
    assert "objective='speed'" in result.reason()
    assert ProbeResult.from_dict(json.loads(result.to_json())) == result
    # The objective is part of the cache key: a memory search does not reuse it.
    assert not probe(model, data(), batch_size=256).from_cache
    assert probe(model, data(), batch_size=256, objective="speed").from_cache
    with pytest.raises(ValueError, match="objective"):
        probe(model, data(), batch_size=256, objective="fast")
