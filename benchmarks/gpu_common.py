"""What the GPU machine's runs (gpu_stall.py, gpu_stranded.py) share: NVML's per-process
utilisation read raw beside the daemon, and the phases the workload announces."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def phases(work: Path) -> dict[int, list[tuple[str, float, int]]]:
    """rank -> [(phase, time, pid)] as tests/workloads/gpu_hang.py wrote them."""
    out: dict[int, list[tuple[str, float, int]]] = {}
    for f in work.glob("phase_rank*"):
        rows = [ln.split() for ln in f.read_text().splitlines() if ln.strip()]
        out[int(f.name.removeprefix("phase_rank"))] = [(n, float(t), int(p)) for n, t, p in rows]
    return out


def start_nvml_sampler(
    dev: Any,
    samples: list[dict[str, Any]],
    stop: threading.Event,
    extra: Callable[[], dict[str, Any]] | None = None,
) -> threading.Thread:
    """Every 0.5 s until ``stop``: {"at", "util": {pid: [(SM %, memory %), ...]}, **extra()}
    appended to ``samples`` (NVML's samples since the last read; an error kept as such)."""
    import pynvml

    def run() -> None:
        seen = 0
        while not stop.is_set():
            now = time.time()
            try:
                got = pynvml.nvmlDeviceGetProcessUtilization(dev, seen)
            except pynvml.NVMLError as exc:
                got = []
                if "Not Found" not in str(exc):
                    samples.append({"at": now, "error": str(exc)})
            per: dict[str, list[tuple[int, int]]] = {}
            for s in got:
                per.setdefault(str(s.pid), []).append((int(s.smUtil), int(s.memUtil)))
                seen = max(seen, int(s.timeStamp))
            samples.append({"at": now, "util": per, **(extra() if extra else {})})
            stop.wait(0.5)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread
