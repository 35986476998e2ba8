"""Device memory readings: how much a GPU (NVML) or the host (psutil, cgroups,
``RLIMIT_AS``, TensorFlow's BFC cap) lets this process use, and the budget from it.

The GPU reading is what ``nvidia-smi`` shows (NVML); the CPU reading is what the
kernel enforces (cgroups, ``RLIMIT_AS``) and what TensorFlow's own CPU allocator
enforces when it is a capped BFC allocator. The idea of measuring rather than
guessing follows accelerate's ``utils/memory.py`` (PR #3684, "Stop halving my batch").
What TensorFlow's allocator does under a cap is shown by the real-cap tests in
``tests/test_memory.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import numbers
import os
import platform
import re
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import psutil

from autosplit.errors import MemoryLimitError
from autosplit.units import MIB, parse_memory

try:
    import resource
except ImportError:  # Windows has no RLIMIT_AS.
    resource = None  # type: ignore[assignment]

__all__ = [
    "LIMIT_SOURCES",
    "DeviceInfo",
    "bfc_enabled",
    "budget_bytes",
    "is_tf_bfc_capped",
    "read_cpu",
    "read_device",
    "read_gpu",
    "split_device",
]

LIMIT_SOURCES = ("nvml", "psutil", "cgroup-v2", "cgroup-v1", "rlimit-as", "tf-bfc-cap")
"""Every value :attr:`DeviceInfo.limit_source` can take."""

_DEVICE_RE = re.compile(r"(?:^|[/:])(CPU|GPU):(\d+)$", re.I)
# cgroup v1 writes "no limit" as PAGE_COUNTER_MAX pages (9223372036854771712 on x86).
_CGROUP_UNLIMITED = 2**60
# TensorFlow's cap when TF_CPU_ALLOCATOR_USE_BFC is on and no limit is given.
_TF_BFC_DEFAULT_MIB = 1 << 16


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    """One reading of one device's memory; every size is in bytes.

    Attributes:
        kind: ``"GPU"`` or ``"CPU"``.
        name: The device's name (``"NVIDIA H100 80GB HBM3"``, the CPU model).
        identity: A stable key for caching results per device: the GPU UUID, or
            ``"cpu:<model name>:<physical RAM bytes>"`` (no hostname).
        total_bytes: The tightest hard total: GPU memory, or the smallest of RAM,
            cgroup limit, ``RLIMIT_AS`` and TensorFlow's BFC cap.
        available_bytes: What this process may still use. On GPU this is
            ``total - used_by_others`` (see :func:`read_gpu`).
        used_by_others_bytes: GPU memory that other processes hold, per NVML;
            ``None`` on CPU.
        limit_source: Which reading bounded ``available_bytes``, one of
            :data:`LIMIT_SOURCES`.
        tf_device: The TensorFlow device, ``"GPU:0"`` or ``"CPU:0"``.
        pci_bus_id: The GPU's PCI bus id as ``"0000:3b:00.0"``; ``None`` on CPU.

    Example:
        >>> info = read_cpu()
        >>> DeviceInfo.from_dict(json.loads(json.dumps(info.to_dict()))) == info
        True
    """

    kind: str
    name: str
    identity: str
    total_bytes: int
    available_bytes: int
    used_by_others_bytes: int | None
    limit_source: str
    tf_device: str
    pci_bus_id: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("GPU", "CPU"):
            raise ValueError(f"Expected `kind` to be 'GPU' or 'CPU'. Received: kind={self.kind!r}")
        if self.limit_source not in LIMIT_SOURCES:
            raise ValueError(
                f"Expected `limit_source` to be one of {LIMIT_SOURCES}. "
                f"Received: limit_source={self.limit_source!r}")

    def to_dict(self) -> dict[str, Any]:
        """Returns a JSON-serialisable dict of every field."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DeviceInfo:
        """Builds a reading from :meth:`to_dict` output.

        Raises:
            ValueError: A required field is missing or an unknown one is present.
        """
        fields = {f.name: f for f in dataclasses.fields(cls)}
        missing = sorted(
            n for n, f in fields.items() if n not in data and f.default is dataclasses.MISSING)
        unknown = sorted(set(data) - set(fields))
        if missing or unknown:
            raise ValueError(
                f"Expected a dict with the fields of DeviceInfo ({', '.join(fields)}). "
                f"Received: missing={missing}, unknown={unknown}")
        return cls(**data)


# ---------------------------------------------------------------------------- GPU


def read_gpu(
    tf_device: str = "GPU:0", *, nvml: Any = None, pci_bus_id: str | None = None,
) -> DeviceInfo:
    """Reads a GPU's memory through NVML.

    The NVML device is the one whose PCI bus id matches TensorFlow's device (TF and
    NVML number GPUs differently: CUDA puts the fastest first, NVML sorts by bus).
    Without a match it falls back to the index, mapped through an integer or UUID
    ``CUDA_VISIBLE_DEVICES`` when one is set.

    TensorFlow reserves most of a GPU's memory when it starts (unless memory growth
    is on), so NVML's ``free`` after TF starts says little. The budget is therefore
    ``available = total - used_by_others``: what TensorFlow may hold, with memory of
    every other process subtracted. What one step needs is read from TensorFlow's
    allocator with :class:`PeakMeter`. Inside a container with its own PID
    namespace NVML reports host PIDs, so this process may be counted as "other";
    pass ``memory_limit`` to :func:`budget_bytes` there.

    Args:
        tf_device: TensorFlow's name for the GPU, ``"GPU:0"`` or ``"/device:GPU:0"``.
        nvml: A module with pynvml's functions; ``pynvml`` (nvidia-ml-py) when ``None``.
        pci_bus_id: TensorFlow's bus id for ``tf_device``; asked from TensorFlow when
            ``None``.

    Returns:
        A reading with ``kind="GPU"`` and ``limit_source="nvml"``.

    Raises:
        ValueError: ``tf_device`` is not a GPU name.
        RuntimeError: NVML has no device for ``tf_device``.
        pynvml.NVMLError: NVML failed (no driver, no permission...).

    Example:
        >>> info = read_gpu("GPU:0")
        >>> print(info.name, format_bytes(info.available_bytes))  # e.g. NVIDIA H100 79.10 GiB
    """
    kind, index = split_device(tf_device)
    if kind != "GPU":
        raise ValueError(f"Expected `tf_device` to name a GPU, like 'GPU:0'. "
                         f"Received: tf_device={tf_device!r}")
    if nvml is None:
        import pynvml as nvml
    if pci_bus_id is None:
        pci_bus_id = _tf_pci_bus_id(index)
    wanted = _normalize_bus_id(pci_bus_id) if pci_bus_id else None

    nvml.nvmlInit()
    try:
        handle, bus_id = _find_nvml_handle(nvml, index, wanted)
        name = _text(nvml.nvmlDeviceGetName(handle))
        uuid = _text(nvml.nvmlDeviceGetUUID(handle))
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        processes = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
    finally:
        nvml.nvmlShutdown()

    me = os.getpid()
    total = int(memory.total)
    # usedGpuMemory is None where the driver cannot tell (WDDM, no permission).
    others = sum(int(p.usedGpuMemory or 0) for p in processes if p.pid != me)
    others = min(others, total)
    return DeviceInfo(
        kind="GPU", name=name, identity=uuid, total_bytes=total,
        available_bytes=total - others, used_by_others_bytes=others,
        limit_source="nvml", tf_device=f"GPU:{index}", pci_bus_id=bus_id)


def _find_nvml_handle(nvml: Any, index: int, wanted: str | None) -> tuple[Any, str]:
    count = int(nvml.nvmlDeviceGetCount())
    handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    bus_ids = [_normalize_bus_id(_text(nvml.nvmlDeviceGetPciInfo(h).busId)) for h in handles]
    if wanted is not None and wanted in bus_ids:
        position = bus_ids.index(wanted)
        return handles[position], bus_ids[position]

    position = index
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")]
    if index < len(visible) and visible[index]:
        entry = visible[index]
        if entry.isdigit():
            position = int(entry)
        else:  # CUDA also accepts a UUID or a unique prefix of one.
            uuids = [_text(nvml.nvmlDeviceGetUUID(h)) for h in handles]
            position = next((i for i, u in enumerate(uuids) if u.startswith(entry)), index)
    if not 0 <= position < count:
        raise RuntimeError(
            f"NVML sees {count} GPU(s) and none matches TensorFlow's GPU:{index} "
            f"(bus id {wanted!r}). Pass `memory_limit` to set the budget by hand.")
    return handles[position], bus_ids[position]


def _tf_pci_bus_id(index: int) -> str | None:
    """TensorFlow's PCI bus id for GPU:<index>, or None when TF does not say."""
    try:
        import tensorflow as tf
        from tensorflow.python.client import device_lib

        # get_device_details() has only name and compute capability; the bus id is
        # in the device description. Listing logical devices first initialises the
        # runtime with the user's GPU options, so device_lib reuses its allocators.
        tf.config.list_logical_devices("GPU")
        for device in device_lib.list_local_devices():
            if device.device_type == "GPU" and device.name.endswith(f"GPU:{index}"):
                match = re.search(r"pci bus id: ([0-9a-fA-F:.]+)", device.physical_device_desc)
                return match.group(1) if match else None
    except Exception:  # A missing bus id only costs the index fallback.
        return None
    return None


def _normalize_bus_id(bus_id: str) -> str:
    """'00000000:3B:00.0' (NVML) and '0000:3b:00.0' (TF) both become '0000:3b:00.0'."""
    parts = bus_id.strip().lower().split(":")
    if len(parts) == 2:  # "3b:00.0" has no domain.
        parts.insert(0, "0")
    domain = parts[0]
    with contextlib.suppress(ValueError):
        domain = f"{int(domain, 16):04x}"
    return ":".join([domain, *parts[1:]])


def _text(value: str | bytes) -> str:
    # pynvml < 11.5 returns bytes for names, UUIDs and bus ids; later ones str.
    return value.decode() if isinstance(value, bytes) else str(value)


# ---------------------------------------------------------------------------- CPU


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
    that cap minus TF's current bytes. Cgroup limits are read at this process's own
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
    used = _status_bytes(proc_root, "VmSize") or 0
    return _Bound(max(soft - used, 0), soft, "rlimit-as")


def _tf_bfc_bound() -> _Bound | None:
    cap = is_tf_bfc_capped()
    if cap is None:
        return None
    used = 0
    tf = sys.modules.get("tensorflow")  # Nothing is allocated before TF is imported.
    if tf is not None:
        try:
            used = int(tf.config.experimental.get_memory_info("CPU:0")["current"])
        except (ValueError, KeyError, AttributeError):
            used = 0
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


def _status_bytes(proc_root: Path, key: str) -> int | None:
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


# ---------------------------------------------------------------- either device


def read_device(tf_device: str | None = None) -> DeviceInfo:
    """Reads the device a model will train on.

    A GPU when TensorFlow sees one and NVML can read it, else the CPU. When
    TensorFlow sees a GPU that NVML cannot read, a ``RuntimeWarning`` says so and
    the host memory is read instead; pass ``memory_limit`` to budget the GPU by hand.

    Args:
        tf_device: ``"GPU:1"``, ``"CPU:0"``..., or ``None`` for the first GPU if any.

    Returns:
        The reading of :func:`read_gpu` or :func:`read_cpu`.

    Example:
        >>> info = read_device()
        >>> info.kind, info.limit_source  # e.g. ('GPU', 'nvml') or ('CPU', 'cgroup-v2')
    """
    if tf_device is not None:
        kind, index = split_device(tf_device)
        if kind == "CPU":
            return read_cpu(tf_device=f"CPU:{index}")
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    wanted = tf_device or "GPU:0"
    if not gpus:
        if tf_device is not None:
            warnings.warn(f"TensorFlow sees no GPU, so {tf_device!r} cannot be read; "
                          "reading host memory instead.", RuntimeWarning, stacklevel=2)
        return read_cpu()
    try:
        import pynvml

        nvml_errors: tuple[type[BaseException], ...] = (pynvml.NVMLError,)
    except ImportError:
        nvml_errors = ()
    try:
        return read_gpu(wanted)
    except (ImportError, OSError, RuntimeError, *nvml_errors) as exc:
        warnings.warn(
            f"TensorFlow sees {len(gpus)} GPU(s) but NVML could not read {wanted!r} "
            f"({exc!r}); reading host memory instead. Pass `memory_limit` to set the "
            "GPU budget by hand.", RuntimeWarning, stacklevel=2)
    return read_cpu()


def budget_bytes(device: DeviceInfo, memory_limit: int | None, headroom: float = 0.1) -> int:
    """The bytes a step may plan for: ``min(available, memory_limit) * (1 - headroom)``.

    Args:
        device: A reading from :func:`read_device`.
        memory_limit: A user's cap in bytes (anything :func:`parse_memory` takes),
            or ``None`` for no cap.
        headroom: The fraction kept free for fragmentation and whatever the reading
            missed, in ``[0, 1)``.

    Returns:
        The budget in bytes, rounded down.

    Raises:
        MemoryLimitError: ``memory_limit`` is not a positive size or ``headroom`` is
            not in ``[0, 1)``.

    Example:
        >>> budget_bytes(read_device(), parse_memory("6GiB"))  # at most 0.9 * 6 GiB
    """
    if (isinstance(headroom, bool) or not isinstance(headroom, numbers.Real)
            or not 0 <= headroom < 1):
        raise MemoryLimitError(
            "Expected `headroom` to be a fraction in [0, 1), like 0.1 to keep 10% free. "
            f"Received: headroom={headroom!r}")
    limit = device.available_bytes
    cap = parse_memory(memory_limit)
    if cap is not None:
        limit = min(limit, cap)
    return math.floor(limit * (1 - headroom))


def is_tf_bfc_capped(environ: Mapping[str, str] | None = None) -> int | None:
    """TensorFlow's CPU cap in bytes when its CPU allocator is BFC, else ``None``.

    Reads the same variables TensorFlow does: ``TF_CPU_ALLOCATOR_USE_BFC`` (``true``
    or ``1``) and ``TF_CPU_BFC_MEM_LIMIT_IN_MB`` (MiB; 65536, i.e. 64 GiB, when
    unset or unreadable, as in TensorFlow).

    Args:
        environ: The environment to read; ``os.environ`` when ``None``.

    Example:
        >>> is_tf_bfc_capped(capped_cpu_env(200 * 2**20))
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


def split_device(tf_device: str) -> tuple[str, int]:
    """'GPU:0', '/device:GPU:0', '/physical_device:gpu:0' -> ('GPU', 0)."""
    match = _DEVICE_RE.search(tf_device) if isinstance(tf_device, str) else None
    if match is None:
        raise ValueError(f"Expected `tf_device` to be like 'GPU:0' or 'CPU:0'. "
                         f"Received: tf_device={tf_device!r}")
    return match.group(1).upper(), int(match.group(2))
