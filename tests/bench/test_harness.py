"""The benchmarks' shared harness: tables, reports, plots, capped children, round robins."""

from __future__ import annotations

import json
import subprocess
import time

import pytest
from _bench import PNG, ROOT, MiB

from autosplit import capped
from benchmarks import (
    harness,
    plots,
)


def test_tables_align_the_first_column_left_and_the_rest_right():
    header, rows = ["method", "n"], [["a", "1"], ["bb", "100"]]
    assert harness.text_table(header, rows) == ("method    n\n"
                                                "------  ---\n"
                                                "a         1\n"
                                                "bb      100")
    assert harness.md_table(header, rows) == ["| method | n |", "|---|---:|", "| a | 1 |",
                                              "| bb | 100 |"]


def test_write_report_writes_json_markdown_and_png_or_nothing(tmp_path):
    panel = plots.Panel("peaks", "MiB", [
        plots.Series("a", [512, 1024], [10.0, 11.0], failed=[2048], failed_y=64.0),
        plots.Series("b", [512, 2048], [20.0, 40.0], marker="s")],
        logy=True, hline=(64.0, "cap 64 MiB"), xticks=[512, 1024, 2048])
    report = {"numbers": [1, 2.5]}
    paths = harness.write_report(tmp_path / "out", "bench", report, "# bench\n",
                                 lambda path: plots.line_plot(path, [[panel, panel], [panel]],
                                                              "title"))
    assert [p.name for p in paths] == ["bench.json", "bench.md", "bench.png"]
    assert json.loads(paths[0].read_text()) == report
    assert paths[1].read_text() == "# bench\n"
    assert paths[2].read_bytes()[:8] == PNG
    assert harness.write_report(None, "bench", report, "# bench\n") == []


def test_quick_runs_write_files_only_where_asked(tmp_path):
    p = harness.parser("d", quick="q", repeats=2)
    assert harness.out_dir(p.parse_args(["--quick"])) is None
    assert harness.out_dir(p.parse_args([])) == harness.RESULTS
    assert harness.out_dir(p.parse_args(["--quick", "--out", str(tmp_path)])) == tmp_path


def test_run_child_is_run_capped_and_says_how_the_child_ended(monkeypatch):
    calls, ends = [], iter([
        capped.CappedRun(0, {"status": "ok", "x": 1}, "", "", 2.0),
        capped.CappedRun(-11, None, "", "Fatal Python error\n", 3.0),
        capped.CappedRun(1, None, "", "Traceback: boom\n", 4.0),
    ])

    def fake(argv, limit, *, timeout, env, capture):
        calls.append((argv, limit, timeout, env, capture))
        return next(ends)

    monkeypatch.setattr(capped, "run_capped", fake)
    ok = harness.run_child("memory_scaling", {"b": 512}, 64, timeout=9)
    crashed = harness.run_child("memory_scaling", {"b": 512}, 64, timeout=9)
    failed = harness.run_child("memory_scaling", {"b": 512}, 64, timeout=9)
    assert ok == {"status": "ok", "x": 1, "child_wall_s": 2.0, "limit_mib": 64}
    assert crashed["status"] == "OOM" and "SIGSEGV" in crashed["oom_where"]
    assert failed["status"] == "error" and "boom" in failed["error"]
    argv, limit, timeout, env, capture = calls[0]
    assert argv == ["-m", "benchmarks.memory_scaling", "--child", '{"b": 512}']
    assert (limit, timeout, capture) == (64 * MiB, 9, True)
    assert env["CUDA_VISIBLE_DEVICES"] == "-1" and str(ROOT) in env["PYTHONPATH"]

    def late(*args, **kwargs):
        raise subprocess.TimeoutExpired("python", 9)

    monkeypatch.setattr(capped, "run_capped", late)
    assert harness.run_child("memory_scaling", {}, 64, timeout=9)["status"] == "error"


def test_serve_child_hands_the_result_back(tmp_path, monkeypatch):
    path = tmp_path / "result.json"
    monkeypatch.setenv(capped.RESULT_ENV, str(path))
    assert harness.serve_child('{"a": 1}', lambda task: {"b": task["a"] + 1}) == 0
    assert json.loads(path.read_text()) == {"b": 2}


def test_run_all_keeps_the_order_of_the_calls():
    def call(i):
        def go():
            time.sleep(0.05 * (3 - i))
            return {"i": i}
        return go

    assert harness.run_all([call(i) for i in range(3)], jobs=3) == [{"i": 0}, {"i": 1}, {"i": 2}]
    assert harness.run_all([call(i) for i in range(2)], jobs=1) == [{"i": 0}, {"i": 1}]


def test_round_robin_rotates_the_order_and_speed_summary_divides_best_by_best(monkeypatch):
    # A full collection before each run cost ~2 s each in a test worker's heap: 12 s.
    monkeypatch.setattr(harness.gc, "collect", lambda: 0)
    order = []
    seconds = {"a": iter([1.0, 2.0]), "b": iter([4.0, 2.0]), "c": iter([8.0, 8.0])}

    def run(name):
        def go():
            order.append(name)
            return {"samples": 100, "seconds": next(seconds[name])}
        return go

    runs = harness.round_robin({n: run(n) for n in "abc"}, 2, lambda line: None)
    assert order == ["a", "b", "c", "b", "c", "a"]
    summary = harness.speed_summary(runs, "b")
    assert summary["a"]["samples_per_s_best"] == pytest.approx(100.0)
    assert summary["a"]["ratio"] == pytest.approx(100.0 / 50.0)
    assert summary["a"]["ratio_median"] == pytest.approx(75.0 / 37.5)
    # Paired: each repeat against b's run beside it, 100/25 and 50/50, their median 2.5.
    assert summary["a"]["ratio_paired"] == pytest.approx(2.5)
    assert summary["c"]["ratio"] == pytest.approx(12.5 / 50.0)


def test_growth_check_by_hand():
    # One input batch of 16 MiB: the bound is 16 + 10% of 40 = 20 MiB, the target 4 MiB.
    c = harness.growth_check(40.0, 45.0, 16.0)
    assert (c["growth_mib"], c["allowed_mib"], c["status"]) == (5.0, 20.0, "PASS")
    assert c["growth_in_batches"] == pytest.approx(5 / 16) and c["target_met"] is False
    assert harness.growth_check(40.0, 43.0, 16.0)["target_met"] is True
    assert harness.growth_check(40.0, 61.0, 16.0)["status"] == "MISS"
    assert harness.growth_check(None, 61.0, 16.0)["status"] == "N/A"
