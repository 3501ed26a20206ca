"""After a restart of the daemon: which deaths of the ranks an earlier run watched (its
``saved.SavedState``) happened while no daemon ran, and the incidents that judge them.
Pure functions: ``deaths.DeathWatch.restore`` feeds them what it read and installs what
they give. The other half, what the journal keeps, is ``state_of``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from sidecar.deaths.incidents import Generation, Incident, Known
from sidecar.deaths.saved import SavedIncident, SavedState
from sidecar.model import ProcKey, Snapshot
from sidecar.probes.outputs import OutputFile
from sidecar.probes.proc import TICKS_PER_SECOND

__all__ = ["Revived", "incidents_of", "killed_at", "revive", "state_of", "watched"]


@dataclass(frozen=True, slots=True)
class Revived:
    """A generation with deaths no postmortem holds: what the death watch needs to judge it."""

    gen: Generation
    ranks: dict[int, Known]
    deaths: dict[int, tuple[int | None, int, str | None]]
    new_dead: tuple[int, ...]  # the ranks that died while the daemon was down
    untimed: frozenset[int]  # those of them whose time of death nothing tells
    doc_id: str | None
    created_at: float | None
    agent_alive: bool


def revive(
    state: SavedState,
    alive: Callable[[ProcKey], bool],
    killed_at: Callable[[ProcKey], int | None],
    now_ns: int,
) -> list[Revived]:
    """The generations of ``state`` with ranks that are gone and whose death no saved
    incident recorded. ``alive``: the process is still the one the key names;
    ``killed_at``: the kernel time (ns) of an OOM kill record naming that process, if any.
    A death's time is the kill record's; a death no record times is put at ``now_ns`` (after
    every timed one, so that it is never taken for the first) and listed in ``untimed``."""
    by_gen: dict[Generation, dict[int, Known]] = {}
    for k in state.ranks:
        by_gen.setdefault(k.gen, {})[k.sample.key.pid] = k
    saved = {i.gen: i for i in state.incidents}
    out = []
    for gen, ranks in by_gen.items():
        inc = saved.get(gen)
        recorded = dict(inc.deaths) if inc is not None else {}
        gone = [pid for pid, k in ranks.items() if pid not in recorded and not alive(k.sample.key)]
        if not gone:
            continue
        deaths = dict(recorded)
        for pid in gone:
            at = killed_at(ranks[pid].sample.key)
            deaths[pid] = (None, at if at is not None else now_ns, "reconstructed")
        out.append(
            Revived(
                gen,
                ranks,
                deaths,
                tuple(sorted(gone)),
                frozenset(pid for pid in gone if deaths[pid][1] == now_ns),
                inc.doc_id if inc else None,
                inc.created_at if inc else None,
                gen.agent_pid in state.agents and alive(ProcKey(gen.agent_pid, state.agents[gen.agent_pid])),
            )
        )
    return out


def killed_at(kills: list[tuple[int, int]]) -> Callable[[ProcKey], int | None]:
    """From the kernel's OOM kills (pid, kernel time ns): the time of the newest one that
    names the process, after it started (an older one named a process that had its pid)."""
    ticks_ns = 10**9 // TICKS_PER_SECOND

    def at(key: ProcKey) -> int | None:
        hits = [ns for pid, ns in kills if pid == key.pid and ns >= key.start_ticks * ticks_ns]
        return max(hits) if hits else None

    return at


def watched(
    known: dict[int, Known], latest: tuple[int, Snapshot] | None, incidents: Iterable[Incident]
) -> tuple[tuple[Known, ...], object]:
    """The ranks the journal keeps (those the latest round saw, and those of open
    incidents) and what the journal would hold in substance (the ranks, the incidents'
    ids and deaths; not the samples' values): compared cheaply every round."""
    incidents = list(incidents)
    in_incident = {pid for inc in incidents for pid in inc.ranks}
    ranks = tuple(
        k for pid, k in known.items() if pid in in_incident or (latest is not None and k.seen_ns == latest[0])
    )
    substance = (
        frozenset(k.sample.key for k in ranks),
        tuple((i.gen, i.doc_id, frozenset(i.deaths)) for i in incidents),
    )
    return ranks, substance


def state_of(
    boot_id: str,
    now_ns: int,
    wall: float,
    ranks: tuple[Known, ...],
    latest: tuple[int, Snapshot] | None,
    incidents: Iterable[Incident],
    agent_files: dict[int, list[OutputFile]],
    rank_files: dict[int, list[OutputFile]],
) -> SavedState:
    """The death watch's state as the journal keeps it (without the curves)."""
    snap = latest[1] if latest is not None else None
    agents = {k.gen.agent_pid for k in ranks}
    return SavedState(
        boot_id=boot_id,
        saved_wall=wall,
        saved_ns=now_ns,
        ranks=ranks,
        agents={j.agent.pid: j.agent.start_ticks for j in snap.jobs} if snap else {},
        agent_files={p: tuple(f) for p, f in agent_files.items() if p in agents},
        rank_files={k.sample.key.pid: tuple(rank_files.get(k.sample.key.pid, ())) for k in ranks},
        cgroups=snap.cgroups if snap else (),
        host=snap.host if snap else None,
        incidents=tuple(SavedIncident(i.gen, i.doc_id, i.created_at, dict(i.deaths)) for i in incidents),
        curves={},
    )


def incidents_of(state: SavedState, revived: list[Revived], now_ns: int, wall: float) -> list[Incident]:
    """The incidents to judge after a restart, one per revived generation, with the memory
    and counters as last saved (the "before" of the deaths)."""
    before = Snapshot(
        state.saved_wall, state.saved_ns / 1e9, (), state.host, (), state.cgroups, {}, 0, 0, 0.0, 0
    )
    out = []
    for r in revived:
        inc = Incident(r.gen, dict(r.ranks), deaths=dict(r.deaths), snapshot_before=before)
        inc.doc_id, inc.created_at = r.doc_id, r.created_at
        inc.host_oom_before = state.host.oom_kills if state.host else None
        inc.cgroup_oom_before = {c.path: c.oom_kills for c in state.cgroups if c.oom_kills is not None}
        inc.cgroup_hits_before = {c.path: c.limit_hits for c in state.cgroups if c.limit_hits is not None}
        inc.reconstructed = (state.saved_wall, wall)
        inc.untimed = set(r.untimed)
        inc.last_death_ns = now_ns  # kept open for the live deaths still to come
        if not r.agent_alive:
            inc.agent_exit = (None, now_ns)
        out.append(inc)
    return out
