"""``autosplit check`` on the command line: JSON out, exit 0 when exact, 1 when not, 2 on
bad usage."""

from __future__ import annotations

import json

import pytest

from autosplit.cli import EXIT_NOT_EXACT, EXIT_OK, EXIT_USAGE, main


def test_cli_check_exact_json_exit_0(capsys):
    code = main(["check", "--model", "mlp", "--input-shape", "12", "--batch-size", "20",
                 "--micro-batch-size", "8", "--json"])
    assert code == EXIT_OK
    result = json.loads(capsys.readouterr().out)
    assert result["exact"] and result["max_relative_difference"] < 1e-5
    assert result["accumulation_steps"] == 3 and result["culprits"] == []


def test_cli_check_batch_norm_exits_1(tmp_path, monkeypatch, capsys):
    (tmp_path / "bnmodels.py").write_text(
        "import keras\n"
        "def build(shape):\n"
        "    m = keras.Sequential([keras.Input(shape), keras.layers.Dense(8),\n"
        "                          keras.layers.BatchNormalization(), keras.layers.Dense(10)])\n"
        "    m.compile(optimizer='sgd', loss=keras.losses.SparseCategoricalCrossentropy(True))\n"
        "    return m\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    code = main(["check", "--model", "bnmodels:build", "--input-shape", "6",
                 "--batch-size", "16", "--micro-batch-size", "4"])
    out = capsys.readouterr().out
    assert code == EXIT_NOT_EXACT
    assert "NOT exact" in out and "BatchNormalization" in out


@pytest.mark.slow
def test_cli_check_mobilenet_v2_exits_1(capsys):
    code = main(["check", "--model", "mobilenet_v2", "--input-shape", "32,32,3",
                 "--batch-size", "8", "--micro-batch-size", "4", "--json"])
    assert code == EXIT_NOT_EXACT
    culprits = json.loads(capsys.readouterr().out)["culprits"]
    assert culprits and {c["class_name"] for c in culprits} == {"BatchNormalization"}


@pytest.mark.parametrize("argv", [
    ["check", "--model", "mlp", "--input-shape", "12", "--batch-size", "8",
     "--micro-batch-size", "0"],
    ["check", "--model", "mlp", "--input-shape", "12", "--batch-size", "8"],
    ["check", "--model", "alexnet", "--input-shape", "12", "--batch-size", "8",
     "--micro-batch-size", "4"],
    ["check", "--model", "nosuchmodule:build", "--input-shape", "12", "--batch-size", "8",
     "--micro-batch-size", "4"],
], ids=["bad-micro", "missing-micro", "unknown-model", "bad-module"])
def test_cli_check_usage_errors_exit_2(argv, capsys):
    assert main(argv) == EXIT_USAGE
    assert capsys.readouterr().err
