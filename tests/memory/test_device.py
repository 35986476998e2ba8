"""autosplit.memory.device and .device_info: what a device holds and the budgets drawn from
it. NVML is a stand-in: this machine has no GPU."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
from _memory import GiB

from autosplit.errors import MemoryLimitError
from autosplit.memory import device
from autosplit.memory.device import budget_bytes, read_device, read_gpu
from autosplit.memory.device_info import DeviceInfo

# --------------------------------------------------------------------- DeviceInfo


def _info(**overrides) -> DeviceInfo:
    fields = dict(kind="CPU", name="Fake", identity="cpu:Fake:1000", total_bytes=1000,
                  available_bytes=1000, used_by_others_bytes=None, limit_source="psutil",
                  tf_device="CPU:0")
    return DeviceInfo(**{**fields, **overrides})


def test_device_info_json_round_trip_and_is_frozen():
    info = _info(kind="GPU", limit_source="nvml", used_by_others_bytes=7,
                 pci_bus_id="0000:3b:00.0", tf_device="GPU:0")
    assert DeviceInfo.from_dict(json.loads(json.dumps(info.to_dict()))) == info
    with pytest.raises(AttributeError):
        info.total_bytes = 1  # type: ignore[misc]


@pytest.mark.parametrize(("data", "match"), [
    ({"kind": "CPU"}, "missing="),
    ({**_info().to_dict(), "colour": "red"}, r"unknown=\['colour'\]"),
    ({**_info().to_dict(), "kind": "TPU"}, "Received: kind='TPU'"),
    ({**_info().to_dict(), "limit_source": "guess"}, "Received: limit_source='guess'"),
])
def test_device_info_from_dict_rejects_bad_dicts(data, match):
    with pytest.raises(ValueError, match=match):
        DeviceInfo.from_dict(data)


def test_read_device_on_this_cpu_only_machine():
    assert read_device().kind == "CPU"
    assert read_device("/device:CPU:0").tf_device == "CPU:0"
    with pytest.warns(RuntimeWarning, match="sees no GPU"):
        assert read_device("GPU:0").kind == "CPU"


# ------------------------------------------------------------------------- GPU


class StandinNvmlError(Exception):
    """What the stand-in raises where pynvml would raise NVMLError."""


class StandinNvml:
    """The pynvml functions read_gpu calls, over a list of fake GPUs.

    ``fail`` names one function that raises, to check NVML is still shut down.
    """

    NVMLError = StandinNvmlError

    def __init__(self, gpus, fail=None):
        self.gpus, self.fail, self.calls = gpus, fail, []

    def _call(self, name):
        self.calls.append(name)
        if name == self.fail:
            raise StandinNvmlError(f"{name} failed")

    def nvmlInit(self):
        self._call("nvmlInit")

    def nvmlShutdown(self):
        self._call("nvmlShutdown")

    def nvmlDeviceGetCount(self):
        self._call("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index):
        self._call("nvmlDeviceGetHandleByIndex")
        return index

    def nvmlDeviceGetPciInfo(self, handle):
        self._call("nvmlDeviceGetPciInfo")
        return SimpleNamespace(busId=self.gpus[handle].bus_id)

    def nvmlDeviceGetName(self, handle):
        self._call("nvmlDeviceGetName")
        return self.gpus[handle].name

    def nvmlDeviceGetUUID(self, handle):
        self._call("nvmlDeviceGetUUID")
        return self.gpus[handle].uuid

    def nvmlDeviceGetMemoryInfo(self, handle):
        self._call("nvmlDeviceGetMemoryInfo")
        gpu = self.gpus[handle]
        return SimpleNamespace(total=gpu.total, used=gpu.used, free=gpu.total - gpu.used)

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        self._call("nvmlDeviceGetComputeRunningProcesses")
        return [SimpleNamespace(pid=pid, usedGpuMemory=used)
                for pid, used in self.gpus[handle].processes]


def _two_gpus():
    """Old pynvml style (bytes) on GPU 0, new style (str) on GPU 1."""
    me = os.getpid()
    return [
        SimpleNamespace(bus_id=b"00000000:1A:00.0", name=b"NVIDIA A100", uuid=b"GPU-aaaa-1111",
                        total=40 * GiB, used=1 * GiB, processes=[(999, GiB)]),
        SimpleNamespace(bus_id="00000000:3B:00.0", name="NVIDIA H100", uuid="GPU-bbbb-2222",
                        total=80 * GiB, used=72 * GiB,
                        processes=[(me, 60 * GiB), (123, 2 * GiB), (456, None)]),
    ]


@pytest.fixture
def no_cuda_env(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return monkeypatch


def test_read_gpu_with_standin_nvml_no_gpu_here(no_cuda_env):
    """Stand-in NVML, because no GPU exists here: TF's GPU:0 sits on bus 3b, NVML's 1.

    The bus id picks the right device among two, memory of other processes excludes
    this one's (and a process NVML cannot measure counts 0), names in bytes or str
    both decode, and NVML is shut down.
    """
    nvml = StandinNvml(_two_gpus())
    info = read_gpu("GPU:0", nvml=nvml, pci_bus_id="0000:3b:00.0")
    assert info == DeviceInfo(
        kind="GPU", name="NVIDIA H100", identity="GPU-bbbb-2222", total_bytes=80 * GiB,
        available_bytes=78 * GiB, used_by_others_bytes=2 * GiB, limit_source="nvml",
        tf_device="GPU:0", pci_bus_id="0000:3b:00.0")
    assert nvml.calls[0] == "nvmlInit" and nvml.calls[-1] == "nvmlShutdown"
    assert nvml.calls.count("nvmlShutdown") == 1

    bytes_style = read_gpu("/device:GPU:1", nvml=StandinNvml(_two_gpus()),
                           pci_bus_id="0000:1A:00.0")
    assert (bytes_style.name, bytes_style.identity, bytes_style.pci_bus_id) == (
        "NVIDIA A100", "GPU-aaaa-1111", "0000:1a:00.0")
    assert bytes_style.used_by_others_bytes == GiB and bytes_style.tf_device == "GPU:1"


@pytest.mark.parametrize(("tf_device", "visible", "pci_bus_id", "expected_uuid"), [
    ("GPU:0", None, "0000:99:00.0", "GPU-aaaa-1111"),  # no bus match: index
    ("GPU:1", None, None, "GPU-bbbb-2222"),  # TF gives no bus id on a CPU-only machine
    ("GPU:0", "1", "0000:99:00.0", "GPU-bbbb-2222"),  # index through CUDA_VISIBLE_DEVICES
    ("GPU:0", "GPU-bbbb", "0000:99:00.0", "GPU-bbbb-2222"),  # UUID prefix
    ("GPU:0", "1", "0000:1a:00.0", "GPU-aaaa-1111"),  # a bus match beats the index
])
def test_read_gpu_standin_fallbacks(no_cuda_env, tf_device, visible, pci_bus_id,
                                    expected_uuid):
    """Stand-in NVML (no GPU here): when the bus id does not settle it, use the index."""
    if visible is not None:
        no_cuda_env.setenv("CUDA_VISIBLE_DEVICES", visible)
    info = read_gpu(tf_device, nvml=StandinNvml(_two_gpus()), pci_bus_id=pci_bus_id)
    assert info.identity == expected_uuid


@pytest.mark.parametrize("fail", [
    "nvmlDeviceGetCount", "nvmlDeviceGetPciInfo", "nvmlDeviceGetName",
    "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetComputeRunningProcesses",
])
def test_read_gpu_standin_shuts_down_when_a_call_raises(no_cuda_env, fail):
    """Stand-in NVML (no GPU here): nvmlShutdown runs even when a reading raises."""
    nvml = StandinNvml(_two_gpus(), fail=fail)
    with pytest.raises(StandinNvmlError, match=fail):
        read_gpu("GPU:0", nvml=nvml, pci_bus_id="0000:3b:00.0")
    assert nvml.calls[-1] == "nvmlShutdown"


def test_read_gpu_standin_missing_device_and_bad_names(no_cuda_env):
    """Stand-in NVML (no GPU here): a GPU NVML lacks is an error, after shutdown."""
    nvml = StandinNvml(_two_gpus())
    with pytest.raises(RuntimeError, match="none matches TensorFlow's GPU:5"):
        read_gpu("GPU:5", nvml=nvml, pci_bus_id="0000:99:00.0")
    assert nvml.calls[-1] == "nvmlShutdown"
    with pytest.raises(ValueError, match="Received: tf_device='CPU:0'"):
        read_gpu("CPU:0", nvml=nvml)
    with pytest.raises(ValueError, match="Received: tf_device='TPU:0'"):
        read_gpu("TPU:0", nvml=nvml)


@pytest.mark.parametrize("bus_id", [
    "00000000:3B:00.0", "0000:3b:00.0", "0000:3B:00.0", "3b:00.0", " 00000000:3b:00.0 ",
])
def test_bus_ids_of_nvml_and_tf_normalise_alike(bus_id):
    assert device._normalize_bus_id(bus_id) == "0000:3b:00.0"


# ---------------------------------------------------------------------- budgets


@pytest.mark.parametrize(("memory_limit", "headroom", "expected"), [
    (None, 0.1, 900),
    (500, 0.1, 450),
    (5000, 0.1, 900),
    (None, 0.0, 1000),
    ("0.5KB", 0.0, 500),
    (1000, 0.25, 750),
])
def test_budget_bytes(memory_limit, headroom, expected):
    assert budget_bytes(_info(), memory_limit, headroom) == expected


def test_budget_bytes_default_headroom_keyword_call():
    assert budget_bytes(_info(), None) == budget_bytes(device=_info(), memory_limit=None,
                                                       headroom=0.1) == 900


@pytest.mark.parametrize("headroom", [-0.1, 1.0, 1.5, float("nan"), True, "0.1", None])
def test_budget_bytes_rejects_bad_headroom(headroom):
    with pytest.raises(MemoryLimitError, match=r"`headroom` to be a fraction in \[0, 1\)"):
        budget_bytes(_info(), None, headroom)


def test_budget_bytes_rejects_bad_limit():
    with pytest.raises(MemoryLimitError, match="Received: memory_limit=0"):
        budget_bytes(_info(), 0)
