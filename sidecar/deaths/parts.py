"""An incident as the postmortem document's parts (``live_parts``): the victim, the job, the
ranks' rows and fates, the cgroup and host at the death, the memory curves, the evidence
cited, the stall and foresight's warnings. Pure: ``write.py`` builds the document from them
(``postmortem/document.py``), the offline path builds its own parts from logs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sidecar.autopsy import Evidence, RankMemory, Verdict, advice
from sidecar.autopsy.filled import what_filled
from sidecar.deaths.incidents import Incident
from sidecar.model import CgroupSample, Fate, Kind, TimelinePoint, Warned
from sidecar.postmortem.document import (
    CgroupAtDeath,
    Cited,
    HostAtDeath,
    JobInfo,
    Parts,
    RankRow,
    Victim,
    iso,
)

__all__ = ["live_parts"]


def live_parts(
    inc: Incident,
    v: Verdict,
    died_at: float,
    ev: Evidence,
    *,
    points: list[TimelinePoint],
    wall_of: Callable[[int | None], float | None],
    updated_at: float,
    hostname: str,
    stall: dict[str, Any] | None,
    warnings: list[Warned] | None = None,
) -> Parts:
    """What the daemon knows of an incident, as the document's parts. ``points``: the job's
    timeline over the window before the death; ``wall_of``: a monotonic ns time as
    wall-clock seconds (None stays None)."""
    before = inc.snapshot_before
    cg, cgroup = _cgroup(inc, v, ev)
    rows = _rows(inc, v, ev, wall_of)
    host = before.host if before else None
    return Parts(
        ident=inc.doc_id or "",
        created_at=inc.created_at or updated_at,
        updated_at=updated_at,
        host=hostname,
        job=JobInfo(
            agent_pid=inc.gen.agent_pid,
            run_id=inc.gen.run_id,
            world_size=inc.gen.world_size,
            restart_count=inc.gen.restart,
            entrypoint=inc.gen.entrypoint,
            key=inc.gen.job,
            launcher=inc.gen.launcher,
        ),
        verdict=v,
        summary=None,
        victim=Victim(exit_code=v.victim.returncode, died_at=died_at),
        evidence=[
            *(Cited(source=e.source, at=wall_of(e.at_ns), detail=e.detail) for e in v.evidence),
            *_restart_note(inc),
        ],
        ranks=rows,
        host_memory=HostAtDeath(
            total_bytes=host.total_bytes if host else None,
            available_bytes=host.available_bytes if host else None,
            min_available_bytes=min(
                (p.host_available_bytes for p in points if p.host_available_bytes is not None), default=None
            ),
        ),
        cgroup=cgroup,
        timeline=points,
        stall=stall,
        warnings=warnings or [],
        advice=advice(
            v,
            [RankMemory(r.rss_bytes, r.tree_rss_bytes) for r in rows],
            cg=cg,
            host_total=host.total_bytes if host else None,
            output_read=ev.output_read,
            flight_enabled=ev.flight_enabled,
            run_output=ev.run_output,
            filling=what_filled(
                cg.charge if cg is not None and v.kind != Kind.KERNEL_OOM else None,
                cg.version if cg is not None else None,
                [p for p in points if p.at <= died_at],
            ),
        ),
        extra=(
            {
                "reconstructed": {
                    "down_since": iso(inc.reconstructed[0]),
                    "restarted_at": iso(inc.reconstructed[1]),
                }
            }
            if inc.reconstructed
            else {}
        ),
    )


def _cgroup(inc: Incident, v: Verdict, ev: Evidence) -> tuple[CgroupSample | None, CgroupAtDeath | None]:
    """The cgroup whose limit bound the victim (the OOM record's, else the victim's), as the
    round before the death read it, and its OOM kills counted after the death (the round
    before predates the kill; on v1 the counter is per cgroup, so the kill shows in the
    victim's own one)."""
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
    if cg is None:
        return None, None
    kills = max(
        (
            n
            for path, n in ev.cgroup_oom_kills_after.items()
            if path == cg.path or (v.victim.cgroup == path and path.startswith(cg.path.rstrip("/") + "/"))
        ),
        default=cg.oom_kills,
    )
    return cg, CgroupAtDeath(sample=cg, oom_kills=kills)


def _rows(
    inc: Incident, v: Verdict, ev: Evidence, wall_of: Callable[[int | None], float | None]
) -> list[RankRow]:
    """Each rank's fate and its memory as last sampled."""
    rows = []
    for r in ev.ranks:
        k = inc.ranks.get(r.pid)
        s = k.sample if k else None
        rows.append(
            RankRow(
                rank=r.rank,
                local_rank=r.local_rank,
                pid=r.pid,
                exit_code=r.returncode,
                signal=r.signal,
                exit_source=r.exit_source,
                died_at=wall_of(r.died_ns) if r.pid not in inc.untimed else None,
                fate=_fate(v.fates.get(r.label, Fate.UNKNOWN), r.pid, inc),
                stranded_since=inc.stranded.get(r.pid) if not r.dead else None,
                rss_bytes=s.rss_bytes if s else None,
                peak_rss_bytes=s.peak_rss_bytes if s else None,
                tree_rss_bytes=s.tree_rss_bytes if s else None,
                tree_pss_bytes=s.tree_pss_bytes if s else None,
                tree_uss_bytes=s.tree_uss_bytes if s else None,
                gpu_memory_bytes=sum(s.gpu_memory_bytes.values()) if s and s.gpu_memory_bytes else None,
                rank_source=s.rank_source if s else None,
                launcher=inc.gen.launcher,
            )
        )
    return rows


def _restart_note(inc: Incident) -> list[Cited]:
    """The evidence line of a postmortem judged after a restart of the daemon."""
    if inc.reconstructed is None:
        return []
    down, up = inc.reconstructed
    return [
        Cited(
            source="trainwatch",
            at=up,
            detail=(
                f"reconstructed: trainwatch was not running from {iso(down)} to {iso(up)}; the deaths in "
                "between were judged after its restart from the kernel log's history, the agent's log and "
                "the cgroups' counters (exit statuses nobody reported, no memory curve for that stretch)"
            ),
        )
    ]


def _fate(fate: Fate, pid: int, inc: Incident) -> Fate:
    """A rank still running that the sampler found stranded (alive, no progress, after the
    death): ``stranded``. A rank that has ended has its death's fate."""
    return Fate.STRANDED if fate == Fate.RUNNING and pid in inc.stranded else fate
