"""Each benchmark script's checks and searches, and the training methods they compare, on
fakes and hand-computed numbers (milliseconds)."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from _bench import PNG, MiB

from benchmarks import (
    batchnorm_stats,
    gpu_check,
    harness,
    memory_scaling,
    overflow_check,
    overhead,
    probe_choices,
    probe_search,
    sequences,
    sequences_xla,
    step_costs,
    workloads,
)


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


@pytest.mark.slow
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
    (sequences_xla, ["--quick", "--models", "transformer"]),
    (overflow_check, ["--quick", "--repeats", "0"]),
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


def test_noise_scale_fit_and_rank_correlation_by_hand():
    from benchmarks import noise_scale

    # Steps exactly S_min (1 + 50 / B) with S_min = 10: the fit finds both.
    points = [{"batch_size": b, "steps": 10 * (1 + 50 / b)} for b in (12, 50, 200, 800)]
    fit = noise_scale.fitted(points, 50.0)
    assert abs(fit["s_min"] - 10) < 1e-9 and max(abs(e) for e in fit["errors"]) < 1e-9
    assert abs(fit["b_crit"] - 50) < 1e-9
    assert noise_scale.rank_correlation([3, 2, 1], [1, 2, 3]) == -1.0
    assert noise_scale.rank_correlation([1, 2, 3, 4], [1, 2, float("inf"), 4]) == 1.0
    training = {"loss": [2.0, 1.0, 0.5], "noise": [4.0, 6.0, 100.0], "signal": [1.0, 1.0, 1.0]}
    assert noise_scale.pooled_to(training, 1.0) == (5.0, 2)  # (4 + 6) / (1 + 1), 2 epochs
