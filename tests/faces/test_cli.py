"""The CLI in-process (``main([...])``) and as a real subprocess."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from autosplit.cli import EXIT_NOTHING_FITS, EXIT_OK, EXIT_USAGE, _demo_summary, main

ROOT = Path(__file__).parents[2]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))


@pytest.mark.slow
def test_probe_json_in_process(capsys):
    code = main(["probe", "--model", "mlp", "--input-shape", "32", "--batch-size", "256",
                 "--json", "--no-cache"])
    assert code == EXIT_OK
    result = json.loads(capsys.readouterr().out)
    assert 1 <= result["micro_batch_size"] <= 256
    assert result["accumulation_steps"] == -(-256 // result["micro_batch_size"])
    assert result["trials"] and {"micro_batch_size", "fits", "oom", "peak_bytes",
                                 "seconds"} <= set(result["trials"][0])


@pytest.mark.slow
def test_probe_table_with_report(capsys):
    code = main(["probe", "--model", "cnn", "--input-shape", "16,16,3", "--batch-size", "64",
                 "--report"])
    out = capsys.readouterr().out
    assert code == EXIT_OK
    assert "micro-batch" in out and "chosen" in out and "memory model" in out


@pytest.mark.parametrize("argv", [
    ["probe", "--model", "alexnet", "--input-shape", "32", "--batch-size", "8"],
    ["probe", "--model", "mlp", "--input-shape", "32,x", "--batch-size", "8"],
    ["probe", "--model", "mlp", "--input-shape", "32", "--batch-size", "0"],
    ["probe", "--model", "mlp", "--input-shape", "32", "--batch-size", "8",
     "--memory-limit", "lots"],
    ["probe", "--model", "nosuchmodule:build", "--input-shape", "32", "--batch-size", "8"],
    ["probe", "--input-shape", "32"],
    ["frobnicate"],
], ids=["unknown-model", "bad-shape", "bad-batch", "bad-memory", "bad-module", "missing",
        "bad-command"])
def test_usage_errors_exit_2(argv, capsys):
    assert main(argv) == EXIT_USAGE
    assert capsys.readouterr().err


@pytest.mark.slow
def test_module_function_model(tmp_path, monkeypatch, capsys):
    (tmp_path / "mymodels.py").write_text(
        "import keras\n"
        "def build(shape):\n"
        "    m = keras.Sequential([keras.Input(shape), keras.layers.Dense(10)])\n"
        "    m.compile(optimizer='sgd', loss=keras.losses.SparseCategoricalCrossentropy(True))\n"
        "    return m\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["probe", "--model", "mymodels:build", "--input-shape", "4",
                 "--batch-size", "32", "--json"]) == EXIT_OK
    assert json.loads(capsys.readouterr().out)["batch_size"] == 32


def run_cli(*args, timeout=300):
    env = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="2")
    return subprocess.run([sys.executable, "-m", "autosplit", *args], env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)


@pytest.mark.slow
def test_probe_subprocess_under_a_real_cap_json():
    done = run_cli("probe", "--model", "mlp", "--input-shape", "64", "--batch-size", "2048",
                   "--memory-limit", "64MiB", "--json", "--no-cache")
    assert done.returncode == EXIT_OK, done.stderr[-2000:]
    result = json.loads(done.stdout)
    assert result["device"]["limit_source"] == "tf-bfc-cap"
    assert result["peak_source"] == "tf-allocator"
    assert result["memory_limit_bytes"] == 64 * 2**20


@pytest.mark.slow
def test_probe_subprocess_nothing_fits_exits_3():
    done = run_cli("probe", "--model", "mlp", "--input-shape", "64", "--batch-size", "64",
                   "--memory-limit", "64MiB", "--headroom", "0.99", "--json", "--no-cache")
    assert done.returncode == EXIT_NOTHING_FITS, done.stderr[-2000:]
    assert json.loads(done.stdout)["error"] == "nothing_fits"


def test_demo_summary_reads_the_fit_report():
    from autosplit.training.fit import FitReport
    from autosplit.training.recovery import OomRecovery

    report = FitReport(
        batch_size=4096, micro_batch_size=683, accumulation_steps=6, padded_rows=2,
        micro_batch_reason="given", input="arrays", batch_norm="pooled", replicas=1,
        workers=1, micro_batch_sizes=(683,), oom_recoveries=(OomRecovery(0, 1366, 683),),
        probe=SimpleNamespace(trials=(None,) * 7), traces=1)
    assert _demo_summary(report, 12, 2.5, 0.25).splitlines() == [
        "", "summary",
        "  target batch        4096",
        "  micro-batch         683 (found by 7 trials of the real step)",
        "  accumulation steps  6",
        "  optimizer steps     12",
        "  loss before/after   2.5000 -> 0.2500",
        "  out of memory       step 0: 1366 -> 683 rows"]
    given = dataclasses.replace(report, probe=None, oom_recoveries=())
    assert "  micro-batch         683 (given)" in _demo_summary(given, 12, 2.5, 0.25)
