"""The record of one device reading, and TensorFlow's device names.

:class:`DeviceInfo` is what :func:`autosplit.memory.device.read_gpu` and
:func:`autosplit.memory.host.read_cpu` return (``ProbeResult.device`` is its
:meth:`~DeviceInfo.to_dict`); :func:`split_device` reads a TensorFlow device name.
Both reading modules import this one and it imports neither: nothing here reads a
device.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

__all__ = ["LIMIT_SOURCES", "DeviceInfo", "split_device"]

LIMIT_SOURCES = ("nvml", "psutil", "cgroup-v2", "cgroup-v1", "rlimit-as", "tf-bfc-cap")
"""Every value :attr:`DeviceInfo.limit_source` can take."""

_DEVICE_RE = re.compile(r"(?:^|[/:])(CPU|GPU):(\d+)$", re.I)


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
        >>> import json
        >>> from autosplit.memory.host import read_cpu
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


def split_device(tf_device: str) -> tuple[str, int]:
    """'GPU:0', '/device:GPU:0', '/physical_device:gpu:0' -> ('GPU', 0)."""
    match = _DEVICE_RE.search(tf_device) if isinstance(tf_device, str) else None
    if match is None:
        raise ValueError(f"Expected `tf_device` to be like 'GPU:0' or 'CPU:0'. "
                         f"Received: tf_device={tf_device!r}")
    return match.group(1).upper(), int(match.group(2))
