"""Device memory readings: how much a GPU (NVML) lets this process use, which device a
model trains on, and the budget from a reading. The host's own readings (psutil,
cgroups, ``RLIMIT_AS``, TensorFlow's BFC cap) are in ``autosplit.memory.host``; the record
both return, :class:`~autosplit.memory.device_info.DeviceInfo`, is in
``autosplit.memory.device_info``.

The GPU reading is what ``nvidia-smi`` shows (NVML); the CPU reading is what the
kernel enforces (cgroups, ``RLIMIT_AS``) and what TensorFlow's own CPU allocator
enforces when it is a capped BFC allocator. The idea of measuring rather than
guessing follows accelerate's ``utils/memory.py`` (PR #3684, "Stop halving my batch").
What TensorFlow's allocator does under a cap is shown by the real-cap tests in
``tests/memory/test_device.py``.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import os
from typing import Any

from autosplit.errors import MemoryLimitError, describe
from autosplit.memory.device_info import LIMIT_SOURCES, DeviceInfo, split_device
from autosplit.memory.host import read_cpu
from autosplit.units import parse_memory
from autosplit.warn import warn_user

__all__ = [
    "LIMIT_SOURCES",  # re-exported from autosplit.memory.device_info, their home
    "DeviceInfo",
    "budget_bytes",
    "check_headroom",
    "read_device",
    "read_gpu",
    "split_device",
]

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
    allocator with :class:`~autosplit.memory.peak_meter.PeakMeter`. Inside a container with
    its own PID namespace NVML reports host PIDs, so this process may be counted as
    "other"; pass ``memory_limit`` to :func:`budget_bytes` there.

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
        >>> info = read_gpu("GPU:0")  # doctest: +SKIP
        >>> print(info.name, format_bytes(info.available_bytes))  # doctest: +SKIP
        NVIDIA H100 80GB HBM3 79.10 GiB
    """
    kind, index = split_device(tf_device)
    if kind != "GPU":
        raise ValueError(f"Expected `tf_device` to name a GPU, like 'GPU:0'. "
                         f"Received: tf_device={tf_device!r}")
    if nvml is None:
        import pynvml

        nvml = pynvml
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
        from autosplit.keras_hooks import internals as _keras

        return _keras.gpu_pci_bus_id(index)
    except Exception:  # A missing bus id only costs the index fallback.
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
        >>> info = read_device()  # doctest: +SKIP
        >>> info.kind, info.limit_source  # doctest: +SKIP
        ('GPU', 'nvml')
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
            warn_user(f"TensorFlow sees no GPU, so {tf_device!r} cannot be read; "
                      "reading host memory instead.", RuntimeWarning)
        return read_cpu()
    try:
        import pynvml

        nvml_errors: tuple[type[BaseException], ...] = (pynvml.NVMLError,)
    except ImportError:
        nvml_errors = ()
    caught: tuple[type[BaseException], ...] = (ImportError, OSError, RuntimeError, *nvml_errors)
    try:
        return read_gpu(wanted)
    except caught as exc:
        warn_user(
            f"TensorFlow sees {len(gpus)} GPU(s) but NVML could not read {wanted!r} "
            f"({exc!r}); reading host memory instead. Pass `memory_limit` to set the "
            "GPU budget by hand.", RuntimeWarning)
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
        >>> budget_bytes(read_device(), parse_memory("6GiB"))  # doctest: +SKIP
        5798205849
    """
    headroom = check_headroom(headroom)
    limit = device.available_bytes
    cap = parse_memory(memory_limit)
    if cap is not None:
        limit = min(limit, cap)
    return math.floor(limit * (1 - headroom))


def check_headroom(headroom: Any) -> float:
    """``headroom`` as a float in ``[0, 1)``; every entry point checks it here.

    Raises:
        MemoryLimitError: ``headroom`` is not a real number in ``[0, 1)``.

    Example:
        >>> check_headroom(0.1)
        0.1
    """
    if (isinstance(headroom, bool) or not isinstance(headroom, numbers.Real)
            or not 0 <= headroom < 1):  # type: ignore[operator]  # typeshed: Real has no __ge__
        raise MemoryLimitError(
            "Expected `headroom` to be a fraction in [0, 1), like 0.1 to keep 10% free. "
            f"Received: headroom={describe(headroom)}.")
    return float(headroom)
