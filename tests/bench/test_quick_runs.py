"""A quick end-to-end run of every benchmark script. The runs are real: capped child
processes under a real TensorFlow memory cap (plain Keras raises a real
``ResourceExhaustedError`` in ``memory_scaling``), the JSON, the Markdown and the PNG.
"""

from __future__ import annotations

import json
import math

import pytest
from _bench import PNG


def read(folder, name):
    assert (folder / f"{name}.md").read_text().startswith("# ")
    return json.loads((folder / f"{name}.json").read_text())


@pytest.mark.slow
def test_memory_scaling_quick_run_under_a_real_cap(tmp_path):
    from benchmarks import memory_scaling

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
    from benchmarks import overhead

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
    from benchmarks import step_costs

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
    from benchmarks import probe_search

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
    from benchmarks import gpu_check

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
    from benchmarks import sequences

    assert sequences.main(["--quick", "--models", "gru", "--out", str(tmp_path)]) == 0
    result = read(tmp_path, "sequences")["results"]["gru"]
    assert set(result) == set(sequences.METHODS)
    # The shares are counted, not timed: the cut by length feeds the same real tokens
    # with less padding than the row cut, as the bare loop does on the same cut.
    assert result["by_length"]["padding_share"] == result["bare_loop"]["padding_share"]
    assert result["tokens"]["padding_share"] == result["bare_loop_tokens"]["padding_share"]
    assert result["by_length"]["padding_share"] < result["rows"]["padding_share"]
    assert all(r["tokens_per_s"] > 0 for r in result.values())


def test_sequences_checks_follow_the_figures():
    from benchmarks import sequences

    def run(vs_rows, vs_bare, share, peak=100.0):
        return {"vs_rows": vs_rows, "vs_bare_loop": vs_bare, "padding_share": share,
                "tokens_per_s": 1000.0 * vs_rows, "peak_mib": peak}

    results = {"gru": {"rows": run(1.0, 0.3, 0.8), "by_length": run(2.5, 0.95, 0.35),
                       "tokens": run(3.0, 0.95, 0.4, peak=90.0)}}
    assert [c["status"] for c in sequences.checks(results)] == ["PASS"] * 7
    results["gru"]["by_length"] = run(1.9, 0.85, 0.45)
    results["gru"]["tokens"] = run(1.9, 0.85, 0.45, peak=110.0)
    assert [c["status"] for c in sequences.checks(results)] == ["MISS"] * 7


@pytest.mark.slow
def test_sequence_replicas_quick_run_against_the_unpacked_baseline(tmp_path):
    from benchmarks import sequence_replicas

    assert sequence_replicas.main(["--quick", "--out", str(tmp_path)]) == 0
    results = read(tmp_path, "sequence_replicas")["results"]
    assert set(results) == {"gru_rows", "gru_tokens"}
    for by in results.values():
        assert set(by) == set(sequence_replicas.METHODS)
        # Counted, not timed: two replicas feed one device's padding; the baseline,
        # which dealt sorted rows out, its own (each child checked whose package ran).
        assert by["own"]["padding_share"] == by["one_device"]["padding_share"]
        assert "its own shape" in by["own"]["padding"]
        assert "its own shape" not in by["dealt"]["padding"]
        assert all(r["tokens_per_s"] > 0 for r in by.values())


def test_sequence_replicas_checks_follow_the_figures():
    from benchmarks import sequence_replicas

    def run(share, vs_dealt):
        return {"padding_share": share, "vs_dealt": vs_dealt}

    results = {"gru_rows": {"one_device": run(0.30, 1.1), "dealt": run(0.50, 1.0),
                            "own": run(0.32, 1.2)}}
    assert [c["status"] for c in sequence_replicas.checks(results)] == ["PASS"] * 2
    results["gru_rows"]["own"] = run(0.34, 0.9)
    assert [c["status"] for c in sequence_replicas.checks(results)] == ["MISS"] * 2


@pytest.mark.slow
def test_sequences_xla_quick_run(tmp_path):
    from benchmarks import sequences_xla

    assert sequences_xla.main(["--quick", "--models", "gru", "--out", str(tmp_path)]) == 0
    result = read(tmp_path, "sequences_xla")["results"]["gru"]
    assert set(result) == set(sequences_xla.METHODS)
    # Counted, not timed: XLA's buckets feed more padding than the cut without them,
    # less than Keras's micro-batches in the input's order, in a bounded set of programs.
    xla = result["tokens_xla"]
    assert result["tokens"]["padding_share"] < xla["padding_share"]
    assert xla["padding_share"] < result["keras_accumulation_xla"]["padding_share"]
    assert result["tokens"]["programs"] is None and 1 <= xla["programs"] <= 20
    assert all(r["tokens_per_s"] > 0 and r["first_seconds"] > 0 for r in result.values())


def test_sequences_xla_checks_follow_the_figures():
    from benchmarks import sequences_xla

    def run(vs_tokens, first_vs_keras, programs):
        return {"vs_tokens": vs_tokens, "first_vs_keras": first_vs_keras,
                "first_seconds": 10.0, "programs": programs}

    results = {"gru": {"tokens_xla": run(1.1, 0.4, 12),
                       "keras_accumulation_xla": run(0.9, 1.0, 40)}}
    assert [c["status"] for c in sequences_xla.checks(results)] == ["PASS"] * 3
    results["gru"]["tokens_xla"] = run(0.9, 0.6, 21)
    assert [c["status"] for c in sequences_xla.checks(results)] == ["MISS"] * 3


@pytest.mark.slow
def test_batchnorm_stats_quick_run(tmp_path):
    from benchmarks import batchnorm_runs, batchnorm_stats

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
    pooled, micro = (batchnorm_runs.find(model, 4, mode)["layers"]["bn_input"]
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
    from benchmarks import probe_choices

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


@pytest.mark.slow
def test_overflow_check_quick_run_restores_the_library(tmp_path):
    import autosplit.step.contribution as contribution
    from benchmarks import overflow_check

    original = contribution.overflowed
    assert overflow_check.main(["--quick", "--out", str(tmp_path)]) == 0
    assert contribution.overflowed is original  # switched off only inside its run
    results = read(tmp_path, "overflow_check")["results"]
    assert results["same_weights"] and results["skipped"] == 0
    assert set(results["seconds_per_large_batch"]) == set(overflow_check.METHODS)


@pytest.mark.slow
def test_whole_batch_quick_run_in_capped_children(tmp_path):
    from benchmarks import whole_batch

    assert whole_batch.main(["--quick", "--out", str(tmp_path)]) == 0
    report = read(tmp_path, "whole_batch")
    cost, recall = report["results"]["cost"], report["results"]["recall"]
    assert "summed" in cost["steps"]["summed"] and "whole batch" in cost["steps"]["whole_batch"]
    assert cost["weights_relative_difference"] < 1e-4 and cost["ratio"] > 0
    ours = recall["autosplit"]
    assert ours["status"] == "ok" and "whole batch" in ours["step"]
    assert ours["applies"] == 2 * (1024 // 256)  # one apply per large batch, 2 epochs
    for key in whole_batch.RECALL_METHODS:
        assert 0.0 <= recall[key]["recall_at_1"] <= 1.0
    memory = report["results"]["memory"]
    assert [p["status"] for p in memory["autosplit"] + memory["keras"]] == ["ok"] * 4
    checks = {c["id"]: c["status"] for c in report["checks"]}
    assert checks["steps"] == checks["same-weights"] == "PASS"
    assert set(checks) == {"steps", "same-weights", "cost", "trains-under-cap", "recall"}
    assert (tmp_path / "whole_batch.png").read_bytes()[:8] == PNG


@pytest.mark.slow
def test_noise_scale_quick_run(tmp_path):
    from benchmarks import noise_scale

    assert noise_scale.main(["--quick", "--out", str(tmp_path)]) == 0
    report = read(tmp_path, "noise_scale")
    [case] = report["results"]["overhead"].values()
    assert case["same_weights"] and case["norms_share_cold"] > 0
    assert len(report["results"]["training"]["noise_scale"]) == 6  # one per epoch
    points = report["results"]["prediction"]["points"]
    assert len(points) == 4 and all(p["batch_size"] >= 1 for p in points)
    assert [c["id"] for c in report["checks"]] == ["a", "b", "c"]
    assert (tmp_path / "noise_scale.png").read_bytes()[:8] == PNG
