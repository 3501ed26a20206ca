"""GPU memory through NVML. The only module that imports ``pynvml`` (from the
``nvidia-ml-py`` distribution), lazily, on the sampler thread.

No bindings, no driver library, no GPU: a normal state, reported as probe failure with
one message and retried once a minute (a driver can be loaded later), never a crash.
A field the device does not support is None and its series is left out, not zero. A GPU
that falls off the bus (NVML_ERROR_GPU_IS_LOST) is kept in the sample with ``lost=True``
so the loss is visible, and the probe reports failure while it lasts.

NVML lists processes by host (initial PID namespace) pid; the caller maps them to ranks.

Each process's activity comes from ``nvmlDeviceGetProcessUtilization``: the driver keeps a
short buffer of per-process samples (SM and memory-controller busy percent); each round
asks for those newer than the last one seen, so a process with no sample since ran no
kernel (0 %). A device that does not report it (NOT_SUPPORTED: some vGPU, MIG) gives None,
and is not asked again.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sidecar.model import GpuDeviceSample, GpuProcessSample

__all__ = ["GpuProbe", "GpuResult", "load_pynvml"]

log = logging.getLogger(__name__)

# NVML return codes (nvml.h); pynvml raises NVMLError subclasses whose .value is one of these.
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_UNKNOWN = 999
NVML_MEMORY_V2 = 0x02000028

RETRY_INIT_SECONDS = 60.0


def load_pynvml() -> Any:
    """Import the NVML bindings. Raises ImportError when nvidia-ml-py is not installed."""
    import pynvml

    return pynvml


@dataclass(frozen=True, slots=True)
class GpuResult:
    devices: tuple[GpuDeviceSample, ...]
    success: bool
    message: str | None


def _code(exc: BaseException) -> int | None:
    value = getattr(exc, "value", None)
    return value if isinstance(value, int) else None


def _is_nvml_error(nvml: Any, exc: BaseException) -> bool:
    error_type = getattr(nvml, "NVMLError", None)
    return isinstance(error_type, type) and isinstance(exc, error_type)


class GpuProbe:
    """Samples every GPU NVML can see. Not thread-safe: one sampler thread calls it."""

    def __init__(
        self,
        loader: Callable[[], Any] = load_pynvml,
        clock: Callable[[], float] = time.monotonic,
        *,
        off: bool = False,
    ) -> None:
        """``off``: turned off (``--disable nvml``): NVML is never loaded."""
        self._off = off
        self._loader = loader
        self._clock = clock
        self._nvml: Any = None
        self._handles: list[Any] = []
        self._names: list[tuple[str | None, str | None]] = []
        self._memory_v2: list[bool] = []
        self._util_seen: list[
            int | None
        ] = []  # per device: newest utilisation sample (us); None: unsupported
        self._next_init = 0.0
        self._init_message: str | None = None
        # per device: the processes the last detailed round listed (see sample())
        self._processes: list[tuple[GpuProcessSample, ...] | None] = []

    def _init(self) -> str | None:
        """Initialise NVML; return None on success, else why not."""
        if self._off:
            return "turned off (--disable nvml): no GPU data"
        try:
            nvml = self._loader()
        except ImportError:
            return "NVML bindings not installed (pip install nvidia-ml-py): no GPU data"
        try:
            nvml.nvmlInit()
        except Exception as exc:
            if not _is_nvml_error(nvml, exc):
                raise
            code = _code(exc)
            if code in (NVML_ERROR_LIBRARY_NOT_FOUND, NVML_ERROR_DRIVER_NOT_LOADED):
                return "no NVIDIA driver on this machine (libnvidia-ml.so.1 not loadable): no GPU data"
            if code == NVML_ERROR_NO_PERMISSION:
                return "NVML refused access (no permission on /dev/nvidia*): no GPU data"
            return f"NVML init failed: {exc}"
        try:
            count = nvml.nvmlDeviceGetCount()
            handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        except Exception as exc:
            if not _is_nvml_error(nvml, exc):
                raise
            self._safe_shutdown(nvml)
            return f"NVML could not list devices: {exc}"
        if not handles:
            self._safe_shutdown(nvml)
            return "NVML found no GPU on this machine"
        self._nvml = nvml
        self._handles = handles
        self._names = [self._identity(h) for h in handles]
        self._memory_v2 = [True] * len(handles)
        self._util_seen = [0] * len(handles)
        self._processes = [None] * len(handles)
        return None

    def _identity(self, handle: Any) -> tuple[str | None, str | None]:
        uuid = name = None
        try:
            uuid = _text(self._nvml.nvmlDeviceGetUUID(handle))
        except Exception as exc:
            if not _is_nvml_error(self._nvml, exc):
                raise
        try:
            name = _text(self._nvml.nvmlDeviceGetName(handle))
        except Exception as exc:
            if not _is_nvml_error(self._nvml, exc):
                raise
        return uuid, name

    @staticmethod
    def _safe_shutdown(nvml: Any) -> None:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()

    def sample(self, detail: bool = True) -> GpuResult:
        """Every device's memory, and its processes with their memory and activity. The
        per-process queries are the costly ones (each a round trip to the driver that a
        training step can wait behind): without ``detail`` the last detailed round's list
        is given again (the activity is a mean since the previous query either way)."""
        if self._nvml is None:
            now = self._clock()
            if now < self._next_init:
                return GpuResult((), False, self._init_message)
            message = self._init()
            if message is not None:
                self._next_init = now + RETRY_INIT_SECONDS
                self._init_message = message
                return GpuResult((), False, message)
            self._init_message = None
            log.info(
                "probe=gpu NVML sees %d GPU(s): %s",
                len(self._handles),
                ", ".join(f"{i}={n[1] or '?'}" for i, n in enumerate(self._names)),
            )
        devices: list[GpuDeviceSample] = []
        problems: list[str] = []
        for index, handle in enumerate(self._handles):
            devices.append(self._device(index, handle, problems, detail))
        return GpuResult(tuple(devices), not problems, "; ".join(problems) or None)

    def _device(self, index: int, handle: Any, problems: list[str], detail: bool = True) -> GpuDeviceSample:
        nvml = self._nvml
        uuid, name = self._names[index]
        used = total = None
        try:
            used, total = self._memory(index, handle)
            last = self._processes[index]
            if not detail and last is not None:
                return GpuDeviceSample(index, uuid, name, used, total, processes=last)
            self._processes[index] = None
            listed = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
            util = self._utilisation(index, handle)
            procs = tuple(
                GpuProcessSample(
                    int(p.pid),
                    _bytes_or_none(p.usedGpuMemory),
                    *(util.get(int(p.pid), (0.0, 0.0)) if util is not None else (None, None)),
                )
                for p in listed
            )
            self._processes[index] = procs
        except Exception as exc:
            if not _is_nvml_error(nvml, exc):
                raise
            code = _code(exc)
            if code in (NVML_ERROR_GPU_IS_LOST, NVML_ERROR_UNKNOWN):
                problems.append(f"GPU {index} lost ({exc})")
                return GpuDeviceSample(index, uuid, name, None, None, lost=True)
            if code in (NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_FUNCTION_NOT_FOUND):
                procs = ()
            else:
                problems.append(f"GPU {index}: {exc}")
                procs = ()
        return GpuDeviceSample(index, uuid, name, used, total, processes=procs)

    def _utilisation(self, index: int, handle: Any) -> dict[int, tuple[float, float]] | None:
        """pid -> mean (SM %, memory %) of its samples since the last round; None when the
        device does not report per-process utilisation. Raises other NVML errors."""
        seen = self._util_seen[index]
        if seen is None:
            return None
        nvml = self._nvml
        try:
            samples = nvml.nvmlDeviceGetProcessUtilization(handle, seen)
        except AttributeError:  # bindings older than the call
            self._util_seen[index] = None
            return None
        except Exception as exc:
            if not _is_nvml_error(nvml, exc):
                raise
            code = _code(exc)
            if code in (NVML_ERROR_NOT_FOUND, 0):  # no sample since: nothing ran
                return {}
            if code in (NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_FUNCTION_NOT_FOUND):
                self._util_seen[index] = None
                return None
            if code in (NVML_ERROR_GPU_IS_LOST, NVML_ERROR_UNKNOWN):
                raise
            return None  # unknown this round; the memory of its processes is still good
        sums: dict[int, list[float]] = {}
        newest = seen
        for sample in samples:
            acc = sums.setdefault(int(sample.pid), [0.0, 0.0, 0.0])
            acc[0] += min(100.0, float(sample.smUtil))
            acc[1] += min(100.0, float(sample.memUtil))
            acc[2] += 1
            newest = max(newest, int(sample.timeStamp))
        self._util_seen[index] = newest
        return {pid: (round(a[0] / a[2], 1), round(a[1] / a[2], 1)) for pid, a in sums.items()}

    def _memory(self, index: int, handle: Any) -> tuple[int | None, int | None]:
        """Used (without the driver's reservation when v2 is available) and total bytes."""
        nvml = self._nvml
        if self._memory_v2[index]:
            try:
                info = nvml.nvmlDeviceGetMemoryInfo(
                    handle, version=getattr(nvml, "nvmlMemory_v2", NVML_MEMORY_V2)
                )
                return _bytes_or_none(info.used), _bytes_or_none(info.total)
            except TypeError:
                self._memory_v2[index] = False  # bindings too old for the version argument
            except Exception as exc:
                if not _is_nvml_error(nvml, exc) or _code(exc) not in (
                    NVML_ERROR_NOT_SUPPORTED,
                    NVML_ERROR_FUNCTION_NOT_FOUND,
                ):
                    raise
                self._memory_v2[index] = False
        try:
            info = nvml.nvmlDeviceGetMemoryInfo(handle)
        except Exception as exc:
            if _is_nvml_error(nvml, exc) and _code(exc) == NVML_ERROR_NOT_SUPPORTED:
                return None, None
            raise
        return _bytes_or_none(info.used), _bytes_or_none(info.total)

    def close(self) -> None:
        if self._nvml is not None:
            self._safe_shutdown(self._nvml)
            self._nvml = None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _bytes_or_none(value: Any) -> int | None:
    # pynvml maps NVML_VALUE_NOT_AVAILABLE to None for usedGpuMemory.
    if value is None:
        return None
    number = int(value)
    return None if number >= (1 << 64) - 1 else number
