"""tf.distribute: MirroredStrategy on two logical CPUs, MultiWorkerMirroredStrategy with
two worker processes on localhost; each compared with the single-device full batch."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).parent
pytestmark = pytest.mark.slow


def child_env(**extra):
    env = dict(os.environ, PYTHONPATH=f"{HERE.parent}:{HERE}", TF_CPP_MIN_LOG_LEVEL="2")
    env.update(extra)
    return env


def test_mirrored_strategy_two_logical_cpus(tmp_path):
    out = tmp_path / "mirrored.json"
    done = subprocess.run([sys.executable, str(HERE / "strategy_child.py"), "mirrored",
                           str(out)], env=child_env(), capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["replicas"] == 2
    assert report["sgd"] <= 1e-5 and report["adam"] <= 1e-4, report
    assert report["sgd_iterations"] == report["adam_iterations"] == 6  # 2 epochs x 3
    # Gradients are all-reduced once per update: never inside the micro-batch loop, and
    # the count does not grow with the accumulation steps.
    assert report["all_reduces_k2"]["loop_body"] == report["all_reduces_k10"]["loop_body"] == 0
    assert report["all_reduces_k2"] == report["all_reduces_k10"]
    assert report["all_reduces_k2"]["main"] >= report["trainable_variables"]
    assert "divide evenly across the 2 replicas" in report["errors"]["indivisible"]
    assert 1 <= report["auto_micro_batch_size"] <= 20  # per replica: 40 / 2


def free_ports(n):
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def run_workers(tmp_path, **extra):
    cluster = {"worker": [f"127.0.0.1:{p}" for p in free_ports(2)]}
    procs, outs = [], []
    for index in range(2):
        tf_config = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})
        env = child_env(TF_CONFIG=tf_config, **(extra if index == 1 else {}))
        env.setdefault("AUTOSPLIT_TEST_COLLECTIVE_TIMEOUT", "30")
        out = tmp_path / f"worker{index}.json"
        outs.append(out)
        procs.append(subprocess.Popen([sys.executable, str(HERE / "strategy_child.py"),
                                       "worker", str(out)], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    codes = []
    for proc in procs:
        try:
            proc.wait(timeout=240)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail("a worker hung past 240 s")
        codes.append(proc.returncode)
    return codes, outs


def test_multi_worker_mirrored_two_processes(tmp_path):
    codes, outs = run_workers(tmp_path)
    assert codes == [0, 0]
    for out in outs:
        report = json.loads(out.read_text())
        assert "error" not in report, report
        assert report["adam"] <= 1e-4 and report["iterations"] == 6
        assert "explicit `micro_batch_size`" in report["auto_refused"]


def test_a_dead_worker_makes_the_other_fail_clearly_and_soon(tmp_path):
    started = time.monotonic()
    codes, outs = run_workers(tmp_path, AUTOSPLIT_TEST_DIE_AFTER="0")
    elapsed = time.monotonic() - started
    assert codes[1] == 17  # the worker that died
    survivor = json.loads(outs[0].read_text())
    assert survivor["error"].startswith("WorkerLostError"), survivor
    assert "stopped answering" in survivor["error"]
    assert elapsed < 200
