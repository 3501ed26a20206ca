"""Bounded memory history per job: a ring of ``TimelinePoint`` whose length is fixed by
``--history`` divided by ``--interval``, so the daemon's memory does not grow with time.
"""

from __future__ import annotations

import math
import threading
from collections import deque

from sidecar.model import JobSample, Snapshot, TimelinePoint

__all__ = ["Timeline", "point_for"]


def point_for(job: JobSample, snapshot: Snapshot) -> TimelinePoint:
    """The history entry of one job in one snapshot. ``cgroup_usage_bytes`` is the usage
    of the cgroup whose limit binds the job's ranks (the tightest level), else of the
    first rank's own cgroup."""
    cgroups = {c.path: c for c in snapshot.cgroups}
    usage = None
    for rank in job.ranks:
        cg = cgroups.get(rank.cgroup or "")
        if cg is None:
            continue
        binding = cgroups.get(cg.limited_by or "") if cg.limited_by else None
        chosen = binding or cg
        if chosen.usage_bytes is not None:
            usage = chosen.usage_bytes
            break
    gpu: dict[str, int] = {}
    for rank in job.ranks:
        if rank.gpu_memory_bytes:
            gpu[rank.rank_label] = sum(rank.gpu_memory_bytes.values())
    return TimelinePoint(
        at=snapshot.taken_at,
        host_available_bytes=snapshot.host.available_bytes if snapshot.host else None,
        cgroup_usage_bytes=usage,
        rss_bytes={r.rank_label: r.rss_bytes for r in job.ranks},
        tree_rss_bytes={r.rank_label: r.tree_rss_bytes for r in job.ranks},
        gpu_memory_bytes=gpu,
    )


class Timeline:
    """Per-job rings. Written by the sampler thread, read by HTTP handlers; a lock keeps
    a reader from seeing a ring while it is being appended to."""

    def __init__(self, history_seconds: float, interval_seconds: float) -> None:
        self.capacity = max(2, math.ceil(history_seconds / interval_seconds))
        self._rings: dict[str, deque[TimelinePoint]] = {}
        self._lock = threading.Lock()

    def record(self, snapshot: Snapshot) -> None:
        live = {job.key for job in snapshot.jobs}
        with self._lock:
            for job in snapshot.jobs:
                ring = self._rings.get(job.key)
                if ring is None:
                    ring = self._rings[job.key] = deque(maxlen=self.capacity)
                ring.append(point_for(job, snapshot))
            # The history of a job that ended is kept until its key is reused or the
            # number of kept histories exceeds a bound (postmortems read it after death).
            stale = [k for k in self._rings if k not in live]
            for key in stale[: max(0, len(self._rings) - len(live) - 16)]:
                del self._rings[key]

    def window(self, job: str, since: float | None = None) -> list[TimelinePoint]:
        with self._lock:
            ring = self._rings.get(job)
            points = list(ring) if ring is not None else []
        return [p for p in points if since is None or p.at >= since]

    def jobs(self) -> list[str]:
        with self._lock:
            return list(self._rings)
