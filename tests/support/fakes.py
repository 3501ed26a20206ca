"""A stand-in for the ``pynvml`` module (nvidia-ml-py) with named scenarios, for machines
without a GPU. It raises the real ``pynvml.NVMLError`` classes, so the probe's error
handling is exercised against the bindings' own exception tree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml

GIB = 1 << 30


@dataclass
class FakeDevice:
    uuid: str
    name: str
    total: int
    used: int
    processes: list[tuple[int, int | None]] = field(default_factory=list)
    lost_after: int | None = None  # sample count after which the GPU is lost
    v2_supported: bool = True
    # per-process utilisation samples still to hand out: (pid, SM %, memory %); None: the
    # device does not report it (NOT_SUPPORTED)
    utilisation: list[tuple[int, int, int]] | None = field(default_factory=list)


class FakeNvml:
    """Enough of pynvml's surface for ``sidecar.probes.gpu``."""

    NVMLError = pynvml.NVMLError
    nvmlMemory_v2 = pynvml.nvmlMemory_v2

    def __init__(self, devices: list[FakeDevice], init_error: int | None = None, old_bindings: bool = False):
        self.devices = devices
        self.init_error = init_error
        self.old_bindings = old_bindings
        self.inited = False
        self.memory_calls = [0] * len(devices)
        self.shutdowns = 0
        self.stamp = 1_700_000_000_000_000
        self.utilisation_asked: list[tuple[int, int]] = []

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise pynvml.NVMLError(self.init_error)
        self.inited = True

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1
        self.inited = False

    def nvmlDeviceGetCount(self) -> int:
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return self.devices[h].uuid

    def nvmlDeviceGetName(self, h: int) -> bytes:
        return self.devices[h].name.encode()  # older bindings return bytes

    def _check_lost(self, h: int) -> None:
        dev = self.devices[h]
        if dev.lost_after is not None and self.memory_calls[h] > dev.lost_after:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)

    def nvmlDeviceGetMemoryInfo(self, h: int, version: int | None = None) -> Any:
        if version is not None and self.old_bindings:
            raise TypeError("nvmlDeviceGetMemoryInfo() got an unexpected keyword argument 'version'")
        self.memory_calls[h] += 1
        self._check_lost(h)
        dev = self.devices[h]
        if version is not None:
            if not dev.v2_supported:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
            return SimpleNamespace(
                total=dev.total, reserved=600 << 20, free=dev.total - dev.used, used=dev.used
            )
        # v1 counts the driver's reservation as used
        return SimpleNamespace(
            total=dev.total, free=dev.total - dev.used - (600 << 20), used=dev.used + (600 << 20)
        )

    def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list[Any]:
        self._check_lost(h)
        return [
            SimpleNamespace(
                pid=pid, usedGpuMemory=used, gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF
            )
            for pid, used in self.devices[h].processes
        ]

    def nvmlDeviceGetProcessUtilization(self, h: int, last_seen: int) -> list[Any]:
        """Samples newer than ``last_seen`` (us): each queued sample once, stamped in turn."""
        self._check_lost(h)
        dev = self.devices[h]
        self.utilisation_asked.append((h, last_seen))
        if dev.utilisation is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if not dev.utilisation:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        out = []
        for pid, sm, mem in dev.utilisation:
            self.stamp += 1000
            out.append(SimpleNamespace(pid=pid, timeStamp=self.stamp, smUtil=sm, memUtil=mem))
        dev.utilisation = []
        return out


def scenario(name: str, rank_pids: tuple[int, ...] = ()) -> Any:
    """A loader for ``GpuProbe(loader=...)``, by scenario name."""
    pids = list(rank_pids)

    def h200(i: int, procs: list[tuple[int, int | None]], **kw: Any) -> FakeDevice:
        return FakeDevice(
            f"GPU-{i:08x}-fake", "NVIDIA H200", 143771 * (1 << 20), sum(p[1] or 0 for p in procs), procs, **kw
        )

    if name == "no_library":

        def loader() -> Any:
            raise ImportError("No module named 'pynvml'")

        return loader
    if name == "no_driver":
        fake = FakeNvml([], init_error=pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    elif name == "no_gpu":
        fake = FakeNvml([])
    elif name == "two_gpus":
        fake = FakeNvml([h200(i, [(pid, (2 + i) * GIB)]) for i, pid in enumerate(pids[:2])])
    elif name == "gpu_lost_mid_run":
        fake = FakeNvml([h200(0, [(pids[0], 3 * GIB)]), h200(1, [(pids[1], 3 * GIB)], lost_after=2)])
    elif name == "unsupported_field":
        fake = FakeNvml([h200(0, [(pids[0], None)], v2_supported=False)])
    elif name == "old_bindings":
        fake = FakeNvml([h200(0, [(pids[0], 5 * GIB)])], old_bindings=True)
    elif name == "foreign_pids":
        fake = FakeNvml([h200(0, [(4_000_000, 4 * GIB)])])
    else:
        raise KeyError(name)
    return lambda: fake
