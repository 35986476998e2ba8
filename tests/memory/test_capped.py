"""autosplit.capped and .memory.peak_meter: children under a real memory cap, and the
peaks a step reaches."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import time
import warnings

import numpy as np
import pytest
from _memory import PACKAGE_PARENT, GiB, KiB, MiB, _write_tree

from autosplit.capped import capped_cpu_env, is_noise, run_capped
from autosplit.errors import MemoryLimitError
from autosplit.memory.host import is_tf_bfc_capped
from autosplit.memory.peak_meter import PeakMeter

# ------------------------------------------------------- capped children and peaks


def test_capped_cpu_env_copies_base_and_sets_the_cap():
    environ_before = dict(os.environ)
    base = {"PATH": "/bin", "TF_CPP_MIN_LOG_LEVEL": "3"}
    env = capped_cpu_env(200 * MiB + 1, base)
    assert env == {"PATH": "/bin", "TF_CPP_MIN_LOG_LEVEL": "3",
                   "TF_CPU_ALLOCATOR_USE_BFC": "true", "TF_CPU_BFC_MEM_LIMIT_IN_MB": "201",
                   "MALLOC_MMAP_THRESHOLD_": "65536"}
    assert base == {"PATH": "/bin", "TF_CPP_MIN_LOG_LEVEL": "3"}
    default = capped_cpu_env(limit_bytes=GiB)
    assert default["PATH"] == os.environ["PATH"]
    assert default["TF_CPP_MIN_LOG_LEVEL"] == os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2")
    assert is_tf_bfc_capped(default) == GiB
    assert dict(os.environ) == environ_before


@pytest.mark.parametrize("limit", [0, -1, None, "junk", True])
def test_capped_cpu_env_rejects_bad_limits(limit):
    with pytest.raises(MemoryLimitError, match="Received: limit_bytes="):
        capped_cpu_env(limit)


def test_peak_meter_rss_fallback_in_this_process(monkeypatch):
    monkeypatch.delenv("TF_CPU_ALLOCATOR_USE_BFC", raising=False)
    meter = PeakMeter("CPU:0")
    assert meter.source == "rss-hwm"
    meter.reset()
    assert 0 < meter.baseline_bytes <= meter.peak_bytes()
    block = np.ones(5_000_000)  # 40 MB, above glibc's largest mmap threshold: returned on free
    peak = meter.peak_bytes()
    assert peak - meter.baseline_bytes >= 35e6
    assert meter.current_bytes() > 0
    del block
    meter.reset()
    assert meter.peak_bytes() < peak - 20e6


def test_peak_meter_rss_fake_proc(monkeypatch, tmp_path):
    monkeypatch.delenv("TF_CPU_ALLOCATOR_USE_BFC", raising=False)
    _write_tree(tmp_path, {"self/status": "VmHWM:\t   3000 kB\nVmRSS:\t   2000 kB",
                           "self/clear_refs": ""})
    meter = PeakMeter("/device:CPU:0", proc_root=tmp_path)
    meter.reset()
    assert (tmp_path / "self" / "clear_refs").read_text() == "5"
    assert (meter.baseline_bytes, meter.peak_bytes(), meter.current_bytes()) == (
        2000 * KiB, 3000 * KiB, 2000 * KiB)
    # VmHWM can trail VmRSS by a few pages (the kernel's per-CPU RSS cache): a step
    # seemed to peak 4 KiB below what it started with. The peak is never below either.
    _write_tree(tmp_path, {"self/status": "VmHWM:\t   1996 kB\nVmRSS:\t   2000 kB"})
    meter.reset()
    assert meter.peak_bytes() == meter.baseline_bytes == 2000 * KiB
    _write_tree(tmp_path, {"self/status": "VmHWM:\t   1996 kB\nVmRSS:\t   2100 kB"})
    assert meter.peak_bytes() == 2100 * KiB


def test_peak_meter_sources(monkeypatch):
    monkeypatch.setenv("TF_CPU_ALLOCATOR_USE_BFC", "true")
    assert PeakMeter().source == "tf-allocator"
    gpu = PeakMeter("/physical_device:gpu:1")
    assert (gpu.tf_device, gpu.source) == ("GPU:1", "tf-allocator")
    with pytest.raises(ValueError, match="Received: tf_device='TPU:0'"):
        PeakMeter("TPU:0")


def _run_capped_child(script: str, limit_bytes: int) -> dict:
    """Runs ``script`` in a fresh Python with TensorFlow capped; returns its last JSON line."""
    run = run_capped(["-c", script], limit_bytes, timeout=180, capture=True,
                     env={"PYTHONPATH": str(PACKAGE_PARENT)})
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


_PEAK_SCRIPT = """
import json
import tensorflow as tf
from autosplit.memory.peak_meter import PeakMeter
from autosplit.memory.host import read_cpu

meter = PeakMeter("CPU:0")
meter.reset()
start = meter.peak_bytes()
x = tf.fill([10_000_000], 1.0)  # 40 MB
peak, current = meter.peak_bytes(), meter.current_bytes()
del x
meter.reset()
info = read_cpu()
print(json.dumps(dict(source=meter.source, start=start, peak=peak, current=current,
                      after_reset=meter.peak_bytes(), limit_source=info.limit_source,
                      total=info.total_bytes, available=info.available_bytes)))
"""


@pytest.mark.slow
def test_peak_meter_tf_allocator_under_real_bfc_cap():
    """A child under a 200 MiB BFC cap: TF's allocator sees a 40 MB tensor, reset forgets it."""
    out = _run_capped_child(_PEAK_SCRIPT, 200 * MiB)
    assert out["source"] == "tf-allocator"
    assert out["start"] < 1 * MiB
    assert out["peak"] >= 40_000_000 and out["current"] >= 40_000_000
    assert out["after_reset"] < 1 * MiB
    assert (out["limit_source"], out["total"]) == ("tf-bfc-cap", 200 * MiB)
    assert out["available"] > 199 * MiB


_OOM_SCRIPT = """
import json, time
import tensorflow as tf

@tf.function
def fill_sum(n):  # a runtime shape, so Grappler cannot fold the allocation away
    return tf.reduce_sum(tf.fill([n], 1.0))

before = float(fill_sum(tf.constant(1000)))
start = time.monotonic()
try:
    fill_sum(tf.constant(100_000_000))  # 400 MB under a 200 MiB cap
    raised = None
except tf.errors.ResourceExhaustedError as exc:
    raised = type(exc).__name__
seconds = time.monotonic() - start
after = float(fill_sum(tf.constant(1000)))
print(json.dumps(dict(raised=raised, seconds=seconds, before=before, after=after,
                      current=tf.config.experimental.get_memory_info("CPU:0")["current"])))
"""


@pytest.mark.slow
def test_real_resource_exhausted_under_bfc_cap_and_process_survives():
    """One real OOM: TF raises ResourceExhaustedError (after ~10 s of retries), then works."""
    out = _run_capped_child(_OOM_SCRIPT, 200 * MiB)
    assert out["raised"] == "ResourceExhaustedError"
    assert out["before"] == out["after"] == 1000.0
    assert out["current"] < 1 * MiB


@pytest.mark.slow
def test_run_capped_stops_a_silent_child_at_its_timeout_and_closes_its_pipes():
    # Captured stdout used to be read to its end before the timeout applied: a child
    # that wrote nothing and never ended held the caller forever, and the pipes were
    # left open (ResourceWarning).
    started = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        with pytest.raises(subprocess.TimeoutExpired):
            run_capped(["-c", "import time; time.sleep(60)"], 96 * MiB, timeout=2,
                       capture=True)
        run = run_capped(["-c", "print('out')"], 96 * MiB, timeout=60, capture=True)
        gc.collect()  # an unclosed pipe warns when its object is collected
    assert time.perf_counter() - started < 30
    assert (run.returncode, run.stdout, run.result) == (0, "out\n", None)


@pytest.mark.slow
def test_run_capped_hands_back_json_and_hides_tensorflow_start_up_lines():
    """The CLI, the tests and the benchmarks start capped children this one way."""
    script = ("import sys, tensorflow as tf\n"
              "from autosplit.capped import write_result\n"
              "print('a real error line', file=sys.stderr)\n"
              "write_result({'cap': tf.config.experimental.get_memory_info('CPU:0')['peak'] >= 0,"
              " 'env': __import__('os').environ['TF_CPU_BFC_MEM_LIMIT_IN_MB']})\n")
    run = run_capped(["-c", script], 96 * MiB, timeout=180, capture=True,
                     env={"PYTHONPATH": str(PACKAGE_PARENT)})
    assert run.returncode == 0, run.stderr
    assert run.result == {"cap": True, "env": "96"}
    assert "a real error line" in run.stderr
    assert not any(is_noise(line) for line in run.stderr.splitlines())
    assert "oneDNN" not in run.stderr and "cuInit" not in run.stderr
