"""Which rank each GPU process belongs to: NVML's per-process memory and activity put on
the ranks whose trees (or namespaces' pids) hold those processes. Part of the sampling
round (``sampler.py``); NVML itself is read by ``probes/gpu.py``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

from sidecar import lognames
from sidecar.model import GpuDeviceSample, ProcKey
from sidecar.sampling.ranks import RankRead

__all__ = ["GpuAttribution"]

log = logging.getLogger(lognames.DAEMON)


class GpuAttribution:
    """Per rank: GPU memory by device; NVML pids that are no rank's; and its tree's
    activity, the busiest (SM %, memory %) of its processes on any GPU. Warns once when
    NVML's pids are not this /proc's (another PID namespace)."""

    def __init__(self, proc_root: str) -> None:
        self.proc_root = proc_root
        self._ns_warned = False

    def attribute(
        self, gpus: tuple[GpuDeviceSample, ...], reads: Iterable[tuple[ProcKey, RankRead]]
    ) -> tuple[dict[ProcKey, dict[int, int]], tuple[int, ...], dict[ProcKey, tuple[float, float]]]:
        if not gpus:
            return {}, (), {}
        owner: dict[int, ProcKey] = {}
        for key, read in reads:
            for pid in read.tree:
                owner[pid] = key
            # NVML reports host pids; NSpid lists the rank's pid in every namespace
            # this /proc can see, so a daemon whose /proc is the host's still matches
            # ranks that run in containers, and log lines with container pids map back.
            for ns_pid in read.ns_pids:
                owner.setdefault(ns_pid, key)
        result: dict[ProcKey, dict[int, int]] = {}
        unmatched: list[int] = []
        activity: dict[ProcKey, tuple[float, float]] = {}
        for device in gpus:
            for proc in device.processes:
                rank = owner.get(proc.pid)
                if rank is None:
                    unmatched.append(proc.pid)
                    continue
                if proc.sm_percent is not None:
                    sm, mem = activity.get(rank, (0.0, 0.0))
                    activity[rank] = (max(sm, proc.sm_percent), max(mem, proc.memory_percent or 0.0))
                if proc.used_bytes is None:
                    continue
                per_gpu = result.setdefault(rank, {})
                per_gpu[device.index] = per_gpu.get(device.index, 0) + proc.used_bytes
        if unmatched and owner and not self._ns_warned:
            foreign = [p for p in unmatched if not os.path.exists(f"{self.proc_root}/{p}")]
            if foreign:
                self._ns_warned = True
                log.warning(
                    "probe=gpu NVML lists pids %s that do not exist in %s: trainwatch runs in "
                    "another PID namespace than the GPU processes (NVML reports host pids). Run it "
                    "in the host PID namespace (docker --pid=host, Kubernetes hostPID: true) to "
                    "attribute GPU memory to ranks",
                    foreign[:5],
                    self.proc_root,
                )
        return result, tuple(unmatched), activity
