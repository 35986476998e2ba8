"""Host memory readings: how much RAM this process may still use.

The smallest of what psutil says is available, what the cgroup (v2 or v1) allows,
``RLIMIT_AS`` and, when TensorFlow's CPU allocator is a capped BFC allocator, that cap.
What TensorFlow's allocator does under such a cap is shown by the real-cap tests in
``tests/memory/test_host.py``.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

import psutil

from autosplit.memory.device_info import DeviceInfo, split_device
from autosplit.units import MIB

try:
    import resource
except ImportError:  # Windows has no RLIMIT_AS.
    resource = None  # type: ignore[assignment]

__all__ = ["bfc_enabled", "is_tf_bfc_capped", "read_cpu", "status_bytes"]

# cgroup v1 writes "no limit" as PAGE_COUNTER_MAX pages (9223372036854771712 on x86).
_CGROUP_UNLIMITED = 2**60
# TensorFlow's cap when TF_CPU_ALLOCATOR_USE_BFC is on and no limit is given.
_TF_BFC_DEFAULT_MIB = 1 << 16


class _Bound(NamedTuple):
    """One reading that bounds CPU memory."""

    available: int  # bytes this process may still allocate under this bound
    total: int  # bytes this bound allows in all
    source: str  # one of LIMIT_SOURCES


def read_cpu(
    *, cgroup_root: str | os.PathLike[str] = "/sys/fs/cgroup",
    proc_root: str | os.PathLike[str] = "/proc", tf_device: str = "CPU:0",
) -> DeviceInfo:
    """Reads how much host memory this process may still use.

    The budget is the smallest of: ``psutil.virtual_memory().available``; cgroup v2
    ``memory.max - memory.current``; cgroup v1 ``memory.limit_in_bytes -
    memory.usage_in_bytes``; ``RLIMIT_AS`` minus the current ``VmSize``; and, when
    TensorFlow's CPU allocator is a capped BFC allocator (:func:`is_tf_bfc_capped`),
    that cap minus TF's current bytes (not when TensorFlow shows its allocator was
    made before the variables were set). Cgroup limits are read at this process's own
    cgroup and every ancestor up to the root (a parent's limit binds its children);
    reclaimable page cache (``inactive_file``) is not counted as used, as in
    ``docker stats``. ``"max"`` and v1's huge "no limit" values are unlimited.

    Args:
        cgroup_root: Where the cgroup file system is mounted.
        proc_root: Where procfs is mounted (``self/cgroup``, ``self/status``,
            ``cpuinfo`` are read from it).
        tf_device: The TensorFlow device to record, ``"CPU:0"``.

    Returns:
        A reading with ``kind="CPU"`` whose ``limit_source`` names the smallest bound.

    Example:
        >>> info = read_cpu()
        >>> info.limit_source in ("psutil", "cgroup-v2", "cgroup-v1", "rlimit-as")
        True
    """
    kind, index = split_device(tf_device)
    if kind != "CPU":
        raise ValueError(f"Expected `tf_device` to name a CPU, like 'CPU:0'. "
                         f"Received: tf_device={tf_device!r}")
    cgroup_root, proc_root = Path(cgroup_root), Path(proc_root)
    memory = psutil.virtual_memory()
    bounds = [_Bound(int(memory.available), int(memory.total), "psutil")]

    v2_path, v1_path = _own_cgroup_paths(proc_root)
    for bound in (
        _cgroup_bound(cgroup_root, v2_path, "memory.max", "memory.current",
                      "inactive_file", "cgroup-v2"),
        _cgroup_bound(cgroup_root / "memory", v1_path, "memory.limit_in_bytes",
                      "memory.usage_in_bytes", "total_inactive_file", "cgroup-v1"),
        _rlimit_as_bound(proc_root),
        _tf_bfc_bound(),
    ):
        if bound is not None:
            bounds.append(bound)

    tightest = min(bounds)
    model = _cpu_model(proc_root)
    return DeviceInfo(
        kind="CPU", name=model, identity=f"cpu:{model}:{int(memory.total)}",
        total_bytes=min(b.total for b in bounds), available_bytes=tightest.available,
        used_by_others_bytes=None, limit_source=tightest.source,
        tf_device=f"CPU:{index}", pci_bus_id=None)


def _own_cgroup_paths(proc_root: Path) -> tuple[str, str]:
    """This process's cgroup v2 path and v1 memory-controller path ('/' if unknown)."""
    v2, v1 = "/", "/"
    try:
        lines = (proc_root / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return v2, v1
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and not controllers:
            v2 = path or "/"
        elif "memory" in controllers.split(","):
            v1 = path or "/"
    return v2, v1


def _cgroup_bound(root: Path, own_path: str, limit_file: str, usage_file: str,
                  stat_key: str, source: str) -> _Bound | None:
    """The tightest limit from the own cgroup up to ``root``; None if none is set."""
    parts = [p for p in own_path.split("/") if p]
    # Without a cgroup namespace the own path may not exist under the mount point;
    # the directories that do exist are still ancestors (or the container's root).
    directories = [root.joinpath(*parts[:depth]) for depth in range(len(parts), -1, -1)]
    tightest = None
    for directory in directories:
        limit = _read_int(directory / limit_file)
        if limit is None or limit >= _CGROUP_UNLIMITED:
            continue
        usage = _read_int(directory / usage_file) or 0
        usage = max(usage - _stat_value(directory / "memory.stat", stat_key), 0)
        bound = _Bound(max(limit - usage, 0), limit, source)
        tightest = bound if tightest is None else min(tightest, bound)
    return tightest


def _rlimit_as_bound(proc_root: Path) -> _Bound | None:
    if resource is None:
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY or soft <= 0:
        return None
    used = status_bytes(proc_root, "VmSize") or 0
    return _Bound(max(soft - used, 0), soft, "rlimit-as")


def _tf_bfc_bound() -> _Bound | None:
    """The BFC cap the environment names, less what TF's CPU allocator holds; None where
    TensorFlow made its CPU allocator without BFC (it reads the variables once, at
    import: no stats for ``CPU:0`` means they came too late)."""
    cap = is_tf_bfc_capped()
    if cap is None:
        return None
    tf = sys.modules.get("tensorflow")
    if tf is None:
        return _Bound(cap, cap, "tf-bfc-cap")
    try:
        used = int(tf.config.experimental.get_memory_info("CPU:0")["current"])
    except ValueError:  # "Allocator stats not available": not a BFC allocator
        return None
    return _Bound(max(cap - used, 0), cap, "tf-bfc-cap")


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    try:
        return int(text)
    except ValueError:  # "max" in cgroup v2
        return None


def _stat_value(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def status_bytes(proc_root: Path, key: str) -> int | None:
    """A ``kB`` field of ``<proc_root>/self/status`` in bytes."""
    try:
        for line in (proc_root / "self" / "status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cpu_model(proc_root: Path) -> str:
    try:
        for line in (proc_root / "cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def is_tf_bfc_capped(environ: Mapping[str, str] | None = None) -> int | None:
    """TensorFlow's CPU cap in bytes when its CPU allocator is BFC, else ``None``.

    Reads the same variables TensorFlow does: ``TF_CPU_ALLOCATOR_USE_BFC`` (``true``
    or ``1``) and ``TF_CPU_BFC_MEM_LIMIT_IN_MB`` (MiB; 65536, i.e. 64 GiB, when
    unset or unreadable, as in TensorFlow).

    Args:
        environ: The environment to read; ``os.environ`` when ``None``.

    Example:
        >>> is_tf_bfc_capped({"TF_CPU_ALLOCATOR_USE_BFC": "true",
        ...                   "TF_CPU_BFC_MEM_LIMIT_IN_MB": "200"})
        209715200
    """
    env = os.environ if environ is None else environ
    if not bfc_enabled(env):
        return None
    try:
        mib = int(env.get("TF_CPU_BFC_MEM_LIMIT_IN_MB", _TF_BFC_DEFAULT_MIB))
    except ValueError:
        mib = _TF_BFC_DEFAULT_MIB
    return mib * MIB


def bfc_enabled(env: Mapping[str, str]) -> bool:
    return env.get("TF_CPU_ALLOCATOR_USE_BFC", "").strip().lower() in ("true", "1")
