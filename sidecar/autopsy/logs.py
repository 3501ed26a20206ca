"""The rules for logs, on top of the autopsy's verdict (``trainwatch diagnose``): what
logs can say and cannot. A SIGKILL nothing explains is ``unknown`` unless a kernel log was
given (then ``external_signal``, ``possible``); a scheduler's own record (Slurm's oom-kill
event, Kubernetes' OOMKilled or eviction, Ray's memory monitor, a time limit) explains a
SIGKILL at ``likely``; a torchrun agent that says it was signalled is ``external_signal``;
a record ties to the death only when both have a wall-clock time and they are close; a
message of the emitter catalog from a launcher's, a shell's, a scheduler's or the kernel's
lines decides what is still weak (``catalog_says``: likely at most unless it names the pid,
possible for a report of what happened elsewhere). When
the logs cannot decide, the rules say what to collect next time. Each rule returns what it
found (``_Told``: its verdict, the evidence it cites, what to collect) or None; ``logs_rules``
alone gathers it. The types the offline path fills from the logs' text (``LogRank``,
``LogRecords``, ``KernelRecords``) are ``logrecords``'.
"""

from __future__ import annotations

import signal as _signal
from dataclasses import dataclass

from sidecar.autopsy.evidence import EvidenceItem, Verdict, rank_name, signal_name
from sidecar.autopsy.logrecords import KernelRecords, LogRecords
from sidecar.autopsy.logwitnesses import (
    MEMORY_RECORDS,
    SOURCES,
    catalog_says,
    death_time,
    far,
    near,
    relayed_death,
    untied_oom,
    verdict_with,
)
from sidecar.model import Confidence, Kind
from sidecar.parse.jobs import JobRecord
from sidecar.parse.torchrun import DeathSignal
from sidecar.units import gib

__all__ = [
    "COLLECT_CGROUP",
    "COLLECT_DAEMON",
    "COLLECT_KERNEL",
    "COLLECT_RANK_LOGS",
    "logs_rules",
]


COLLECT_KERNEL = (
    "The kernel log of the node where the rank died, from around the death: "
    "`sudo dmesg -T | grep -iE 'killed process|oom-kill|out of memory|NVRM: Xid'` "
    "(or `journalctl -k --since '...'`); an OOM kill names the pid there."
)
COLLECT_CGROUP = (
    "The job's memory cgroup counters: `cat /sys/fs/cgroup/<job cgroup>/memory.events` (cgroup v2: "
    "oom_kill) or `memory.failcnt` and `memory.oom_control` (v1); in Kubernetes `kubectl describe pod` "
    "(Last State: OOMKilled), under Slurm `sacct -j JOBID -o JobID,State,MaxRSS,ReqMem`."
)
COLLECT_RANK_LOGS = (
    "The ranks' own output: run torchrun with `--log-dir DIR --redirects 3 --tee 3`, and decorate the "
    "entrypoint with `@record` (torch.distributed.elastic.multiprocessing.errors) so each rank's "
    "exception lands in its error file."
)
COLLECT_DAEMON = (
    "Run trainwatch during the job (`trainwatch run -- torchrun ...`, or `trainwatch --attach-torchrun` "
    "on the node): it sees exits, kernel records, cgroup counters and memory curves as they happen."
)


def _who(v: Verdict) -> str:
    return rank_name(v.victim.label, v.victim.pid, from_logs=True)


def logs_rules(
    v: Verdict, g: LogRecords, k: KernelRecords, kernel_given: bool, collect: list[str]
) -> Verdict:
    """What logs can and cannot say, on top of the autopsy's verdict: each rule of
    ``_LOG_RULES`` in order, the first that answers decides; else the verdict stands. What to
    collect next time goes into ``collect``."""
    who = _who(v)
    sigkill = v.victim.signal == _signal.SIGKILL or (v.victim.exit_code is None and v.kind == Kind.UNKNOWN)
    # an exit status alone read as Python's after an uncaught exception (no words cited) is as
    # weak as an unexplained signal: a launcher's or a shell's word on that status decides
    unsaid = v.kind == Kind.PYTHON_EXCEPTION and not any(
        e.source in ("output", "catalog") for e in v.evidence
    )
    weak = v.kind in (Kind.EXTERNAL_SIGNAL, Kind.UNKNOWN) or (
        v.kind in (Kind.ABORT, Kind.PYTHON_EXCEPTION)
        and v.confidence == Confidence.POSSIBLE
        and (v.kind == Kind.ABORT or unsaid)
    )
    c = _LogCase(v, g, k, kernel_given, who, sigkill, weak, {j.what: j for j in g.jobs}, death_time(v, g))
    for rule in _LOG_RULES:
        found = rule(c)
        if found is not None:
            collect.extend(found.collect)
            items = [*v.evidence, *found.items]
            return verdict_with(v, found.kind, found.confidence, found.summary, items, found.all_torn_down)
    if v.confidence == Confidence.POSSIBLE:
        collect += [COLLECT_KERNEL, COLLECT_RANK_LOGS]
    return v


@dataclass(frozen=True, slots=True)
class _LogCase:
    """The verdict the logs are asked about, and what every rule weighs: whether it is weak
    (an unexplained signal, an exit status alone) and a SIGKILL, the job's records by what
    they say, and the death's wall-clock time where a line gave it."""

    v: Verdict
    g: LogRecords
    k: KernelRecords
    kernel_given: bool
    who: str
    sigkill: bool
    weak: bool
    jobs: dict[str, JobRecord]
    death: float | None


@dataclass(frozen=True, slots=True)
class _Told:
    """What a rule for logs found when it answers: its verdict, the evidence it cites (after
    the autopsy's), what to collect next time, and whether every rank was torn down."""

    kind: Kind
    confidence: Confidence
    summary: str
    items: tuple[EvidenceItem, ...] = ()
    collect: tuple[str, ...] = ()
    all_torn_down: bool = False


def _agent_signalled(c: _LogCase) -> _Told | None:
    """torchrun's agent itself got the signal and shut every rank down with it."""
    g, weak = c.g, c.weak
    signalled = next((rec for rec in g.agent if isinstance(rec, DeathSignal)), None)
    if signalled is not None and weak:
        name = signal_name(signalled.signal) or "a signal"
        hint = " (the terminal or SSH session it ran in closed)" if signalled.signal == _signal.SIGHUP else ""
        # no sender told: SIGHUP, SIGINT are a terminal's, a person's (likely); a SIGTERM may
        # as well be an OOM daemon's or an eviction's (possible)
        return _Told(
            Kind.EXTERNAL_SIGNAL,
            Confidence.POSSIBLE if signalled.signal == _signal.SIGTERM else Confidence.LIKELY,
            f"The torchrun agent itself received {name}{hint} and shut every rank down with it; no rank "
            "failed on its own.",
            (EvidenceItem("torchrun", None, signalled.line),),
            all_torn_down=True,
        )
    return None


def _scheduler_record(c: _LogCase) -> _Told | None:
    """A scheduler's record of what ended the job: a memory kill, its policy, an eviction, a
    time limit, a preemption, a cancel."""
    v, who, sigkill, weak, jobs = c.v, c.who, c.sigkill, c.weak, c.jobs
    if weak and (sigkill or v.victim.exit_code is None):
        for what, kind, text in (
            (
                "oom_cgroup",
                Kind.CGROUP_OOM,
                "{src} reports an out-of-memory kill{scope}: {who} was killed by that "
                "memory limit (the record names the {unit}, not the pid).",
            ),
            (
                "memory_policy",
                Kind.USERSPACE_OOM,
                "{src}'s own memory accounting found the step over its limit and killed it{scope}: {who} "
                "was killed by the scheduler's policy (its polling, not the kernel's cgroup limit).",
            ),
            (
                "eviction",
                Kind.USERSPACE_OOM,
                "Kubernetes evicted the pod because the node ran low on memory: "
                "the kubelet ended {who} (a scheduler's memory policy, before the kernel's OOM killer).",
            ),
            (
                "memory_monitor",
                Kind.USERSPACE_OOM,
                "Ray's memory monitor killed {who}'s worker as the node "
                "crossed its memory-usage threshold (RAY_memory_usage_threshold).",
            ),
            (
                "time_limit",
                Kind.EXTERNAL_SIGNAL,
                "Slurm ended the job at its time limit: {who} was killed with the rest of the step.",
            ),
            (
                "preempted",
                Kind.EXTERNAL_SIGNAL,
                "Slurm preempted the job: {who} was killed with the rest of it.",
            ),
            ("node_failure", Kind.EXTERNAL_SIGNAL, "Slurm cancelled the job after a node failure."),
            (
                "cancelled",
                Kind.EXTERNAL_SIGNAL,
                "The scheduler cancelled the job{scope}: {who} was killed with it.",
            ),
        ):
            job = jobs.get(what)
            if job is None:
                continue
            src = SOURCES.get(job.source, job.source)
            unit = {"slurm": "step", "kubernetes": "container", "docker": "container"}.get(
                job.source, "cgroup"
            )
            scope = f" in {job.scope}" if job.scope else ""
            said = text.format(src=src, scope=scope, who=who, unit=unit)
            return _Told(kind, Confidence.LIKELY, said, (EvidenceItem(job.source, None, job.line),))
    return None


def _relayed_memory_kill(c: _LogCase) -> _Told | None:
    """An exception that only relays another process's abrupt death, beside the job's memory kill."""
    v, g, who, jobs = c.v, c.g, c.who, c.jobs
    relay = relayed_death(v, g)
    memory = next((jobs[w] for w in MEMORY_RECORDS if w in jobs), None)
    if relay is not None and memory is not None:
        # the exception only relays that a worker, an actor or a child died abruptly: the
        # job's memory killer, which kills without a word to the process, is why
        scope = f" in {memory.scope}" if memory.scope else ""
        return _Told(
            MEMORY_RECORDS[memory.what],
            Confidence.LIKELY,
            f"{who} ended on an exception that only relays another process's abrupt death "
            f"({relay.strip()[:160]}), and {SOURCES.get(memory.source, memory.source)} reports "
            f"a memory kill{scope}: that process was most likely killed for memory (the record "
            "names no pid).",
            (EvidenceItem("output", None, relay), EvidenceItem(memory.source, None, memory.line)),
        )
    return None


def _untied_oom_record(c: _LogCase) -> _Told | None:
    """A kernel OOM record near the death that does not name the rank's pid."""
    v, g, k, who, sigkill, weak, death = c.v, c.g, c.k, c.who, c.sigkill, c.weak, c.death
    untied = untied_oom(v, g, k) if weak and sigkill else None
    if untied is not None and not far(k.oom_at.get(untied[0].pid), death):
        oom, why = untied
        memcg = oom.scope == "memcg" or oom.oom_memcg is not None
        return _Told(
            Kind.CGROUP_OOM if memcg else Kind.KERNEL_OOM,
            Confidence.LIKELY if near(k.oom_at.get(oom.pid), death) else Confidence.POSSIBLE,
            f"{who} was SIGKILLed and the kernel's OOM killer killed pid {oom.pid} ({oom.comm})"
            + (f" for the limit of memory cgroup {oom.oom_memcg}" if oom.oom_memcg else "")
            + why,
            tuple(EvidenceItem("kmsg", None, line) for line in oom.lines),
        )
    return None


def _userspace_near(c: _LogCase) -> _Told | None:
    """A userspace OOM daemon's kill near the death."""
    v, g, who, sigkill, weak, death = c.v, c.g, c.who, c.sigkill, c.weak, c.death
    near_kills = [u for u, at in zip(g.userspace, g.userspace_at, strict=True) if near(at, death)]
    if weak and near_kills and (sigkill or v.victim.exit_code is None):
        u = near_kills[0]
        return _Told(
            Kind.USERSPACE_OOM,
            Confidence.LIKELY,
            f"The userspace OOM daemon {u.daemon} killed "
            + (f"cgroup {u.cgroup}" if u.cgroup else f"pid {u.pid}")
            + f", and {who} died by it (its record names the "
            + ("cgroup" if u.cgroup else "pid")
            + ", the logs do not tie it to the rank).",
            (EvidenceItem(u.daemon, None, u.detail),),
        )
    return None


def _partial_oom_record(c: _LogCase) -> _Told | None:
    """A kernel OOM record cut off before it names its victim."""
    v, k, sigkill, weak = c.v, c.k, c.sigkill, c.weak
    if weak and k.partial and (sigkill or v.victim.exit_code is None):
        constraint, line = k.partial[0]
        items = [EvidenceItem("kmsg", None, line.text)]
        biggest = max(k.tasks.items(), key=lambda kv: kv[1][0]) if k.tasks else None
        size = ""
        if biggest is not None:
            pid, (pages, comm) = biggest
            rss = k.task_rss_bytes(pid)
            size = (
                f"{gib(rss)} RSS"
                if rss is not None
                else f"{pages} pages RSS (the record does not tell their size)"
            )
            items.append(
                EvidenceItem("kmsg", None, f"task table: largest process {comm} (pid {pid}), {size}")
            )
        memcg = constraint == "CONSTRAINT_MEMCG"
        tail = (
            f"; the largest process in its task table was {biggest[1][1]} (pid {biggest[0]}) with {size}"
            if biggest
            else ""
        )
        return _Told(
            Kind.CGROUP_OOM if memcg else Kind.KERNEL_OOM,
            Confidence.LIKELY,
            ("A memory cgroup's limit" if memcg else "The machine running out of memory")
            + f" made the kernel's OOM killer act ({constraint}), but the record is cut off before it names "
            f"the victim{tail}.",
            tuple(items),
        )
    return None


def _catalog_told(c: _LogCase) -> _Told | None:
    """A catalog message in the job's lines that tells what ended the rank."""
    v, g, k, who, weak, death = c.v, c.g, c.k, c.who, c.weak, c.death
    told = catalog_says(v, g, k, death) if weak else None
    if told is not None:
        hit, confidence = told
        m = hit.message
        items = (
            EvidenceItem(m.emitter, None, hit.line),
            EvidenceItem("catalog", None, f"{m.id}: {m.mechanism}"),
        )
        return _Told(m.kind or Kind.UNKNOWN, confidence, m.told(who, hit.fields), items)
    return None


def _shm_unmeasured(c: _LogCase) -> _Told | None:
    """A DataLoader worker's bus error blamed on /dev/shm, which only the daemon can measure."""
    v, who = c.v, c.who
    if v.kind == Kind.BUS_ERROR and v.facts.shm_exhausted:
        # the DataLoader's message guesses /dev/shm; only the daemon can measure it
        return _Told(
            Kind.BUS_ERROR,
            Confidence.POSSIBLE,
            f"{who}: a DataLoader worker died of SIGBUS. Its message blames shared memory (/dev/shm), "
            "the usual "
            "cause, but these logs do not show /dev/shm's size or use (a memory-mapped file on a failing "
            "volume does the same).",
            collect=(
                "The size and use of /dev/shm where the job ran: `df -h /dev/shm` (in Docker, --shm-size).",
            ),
        )
    return None


def _sigkill_unexplained(c: _LogCase) -> _Told | None:
    """A SIGKILL no record explains: unknown without the kernel log, from outside with it."""
    v, g, kernel_given, who = c.v, c.g, c.kernel_given, c.who
    if v.kind == Kind.EXTERNAL_SIGNAL and v.victim.signal == _signal.SIGKILL:
        low = [j for j in g.jobs if j.what == "memory_usage" and j.value is not None and j.value < 60]
        if not kernel_given:
            return _Told(
                Kind.UNKNOWN,
                Confidence.POSSIBLE,
                f"{who} was killed by SIGKILL and these logs do not say by whom. Most often that is the "
                "kernel's OOM killer (the machine or a container/cgroup limit out of memory), "
                "else a scheduler "
                "or a person"
                + (f"; the last host-memory reading was only {low[-1].value:g}% used" if low else "")
                + ". The kernel log decides.",
                (EvidenceItem(low[-1].source, None, low[-1].line),) if low else (),
                (COLLECT_KERNEL, COLLECT_CGROUP),
            )
        return _Told(
            Kind.EXTERNAL_SIGNAL,
            Confidence.POSSIBLE,
            f"{who} was killed by SIGKILL, and the kernel log given has no OOM record naming it: if that log "
            "covers this node at the time of the death, the kill came from outside (a scheduler, a person, "
            "a container runtime enforcing its limit, a userspace OOM daemon).",
            (
                EvidenceItem(
                    "kmsg",
                    None,
                    "no OOM record in the kernel log given names "
                    + (f"pid {v.victim.pid}" if v.victim.pid else "a process of this death"),
                ),
            ),
            (COLLECT_CGROUP,),
        )
    return None


def _unknown(c: _LogCase) -> _Told | None:
    """Neither how nor why: what the logs do hold, and what would decide."""
    v, g, who, jobs = c.v, c.g, c.who, c.jobs
    if v.kind == Kind.UNKNOWN:
        items: list[EvidenceItem] = []
        context = []
        ds = [j for j in g.jobs if j.source == "deepspeed" and j.what == "teardown"]
        if ds:
            items.append(EvidenceItem("deepspeed", None, ds[0].line))
            context.append(
                "DeepSpeed's launcher killed its workers (its sigkill_handler runs when any worker fails); "
                "which worker failed first, and why, is not in them"
            )
        ray = jobs.get("worker_died")
        if ray is not None:
            items.append(EvidenceItem("ray", None, ray.line))
            context.append(
                "Ray says the worker died unexpectedly and lists the OOM killer, `ray stop` or a crash as "
                "possible causes; nothing here tells which"
            )
        low = [j for j in g.jobs if j.what == "memory_usage" and j.value is not None]
        if low:
            items.append(EvidenceItem(low[-1].source, None, low[-1].line))
            context.append(f"the last host-memory reading was {low[-1].value:g}% used")
        return _Told(
            Kind.UNKNOWN,
            Confidence.POSSIBLE,
            f"{who} ended, and these logs say neither how nor why"
            + ("; " + "; ".join(context) if context else "")
            + ". The kernel log and the ranks' own output decide.",
            tuple(items),
            (COLLECT_KERNEL, COLLECT_RANK_LOGS),
        )
    return None


_LOG_RULES = (
    _agent_signalled,
    _scheduler_record,
    _relayed_memory_kill,
    _untied_oom_record,
    _userspace_near,
    _partial_oom_record,
    _catalog_told,
    _shm_unmeasured,
    _sigkill_unexplained,
    _unknown,
)
