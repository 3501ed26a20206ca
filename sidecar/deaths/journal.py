"""What the death watch knows, kept on disk, so that a restarted daemon can explain the
deaths that happened while it was down.

A daemon can be SIGKILLed, OOM-killed or restarted by its supervisor in the middle of an
incident. The kernel keeps its log (the OOM records naming the victim's pid) and the agent
keeps its log file; what the new process lacks is which processes were ranks, of which
job, in which cgroup, printing where. Every ``SAVE_EVERY_S`` while jobs are watched (and at
once when the set of ranks or an incident changes) the death watch writes that here:
the ranks as last sampled, their jobs' output files, the cgroups' counters, the incidents
with their postmortem ids and the deaths recorded, and a thinned memory curve per job.

At start, a state of the same boot (``/proc/sys/kernel/random/boot_id``) is read back:
ranks that are gone and whose death no postmortem holds are judged again from the kernel
log's history and the agent's log, and the postmortem says it was *reconstructed*. A state
of another boot is dropped (its pids mean nothing now). The file is the daemon's own
(written atomically, mode 0600, in the postmortem directory); a malformed one is ignored
with a warning.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import threading
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

__all__ = [
    "SAVE_EVERY_S",
    "STATE_NAME",
    "Journal",
    "SavedIncident",
    "State",
    "read_boot_id",
    "thin",
]

log = logging.getLogger("sidecar.journal")  # the log keeps its names across the move

SCHEMA = "trainwatch.state/v1"
STATE_NAME = "trainwatch.state"  # in the postmortem directory (the store reads only *.json)
SECOND_SLOT = ".b"  # trainwatch.state.b: the slot written in turn with it
SAVE_EVERY_S = 5.0
MAX_BYTES = 8 << 20  # a state this large is not the daemon's
CURVE_POINTS = 150  # per job: the memory curve kept across a restart, thinned to this many


def read_boot_id(proc_root: str = "/proc") -> str | None:
    try:
        with open(f"{proc_root}/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read(64).strip() or None
    except (OSError, UnicodeDecodeError):
        return None


@dataclass(frozen=True, slots=True)
class SavedIncident:
    gen: Generation
    doc_id: str | None
    created_at: float | None
    deaths: dict[int, tuple[int | None, int, str | None]]  # as Incident.deaths


@dataclass(frozen=True, slots=True)
class State:
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


class Journal:
    """The state, in two files written in turn (``save`` from any thread, one write at a
    time; ``load`` at start reads the newer one of this boot).

    Each save overwrites the older slot in place (open, one ``pwrite`` of the JSON padded
    with spaces to the slot's length, close: no truncate, no rename, no new directory
    entry; each rename cost an ext4 journal transaction, every 5 s). Nothing is held open
    between saves, so the file system can still be remounted read-only or unmounted. A
    write cut short (the daemon SIGKILLed in the middle of one) spoils only its own slot:
    the other holds the state of one save before. Each slot is a file this process made
    (whatever was at its path, a planted link too, is unlinked first and the file created
    exclusively, mode 0600), and it is written only while its path still names that file
    (same inode, one link): else a new one is made."""

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, STATE_NAME)
        self.paths = (self.path, self.path + SECOND_SLOT)
        self._lock = threading.Lock()
        self._failed: str | None = None  # the last write error, logged once
        self._made: list[tuple[int, int] | None] = [None, None]  # (device, inode) of each slot made
        self._sizes = [0, 0]
        self._next = 0

    def _open_slot(self, i: int) -> int:
        path = self.paths[i]
        made = self._made[i]
        if made is not None:
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
            except FileNotFoundError:
                fd = -1
            if fd >= 0:
                st = os.fstat(fd)
                if (st.st_dev, st.st_ino) == made and st.st_nlink == 1:
                    return fd
                os.close(fd)  # not the file this process made any more
        os.makedirs(os.path.dirname(path), mode=0o750, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # whatever is there (a planted link) goes; a new file is made
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        st = os.fstat(fd)
        self._made[i], self._sizes[i] = (st.st_dev, st.st_ino), 0
        return fd

    def save(self, state: State) -> None:
        data = json.dumps(encode(state), separators=(",", ":")).encode()
        with self._lock:
            i = self._next
            try:
                fd = self._open_slot(i)
                try:
                    padded = data + b" " * (self._sizes[i] - len(data))  # JSON allows trailing blanks
                    if os.pwrite(fd, padded, 0) != len(padded):
                        raise OSError(errno.EIO, "short write")
                finally:
                    os.close(fd)
                self._sizes[i] = max(self._sizes[i], len(data))
                self._next = 1 - i
            except OSError as exc:
                self._made[i] = None  # made afresh next time
                if self._failed != str(exc):
                    log.warning(
                        "journal: %s not written (%s): a restart will not know the jobs", self.paths[i], exc
                    )
                    self._failed = str(exc)
                return
            if self._failed is not None:
                log.info("journal: %s written again", self.paths[i])
                self._failed = None

    def load(self, boot_id: str | None) -> State | None:
        """The newer saved state of this boot, else None (and why, in the log)."""
        states = [s for s in (self._load(path, boot_id) for path in self.paths) if s is not None]
        return max(states, key=lambda s: s.saved_ns) if states else None

    @staticmethod
    def _load(path: str, boot_id: str | None) -> State | None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("journal: %s not read: %s", path, exc)
            return None
        try:
            st = os.fstat(fd)
            if st.st_uid != os.geteuid() or st.st_size > MAX_BYTES:
                log.warning("journal: %s is not this daemon's (owner or size); ignored", path)
                return None
            raw = os.read(fd, MAX_BYTES + 1)
        finally:
            os.close(fd)
        try:
            state = decode(json.loads(raw))
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:
            log.warning("journal: %s is malformed (%s); ignored", path, exc)
            return None
        if boot_id is None or state.boot_id != boot_id:
            log.info("journal: %s is of another boot; its processes are gone", path)
            return None
        return state


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
    }


def _gen(g: Generation) -> list[Any]:
    return [g.job, g.agent_pid, g.run_id, g.world_size, g.restart, g.entrypoint]


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


def encode(s: State) -> dict[str, Any]:
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
    job, agent, run_id, world, restart, entry = _list(v)
    return Generation(_str(job), _int(agent), _ostr(run_id), _oint(world), _int(restart), _ostr(entry))


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


def decode(d: Any) -> State:
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
    return State(
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
