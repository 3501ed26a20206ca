"""The postmortem document of a live incident (``trainwatch.postmortem/v1``): built from the
verdict, the evidence it came from, the incident's ranks as last sampled and the job's
memory timeline, as a pure function (the death watch passes in what it read).
``trainwatch diagnose`` builds its own document from logs today; both are to meet here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sidecar.advice import advice
from sidecar.autopsy import Evidence, Verdict, signal_name
from sidecar.gather import Incident
from sidecar.model import Fate, TimelinePoint
from sidecar.postmortem import SCHEMA, iso

__all__ = ["live_document"]


def live_document(
    inc: Incident,
    v: Verdict,
    died_at: float,
    ev: Evidence,
    *,
    points: list[TimelinePoint],
    wall_of: Callable[[int | None], float | None],
    updated_at: float,
    hostname: str,
    stacks: dict[str, Any] | None,
) -> dict[str, Any]:
    """The document. ``points``: the job's timeline over the window before the death;
    ``wall_of``: a monotonic ns time as wall-clock seconds (None stays None)."""
    before = inc.snapshot_before
    cgroups = {c.path: c for c in before.cgroups} if before else {}
    cg_path = (
        (v.oom.oom_memcg if v.oom and v.oom.oom_memcg else None)
        or v.victim.cgroup_limited_by
        or v.victim.cgroup
    )
    cg = cgroups.get(cg_path or "")
    if cg is None and v.victim.cgroup:
        cg = cgroups.get(v.victim.cgroup)
    ranks = []
    for r in ev.ranks:
        k = inc.ranks.get(r.pid)
        s = k.sample if k else None
        ranks.append(
            {
                "rank": r.rank,
                "local_rank": r.local_rank,
                "pid": r.pid,
                "exit_code": r.returncode,
                "signal": signal_name(r.signal),
                "exit_source": r.exit_source,
                "died_at": iso(wall_of(r.died_ns)),
                "fate": v.fates.get(r.label, Fate.UNKNOWN),
                "rss_bytes": s.rss_bytes if s else None,
                "peak_rss_bytes": s.peak_rss_bytes if s else None,
                "tree_rss_bytes": s.tree_rss_bytes if s else None,
                "gpu_memory_bytes": sum(s.gpu_memory_bytes.values()) if s and s.gpu_memory_bytes else None,
            }
        )
    host = before.host if before else None
    min_avail = min(
        (p.host_available_bytes for p in points if p.host_available_bytes is not None), default=None
    )
    doc: dict[str, Any] = {
        "schema": SCHEMA,
        "id": inc.doc_id,
        "created_at": iso(inc.created_at),
        "updated_at": iso(updated_at),
        "host": hostname,
        "job": {
            "agent_pid": inc.gen.agent_pid,
            "run_id": inc.gen.run_id,
            "world_size": inc.gen.world_size,
            "restart_count": inc.gen.restart,
            "entrypoint": inc.gen.entrypoint,
            "key": inc.gen.job,
        },
        "victim": {
            "rank": v.victim.rank,
            "local_rank": v.victim.local_rank,
            "pid": v.victim.pid,
            "exit_code": v.victim.returncode,
            "signal": signal_name(v.victim.signal),
            "died_at": iso(died_at),
            # first-hand, from the kernel's kill line: the RSS at the moment of the kill
            "kernel_rss_bytes": v.oom.rss_bytes if v.oom else None,
        },
        "killer": {
            "kind": v.kind,
            "confidence": v.confidence,
            "summary": v.summary,
            "evidence": [
                {"source": e.source, "at": iso(wall_of(e.at_ns)), "detail": e.detail} for e in v.evidence
            ],
        },
        "ranks": ranks,
        "memory": {
            "host": {
                "total_bytes": host.total_bytes if host else None,
                "available_bytes_at_death": host.available_bytes if host else None,
                "min_available_bytes": min_avail,
            },
            "cgroup": None
            if cg is None
            else {
                "path": cg.path,
                "version": cg.version,
                "limit_bytes": cg.effective_limit_bytes,
                "usage_bytes_at_death": cg.usage_bytes,
                "peak_bytes": cg.peak_bytes,
                # counted after the death (the snapshot before it predates the kill); on v1
                # the counter is per cgroup, so the kill shows in the victim's own one
                "oom_kills": max(
                    (
                        n
                        for path, n in ev.cgroup_oom_kills_after.items()
                        if path == cg.path
                        or (v.victim.cgroup == path and path.startswith(cg.path.rstrip("/") + "/"))
                    ),
                    default=cg.oom_kills,
                ),
            },
        },
        "timeline": [
            {
                "at": iso(p.at),
                "host_available_bytes": p.host_available_bytes,
                "cgroup_usage_bytes": p.cgroup_usage_bytes,
                "rss_bytes": p.rss_bytes,
                "tree_rss_bytes": p.tree_rss_bytes,
                "gpu_memory_bytes": p.gpu_memory_bytes,
            }
            for p in points
        ],
        "stacks": stacks,
        "advice": advice(v, ranks, cg, host.total_bytes if host else None, ev.output_read, ev.flight_enabled),
    }
    return doc
