"""The benchmarks: ``memory_scaling.py``'s checks, report and plot, and its quick run.

The quick run is end to end: real child processes under a real TensorFlow memory cap
(plain Keras raises a real ``ResourceExhaustedError`` at B = 1024), the JSON, the
Markdown and the PNG. ``overhead.py --quick`` (about a minute) and
``probe_search.py --quick`` (a few minutes) together take well over the 60 s this file
may spend on them, so they are not run here; their own ``--quick`` modes are the smoke
tests.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20


def load(name: str):
    """A benchmark script as a module (benchmarks/ is not a package)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while being built
    spec.loader.exec_module(module)
    return module


ms = load("memory_scaling")


def ok(peak_mib, samples_per_s=1000.0, held_mib=10.0, **extra):
    return {"status": "ok", "peak_mib": peak_mib, "samples_per_s": samples_per_s,
            "held_mib": held_mib, **extra}


def oom():
    return {"status": "OOM", "peak_mib": "OOM", "samples_per_s": "OOM"}


def point(B, m, k, capped, uncapped=None):
    return {"batch_size": B, "micro_batch_size": m, "accumulation_steps": k,
            "capped": capped, "uncapped": uncapped or {"keras": ok(50.0)}}


def synthetic_model():
    """Two sizes, numbers chosen so every check can be worked out by hand."""
    return {
        "label": "toy", "input_shape": [128], "cap_mib": 96, "samples_per_epoch": 8192,
        "fixed_micro_batch_size": 128, "example_bytes": 1024, "input_bytes": 1020,
        "trainable_weight_bytes": 4 * MiB,
        "points": [
            point(512, 512, 1, {"keras": ok(40.0), "autosplit": ok(41.0),
                                "keras_at_m": ok(40.0), "keras_accumulation": ok(40.0),
                                "autosplit_fixed": ok(30.0)}),
            # One input batch at B = 16384 is 16 MiB: (a) allows 5% of 30 + 16 = 17.5 MiB
            # of growth, and 30 -> 47 is 17.
            point(16384, 2048, 8, {
                "keras": oom(), "keras_accumulation": ok(80.0),
                "autosplit": ok(87.0, samples_per_s=3000.0, held_mib=30.0,
                                oom_recoveries=[{"step": 3, "failed": 2304, "retry": 2048}]),
                # (b): expected 76 + 4 (weights) = 80 MiB; 87 / 80 = 1.0875.
                "keras_at_m": ok(76.0, samples_per_s=2000.0, held_mib=12.0),
                "autosplit_fixed": ok(47.0)}),
        ],
    }


def by_id(checks):
    return {c["id"]: c for c in checks}


def test_keras_split_uses_equal_micro_batches_no_larger_than_m():
    assert ms.keras_split(1024, 696) == (2, 512)
    assert ms.keras_split(1024, 1024) == (1, 1024)
    assert ms.keras_split(16384, 2000) == (9, 1820)
    assert ms.keras_split(16384, 128) == (128, 128)


def test_fixed_micro_batch_splits_every_size():
    assert ms.FULL.fixed_micro_batch == 128
    assert ms.QUICK.fixed_micro_batch < min(ms.QUICK.batch_sizes)


def test_checks_worked_by_hand():
    checks = by_id(ms.checks_for("toy", synthetic_model()))
    a = checks["a"]
    assert (a["from_batch_size"], a["to_batch_size"]) == (512, 16384)
    assert a["input_batch_copy_mib"] == pytest.approx(16.0)
    assert a["growth_mib"] == pytest.approx(17.0)
    assert a["allowed_mib"] == pytest.approx(17.5)
    assert a["status"] == "PASS"
    b = checks["b"]
    assert [r["batch_size"] for r in b["rows"]] == [16384]  # k = 1 at 512 is no split
    assert b["worst"]["ratio"] == pytest.approx(1.0875)
    assert b["worst"]["held_excess_mib"] == pytest.approx(30.0 - 12.0)
    assert b["worst"]["transient_excess_mib"] == pytest.approx((87.0 - 30.0) - (76.0 - 12.0))
    assert b["status"] == "PASS"
    c = checks["c"]
    assert c["status"] == "PASS"
    assert c["keras_oom"] == [16384]
    assert c["autosplit_oom_recoveries"] == 1
    d = checks["d"]
    assert d["rows"][0]["ratio"] == pytest.approx(1.5)
    assert d["status"] == "PASS"


def test_checks_miss_when_the_numbers_say_so():
    model = synthetic_model()
    capped = model["points"][1]["capped"]
    capped["autosplit_fixed"] = ok(60.0)  # growth 30 > 17.5
    capped["autosplit"] = ok(96.0, samples_per_s=1500.0, held_mib=30.0)  # 96 / 80 = 1.2
    model["points"][0]["capped"]["autosplit"] = oom()
    model["points"][1]["capped"]["keras"] = ok(95.0)
    checks = by_id(ms.checks_for("toy", model))
    assert {key: c["status"] for key, c in checks.items()} == {
        "a": "MISS", "b": "MISS", "c": "MISS", "d": "MISS"}
    assert checks["c"]["autosplit_trained"] == [16384]
    assert checks["c"]["keras_oom"] == []


def test_report_and_plot_from_a_synthetic_run(tmp_path):
    model = synthetic_model()
    report = {"question": ms.QUESTION, "command": "python benchmarks/memory_scaling.py",
              "units": ms.UNITS, "peak_source": ms.PEAK_SOURCE,
              "machine": {"cpu_count": 2, "tensorflow": "x", "keras": "y", "python": "z",
                          "date": "today", "load_average_at_start": [0.0]},
              "settings": {"repeats": 2}, "models": {"toy": model},
              "checks": ms.checks_for("toy", model),
              "streaming": {"available": False, "note": "not yet"}}
    for p in model["points"]:
        for method in ms.CAPPED_METHODS:
            p["capped"].setdefault(method, ms.public(None))
    report["notes"] = ms.notes(report)
    text = ms.markdown(report)
    assert "Peak source: tf-allocator (BFC)" in text
    assert "**OOM**" in text and "87.0*" in text  # the recovered point is marked
    assert "- (a) toy: **PASS**" in text
    assert any("recovered by autosplit" in n for n in report["notes"])
    ms.plot(report, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_flags_exit_before_anything_runs():
    with pytest.raises(SystemExit):
        ms.main(["--quick", "--repeats", "0"])
    with pytest.raises(SystemExit):
        ms.main(["--quick", "--models", "resnet"])


@pytest.mark.slow
def test_quick_run_writes_every_point_the_checks_and_the_plot(tmp_path):
    assert ms.main(["--quick", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "memory_scaling.json").read_text())
    assert report["peak_source"] == "tf-allocator (BFC)"
    assert report["models"]
    for model in report["models"].values():
        assert [p["batch_size"] for p in model["points"]] == list(ms.QUICK.batch_sizes)
        for p in model["points"]:
            for condition, methods in (("capped", ms.CAPPED_METHODS),
                                       ("uncapped", ms.UNCAPPED_METHODS)):
                for method in methods:
                    r = p[condition][method]
                    for name in ("peak_mib", "samples_per_s"):
                        value = r[name]
                        assert value == "OOM" or (
                            isinstance(value, (int, float)) and value > 0), (
                            p["batch_size"], condition, method, name, r)
                    if r["status"] == "ok":
                        assert r["peak_source"] == "tf-allocator"
    checks = report["checks"]
    assert {(c["model"], c["id"]) for c in checks} == {
        (key, i) for key in report["models"] for i in "abcd"}
    assert all(c["status"] in ("PASS", "MISS", "N/A") and c["summary"] for c in checks)
    # The quick configuration is built so: plain Keras fails at 1024, autosplit trains.
    assert by_id(checks)["c"]["status"] == "PASS", by_id(checks)["c"]
    assert "streaming" in report
    assert (tmp_path / "memory_scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "## Checks" in (tmp_path / "memory_scaling.md").read_text()
