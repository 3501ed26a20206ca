"""The postmortem document (``trainwatch.postmortem/v1``, CONTRACTS.md), built in one place for
both paths: the daemon's death watch and ``trainwatch diagnose``. Each path turns what it
gathered into the typed parts below; :func:`build` lays them out. A field a path cannot know
is null, never missing: a document from logs has no memory curve and no job key, a live one
has no ``inputs``. Ids and times are formatted here too.
"""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from sidecar.autopsy.evidence import Verdict, signal_name
from sidecar.model import CgroupSample, Confidence, Kind, TimelinePoint, Warned
from sidecar.redact import redact_doc

__all__ = [
    "ID_PATTERN",
    "SCHEMA",
    "CgroupAtDeath",
    "Cited",
    "HostAtDeath",
    "JobInfo",
    "RankRow",
    "build",
    "epoch_of",
    "iso",
    "make_id",
]

SCHEMA = "trainwatch.postmortem/v1"
ID_PATTERN = re.compile(r"^[0-9]{8}T[0-9]{6}Z-[A-Za-z0-9_.-]{1,64}-[0-9]{1,10}-r[A-Za-z0-9_.-]{1,32}$")


def iso(epoch: float | None) -> str | None:
    """ISO-8601 with offset (UTC), millisecond precision."""
    if epoch is None:
        return None
    return datetime.fromtimestamp(epoch, tz=timezone.utc).isoformat(timespec="milliseconds")


def epoch_of(value: Any) -> float | None:
    """The inverse of :func:`iso` for a document's times: epoch seconds, or None for a value
    that is not an ISO-8601 time (a hand-made or damaged document)."""
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value).timestamp()
    except ValueError:
        return None


def make_id(
    died_at: float, agent_pid: int, rank_label: str, host: str | None = None, restart: int = 0
) -> str:
    """``<UTC second>-<host>-<agent pid>-r<rank>``, plus ``-a<restart>`` for a later worker
    generation (whose rank of the same label may die within the same second)."""
    host = re.sub(r"[^A-Za-z0-9_.-]", "-", (host or socket.gethostname()))[:64] or "host"
    stamp = datetime.fromtimestamp(died_at, tz=timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    label = re.sub(r"[^A-Za-z0-9_.-]", "-", rank_label)[:32] or "x"
    return f"{stamp}-{host}-{agent_pid}-r{label}" + (f"-a{restart}" if restart else "")


@dataclass(frozen=True, kw_only=True)
class JobInfo:
    agent_pid: int | None = None
    run_id: str | None = None
    world_size: int | None = None
    restart_count: int | None = None
    entrypoint: str | None = None
    key: str | None = None  # the job label of the metrics; the daemon's only
    launcher: str | None = None  # what started the ranks (sampling/jobs.py); the daemon's only


@dataclass(frozen=True, kw_only=True)
class RankRow:
    """One rank's fate and its memory as last known (wall-clock ``died_at``)."""

    rank: int | None
    local_rank: int | None
    pid: int | None
    exit_code: int | None
    signal: int | None
    died_at: float | None
    fate: str
    exit_source: str | None = None
    rss_bytes: int | None = None
    peak_rss_bytes: int | None = None
    tree_rss_bytes: int | None = None
    tree_pss_bytes: int | None = None
    tree_uss_bytes: int | None = None
    gpu_memory_bytes: int | None = None
    local_rank_inferred: bool = False  # a log gave the pid only; the local rank is a guess
    # the daemon's: where the rank's number came from (its launcher's variable, or "order"),
    # and the launcher whose rank it was (a fate is the same word whatever the launcher)
    rank_source: str | None = None
    launcher: str | None = None
    stranded_since: float | None = None  # fate "stranded": since when (wall)


@dataclass(frozen=True, kw_only=True)
class Cited:
    """One line of the killer's evidence (wall-clock ``at``)."""

    source: str
    at: float | None
    detail: str


@dataclass(frozen=True, kw_only=True)
class HostAtDeath:
    total_bytes: int | None = None
    available_bytes: int | None = None
    min_available_bytes: int | None = None


@dataclass(frozen=True, kw_only=True)
class CgroupAtDeath:
    """The cgroup whose limit mattered, as sampled before the death; ``oom_kills`` counted
    after it."""

    sample: CgroupSample
    oom_kills: int | None


@dataclass(frozen=True, kw_only=True)
class Victim:
    exit_code: int | None
    died_at: float | None


NO_DEATH = (
    "These logs name no death of a training process: no failed rank, no kill, no kernel OOM "
    "record, no rank error. Give the torchrun output and the kernel log of the node where it died."
)


@dataclass(kw_only=True)
class Parts:
    """Everything a document says, typed. ``verdict`` None: the inputs name no death."""

    ident: str
    created_at: float
    updated_at: float | None
    host: str | None
    job: JobInfo
    verdict: Verdict | None
    summary: str | None  # the verdict's, unless the path words it for its reader
    victim: Victim
    evidence: list[Cited]
    ranks: list[RankRow]
    host_memory: HostAtDeath
    cgroup: CgroupAtDeath | None
    timeline: list[TimelinePoint]
    stall: dict[str, Any] | None  # the snapshot taken when the job stalled before the death
    advice: list[str]
    warnings: list[Warned] = field(default_factory=list)  # what foresight predicted before the death
    extra: dict[str, Any] = field(default_factory=dict)  # diagnose: inputs, collect, diagnosed_by


def _rank(r: RankRow) -> dict[str, Any]:
    row: dict[str, Any] = {
        "rank": r.rank,
        "local_rank": r.local_rank,
        "pid": r.pid,
        "exit_code": r.exit_code,
        "signal": signal_name(r.signal),
        "exit_source": r.exit_source,
        "died_at": iso(r.died_at),
        "fate": r.fate,
        "rss_bytes": r.rss_bytes,
        "peak_rss_bytes": r.peak_rss_bytes,
        "tree_rss_bytes": r.tree_rss_bytes,
        "tree_pss_bytes": r.tree_pss_bytes,
        "tree_uss_bytes": r.tree_uss_bytes,
        "gpu_memory_bytes": r.gpu_memory_bytes,
    }
    if r.rank_source is not None:
        row["rank_source"] = r.rank_source
    if r.launcher is not None:
        row["launcher"] = r.launcher
    if r.stranded_since is not None:
        row["stranded_since"] = iso(r.stranded_since)
    if r.local_rank_inferred:
        row["local_rank_inferred"] = True
    return row


def _cgroup(c: CgroupAtDeath | None) -> dict[str, Any] | None:
    if c is None:
        return None
    s = c.sample
    return {
        "path": s.path,
        "version": s.version,
        "limit_bytes": s.effective_limit_bytes,
        "usage_bytes_at_death": s.usage_bytes,
        "peak_bytes": s.peak_bytes,
        "oom_kills": c.oom_kills,
        # what the charge was made of at the last sample before the death (memory.stat)
        "charge": (
            {
                "anon_bytes": s.charge.anon_bytes,
                "file_bytes": s.charge.file_bytes,
                "shmem_bytes": s.charge.shmem_bytes,
                "kernel_bytes": s.charge.kernel_bytes,
                "working_set_bytes": s.charge.working_set_bytes,
            }
            if s.charge is not None
            else None
        ),
    }


def build(p: Parts) -> dict[str, Any]:
    """The document, in the contract's key order, with every string a job could have put
    there (evidence lines, rank output, error files, summaries, the entrypoint, the stall's stacks)
    through the redactor; the timeline holds only the daemon's numbers and times."""
    v = p.verdict
    if v is None:
        killer: dict[str, Any] = {"kind": Kind.UNKNOWN, "confidence": Confidence.POSSIBLE}
    else:
        killer = {"kind": v.kind, "confidence": v.confidence}
    killer["summary"] = p.summary if p.summary is not None else (v.summary if v else NO_DEATH)
    killer["evidence"] = [{"source": e.source, "at": iso(e.at), "detail": e.detail} for e in p.evidence]
    if v is not None and v.facts.peer_failure:  # its cause is on another rank: story joins nodes on it
        killer["peer_failure"] = True
    sender = v.facts.sender if v is not None else None
    if sender is not None:  # CONTRACTS' killer.sender: who sent the signal, and the tool it was
        killer["sender"] = {
            "pid": sender.pid,
            "comm": sender.comm,
            "exe": sender.exe,
            "uid": sender.uid,
            "cgroup": sender.cgroup,
            "parents": [{"pid": pid, "comm": comm} for pid, comm, _ in sender.parents],
            "tool": sender.tool,
            "detail": sender.detail,
        }
    doc = {
        "schema": SCHEMA,
        "id": p.ident,
        "created_at": iso(p.created_at),
        "updated_at": iso(p.updated_at),
        "host": p.host,
        "job": {
            "agent_pid": p.job.agent_pid,
            "run_id": p.job.run_id,
            "world_size": p.job.world_size,
            "restart_count": p.job.restart_count,
            "entrypoint": p.job.entrypoint,
            "key": p.job.key,
            **({"launcher": p.job.launcher} if p.job.launcher is not None else {}),
        },
        "victim": {
            "rank": v.victim.rank if v else None,
            "local_rank": v.victim.local_rank if v else None,
            "pid": (v.victim.pid or None) if v else None,
            "exit_code": p.victim.exit_code,
            "signal": signal_name(v.victim.signal) if v else None,
            "died_at": iso(p.victim.died_at),
            # first-hand, from the kernel's kill line: the RSS at the moment of the kill
            "kernel_rss_bytes": v.oom.rss_bytes if v and v.oom else None,
        },
        "killer": killer,
        "ranks": [_rank(r) for r in p.ranks],
        "memory": {
            "host": {
                "total_bytes": p.host_memory.total_bytes,
                "available_bytes_at_death": p.host_memory.available_bytes,
                "min_available_bytes": p.host_memory.min_available_bytes,
            },
            "cgroup": _cgroup(p.cgroup),
        },
        "warnings": [
            {
                "at": iso(w.at),
                "rank": w.rank,
                "exhaustion_seconds": w.exhaustion_seconds,
                "rate_bytes_per_second": round(w.rate_bytes_per_second),
                "limit": {"kind": w.limit.kind, "path": w.limit.path, "limit_bytes": w.limit.limit_bytes},
            }
            for w in p.warnings
        ],
        "timeline": [
            {
                "at": iso(t.at),
                "host_available_bytes": t.host_available_bytes,
                "cgroup_usage_bytes": t.cgroup_usage_bytes,
                "rss_bytes": t.rss_bytes,
                "tree_rss_bytes": t.tree_rss_bytes,
                "gpu_memory_bytes": t.gpu_memory_bytes,
                "cgroup_charge_bytes": t.cgroup_charge_bytes or None,
                "workers_uss_bytes": t.workers_uss_bytes or None,
            }
            for t in p.timeline
        ],
        "stall": p.stall,
        "advice": p.advice,
        **p.extra,
    }
    timeline, doc["timeline"] = doc["timeline"], []
    clean: dict[str, Any] = redact_doc(doc)  # keeps the key order
    clean["timeline"] = timeline
    return clean
