"""tf.distribute: MirroredStrategy on two logical CPUs, MultiWorkerMirroredStrategy with
two worker processes on localhost; each compared with the single-device full batch."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from common import assert_weights_close, child_env, local_workers

from autosplit.capped import capped_cpu_env

HERE = Path(__file__).parents[1]  # tests/, beside the child scripts
pytestmark = pytest.mark.slow


def run_scenario(scenario, tmp_path):
    """strategy_child.py's ``scenario`` in a child process: the report it wrote."""
    out = tmp_path / f"{scenario}.json"
    done = subprocess.run([sys.executable, str(HERE / "strategy_child.py"), scenario,
                           str(out)], env=child_env(), capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def test_mirrored_strategy_two_logical_cpus(tmp_path):
    report = run_scenario("mirrored", tmp_path)
    assert report["replicas"] == 2
    assert report["sgd"] <= 1e-5 and report["adam"] <= 1e-4, report
    assert report["sgd_iterations"] == report["adam_iterations"] == 6  # 2 epochs x 3
    # A batched dataset read by one iterator whose epochs end at a marker.
    assert report["batched_40"] <= 1e-5 and report["batched_50"] <= 1e-5, report
    assert (report["batched_40_iterations"], report["batched_50_iterations"]) == (6, 4)
    # Gradients are all-reduced once per update: never inside the micro-batch loop, and
    # the count does not grow with the accumulation steps.
    assert report["all_reduces_k2"]["loop_body"] == report["all_reduces_k10"]["loop_body"] == 0
    assert report["all_reduces_k2"] == report["all_reduces_k10"]
    assert report["all_reduces_k2"]["main"] >= report["trainable_variables"]
    assert "divide evenly across the 2 replicas" in report["errors"]["indivisible"]
    assert 1 <= report["auto_micro_batch_size"] <= 20  # per replica: 40 / 2
    # tf.distribute inputs, two per-replica batches a step
    assert report["distributed_dataset"] <= 1e-5 and report["from_function"] <= 1e-5, report
    # synchronized BatchNormalization: global counts, moving statistics pooled exactly
    assert report["bn_synchronized"] <= 1e-5, report["bn_synchronized"]
    # Pairs of two lengths cut by length on two replicas (tests/data/test_replicas.py
    # has the padding's figures), with the padding fed reported.
    pairs = report["pairs"]
    assert pairs["error"] <= 1e-5, pairs
    assert pairs["padding"].startswith("by length on 2 replicas"), pairs
    assert 0 < pairs["padding_share"] < 1


def test_mixed_float16_on_two_replicas_overflows_where_model_fit_does(tmp_path):
    # Each replica's float16 gradients of its 64 rows overflow where model.fit's do under
    # the same strategy: one decision for both, the same loss scale and iterations.
    report = run_scenario("mixed", tmp_path)
    for name in ("overflows", "small"):
        case = report[name]
        assert case["autosplit"] == case["model_fit"], case
        assert case["error"] <= 2e-3, case
    assert report["overflows"]["model_fit"][-1][1] < 8  # 2 epochs of 4: some skipped


def test_called_inside_the_strategy_scope_trains_as_outside(tmp_path):
    """Users indent everything under `with strategy.scope():`, and model.fit works there:
    fit_large_batch (its validation too), probe, check and accumulate_gradients give what
    they give outside it."""
    report = run_scenario("scope", tmp_path)
    for name, created in (("mirrored", "MirroredVariable"), ("one_device", "ResourceVariable"),
                          ("default", "ResourceVariable")):
        result = report[name]
        assert result["error"] <= 1e-6, (name, result)
        assert result["logs_error"] <= 1e-6, (name, result)
        assert result["log_keys"] == ["accuracy", "loss", "val_accuracy", "val_loss"], result
        assert result["sizes"][0] == result["sizes"][1], (name, result)
        assert result["iterations"] == 6, (name, result)  # 2 epochs x 3 large batches
        assert result["created"] == created, (name, result)  # the caller's scope is intact
        assert result["check_exact"] == [True, True], (name, result)
        assert result["gradients_error"] <= 1e-6, (name, result)


def run_workers(tmp_path, scenario="worker", caps=None, both=None, **extra):
    """Two workers on localhost; ``extra`` environment for worker 1 only, ``both`` for
    both; ``caps`` gives each its own real TensorFlow CPU cap."""
    def env_of(index, env):
        env.update(both or {}, **(extra if index == 1 else {}))
        if caps:
            env = capped_cpu_env(caps[index], env)
        env.setdefault("AUTOSPLIT_TEST_COLLECTIVE_TIMEOUT", "30")
        return env

    outs = [tmp_path / f"worker{index}.json" for index in range(2)]
    codes = local_workers(lambda index: [str(HERE / "strategy_child.py"), scenario,
                                         str(outs[index])], tmp_path, env_of=env_of,
                          timeout=240)
    return codes, outs


def test_multi_worker_mirrored_two_processes(tmp_path):
    codes, outs = run_workers(tmp_path, both={"AUTOSPLIT_TEST_AUTO": "1"})
    assert codes == [0, 0]
    for out in outs:
        report = json.loads(out.read_text())
        assert "error" not in report, report
        assert report["adam"] <= 1e-4 and report["iterations"] == 6
        # micro_batch_size="auto" is searched in lockstep and trains exactly.
        assert report["auto_error"] <= 1e-4, report
        assert report["auto"]["workers"] == 2
        assert report["auto"]["micro_batch_reason"].startswith("worker ")
        assert report["shuffled_error"] <= 1e-4, report  # the workers shuffled alike


def test_a_dead_worker_makes_the_other_fail_clearly_and_soon(tmp_path):
    started = time.monotonic()
    codes, outs = run_workers(tmp_path, AUTOSPLIT_TEST_DIE_AFTER="0")
    elapsed = time.monotonic() - started
    assert codes[1] == 17  # the worker that died
    survivor = json.loads(outs[0].read_text())
    assert survivor["error"].startswith("WorkerLostError"), survivor
    assert "stopped answering" in survivor["error"]
    assert elapsed < 200


def reference_demo_weights():
    """Single-device, full-batch plain Keras on the same data and seed."""
    from strategy_child import demo_data, demo_mlp

    x, y = demo_data()
    model = demo_mlp()
    model.fit(x, y, batch_size=4096, shuffle=False, verbose=0)
    return model.get_weights(), int(model.optimizer.iterations)


def worker_weights(out):
    saved = np.load(str(out) + ".npz")
    return [saved[f"arr_{i}"] for i in range(len(saved))]


# Worker 0 has less memory than worker 1. A share of 2048 rows of the wide demo MLP
# peaks at 45-56 MiB (it varies with the allocator's layout): at 36 MiB it never fits and
# the worker recovers at 1024 or 512 rows (15 of 15 runs); under 44 MiB the search, with
# its 10% headroom, chose 683 or 1024 (8 of 8). The apply's all-reduce needs buffers of
# its largest weight, 1 MiB. With the earlier 128-1024-1024-10 MLP it needed one of
# 4.55 MiB: under a 44 MiB cap, 1 run in 12 found 12 MiB free but no 4.55 MiB hole, and
# failed in the apply, where autosplit assumes memory does not run out (README).
TIGHT = (36 * 2**20, 160 * 2**20)
ROOMY = (44 * 2**20, 160 * 2**20)


@pytest.mark.slow
def test_an_oom_on_one_worker_is_recovered_by_all_and_stays_exact(tmp_path):
    """A fixed micro-batch that only worker 0 cannot fit: it runs out of memory, the
    other waits in the agreement (not in a collective apply), worker 0 finishes the same
    batch in smaller pieces, and both apply once, exactly."""
    codes, outs = run_workers(tmp_path, "capped_worker", caps=TIGHT,
                              both={"AUTOSPLIT_TEST_MICRO": "2048"})
    reports = [json.loads(out.read_text()) for out in outs]
    assert codes == [0, 0], reports
    for report in reports:
        assert "error" not in report, report
        assert report["iterations"] == 2  # 8192 / 4096 large batches, each applied once
    assert reports[0]["autosplit"]["oom_recoveries"], reports[0]
    assert reports[0]["autosplit"]["micro_batch_size"] < 2048
    assert reports[1]["autosplit"]["oom_recoveries"] == []
    assert reports[1]["autosplit"]["micro_batch_size"] == 2048  # each worker its own size
    expected, iterations = reference_demo_weights()
    assert iterations == 2
    for out in outs:
        assert_weights_close(expected, worker_weights(out), 1e-5)
    for a, b in zip(worker_weights(outs[0]), worker_weights(outs[1]), strict=True):
        np.testing.assert_array_equal(a, b)  # the replicas stay identical


@pytest.mark.slow
def test_auto_searches_in_lockstep_each_worker_its_own_size(tmp_path):
    codes, outs = run_workers(tmp_path, "capped_worker", caps=ROOMY,
                              both={"AUTOSPLIT_TEST_MICRO": "auto"})
    reports = [json.loads(out.read_text()) for out in outs]
    assert codes == [0, 0], reports
    sizes = []
    for index, report in enumerate(reports):
        assert "error" not in report, report
        info = report["autosplit"]
        assert info["micro_batch_reason"].startswith(f"worker {index} of 2: ")
        sizes.append(info["micro_batch_size"])
        assert report["iterations"] == 2
    assert sizes[0] < sizes[1], sizes  # each worker the largest size its own memory allows
    expected, _ = reference_demo_weights()
    for out in outs:
        assert_weights_close(expected, worker_weights(out), 1e-5)
