"""Bounded memory history per job, kept in **time**: every point of the last
``history_seconds``, whatever the sampling rate. Under memory pressure the sampler runs at
10 Hz; a ring sized ``history / interval`` would then hold a tenth of the history, and the
curve before an OOM (the moment it matters most) would be cut to a minute. So the ring is
thinned instead of cut: the newest ``FULL_RATE_SECONDS`` keep every point, older points
keep one per ``interval`` (the base rate), and points older than the history go. Memory stays
bounded: at most ``history / interval + FULL_RATE_SECONDS / PRESSURE_INTERVAL_SECONDS`` points a job.
"""

from __future__ import annotations

import math
import threading
from collections import deque

from sidecar.model import JobSample, Snapshot, TimelinePoint
from sidecar.settings import PRESSURE_INTERVAL_SECONDS

__all__ = ["FULL_RATE_SECONDS", "Timeline", "point_for"]

# The newest stretch kept at whatever rate it was sampled (the 10 Hz run-up to a kill).
FULL_RATE_SECONDS = 60.0
# Thinning keeps a point at least this fraction of an interval after the last one kept: the
# sampler's rounds are not exactly one interval apart.
THIN_TOLERANCE = 0.95


def point_for(job: JobSample, snapshot: Snapshot) -> TimelinePoint:
    """The history entry of one job in one snapshot. ``cgroup_usage_bytes`` is the usage
    of the cgroup whose limit binds the job's ranks (the tightest level), else of the
    first rank's own cgroup."""
    cgroups = {c.path: c for c in snapshot.cgroups}
    usage = None
    charge: dict[str, int] = {}
    for rank in job.ranks:
        cg = cgroups.get(rank.cgroup or "")
        if cg is None:
            continue
        binding = cgroups.get(cg.limited_by or "") if cg.limited_by else None
        chosen = binding or cg
        if chosen.usage_bytes is not None:
            usage = chosen.usage_bytes
            c = chosen.charge
            if c is not None:
                charge = {"anon": c.anon_bytes, "file": c.file_bytes, "shmem": c.shmem_bytes}
                if c.kernel_bytes is not None:
                    charge["kernel"] = c.kernel_bytes
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
        cgroup_charge_bytes=charge,
        workers_uss_bytes={
            r.rank_label: sum(u for _, u, _ in r.workers_uss) for r in job.ranks if r.workers_uss
        },
    )


class Timeline:
    """Per-job rings. Written by the sampler thread, read by HTTP handlers and the death
    watch; a lock keeps a reader from seeing a ring while it is being changed."""

    def __init__(self, history_seconds: float, interval_seconds: float) -> None:
        self.history_seconds = history_seconds
        self.interval_seconds = interval_seconds
        self.full_rate_seconds = min(FULL_RATE_SECONDS, history_seconds)
        # the most points a ring can hold once thinned: the base rate over the history, plus
        # the full-rate stretch at the fastest rate
        self.capacity = max(
            2, math.ceil(history_seconds / (THIN_TOLERANCE * interval_seconds)) + 1
        ) + math.ceil(self.full_rate_seconds / min(interval_seconds, PRESSURE_INTERVAL_SECONDS))
        self._rings: dict[str, deque[TimelinePoint]] = {}
        self._lock = threading.Lock()

    def record(self, snapshot: Snapshot) -> None:
        live = {job.key for job in snapshot.jobs}
        with self._lock:
            for job in snapshot.jobs:
                ring = self._rings.get(job.key)
                if ring is None:
                    ring = self._rings[job.key] = deque()
                ring.append(point_for(job, snapshot))
                self._trim(ring)
            # The history of a job that ended is kept until its key is reused or the
            # number of kept histories exceeds a bound (postmortems read it after death).
            stale = [k for k in self._rings if k not in live]
            for key in stale[: max(0, len(self._rings) - len(live) - 16)]:
                del self._rings[key]

    def _trim(self, ring: deque[TimelinePoint]) -> None:
        newest = ring[-1].at
        while ring and ring[0].at < newest - self.history_seconds:
            ring.popleft()
        if len(ring) <= self.capacity:
            return
        # Thin what is older than the full-rate stretch to one point per base interval.
        edge = newest - self.full_rate_seconds
        kept: list[TimelinePoint] = []
        for p in ring:
            if p.at >= edge or not kept or p.at - kept[-1].at >= THIN_TOLERANCE * self.interval_seconds:
                kept.append(p)
        ring.clear()
        ring.extend(kept[-self.capacity :])

    def restore(self, job: str, points: list[TimelinePoint]) -> None:
        """Put back a job's earlier history (kept across a restart of the daemon), before
        whatever was recorded since."""
        with self._lock:
            ring = self._rings.setdefault(job, deque())
            first = ring[0].at if ring else None
            older = [p for p in points if first is None or p.at < first]
            ring.extendleft(reversed(older))
            if ring:
                self._trim(ring)

    def window(self, job: str, since: float | None = None) -> list[TimelinePoint]:
        with self._lock:
            ring = self._rings.get(job)
            points = list(ring) if ring is not None else []
        return [p for p in points if since is None or p.at >= since]

    def jobs(self) -> list[str]:
        with self._lock:
            return list(self._rings)
