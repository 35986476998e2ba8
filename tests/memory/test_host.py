"""autosplit.memory.host: the host's memory, read for real wherever this machine allows
(procfs, psutil, a TensorFlow child under a real BFC cap); cgroup trees are fake
directories, so that every layout is covered."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
from _memory import PACKAGE_PARENT, GiB, MiB, _write_tree

from autosplit.memory import host as host_readings
from autosplit.memory.device_info import LIMIT_SOURCES, DeviceInfo
from autosplit.memory.host import is_tf_bfc_capped, read_cpu

# ------------------------------------------------------------------------- CPU


@pytest.fixture
def host(monkeypatch):
    """Fixed RAM (64 GiB, 48 GiB available), no RLIMIT_AS and no BFC cap."""
    monkeypatch.setattr(host_readings.psutil, "virtual_memory",
                        lambda: SimpleNamespace(total=64 * GiB, available=48 * GiB))
    infinity = host_readings.resource.RLIM_INFINITY
    monkeypatch.setattr(host_readings.resource, "getrlimit", lambda which: (infinity, infinity))
    monkeypatch.delenv("TF_CPU_ALLOCATOR_USE_BFC", raising=False)
    monkeypatch.delenv("TF_CPU_BFC_MEM_LIMIT_IN_MB", raising=False)
    return monkeypatch


_V1_NO_LIMIT = 9223372036854771712


_CGROUP_CASES = {
    "v2-nested-parent-binds": (
        {"proc/self/cgroup": "0::/app/worker",
         "cg/app/memory.max": 80 * MiB, "cg/app/memory.current": 10 * MiB,
         "cg/app/memory.stat": "anon 1\ninactive_file 0",
         "cg/app/worker/memory.max": "max", "cg/app/worker/memory.current": 5 * MiB},
        (70 * MiB, 80 * MiB, "cgroup-v2")),
    "v2-page-cache-not-counted": (
        {"proc/self/cgroup": "0::/",
         "cg/memory.max": 100 * MiB, "cg/memory.current": 40 * MiB,
         "cg/memory.stat": f"anon {36 * MiB}\ninactive_file {4 * MiB}"},
        (64 * MiB, 100 * MiB, "cgroup-v2")),
    "v1": (
        {"proc/self/cgroup": "4:memory:/job\n0::/",
         "cg/memory/memory.limit_in_bytes": _V1_NO_LIMIT,
         "cg/memory/job/memory.limit_in_bytes": 50 * MiB,
         "cg/memory/job/memory.usage_in_bytes": 20 * MiB,
         "cg/memory/job/memory.stat": "total_inactive_file 0"},
        (30 * MiB, 50 * MiB, "cgroup-v1")),
    "v1-own-path-not-mounted": (
        {"proc/self/cgroup": "4:memory:/docker/abc",
         "cg/memory/memory.limit_in_bytes": 60 * MiB,
         "cg/memory/memory.usage_in_bytes": 0},
        (60 * MiB, 60 * MiB, "cgroup-v1")),
    "v1-and-v2-smaller-wins": (
        {"proc/self/cgroup": "4:memory:/\n0::/",
         "cg/memory.max": 100 * MiB, "cg/memory.current": 0,
         "cg/memory/memory.limit_in_bytes": 30 * MiB,
         "cg/memory/memory.usage_in_bytes": 0},
        (30 * MiB, 30 * MiB, "cgroup-v1")),
    "unlimited": (
        {"proc/self/cgroup": "4:memory:/\n0::/",
         "cg/memory.max": "max", "cg/memory.current": 5 * MiB,
         "cg/memory/memory.limit_in_bytes": _V1_NO_LIMIT,
         "cg/memory/memory.usage_in_bytes": 5 * MiB},
        (48 * GiB, 64 * GiB, "psutil")),
    "no-cgroup-files": ({}, (48 * GiB, 64 * GiB, "psutil")),
}


@pytest.mark.parametrize("case", list(_CGROUP_CASES))
def test_read_cpu_fake_cgroup_trees(host, tmp_path, case):
    files, (available, total, source) = _CGROUP_CASES[case]
    _write_tree(tmp_path, {"proc/cpuinfo": "processor\t: 0\nmodel name\t: Fake CPU 9000",
                           **files})
    info = read_cpu(cgroup_root=tmp_path / "cg", proc_root=tmp_path / "proc")
    assert (info.available_bytes, info.total_bytes, info.limit_source) == (
        available, total, source)
    assert info.kind == "CPU" and info.tf_device == "CPU:0"
    assert info.name == "Fake CPU 9000"
    assert info.identity == f"cpu:Fake CPU 9000:{64 * GiB}"
    assert info.used_by_others_bytes is None and info.pci_bus_id is None


def test_read_cpu_rlimit_as_is_smallest(host, tmp_path):
    infinity = host_readings.resource.RLIM_INFINITY
    host.setattr(host_readings.resource, "getrlimit", lambda which: (GiB, infinity))
    _write_tree(tmp_path, {"proc/self/status": f"Name:\tpython\nVmSize:\t{900 * 1024} kB",
                           "cg/memory.max": 200 * MiB, "cg/memory.current": 0})
    info = read_cpu(cgroup_root=tmp_path / "cg", proc_root=tmp_path / "proc")
    # The budget is bounded by RLIMIT_AS, the tightest total by the cgroup.
    assert (info.available_bytes, info.total_bytes, info.limit_source) == (
        124 * MiB, 200 * MiB, "rlimit-as")


class _StandinTF:
    """What read_cpu asks of a loaded TensorFlow: its CPU allocator's stats.

    ``current=None`` is an allocator without stats (TensorFlow raises ValueError), as
    TensorFlow's plain CPU allocator is when it was created before the BFC variables
    were set. A stand-in, so the state does not depend on what ran before in this process.
    """

    def __init__(self, current):
        def get_memory_info(tf_device):
            assert tf_device == "CPU:0"
            if current is None:
                raise ValueError(f"Allocator stats not available for device '{tf_device}'")
            return {"current": current, "peak": current}

        self.config = SimpleNamespace(
            experimental=SimpleNamespace(get_memory_info=get_memory_info))


@pytest.mark.parametrize(("tf_state", "expected"), [
    ("not-imported", (16 * MiB, 16 * MiB, "tf-bfc-cap")),  # the cap holds once TF loads
    ("bfc-3MiB-used", (13 * MiB, 16 * MiB, "tf-bfc-cap")),
    # The allocator predates the variables: no cap binds, the cgroup does.
    ("allocator-without-stats", (200 * MiB, 200 * MiB, "cgroup-v2")),
])
def test_read_cpu_tf_bfc_cap(host, tmp_path, tf_state, expected):
    host.setenv("TF_CPU_ALLOCATOR_USE_BFC", "true")
    host.setenv("TF_CPU_BFC_MEM_LIMIT_IN_MB", "16")
    if tf_state == "not-imported":
        host.delitem(sys.modules, "tensorflow", raising=False)
    else:
        current = 3 * MiB if tf_state == "bfc-3MiB-used" else None
        host.setitem(sys.modules, "tensorflow", _StandinTF(current))
    _write_tree(tmp_path, {"cg/memory.max": 200 * MiB, "cg/memory.current": 0})
    info = read_cpu(cgroup_root=tmp_path / "cg", proc_root=tmp_path / "proc")
    assert (info.available_bytes, info.total_bytes, info.limit_source) == expected


_LATE_BFC_SCRIPT = """
import json, os
import tensorflow as tf
from autosplit.memory.host import read_cpu

tf.constant(1.0) + 1  # TensorFlow creates its CPU allocator, without BFC
os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
os.environ["TF_CPU_BFC_MEM_LIMIT_IN_MB"] = "16"
try:
    tf.config.experimental.get_memory_info("CPU:0")
    stats = True
except ValueError:
    stats = False
x = tf.fill([10_000_000], 1.0)  # 40 MB: more than the 16 MiB the variables name
print(json.dumps(dict(stats=stats, size=int(tf.size(x)), source=read_cpu().limit_source)))
"""


@pytest.mark.slow
def test_read_cpu_when_bfc_is_set_after_tensorflow_made_its_allocator():
    """A fresh child: BFC variables set after TF's first op bind nothing, and read_cpu says so.

    oneDNN off, because its allocator keeps stats without being BFC: TensorFlow's plain
    CPU allocator is the one whose missing stats tell read_cpu the cap is not in force.
    """
    env = {**os.environ, "PYTHONPATH": str(PACKAGE_PARENT), "TF_ENABLE_ONEDNN_OPTS": "0"}
    for name in ("TF_CPU_ALLOCATOR_USE_BFC", "TF_CPU_BFC_MEM_LIMIT_IN_MB"):
        env.pop(name, None)
    run = subprocess.run([sys.executable, "-c", _LATE_BFC_SCRIPT], env=env, timeout=180,
                         capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert (out["stats"], out["size"]) == (False, 10_000_000)  # not BFC: 40 MB fit
    assert out["source"] in ("psutil", "cgroup-v2", "cgroup-v1", "rlimit-as")


def test_read_cpu_real_machine():
    info = read_cpu()
    assert info.kind == "CPU" and info.limit_source in LIMIT_SOURCES
    assert 0 < info.available_bytes <= info.total_bytes
    assert info.identity.startswith("cpu:") and info.name
    assert DeviceInfo.from_dict(json.loads(json.dumps(info.to_dict()))) == info


@pytest.mark.parametrize(("environ", "expected"), [
    ({}, None),
    ({"TF_CPU_BFC_MEM_LIMIT_IN_MB": "200"}, None),
    ({"TF_CPU_ALLOCATOR_USE_BFC": "false", "TF_CPU_BFC_MEM_LIMIT_IN_MB": "200"}, None),
    ({"TF_CPU_ALLOCATOR_USE_BFC": "true", "TF_CPU_BFC_MEM_LIMIT_IN_MB": "200"}, 200 * MiB),
    ({"TF_CPU_ALLOCATOR_USE_BFC": "1", "TF_CPU_BFC_MEM_LIMIT_IN_MB": "8"}, 8 * MiB),
    ({"TF_CPU_ALLOCATOR_USE_BFC": "TRUE"}, 64 * GiB),  # TensorFlow's default cap
])
def test_is_tf_bfc_capped(environ, expected):
    assert is_tf_bfc_capped(environ) == expected


def test_is_tf_bfc_capped_reads_this_process(monkeypatch):
    monkeypatch.setenv("TF_CPU_ALLOCATOR_USE_BFC", "true")
    monkeypatch.setenv("TF_CPU_BFC_MEM_LIMIT_IN_MB", "300")
    assert is_tf_bfc_capped() == 300 * MiB
    monkeypatch.delenv("TF_CPU_ALLOCATOR_USE_BFC")
    assert is_tf_bfc_capped() is None
