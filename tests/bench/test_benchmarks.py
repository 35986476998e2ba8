"""The benchmarks: the shared harness, each script's checks and searches, the training
methods they compare, and a quick end-to-end run of every script.

The quick runs are real: capped child processes under a real TensorFlow memory cap
(plain Keras raises a real ``ResourceExhaustedError`` in ``memory_scaling``), the JSON,
the Markdown and the PNG. They are marked slow; everything else runs in seconds on
fakes and hand-computed numbers.
"""

from __future__ import annotations

import json
import math
import subprocess
import time

import keras
import numpy as np
import pytest

from autosplit import capped
from benchmarks import (
    batchnorm_stats,
    gpu_check,
    harness,
    memory_scaling,
    overhead,
    probe_choices,
    probe_search,
    sequences,
    step_costs,
    workloads,
)

ROOT = harness.ROOT
MiB = 2**20
PNG = b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------- the harness


def test_tables_align_the_first_column_left_and_the_rest_right():
    header, rows = ["method", "n"], [["a", "1"], ["bb", "100"]]
    assert harness.text_table(header, rows) == ("method    n\n"
                                                "------  ---\n"
                                                "a         1\n"
                                                "bb      100")
    assert harness.md_table(header, rows) == ["| method | n |", "|---|---:|", "| a | 1 |",
                                              "| bb | 100 |"]


def test_write_report_writes_json_markdown_and_png_or_nothing(tmp_path):
    panel = harness.Panel("peaks", "MiB", [
        harness.Series("a", [512, 1024], [10.0, 11.0], failed=[2048], failed_y=64.0),
        harness.Series("b", [512, 2048], [20.0, 40.0], marker="s")],
        logy=True, hline=(64.0, "cap 64 MiB"), xticks=[512, 1024, 2048])
    report = {"numbers": [1, 2.5]}
    paths = harness.write_report(tmp_path / "out", "bench", report, "# bench\n",
                                 lambda path: harness.line_plot(path, [[panel, panel], [panel]],
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


# ---------------------------------------------------------------- memory_scaling


def ok(peak, rate=1000.0, **extra):
    return {"status": "ok", "peak_mib": peak, "samples_per_s": rate, "held_mib": 1.0,
            "peak_source": "tf-allocator", **extra}


def oom():
    return {"status": "OOM", "peak_mib": "OOM", "samples_per_s": "OOM", "oom_where": "training"}


def scaling_model():
    """Two sizes; one large batch of inputs at B = 16384 is 16384 * 1024 bytes = 16 MiB."""
    def point(B, methods):
        return {"batch_size": B, "accumulation_steps": B // 128, "methods": methods}

    return {"label": "toy", "cap_mib": 96, "rows": 32768, "micro_batch_size": 128,
            "example_bytes": 1024, "trainable_weight_bytes": 4 * MiB, "points": [
                point(512, {"autosplit_examples": ok(40.0), "autosplit_arrays": ok(30.0),
                            "autosplit_batched": ok(40.0), "keras": ok(50.0),
                            "keras_accumulation": ok(41.0), "bare_loop": ok(39.0)}),
                # growth: examples +3 (target met), arrays +19 (<= 16 + 3), batched +21 (MISS)
                point(16384, {"autosplit_examples": ok(43.0), "autosplit_arrays": ok(49.0),
                              "autosplit_batched": ok(61.0, oom_recoveries=[{"step": 1}]),
                              "keras": oom(), "keras_accumulation": ok(50.0),
                              "bare_loop": ok(40.0)})]}


def test_memory_scaling_checks_worked_by_hand():
    checks = {c["id"]: c for c in memory_scaling.checks_for("toy", scaling_model())}
    assert {k: c["status"] for k, c in checks.items()} == {
        "a-examples": "PASS", "a-arrays": "PASS", "a-batched": "MISS",
        "b-examples": "PASS", "b-arrays": "PASS", "b-batched": "MISS", "c": "PASS"}
    a = checks["a-examples"]
    assert (a["input_batch_mib"], a["growth_mib"], a["allowed_mib"]) == (16.0, 3.0, 20.0)
    assert a["target_met"] is True and checks["a-arrays"]["target_met"] is False
    assert [r["ratio"] for r in checks["b-batched"]["rows"]] == pytest.approx([40 / 41, 61 / 50])
    assert checks["c"]["keras_oom"] == [16384]


def test_memory_scaling_checks_miss_or_say_not_run():
    model = scaling_model()
    model["points"][1]["methods"]["keras"] = ok(90.0)  # the cap never bit plain Keras
    model["points"][1]["methods"]["autosplit_arrays"] = oom()
    checks = {c["id"]: c for c in memory_scaling.checks_for("toy", model)}
    assert checks["c"]["status"] == "MISS" and checks["a-arrays"]["status"] == "N/A"
    for point in model["points"]:
        point["methods"]["keras"] = memory_scaling.NOT_RUN
    assert {c["id"]: c["status"] for c in memory_scaling.checks_for("toy", model)}["c"] == "N/A"


def test_memory_scaling_report_and_plot_from_a_synthetic_run(tmp_path):
    model = scaling_model()
    report = {"question": memory_scaling.QUESTION, "command": "python -m benchmarks.x",
              "units": memory_scaling.UNITS, "machine": harness.machine_info(),
              "settings": {"micro_batch_size": 128, "repeats": 2}, "models": {"toy": model},
              "checks": memory_scaling.checks_for("toy", model),
              "notes": memory_scaling.notes({"toy": model})}
    text = memory_scaling.markdown(report)
    assert "| 16384 | 128 | 43.0 | 49.0 | 61.0* | **OOM** | 50.0 | 40.0 |" in text
    assert "- (a-batched) **MISS**" in text
    assert any("recovered from an OOM" in n for n in report["notes"])
    memory_scaling.plot(report, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").read_bytes()[:8] == PNG


# ---------------------------------------------------------------- probe_search


def threshold(limit, tried):
    def fits(m):
        tried.append(m)
        return m <= limit
    return fits


def test_searches_try_exactly_these_sizes():
    tried = []
    assert probe_search.bisection(4096, threshold(1000, tried)) == 1000
    assert tried == [2048, 1024, 512, 768, 896, 960, 992, 1008, 1000, 1004, 1002, 1001]
    tried = []
    assert probe_search.lightning_binsearch(4096, threshold(1000, tried)) == 1000
    assert tried == [2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 768, 896, 960, 992, 1008, 1000,
                     1004, 1002, 1001]
    tried = []
    assert probe_search.accelerate_backoff(4096, threshold(1000, tried)) == 933
    assert tried == [4096, 3686, 3317, 2985, 2686, 2417, 2175, 1957, 1761, 1584, 1425, 1282,
                     1153, 1037, 933]
    assert probe_search.accelerate_backoff(8, threshold(0, [])) == 0
    assert probe_search.bisection(8, threshold(0, [])) == 0


def trial(rows, fits=True, oom=False, peak=30 * MiB, seconds=1.0):
    return {"micro_batch_size": rows, "rows": rows, "fits": fits, "oom": oom,
            "peak_bytes": None if oom else peak, "seconds": seconds}


def test_probe_search_summary_checks_and_notes_by_hand():
    raw = {"exhaustive": {"found": 2000, "seconds": 100.0, "unsplit_fits": False,
                          "largest_split": 2000, "confirm": {"2000": False, "2001": False},
                          "trials": [trial(4096, False, True), trial(2000)]},
           "autosplit": {"found": 1900, "seconds": 20.0,
                         "trials": [trial(64), trial(1024), trial(2100, False, True),
                                    trial(1900, peak=60 * MiB)]},
           "autosplit_headroom": {"found": 1700, "seconds": 20.0, "trials": [trial(1700)]},
           "lightning": {"found": 2048, "seconds": 90.0,
                         "trials": [trial(2)] * 12},
           "accelerate": {"found": 2417, "seconds": 50.0,
                          "trials": [trial(4096, False, True)] * 5 + [trial(2417)]}}
    summary = probe_search.summarise(raw)
    assert summary["autosplit"]["fraction_of_true_max"] == pytest.approx(0.95)
    assert (summary["autosplit"]["trials"], summary["autosplit"]["ooms"]) == (4, 1)
    assert summary["autosplit"]["peak_mib_at_found"] == 60.0
    assert summary["autosplit"]["sequence"] == "64 1024 2100x 1900"
    series = [{"batch_size": 1024, "accumulation_steps": 2, "seconds_per_trial": 2.0},
              {"batch_size": 8192, "accumulation_steps": 12, "seconds_per_trial": 2.5}]
    checks = {c["id"]: c["status"] for c in probe_search.checks(summary, series)}
    assert checks == {"close": "PASS", "trials": "PASS", "ooms": "MISS", "seconds": "PASS",
                      "flat": "PASS"}
    series[1]["seconds_per_trial"] = 4.0
    assert probe_search.checks(summary, series)[-1]["status"] == "MISS"
    notes = probe_search.notes({"raw": raw, "methods": summary})
    assert any("did NOT fit again" in n for n in notes)
    assert any("accelerate" in n and "2417" in n for n in notes)
    raw["autosplit"] = {"status": "OOM", "error": "crashed (SIGSEGV) under the cap"}
    failed = probe_search.checks(probe_search.summarise(raw), series)
    assert [c["status"] for c in failed[:4]] == ["N/A"] * 4


def test_probe_search_series_averages_trials_that_did_not_run_out_of_memory():
    [row] = probe_search.series_summary([{"batch_size": 4096, "found": 512,
                                          "accumulation_steps": 8, "seconds": 14.0,
                                          "trials": [trial(64, seconds=1.0),
                                                     trial(1024, False, True, seconds=10.0),
                                                     trial(512, seconds=3.0)]}])
    assert (row["trials"], row["ooms"], row["seconds_per_trial"]) == (3, 1, 2.0)


# ---------------------------------------------------------------- the methods


def test_bare_loop_is_one_exact_full_batch_step():
    spec = workloads.mlp_spec(8, (16,))
    x, y = workloads.synthetic(64, spec.input_shape, seed=3)
    reference, bare = (workloads.build_model(spec, seed=1) for _ in range(2))
    for model in (reference, bare):  # SGD: a step proportional to the gradient
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss=reference.loss)
    reference.train_on_batch(x, y)
    clock = workloads.EpochMeter(None, samples_per_epoch=64, warmup=0)
    workloads.bare_loop(bare, x, y, batch_size=64, micro_batch_size=16, epochs=1, callback=clock)
    assert int(bare.optimizer.iterations) == 1 and clock.records[0]["applies"] == 1
    for expected, actual in zip(reference.get_weights(), bare.get_weights(), strict=True):
        np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="multiple"):
        workloads.bare_loop(bare, x, y, batch_size=64, micro_batch_size=24, epochs=1,
                            callback=clock)


@pytest.mark.parametrize("method, rows, k, applies", [
    ("autosplit_examples", 32, 4, 2), ("autosplit_arrays", 32, 4, 2),
    ("autosplit_batched", 32, 4, 2), ("keras", 128, 1, 2), ("keras_at_m", 32, 1, 8),
    ("keras_accumulation", 32, 4, 2), ("bare_loop", 32, 4, 2)])
def test_every_method_trains_and_counts_its_applies(method, rows, k, applies):
    """256 rows, B = 128, m = 32: two applies per epoch, but eight for plain Keras at m."""
    spec = workloads.mlp_spec(8, (16,))
    x, y = workloads.synthetic(256, spec.input_shape)
    r = workloads.measure(method, spec, x, y, batch_size=128, micro_batch_size=32, repeats=1)
    assert r["status"] == "ok", r
    assert (r["micro_batch_size"], r["accumulation_steps"]) == (rows, k)
    assert [e["applies"] for e in r["epochs"]] == [applies]
    assert r["peak_mib"] > 0 and r["samples_per_s"] > 0


# ---------------------------------------------------------------- overhead and gpu_check


def test_overhead_checks_every_target_per_epoch_and_per_call():
    def rate(epoch, call):
        # Two repeats each: the paired ratio pairs each repeat with the baseline's.
        return {"samples_per_s_best": epoch, "call_samples_per_s_best": call,
                "samples_per_s_all": [epoch, epoch / 2], "call_samples_per_s_all": [call, call]}

    cases = {
        "mlp": {"name": "mlp", "targets": [("autosplit_arrays", "bare_loop", 0.95),
                                           ("autosplit_batched", "bare_batched", 0.95)],
                "methods": {"autosplit_arrays": rate(96.0, 80.0), "bare_loop": rate(100.0, 100.0),
                            "autosplit_batched": rate(50.0, 50.0),
                            "bare_batched": rate(50.0, 40.0)}},
        "encoder": {"name": "encoder", "targets": [("autosplit_examples", "keras_at_m", 1.0)],
                    "methods": {"autosplit_examples": rate(99.0, 120.0),
                                "keras_at_m": rate(100.0, 100.0)}}}
    checks = overhead.checks(cases)
    assert [(c["id"], c["status"]) for c in checks] == [
        ("mlp:autosplit_arrays:per-epoch", "PASS"), ("mlp:autosplit_arrays:per-call", "MISS"),
        ("mlp:autosplit_batched:per-epoch", "PASS"), ("mlp:autosplit_batched:per-call", "PASS"),
        ("encoder:autosplit_examples:per-epoch", "MISS"),
        ("encoder:autosplit_examples:per-call", "PASS")]
    assert [c["ratio"] for c in checks] == pytest.approx([0.96, 0.8, 1.0, 1.25, 0.99, 1.2])
    # The status is the best over best; the paired ratio, against the check's own
    # baseline, is reported beside it.
    assert checks[0]["summary"].endswith("(target >= 0.95; paired 0.96)")
    assert checks[3]["summary"].endswith("(target >= 0.95; paired 1.25)")


def test_overhead_set_up_is_the_call_beyond_its_epochs_at_steady_speed():
    # 2 timed epochs of 4 s in all: the warm-up epoch at that speed is 2 s more, so a
    # 10 s call spent 4 s on set-up, tracing and the warm-up's own extra.
    assert overhead.setup_seconds({"call_seconds": 10.0, "seconds": 4.0}, 2) == 4.0


def test_gpu_check_checks_growth_per_input_kind_and_speed():
    def point(B, examples, arrays):  # the peaks above what was held: what the check reads
        return {"batch_size": B, "methods": {
            "autosplit_examples": ok(50.0, step_peak_mib=examples),
            "autosplit_arrays": ok(50.0, step_peak_mib=arrays)}}

    report = {"example_bytes": 1024, "points": [point(512, 100.0, 100.0),
                                                point(16384, 103.0, 130.0)],
              "speed": {"batch_size": 16384, "micro_batch_size": 128,
                        "methods": {"autosplit_arrays": {"ratio": 0.97}}}}
    checks = {c["id"]: c for c in gpu_check.checks(report)}
    assert checks["a-examples"]["status"] == "PASS" and checks["a-examples"]["target_met"]
    assert checks["a-arrays"]["status"] == "MISS"  # 30 MiB > 16 + 10
    assert checks["speed"]["status"] == "PASS"


@pytest.mark.parametrize("module, argv", [
    (memory_scaling, ["--quick", "--repeats", "0"]),
    (memory_scaling, ["--quick", "--methods", "resnet"]),
    (overhead, ["--quick", "--epochs", "0"]),
    (overhead, ["--quick", "--cases", "medium_k"]),
    (probe_search, ["--quick", "--batch-size", "0"]),
    (gpu_check, ["--quick", "--repeats", "0"]),
    (batchnorm_stats, ["--quick", "--ks", "3"]),
    (step_costs, ["--quick", "--repeats", "0"]),
    (probe_choices, ["--quick", "--repeats", "0"]),
    (sequences, ["--quick", "--models", "bert"]),
])
def test_bad_flags_exit_before_anything_runs(module, argv):
    with pytest.raises(SystemExit, match="Expected"):
        module.main(argv)


def test_probe_choices_compares_answers_on_the_small_batch_grid():
    assert probe_choices.grid(512)[:6] == [512, 256, 171, 128, 103, 86]
    # 4096's 256 and 274 both round down to 512's 256; 241 rounds to 171, one step on.
    assert probe_choices.steps_apart(512, 256, 274) == 0
    assert probe_choices.steps_apart(512, 256, 241) == 1
    assert probe_choices.steps_apart(512, 512, 241) == 2


def _probe_run(batch_size, chosen, seconds, speeds=()):
    trials = [{"micro_batch_size": m, "fits": True, "oom": False, "peak_bytes": 1,
               "seconds": 1.0, "samples_per_second": v} for m, v in speeds]
    return {"batch_size": batch_size, "micro_batch_size": chosen, "seconds": seconds,
            "ooms": 0, "wall_s": seconds + 5, "trials": trials, "reason": "r"}


def test_probe_choices_checks_answer_time_and_the_speed_rule():
    s = probe_choices.QUICK
    same = {64: [_probe_run(64, 32, 4.0)], 128: [_probe_run(128, 32, 5.0)]}
    speed = [{**_probe_run(128, 32, 3.0, [(32, 100.0), (22, 104.0)]), "model": "mlp 32"}]
    checks = {c["id"]: c for c in probe_choices.checks(same, speed, s)}
    assert checks["same"]["status"] == "PASS" and checks["time"]["status"] == "PASS"
    assert checks["speed-mlp 32"]["status"] == "PASS"  # 4% faster: the largest is kept
    speed[0]["micro_batch_size"] = 22  # kept a size only 4% faster: against the rule
    same[128] = [_probe_run(128, 16, 9.0)]  # two sizes of 64's grid away, 2.25x the time
    checks = {c["id"]: c for c in probe_choices.checks(same, speed, s)}
    assert [checks[k]["status"] for k in ("same", "time", "speed-mlp 32")] == [
        "MISS", "MISS", "MISS"]
    assert [p["micro_batch_size"] for p in probe_choices.curve(speed[0])] == [32, 22]
    # A size that fit once and then ran out of memory is out of the curve, as it is out
    # of the probe's rule: 22 is then the largest, and keeping it follows the rule.
    speed[0]["trials"].append({**speed[0]["trials"][0], "fits": False, "oom": True,
                               "samples_per_second": None})
    assert [p["micro_batch_size"] for p in probe_choices.curve(speed[0])] == [22]
    checks = {c["id"]: c for c in probe_choices.checks(same, speed, s)}
    assert checks["speed-mlp 32"]["status"] == "PASS"
    # The rule is decided on the timings in turn (A B B A): 22 led on a first timing of
    # 120 and its mean still leads by 7%, but in turn it ran 1.01x the largest.
    timed = [(32, 100.0), (22, 120.0), (32, 100.0), (22, 101.0), (22, 101.0), (32, 100.0)]
    speed = [{**_probe_run(128, 32, 3.0, timed), "model": "mlp 32"}]
    assert probe_choices.in_turn(speed[0]) == {22: pytest.approx(1.01)}
    checks = {c["id"]: c for c in probe_choices.checks(same, speed, s)}
    assert checks["speed-mlp 32"]["status"] == "PASS"
    speed[0]["micro_batch_size"] = 22
    checks = {c["id"]: c for c in probe_choices.checks(same, speed, s)}
    assert checks["speed-mlp 32"]["status"] == "MISS"
    # Never timed in turn while its mean leads by more than 5%: the probe broke its rule.
    speed = [{**_probe_run(128, 32, 3.0, [(32, 100.0), (22, 107.0)]), "model": "mlp 32"}]
    checks = {c["id"]: c for c in probe_choices.checks(same, speed, s)}
    assert checks["speed-mlp 32"]["status"] == "MISS"


# ---------------------------------------------------------------- quick runs, end to end


def read(folder, name):
    assert (folder / f"{name}.md").read_text().startswith("# ")
    return json.loads((folder / f"{name}.json").read_text())


@pytest.mark.slow
def test_memory_scaling_quick_run_under_a_real_cap(tmp_path):
    methods = "autosplit_batched,keras"
    assert memory_scaling.main(["--quick", "--jobs", "3", "--methods", methods,
                                "--out", str(tmp_path)]) == 0
    report = read(tmp_path, "memory_scaling")
    [model] = report["models"].values()
    assert [p["batch_size"] for p in model["points"]] == [512, 1024]
    for p in model["points"]:
        r = p["methods"]["autosplit_batched"]
        assert r["status"] == "ok" and r["peak_source"] == "tf-allocator"
        assert (r["micro_batch_size"], r["accumulation_steps"]) == (128, p["batch_size"] // 128)
        assert r["input"] == "batched tf.data.Dataset" and 0 < r["peak_mib"] < 64
        assert p["methods"]["bare_loop"]["status"] == "not run"
    # Plain Keras fits at 512 and meets the cap at 1024: a real ResourceExhaustedError.
    assert [p["methods"]["keras"]["status"] for p in model["points"]] == ["ok", "OOM"]
    checks = {c["id"]: c["status"] for c in report["checks"]}
    assert checks["c"] == "PASS" and checks["a-batched"] in ("PASS", "MISS")
    assert checks["a-arrays"] == checks["b-batched"] == "N/A"
    assert (tmp_path / "memory_scaling.png").read_bytes()[:8] == PNG


@pytest.mark.slow
def test_overhead_quick_run(tmp_path):
    assert overhead.main(["--quick", "--out", str(tmp_path)]) == 0
    report = read(tmp_path, "overhead")
    cases = report["cases"]
    assert list(cases) == ["mlp128", "cnn", "deep", "encoder", "large_k"]
    mlp = cases["mlp128"]
    # 2048 rows: 2 applies per epoch at B = 1024, 32 at model.fit's m = 64.
    assert {m: r["applies_per_epoch"] for m, r in mlp["methods"].items()} == {
        "autosplit_arrays": 2, "autosplit_examples": 2, "autosplit_batched": 2,
        "bare_loop": 2, "bare_batched": 2, "keras_at_m": 32, "keras_accumulation": 2,
        "hand_loop": 2}
    assert mlp["methods"]["bare_loop"]["ratio"] == 1.0
    assert all(r["call_samples_per_s_best"] > 0 and math.isfinite(r["setup_seconds"])
               for c in cases.values() for r in c["methods"].values())
    assert cases["large_k"]["accumulation_steps"] == 32
    # The Dense stack of 8 layers (18 variables): 1024 rows, B = 512, m = 64.
    assert {m: r["applies_per_epoch"] for m, r in cases["deep"]["methods"].items()} == {
        "autosplit_arrays": 2, "autosplit_examples": 2, "bare_loop": 2, "keras_at_m": 16}
    # Every target twice: per epoch and per call.
    assert len(report["checks"]) == 2 * sum(len(c["targets"]) for c in cases.values()) == 20


@pytest.mark.slow
def test_step_costs_quick_run_restores_the_library(tmp_path):
    from autosplit.step import sums, update

    before = (sums.Stash.put, update.update_metrics, sums.Stash.record)
    assert step_costs.main(["--quick", "--out", str(tmp_path)]) == 0
    assert (sums.Stash.put, update.update_metrics, sums.Stash.record) == before
    report = read(tmp_path, "step_costs")
    variants = report["variants"]
    assert list(variants) == list(step_costs.VARIANTS)
    assert variants["bare"]["ratio_to_bare"] == 1.0
    assert all(r["samples_per_s"] > 0 and r["us_per_micro_batch"] > 0 for r in variants.values())
    assert set(report["iterator_ms"]) == {"bare", "arrays", "examples"}
    assert all(ms > 0 for ms in report["iterator_ms"].values())


@pytest.mark.slow
def test_probe_search_quick_run_under_a_real_cap(tmp_path):
    assert probe_search.main(["--quick", "--jobs", "2", "--out", str(tmp_path)]) == 0
    report = read(tmp_path, "probe_search")
    assert report["raw"]["exhaustive"]["unsplit_fits"] is True  # the quick cap holds B = 256
    for method, r in report["methods"].items():
        assert 0 < r["found"] <= 256 and r["trials"] >= 1 and r["ooms"] == 0, (method, r)
        assert r["error"] is None
    assert [r["batch_size"] for r in report["series"]] == [256, 512]
    assert all(r["seconds_per_trial"] > 0 for r in report["series"])
    assert [c["id"] for c in report["checks"]] == ["close", "trials", "ooms", "seconds", "flat"]
    assert (tmp_path / "probe_search.png").read_bytes()[:8] == PNG


@pytest.mark.slow
def test_gpu_check_quick_run_on_the_cpu_path(tmp_path):
    assert gpu_check.main(["--quick", "--out", str(tmp_path)]) == 0
    report = read(tmp_path, "gpu_check")
    assert report["device"]["kind"] in ("CPU", "GPU")
    assert report["probe"]["status"] == "ok" and report["probe"]["trials"]
    assert [p["batch_size"] for p in report["points"]] == [256, 512]
    for p in report["points"]:
        for method in gpu_check.METHODS:
            r = p["methods"][method]
            assert r["status"] == "ok" and r["peak_mib"] > 0
            assert r["peak_mib"] >= r["step_peak_mib"] >= 0
    assert report["speed"]["methods"]["autosplit_arrays"]["ratio"] > 0
    assert [c["id"] for c in report["checks"]] == ["a-examples", "a-arrays", "speed"]
    assert (tmp_path / "gpu_check.png").read_bytes()[:8] == PNG


@pytest.mark.slow
def test_sequences_quick_run(tmp_path):
    assert sequences.main(["--quick", "--models", "gru", "--out", str(tmp_path)]) == 0
    result = read(tmp_path, "sequences")["results"]["gru"]
    assert set(result) == set(sequences.METHODS)
    # The shares are counted, not timed: the cut by length feeds the same real tokens
    # with less padding than the row cut, as the bare loop does on the same cut.
    assert result["by_length"]["padding_share"] == result["bare_loop"]["padding_share"]
    assert result["by_length"]["padding_share"] < result["rows"]["padding_share"]
    assert all(r["tokens_per_s"] > 0 for r in result.values())


def test_sequences_checks_follow_the_figures():
    def run(vs_rows, vs_bare, share):
        return {"vs_rows": vs_rows, "vs_bare_loop": vs_bare, "padding_share": share}

    results = {"gru": {"rows": run(1.0, 0.3, 0.8), "by_length": run(2.5, 0.95, 0.35)}}
    assert [c["status"] for c in sequences.checks(results)] == ["PASS"] * 3
    results["gru"]["by_length"] = run(1.9, 0.85, 0.45)
    assert [c["status"] for c in sequences.checks(results)] == ["MISS"] * 3


@pytest.mark.slow
def test_batchnorm_stats_quick_run(tmp_path):
    assert batchnorm_stats.main(["--quick", "--out", str(tmp_path)]) == 0
    report = read(tmp_path, "batchnorm_stats")
    [model] = report["models"].values()  # quick: bn_first only
    assert model["layers"] == ["bn_input", "bn1", "bn2", "bn3"]
    assert [(r["k"], r["mode"]) for r in model["runs"]] == [
        (1, "pooled"), (1, "micro"), (4, "pooled"), (4, "micro")]
    for r in model["runs"]:
        assert r["applies"] == 4 and 0 <= r["held_out_accuracy"] <= 1
        assert set(r["layers"]) == set(model["layers"]) and r["weights_rel"] >= 0
    # The robust fact: BatchNormalization on the raw inputs sees the same rows whatever
    # the weights, so pooling reproduces model.fit's moving statistics; micro does not.
    pooled, micro = (batchnorm_stats.find(model, 4, mode)["layers"]["bn_input"]
                     for mode in ("pooled", "micro"))
    assert pooled["variance_rel"] < 1e-4 and pooled["mean_in_std"] < 1e-4
    assert micro["variance_rel"] > 1e-2
    for r in [model["reference"], *model["runs"]]:  # the float64 statistics, the yardstick
        if r.get("mode") != "micro" or r["k"] == 1:
            assert r["bn_input_vs_float64"]["variance_rel"] < 1e-4, r
    checks = {c["id"]: c["status"] for c in report["checks"]}
    assert checks == {"first-layer": "PASS", "k1": "PASS", "deeper": checks["deeper"]}
    assert (tmp_path / "batchnorm_stats.png").read_bytes()[:8] == PNG


@pytest.mark.slow
def test_probe_choices_quick_run_through_the_command_line(tmp_path):
    assert probe_choices.main(["--quick", "--out", str(tmp_path)]) == 0
    report = read(tmp_path, "probe_choices")
    runs = [r for runs in report["same"].values() for r in runs]
    assert [r["batch_size"] for r in runs] == [64, 128]
    for r in runs + report["speed"]:
        assert "error" not in r, r
        assert r["micro_batch_size"] >= 1 and r["trials"] and r["seconds"] > 0
    [speed] = report["speed"]
    assert speed["objective"] == "speed" and probe_choices.curve(speed)
    assert [c["id"] for c in report["checks"]] == ["same", "time", "speed-mlp 32"]
