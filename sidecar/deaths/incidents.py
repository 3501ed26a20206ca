"""An incident and its data: one worker generation of a job (``Generation``), its ranks as
last sampled (``Known``), the deaths and counters of one incident (``Incident``), what an
autopsy round reads (``Plan``) and what it read (``Reads``). Pure functions turn them into
the autopsy's ``Evidence`` (``join_evidence``); ``parts.py`` turns them into the postmortem
document's parts. No I/O: ``gather.py`` reads, ``hear.py`` and ``write.py`` decide when.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from sidecar.autopsy import Evidence, RankState, UserspaceKill, Verdict, agent_name
from sidecar.deaths.records import Records
from sidecar.model import Fate, Kind, RankSample, Snapshot
from sidecar.model.stall import StallSnapshot
from sidecar.parse.flight import FlightVerdict
from sidecar.parse.ranks import Finding
from sidecar.probes.outputs import OutputFile

__all__ = [
    "Generation",
    "Incident",
    "Known",
    "Plan",
    "Reads",
    "clean_end",
    "join_evidence",
    "killers_of",
    "plan_of",
]


@dataclass(frozen=True, slots=True)
class Generation:
    """One worker generation of one job: what its ranks share, and an incident's key."""

    job: str
    agent_pid: int
    run_id: str | None
    world_size: int | None
    restart: int
    entrypoint: str | None
    launcher: str = "torchrun"


@dataclass(slots=True)
class Known:
    """A process known to be a rank: its generation of its job, its last sample and the
    figures the autopsy needs of it once it is gone (its cgroup's limit, its GPUs)."""

    gen: Generation
    sample: RankSample
    cgroup_limited_by: str | None
    seen_ns: int


@dataclass(slots=True)
class Incident:
    gen: Generation
    ranks: dict[int, Known]
    # pid -> (wait status or None when unknown, monotonic ns, who told: ExitEvent.source)
    deaths: dict[int, tuple[int | None, int, str | None]] = field(default_factory=dict)
    agent_exit: tuple[int | None, int] | None = None
    doc_id: str | None = None
    created_at: float | None = None
    due_ns: int | None = None
    last_death_ns: int = 0
    counted: dict[int, str] = field(default_factory=dict)
    host_oom_before: int | None = None
    cgroup_oom_before: dict[str, int] = field(default_factory=dict)
    cgroup_hits_before: dict[str, int] = field(default_factory=dict)  # CgroupSample.limit_hits
    snapshot_before: Snapshot | None = None
    # the job's /dev/shm, read while a process of it lived: (size, used, seconds before the
    # first death it was read, None when read at the autopsy)
    shm: tuple[int, int, float | None] | None = None
    stall: StallSnapshot | None = None  # the snapshot taken when the job stalled (stalls/tracker.py)
    # judged after a restart of the daemon: (when the state was last saved, when it came back), wall
    reconstructed: tuple[float, float] | None = None
    untimed: set[int] = field(default_factory=set)  # deaths whose time nothing tells (after a restart)
    # survivors alive and making no progress after the death (stalls/stranded.py): pid -> since, wall
    stranded: dict[int, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Plan:
    """What one autopsy round reads, copied from the shared state under the lock."""

    agent_files: tuple[OutputFile, ...]
    rank_files: tuple[tuple[int, str, tuple[OutputFile, ...]], ...]  # (pid, label, its own files)
    seen_at: dict[int, float]  # rank pid -> wall time first seen (older dumps are not its)
    oomd_baseline: dict[tuple[str, int], dict[str, int]]
    error_files: tuple[tuple[str, str, int | None], ...]  # (rank label, its TORCHELASTIC_ERROR_FILE, uid)


def plan_of(
    inc: Incident,
    agent_outputs: dict[int, list[OutputFile]],
    rank_files: dict[int, tuple[list[OutputFile], float]],
    oomd_baseline: dict[tuple[str, int], dict[str, int]],
) -> Plan:
    """What one autopsy round of ``inc`` reads, from the death watch's state (``rank_files``:
    pid -> (its own output files, when it was first seen))."""
    before = inc.snapshot_before
    return Plan(
        tuple(agent_outputs.get(inc.gen.agent_pid, [])),
        tuple(
            (pid, k.sample.rank_label, tuple(rank_files.get(pid, ([], 0.0))[0]))
            for pid, k in inc.ranks.items()
        ),
        {pid: rank_files.get(pid, ([], 0.0))[1] for pid in inc.ranks},
        {
            (cg.path, cg.version): dict(oomd_baseline[(cg.path, cg.version)])
            for cg in (before.cgroups if before else ())
            if (cg.path, cg.version) in oomd_baseline
        },
        tuple(
            (k.sample.rank_label, k.sample.error_file, k.sample.uid)
            for k in inc.ranks.values()
            if k.sample.error_file
        ),
    )


@dataclass(frozen=True, slots=True)
class Reads:
    """What one autopsy round read and parsed, outside the lock."""

    texts: list[tuple[str | None, str]]  # the output read (and the error files')
    agent_codes: dict[int, tuple[int, str]]  # pid -> (wait status, the agent's line)
    teardown: frozenset[int]
    findings: tuple[tuple[str | None, Finding], ...]
    cgroup_oom_after: dict[str, int]
    cgroup_hits_after: dict[str, int]
    host_oom_after: int | None
    daemons: list[tuple[str, int, list[UserspaceKill]]]
    oomd: list[UserspaceKill]
    flight: FlightVerdict | None
    flight_on: bool | None
    shm: tuple[int, int, float | None] | None
    skipped: tuple[str, ...] = ()  # job-named files not read, each with why
    job_said: tuple[tuple[str, str], ...] = ()  # gather.job_log_said

    @classmethod
    def nothing(cls) -> Reads:
        """A round whose reads failed: the postmortem comes from the feeds alone."""
        return cls([], {}, frozenset(), (), {}, {}, None, [], [], None, None, None)


# -- the autopsy's evidence -----------------------------------------------------------


def join_evidence(
    inc: Incident,
    reads: Reads,
    records: Records,
    *,
    latest: Snapshot | None,
    rank_gpus: dict[int, frozenset[int]],
    kernel_log_readable: bool,
    exits_first_hand: bool,
) -> Evidence:
    """The autopsy's evidence: one round's reads joined with what the feeds recorded
    (``records``), the latest snapshot's OOM counters and the GPUs each rank used. Updates
    ``inc.deaths`` with the exit statuses the agent's log gave where nothing else did."""
    ranks = []
    # Without first-hand exits, death times are when a death was noticed: the agent's
    # log then tells the order (whom it tore down) and the statuses.
    second_hand = any(d[2] not in ("connector", "pidfd") for d in inc.deaths.values())
    teardown = reads.teardown if second_hand else frozenset[int]()
    if second_hand:
        for pid, d in list(inc.deaths.items()):
            if d[0] is None and pid in reads.agent_codes:
                inc.deaths[pid] = (reads.agent_codes[pid][0], d[1], "agent-log")
    for pid, k in sorted(
        inc.ranks.items(), key=lambda kv: (kv[1].sample.rank is None, kv[1].sample.rank or 0)
    ):
        code, ns, source = inc.deaths.get(pid, (None, None, None))
        ranks.append(
            RankState(
                label=k.sample.rank_label,
                rank=k.sample.rank,
                local_rank=k.sample.local_rank,
                pid=pid,
                ns_pids=k.sample.ns_pids,
                exit_code=code,
                died_ns=ns,
                cgroup=k.sample.cgroup,
                cgroup_limited_by=k.cgroup_limited_by,
                exit_source=source,
                gpus=tuple(sorted(rank_gpus.get(pid, ()))),
                slurm_times=k.sample.slurm_times,
            )
        )
    after_cg = {c.path: c.oom_kills for c in latest.cgroups if c.oom_kills is not None} if latest else {}
    after_cg.update(reads.cgroup_oom_after)
    hits_cg = {c.path: c.limit_hits for c in latest.cgroups if c.limit_hits is not None} if latest else {}
    hits_cg.update(reads.cgroup_hits_after)
    userspace = [
        *records.userspace,
        *reads.oomd,
        *(rec for _, _, lines in reads.daemons for rec in lines),
    ]
    return Evidence(
        tuple(ranks),
        kernel=tuple(records.ooms.kills),
        signals=tuple(records.signals),
        agent_pid=inc.gen.agent_pid,
        agent_name=agent_name(inc.gen.launcher),
        oom_daemons=tuple((comm, pid) for comm, pid, _ in reads.daemons),
        host_oom_kills_before=inc.host_oom_before,
        host_oom_kills_after=reads.host_oom_after,
        cgroup_oom_kills_before=inc.cgroup_oom_before,
        cgroup_oom_kills_after=after_cg,
        cgroup_limit_hits_before=inc.cgroup_hits_before,
        cgroup_limit_hits_after=hits_cg,
        kernel_log_readable=kernel_log_readable,
        exits_first_hand=exits_first_hand,
        userspace=tuple(userspace),
        agent_teardown=teardown,
        output=reads.findings,
        output_read=bool(reads.texts),
        run_output=next((k.sample.run_output for k in inc.ranks.values() if k.sample.run_output), None),
        world_size=inc.gen.world_size,
        flight=reads.flight,
        flight_enabled=reads.flight_on,
        shm=reads.shm,
        skipped=reads.skipped,
        kernel_losses=tuple(records.kmsg_losses),
        xids=tuple(records.xids),
        kernel_said=tuple(records.said),
        job_said=reads.job_said,
        lost_gpus=tuple((ns, index, name) for index, (ns, name) in sorted(records.lost_gpus.items())),
    )


def clean_end(inc: Incident, ev: Evidence, verdict: Verdict, readable_log: bool) -> bool | None:
    """For deaths that nothing explains and whose statuses are all unknown: True when it
    was the job's clean end (no postmortem), None while that cannot be told yet.
    ``readable_log``: the agent's output can be read (it names every failed rank). After a
    restart of the daemon, ranks that ended without a trace are taken as the job's end: an
    'unknown' for every job that finished while the daemon was down would be noise."""
    if verdict.kind != Kind.UNKNOWN or any(r.exit_code not in (None, 0) for r in ev.ranks if r.dead):
        return False
    if inc.reconstructed is not None and all(r.exit_code is None for r in ev.ranks if r.dead):
        return True
    if inc.agent_exit is not None and inc.agent_exit[0] is not None:
        return inc.agent_exit[0] == 0
    if inc.agent_exit is not None:  # the agent is gone, its status unknown too
        return readable_log  # its log names no failed rank: training ended
    if all(r.dead for r in ev.ranks):
        return None  # every rank ended and the agent still runs: give it time to exit
    return False


def killers_of(v: Verdict, ev: Evidence) -> list[tuple[RankState, str]]:
    """Each abnormally ended rank with the killer its death is counted under: the verdict's
    kind for the root cause and the same cause, the agent for its teardown, else unknown."""
    killers: dict[Fate, str] = {
        Fate.ROOT_CAUSE: v.kind,
        Fate.SAME_CAUSE: v.kind,
        Fate.TERMINATED_BY_AGENT: Kind.AGENT_TEARDOWN,
    }
    out = []
    for r in ev.ranks:
        fate = v.fates.get(r.label)
        if r.abnormal:
            out.append((r, killers.get(fate, Kind.UNKNOWN) if fate is not None else Kind.UNKNOWN))
    return out
