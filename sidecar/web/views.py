"""What the routes show that is not a document of its own: ``GET /ranks`` (the live view as
JSON, what a job chose passed through the redactor) and which of JSON or HTML a client
prefers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sidecar.model import CgroupSample, Snapshot
from sidecar.model.stall import StallSnapshot
from sidecar.redact import redact_doc

__all__ = ["prefers_html", "ranks_view"]


def prefers_html(accept: str) -> bool:
    """True when the client ranks text/html above application/json (a browser does)."""

    def quality(media: str) -> float:
        best = 0.0
        for part in accept.split(","):
            name, *params = (p.strip() for p in part.split(";"))
            if name in (media, media.split("/")[0] + "/*"):
                q = next(
                    (
                        float(p[2:])
                        for p in params
                        if p.startswith("q=") and p[2:].replace(".", "", 1).isdigit()
                    ),
                    1.0,
                )
                best = max(best, q * (1.0 if name == media else 0.99))
        return best

    return quality("text/html") > quality("application/json")


def _cgroup_view(c: CgroupSample) -> dict[str, Any]:
    """A memory cgroup as ``/ranks`` shows it, in the job list and under each rank alike."""
    return {
        "path": c.path,
        "version": c.version,
        "usage_bytes": c.usage_bytes,
        "limit_bytes": c.limit_bytes,
        "peak_bytes": c.peak_bytes,
        "oom_kills": c.oom_kills,
        "limited_by": c.limited_by,
        "effective_limit_bytes": c.effective_limit_bytes,
        "ancestors": [{"path": a.path, "limit_bytes": a.limit_bytes} for a in c.ancestors],
        "exhaustion_seconds": c.exhaustion_seconds,
    }


def _stall_view(stall_of: Callable[[str], StallSnapshot | None] | None, job: str) -> dict[str, Any] | None:
    snap = stall_of(job) if stall_of is not None else None
    return snap.view() if snap is not None else None


def ranks_view(
    snap: Snapshot | None,
    stall_after: float,
    stall_of: Callable[[str], StallSnapshot | None] | None = None,
) -> dict[str, Any]:
    """The JSON of ``GET /ranks``: attached jobs, their ranks and the last sample of each."""
    if snap is None:
        return {"taken_at": None, "jobs": [], "host": None, "gpus": [], "cgroups": [], "probes": {}}
    cgroups = {c.path: c for c in snap.cgroups}
    jobs = []
    for job in snap.jobs:
        ranks = []
        for r in job.ranks:
            cg = cgroups.get(r.cgroup) if r.cgroup else None
            p = r.progress
            ranks.append(
                {
                    "rank": r.rank,
                    "label": r.rank_label,
                    "local_rank": r.local_rank,
                    "rank_source": r.rank_source,
                    "restart": r.restart,
                    "pid": r.key.pid,
                    "ns_pids": list(r.ns_pids),
                    "rss_bytes": r.rss_bytes,
                    "peak_rss_bytes": r.peak_rss_bytes,
                    "tree_rss_bytes": r.tree_rss_bytes,
                    "tree_pss_bytes": r.tree_pss_bytes,
                    "tree_uss_bytes": r.tree_uss_bytes,
                    "tree_processes": r.tree_processes,
                    # each descendant's USS, and its growth since first measured (copy-on-access)
                    "workers": [
                        {"pid": pid, "uss_bytes": uss, "uss_growth_bytes": uss - first}
                        for pid, uss, first in r.workers_uss
                    ],
                    "exhaustion_seconds": r.exhaustion_seconds,
                    "binding_limit": None
                    if r.binding_limit is None
                    else {
                        "kind": r.binding_limit.kind,
                        "path": r.binding_limit.path,
                        "limit_bytes": r.binding_limit.limit_bytes,
                    },
                    "cpu_seconds": round(r.cpu_seconds, 3),
                    "threads": r.threads,
                    "gpu_memory_bytes": {str(k): v for k, v in r.gpu_memory_bytes.items()} or None,
                    # NVML's per-process activity of the rank's tree this round (percent)
                    "gpu_sm_percent": r.gpu_sm_percent,
                    "gpu_memory_percent": r.gpu_memory_percent,
                    "stalled": p is not None and p.stalled_seconds >= stall_after,
                    "stalled_seconds": p.stalled_seconds if p else 0.0,
                    "stall_reason": p.reason if p else None,
                    "cpu_busy": p.cpu_busy if p else None,
                    "gpu_busy": p.gpu_busy if p else None,
                    "cgroup": None if cg is None else _cgroup_view(cg),
                }
            )
        stalled = job.stalled_seconds >= stall_after
        # what a job chose (its entrypoint, run id, the stacks of its ranks) goes through the redactor
        jobs.append(
            redact_doc(
                {
                    "job": job.key,
                    "launcher": job.launcher,
                    "agent_pid": job.agent.pid,
                    "run_id": job.run_id,
                    "world_size": job.world_size,
                    "restart_count": job.restart_count,
                    "max_restarts": job.max_restarts,
                    "entrypoint": job.entrypoint,
                    "started_at": job.started_at,
                    "agent_alive": job.agent_alive,
                    "stalled_seconds": job.stalled_seconds,
                    "stalled": stalled,
                    "suspected_missing": list(job.suspected_missing) if stalled else [],
                    # the snapshot taken when the stall reached --stall-after (stalls/tracker.py)
                    "stall": _stall_view(stall_of, job.key) if stalled else None,
                    # ranks alive and making no progress after another's death (stalls/stranded.py)
                    "stranded": None
                    if job.stranded is None
                    else {
                        "since": job.stranded.since,
                        "dead_ranks": list(job.stranded.dead_ranks),
                        "ranks": list(job.stranded.ranks),
                        "gpu_memory_bytes": job.stranded.gpu_memory_bytes,
                    },
                    "ranks": ranks,
                }
            )
        )
    host = snap.host
    return {
        "taken_at": snap.taken_at,
        "jobs": jobs,
        "host": None
        if host is None
        else {
            "total_bytes": host.total_bytes,
            "available_bytes": host.available_bytes,
            "oom_kills": host.oom_kills,
            "memory_pressure_some_ratio": host.psi_some_avg10_ratio,
            "memory_pressure_full_ratio": host.psi_full_avg10_ratio,
            "shm_used_bytes": host.shm_used_bytes,
            "shm_size_bytes": host.shm_total_bytes,
        },
        "gpus": [
            {
                "index": d.index,
                "uuid": d.uuid,
                "name": d.name,
                "used_bytes": d.used_bytes,
                "total_bytes": d.total_bytes,
                "lost": d.lost,
                "processes": [
                    {
                        "pid": p.pid,
                        "used_bytes": p.used_bytes,
                        "sm_percent": p.sm_percent,
                        "memory_percent": p.memory_percent,
                    }
                    for p in d.processes
                ],
            }
            for d in snap.gpus
        ],
        "cgroups": [_cgroup_view(c) for c in snap.cgroups],
        "probes": {
            name: {"success": s.success, "duration_seconds": s.duration_seconds, "message": s.message}
            for name, s in snap.probes.items()
        },
        "unreadable_processes": snap.unreadable_processes,
        "samples_total": snap.samples_total,
        "overruns_total": snap.overruns_total,
    }
