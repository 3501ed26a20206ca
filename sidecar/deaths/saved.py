"""What the journal keeps of the death watch (``SavedState``: the ranks as last sampled, their
jobs' output files, the cgroups' counters, the incidents with their postmortem ids and the
deaths recorded, a thinned memory curve per job), and its encoding as flat JSON records.
The decoders check every field's type: a state file is read back by a daemon running as
root, so a malformed one is refused, never half-believed. The file itself is
``journal.py``'s.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from sidecar.deaths.incidents import Generation, Known
from sidecar.model import (
    CgroupLevel,
    CgroupSample,
    HostSample,
    MemoryCharge,
    ProcKey,
    RankSample,
    TimelinePoint,
)
from sidecar.probes.outputs import OutputFile

__all__ = ["SavedIncident", "SavedState", "decode", "encode", "thin"]

SCHEMA = "trainwatch.state/v1"
CURVE_POINTS = 150  # per job: the memory curve kept across a restart, thinned to this many


@dataclass(frozen=True, slots=True)
class SavedIncident:
    gen: Generation
    doc_id: str | None
    created_at: float | None
    deaths: dict[int, tuple[int | None, int, str | None]]  # as Incident.deaths


@dataclass(frozen=True, slots=True)
class SavedState:
    boot_id: str
    saved_wall: float
    saved_ns: int  # CLOCK_MONOTONIC: the same clock for every process of one boot
    ranks: tuple[Known, ...]
    agents: dict[int, int]  # agent pid -> its start (clock ticks since boot)
    agent_files: dict[int, tuple[OutputFile, ...]]
    rank_files: dict[int, tuple[OutputFile, ...]]
    cgroups: tuple[CgroupSample, ...]
    host: HostSample | None
    incidents: tuple[SavedIncident, ...]
    curves: dict[str, tuple[TimelinePoint, ...]]  # job key -> its memory curve


# -- encoding (flat records field by field, in declaration order: the decoders unpack it) --


def _files(files: tuple[OutputFile, ...]) -> list[list[Any]]:
    return [[f.pid, f.fd, f.path, f.device, f.inode, f.offset] for f in files]


def _sample(s: RankSample) -> dict[str, Any]:
    return {
        "job": s.job,
        "rank": s.rank,
        "label": s.rank_label,
        "local_rank": s.local_rank,
        "restart": s.restart,
        "pid": s.key.pid,
        "start": s.key.start_ticks,
        "rss": s.rss_bytes,
        "peak": s.peak_rss_bytes,
        "cpu": s.cpu_seconds,
        "threads": s.threads,
        "tree_rss": s.tree_rss_bytes,
        "tree_pss": s.tree_pss_bytes,
        "tree_uss": s.tree_uss_bytes,
        "tree_n": s.tree_processes,
        "cgroup": s.cgroup,
        "gpu": [[i, b] for i, b in s.gpu_memory_bytes.items()],
        "ns_pids": list(s.ns_pids),
        "flight": list(s.flight_recorder) if s.flight_recorder is not None else None,
        "error_file": s.error_file,
        "uid": s.uid,
        "rank_source": s.rank_source,
    }


def _gen(g: Generation) -> list[Any]:
    return [g.job, g.agent_pid, g.run_id, g.world_size, g.restart, g.entrypoint, g.launcher]


def _cgroup(c: CgroupSample) -> list[Any]:
    return [
        c.path,
        c.version,
        c.usage_bytes,
        c.limit_bytes,
        c.peak_bytes,
        c.oom_kills,
        c.oom_events,
        [[a.path, a.limit_bytes] for a in c.ancestors],
        c.limited_by,
        c.effective_limit_bytes,
        _charge(c.charge),
        c.events,
        list(c.pressure_ratio) if c.pressure_ratio else None,
        list(c.pressure_stall_seconds) if c.pressure_stall_seconds else None,
        c.limit_hits,
    ]


_NAMES: dict[type, tuple[str, ...]] = {}


def _flat(obj: Any) -> list[Any]:
    """A flat record's fields in order (what ``dataclasses.astuple`` gives for these
    records of numbers and flat dicts, without its recursive deep copy: the journal is
    written every few seconds while a job runs, and astuple was most of its cost)."""
    cls = type(obj)
    names = _NAMES.get(cls)
    if names is None:
        names = _NAMES[cls] = tuple(f.name for f in fields(cls))
    return [getattr(obj, n) for n in names]


def _charge(c: MemoryCharge | None) -> list[Any] | None:
    return _flat(c) if c is not None else None


def _host(h: HostSample) -> list[Any]:
    return _flat(h)


def _point(p: TimelinePoint) -> list[Any]:
    return _flat(p)


def thin(points: list[TimelinePoint], most: int = CURVE_POINTS) -> tuple[TimelinePoint, ...]:
    """At most ``most`` points, evenly chosen, the newest always kept."""
    if len(points) <= most:
        return tuple(points)
    step = len(points) / most
    picked = [points[int(i * step)] for i in range(most - 1)]
    return (*picked, points[-1])


def encode(s: SavedState) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "boot_id": s.boot_id,
        "saved_wall": s.saved_wall,
        "saved_ns": s.saved_ns,
        "ranks": [
            {
                "gen": _gen(k.gen),
                "sample": _sample(k.sample),
                "limited_by": k.cgroup_limited_by,
                "seen_ns": k.seen_ns,
            }
            for k in s.ranks
        ],
        "agents": [[pid, start] for pid, start in s.agents.items()],
        "agent_files": [[pid, _files(files)] for pid, files in s.agent_files.items()],
        "rank_files": [[pid, _files(files)] for pid, files in s.rank_files.items()],
        "cgroups": [_cgroup(c) for c in s.cgroups],
        "host": _host(s.host) if s.host is not None else None,
        "incidents": [
            {
                "gen": _gen(i.gen),
                "doc_id": i.doc_id,
                "created_at": i.created_at,
                "deaths": [[pid, code, ns, source] for pid, (code, ns, source) in i.deaths.items()],
            }
            for i in s.incidents
        ],
        "curves": [[job, [_point(p) for p in points]] for job, points in s.curves.items()],
    }


# -- decoding (strict: a field of the wrong type fails the whole state) -------------------


def _int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"not an integer: {v!r}")
    return v


def _oint(v: Any) -> int | None:
    return None if v is None else _int(v)


def _num(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"not a number: {v!r}")
    return float(v)


def _onum(v: Any) -> float | None:
    return None if v is None else _num(v)


def _str(v: Any) -> str:
    if not isinstance(v, str):
        raise ValueError(f"not a string: {v!r}")
    return v


def _ostr(v: Any) -> str | None:
    return None if v is None else _str(v)


def _list(v: Any) -> list[Any]:
    if not isinstance(v, list):
        raise ValueError(f"not a list: {v!r}")
    return v


def _int_map(v: Any) -> dict[str, int]:
    if not isinstance(v, dict):
        raise ValueError(f"not a map: {v!r}")
    return {_str(k): _int(n) for k, n in v.items()}


def _ungen(v: Any) -> Generation:
    fields = _list(v)
    if len(fields) == 6:  # saved before jobs named their launcher: torchrun's, the only one then
        fields = [*fields, "torchrun"]
    job, agent, run_id, world, restart, entry, launcher = fields
    return Generation(
        _str(job), _int(agent), _ostr(run_id), _oint(world), _int(restart), _ostr(entry), _str(launcher)
    )


def _unfiles(v: Any) -> tuple[OutputFile, ...]:
    out = []
    for f in _list(v):
        pid, fd, path, dev, ino, offset = _list(f)
        out.append(OutputFile(_int(pid), _int(fd), _str(path), _int(dev), _int(ino), _int(offset)))
    return tuple(out)


def _unsample(d: Any) -> RankSample:
    if not isinstance(d, dict):
        raise ValueError("a rank is not a map")
    flight = d["flight"]
    return RankSample(
        job=_str(d["job"]),
        rank=_oint(d["rank"]),
        rank_label=_str(d["label"]),
        local_rank=_oint(d["local_rank"]),
        restart=_int(d["restart"]),
        key=ProcKey(_int(d["pid"]), _int(d["start"])),
        rss_bytes=_int(d["rss"]),
        peak_rss_bytes=_oint(d["peak"]),
        cpu_seconds=_num(d["cpu"]),
        threads=_int(d["threads"]),
        tree_rss_bytes=_int(d["tree_rss"]),
        tree_pss_bytes=_oint(d.get("tree_pss")),
        tree_uss_bytes=_oint(d.get("tree_uss")),
        tree_processes=_int(d["tree_n"]),
        cgroup=_ostr(d["cgroup"]),
        gpu_memory_bytes={_int(i): _int(b) for i, b in (_list(p) for p in _list(d["gpu"]))},
        ns_pids=tuple(_int(p) for p in _list(d["ns_pids"])),
        flight_recorder=(_int(flight[0]), _str(flight[1])) if flight is not None else None,
        error_file=_ostr(d["error_file"]),
        uid=_oint(d["uid"]),
        rank_source=_str(d.get("rank_source", "RANK")),  # saved before it was kept: torchrun's RANK
    )


def _uncharge(v: Any) -> MemoryCharge | None:
    if v is None:
        return None
    anon, file, shmem, kernel, working, inactive = _list(v)
    return MemoryCharge(_int(anon), _int(file), _int(shmem), _oint(kernel), _oint(working), _int(inactive))


def _uncgroup(v: Any) -> CgroupSample:
    fields = _list(v)
    path, version, usage, limit, peak, kills, events, ancestors, limited_by, effective, charge, mem_events = (
        fields[:12]
    )
    ratio, stall = (_pair(x) for x in [*fields[12:14], None, None][:2])  # older states have none
    return CgroupSample(
        _str(path),
        _int(version),
        _oint(usage),
        _oint(limit),
        _oint(peak),
        _oint(kills),
        _oint(events),
        tuple(CgroupLevel(_str(a[0]), _oint(a[1])) for a in (_list(x) for x in _list(ancestors))),
        _ostr(limited_by),
        _oint(effective),
        _uncharge(charge),
        _int_map(mem_events),
        ratio,
        stall,
        limit_hits=_oint(fields[14]) if len(fields) > 14 else None,  # older states have none
    )


def _pair(v: Any) -> tuple[float, float | None] | None:
    if v is None:
        return None
    first, second = _list(v)
    return _num(first), _onum(second)


def _unhost(v: Any) -> HostSample:
    total, avail, kills, s10, f10, st, ft, shm_total, shm_used = _list(v)
    return HostSample(
        _int(total),
        _int(avail),
        _oint(kills),
        _onum(s10),
        _onum(f10),
        _onum(st),
        _onum(ft),
        _oint(shm_total),
        _oint(shm_used),
    )


def _unpoint(v: Any) -> TimelinePoint:
    fields = _list(v)
    if len(fields) not in (6, 7, 8):  # a state saved before the charge (7) and workers (8) were kept
        raise ValueError(f"a timeline point of {len(fields)} fields")
    at, avail, usage, rss, tree, gpu = fields[:6]
    charge = _int_map(fields[6]) if len(fields) > 6 else {}
    workers = _int_map(fields[7]) if len(fields) > 7 else {}
    return TimelinePoint(
        _num(at), _oint(avail), _oint(usage), _int_map(rss), _int_map(tree), _int_map(gpu), charge, workers
    )


def decode(d: Any) -> SavedState:
    if not isinstance(d, dict) or d.get("schema") != SCHEMA:
        raise ValueError("not a trainwatch state")
    ranks = tuple(
        Known(_ungen(r["gen"]), _unsample(r["sample"]), _ostr(r["limited_by"]), _int(r["seen_ns"]))
        for r in _list(d["ranks"])
    )
    incidents = []
    for i in _list(d["incidents"]):
        deaths: dict[int, tuple[int | None, int, str | None]] = {}
        for pid, code, ns, source in (_list(x) for x in _list(i["deaths"])):
            deaths[_int(pid)] = (_oint(code), _int(ns), _ostr(source))
        incidents.append(SavedIncident(_ungen(i["gen"]), _ostr(i["doc_id"]), _onum(i["created_at"]), deaths))
    return SavedState(
        boot_id=_str(d["boot_id"]),
        saved_wall=_num(d["saved_wall"]),
        saved_ns=_int(d["saved_ns"]),
        ranks=ranks,
        agents={_int(p): _int(t) for p, t in (_list(x) for x in _list(d["agents"]))},
        agent_files={_int(p): _unfiles(f) for p, f in (_list(x) for x in _list(d["agent_files"]))},
        rank_files={_int(p): _unfiles(f) for p, f in (_list(x) for x in _list(d["rank_files"]))},
        cgroups=tuple(_uncgroup(c) for c in _list(d["cgroups"])),
        host=_unhost(d["host"]) if d["host"] is not None else None,
        incidents=tuple(incidents),
        curves={
            _str(j): tuple(_unpoint(p) for p in _list(ps)) for j, ps in (_list(x) for x in _list(d["curves"]))
        },
    )
