"""The rules for logs, on top of the autopsy's verdict (``trainwatch diagnose``): what
logs can say and cannot. A SIGKILL nothing explains is ``unknown`` unless a kernel log was
given (then ``external_signal``, ``possible``); a scheduler's own record (Slurm's oom-kill
event, Kubernetes' OOMKilled or eviction, Ray's memory monitor, a time limit) explains a
SIGKILL at ``likely``; a torchrun agent that says it was signalled is ``external_signal``;
a record ties to the death only when both have a wall-clock time and they are close; a
message of the emitter catalog from a launcher's, a shell's, a scheduler's or the kernel's
lines decides what is still weak (``_catalog_says``: likely at most unless it names the pid,
possible for a report of what happened elsewhere). When
the logs cannot decide, the rules say what to collect next time. The types the offline path
fills from the logs' text (``LogRank``, ``LogRecords``, ``KernelRecords``) are ``logrecords``'.
"""

from __future__ import annotations

import signal as _signal
from pathlib import PurePosixPath

from sidecar.autopsy.evidence import EvidenceItem, KernelOom, Verdict, rank_name, signal_name
from sidecar.autopsy.logrecords import KernelRecords, LogRecords
from sidecar.autopsy.ranking import told_of
from sidecar.catalog import Hit
from sidecar.model import Confidence, Fate, Kind
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
    """What logs can and cannot say, on top of the autopsy's verdict."""
    who = _who(v)
    items = list(v.evidence)
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
    signalled = next((rec for rec in g.agent if isinstance(rec, DeathSignal)), None)
    if signalled is not None and weak:
        name = signal_name(signalled.signal) or "a signal"
        items.append(EvidenceItem("torchrun", None, signalled.line))
        hint = " (the terminal or SSH session it ran in closed)" if signalled.signal == _signal.SIGHUP else ""
        # no sender told: SIGHUP, SIGINT are a terminal's, a person's (likely); a SIGTERM may
        # as well be an OOM daemon's or an eviction's (possible)
        return _with(
            v,
            Kind.EXTERNAL_SIGNAL,
            Confidence.POSSIBLE if signalled.signal == _signal.SIGTERM else Confidence.LIKELY,
            f"The torchrun agent itself received {name}{hint} and shut every rank down with it; no rank "
            "failed on its own.",
            items,
            all_torn_down=True,
        )
    jobs = {j.what: j for j in g.jobs}
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
            items.append(EvidenceItem(job.source, None, job.line))
            src = _SOURCES.get(job.source, job.source)
            unit = {"slurm": "step", "kubernetes": "container", "docker": "container"}.get(
                job.source, "cgroup"
            )
            scope = f" in {job.scope}" if job.scope else ""
            return _with(
                v, kind, Confidence.LIKELY, text.format(src=src, scope=scope, who=who, unit=unit), items
            )
    relay = _relayed_death(v, g)
    memory = next((jobs[w] for w in _MEMORY_RECORDS if w in jobs), None)
    if relay is not None and memory is not None:
        # the exception only relays that a worker, an actor or a child died abruptly: the
        # job's memory killer, which kills without a word to the process, is why
        items += [EvidenceItem("output", None, relay), EvidenceItem(memory.source, None, memory.line)]
        scope = f" in {memory.scope}" if memory.scope else ""
        return _with(
            v,
            _MEMORY_RECORDS[memory.what],
            Confidence.LIKELY,
            f"{who} ended on an exception that only relays another process's abrupt death "
            f"({relay.strip()[:160]}), and {_SOURCES.get(memory.source, memory.source)} reports "
            f"a memory kill{scope}: that process was most likely killed for memory (the record "
            "names no pid).",
            items,
        )
    death = _death_time(v, g)
    untied = _untied_oom(v, g, k) if weak and sigkill else None
    if untied is not None and not _far(k.oom_at.get(untied[0].pid), death):
        oom, why = untied
        items += [EvidenceItem("kmsg", None, line) for line in oom.lines]
        memcg = oom.scope == "memcg" or oom.oom_memcg is not None
        return _with(
            v,
            Kind.CGROUP_OOM if memcg else Kind.KERNEL_OOM,
            Confidence.LIKELY if _near(k.oom_at.get(oom.pid), death) else Confidence.POSSIBLE,
            f"{who} was SIGKILLed and the kernel's OOM killer killed pid {oom.pid} ({oom.comm})"
            + (f" for the limit of memory cgroup {oom.oom_memcg}" if oom.oom_memcg else "")
            + why,
            items,
        )
    near_kills = [u for u, at in zip(g.userspace, g.userspace_at, strict=True) if _near(at, death)]
    if weak and near_kills and (sigkill or v.victim.exit_code is None):
        u = near_kills[0]
        items.append(EvidenceItem(u.daemon, None, u.detail))
        return _with(
            v,
            Kind.USERSPACE_OOM,
            Confidence.LIKELY,
            f"The userspace OOM daemon {u.daemon} killed "
            + (f"cgroup {u.cgroup}" if u.cgroup else f"pid {u.pid}")
            + f", and {who} died by it (its record names the "
            + ("cgroup" if u.cgroup else "pid")
            + ", the logs do not tie it to the rank).",
            items,
        )
    if weak and k.partial and (sigkill or v.victim.exit_code is None):
        constraint, line = k.partial[0]
        items.append(EvidenceItem("kmsg", None, line.text))
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
        return _with(
            v,
            Kind.CGROUP_OOM if memcg else Kind.KERNEL_OOM,
            Confidence.LIKELY,
            ("A memory cgroup's limit" if memcg else "The machine running out of memory")
            + f" made the kernel's OOM killer act ({constraint}), but the record is cut off before it names "
            f"the victim{tail}.",
            items,
        )
    told = _catalog_says(v, g, k, death) if weak else None
    if told is not None:
        hit, confidence = told
        m = hit.message
        items.append(EvidenceItem(m.emitter, None, hit.line))
        items.append(EvidenceItem("catalog", None, f"{m.id}: {m.mechanism}"))
        return _with(v, m.kind or Kind.UNKNOWN, confidence, m.told(who, hit.fields), items)
    if v.kind == Kind.BUS_ERROR and v.facts.shm_exhausted:
        # the DataLoader's message guesses /dev/shm; only the daemon can measure it
        collect.append(
            "The size and use of /dev/shm where the job ran: `df -h /dev/shm` (in Docker, --shm-size)."
        )
        return _with(
            v,
            Kind.BUS_ERROR,
            Confidence.POSSIBLE,
            f"{who}: a DataLoader worker died of SIGBUS. Its message blames shared memory (/dev/shm), "
            "the usual "
            "cause, but these logs do not show /dev/shm's size or use (a memory-mapped file on a failing "
            "volume does the same).",
            items,
        )
    if v.kind == Kind.EXTERNAL_SIGNAL and v.victim.signal == _signal.SIGKILL:
        low = [j for j in g.jobs if j.what == "memory_usage" and j.value is not None and j.value < 60]
        if not kernel_given:
            collect += [COLLECT_KERNEL, COLLECT_CGROUP]
            if low:
                items.append(EvidenceItem(low[-1].source, None, low[-1].line))
            return _with(
                v,
                Kind.UNKNOWN,
                Confidence.POSSIBLE,
                f"{who} was killed by SIGKILL and these logs do not say by whom. Most often that is the "
                "kernel's OOM killer (the machine or a container/cgroup limit out of memory), "
                "else a scheduler "
                "or a person"
                + (f"; the last host-memory reading was only {low[-1].value:g}% used" if low else "")
                + ". The kernel log decides.",
                items,
            )
        items.append(
            EvidenceItem(
                "kmsg",
                None,
                "no OOM record in the kernel log given names "
                + (f"pid {v.victim.pid}" if v.victim.pid else "a process of this death"),
            )
        )
        collect.append(COLLECT_CGROUP)
        return _with(
            v,
            Kind.EXTERNAL_SIGNAL,
            Confidence.POSSIBLE,
            f"{who} was killed by SIGKILL, and the kernel log given has no OOM record naming it: if that log "
            "covers this node at the time of the death, the kill came from outside (a scheduler, a person, "
            "a container runtime enforcing its limit, a userspace OOM daemon).",
            items,
        )
    if v.kind == Kind.UNKNOWN:
        collect += [COLLECT_KERNEL, COLLECT_RANK_LOGS]
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
        return _with(
            v,
            Kind.UNKNOWN,
            Confidence.POSSIBLE,
            f"{who} ended, and these logs say neither how nor why"
            + ("; " + "; ".join(context) if context else "")
            + ". The kernel log and the ranks' own output decide.",
            items,
        )
    if v.confidence == Confidence.POSSIBLE:
        collect += [COLLECT_KERNEL, COLLECT_RANK_LOGS]
    return v


# a scheduler's or a memory daemon's record of a memory kill in the job, and its killer
_MEMORY_RECORDS = {
    "oom_cgroup": Kind.CGROUP_OOM,
    "memory_policy": Kind.USERSPACE_OOM,
    "eviction": Kind.USERSPACE_OOM,
    "memory_monitor": Kind.USERSPACE_OOM,
}
_SOURCES = {"slurm": "Slurm", "kubernetes": "Kubernetes", "docker": "Docker"}  # a record's source, named


def _relayed_death(v: Verdict, g: LogRecords) -> str | None:
    """The line that relays another process's abrupt death (a Ray actor or worker, a
    DataLoader worker: the catalog's ``relays_death``), in the victim's output, output that
    names no rank, or a launcher's lines, where the victim ended on an exception: the
    exception is that report, not a cause of its own."""
    if v.kind != Kind.PYTHON_EXCEPTION:
        return None
    label = v.victim.label
    for lab, f in g.findings:
        if lab not in (None, label):
            continue
        if f.kind == "said" and f.get("relays_death") == "1":
            return f.line
        # torch's own words for a DataLoader worker's death: by SIGKILL ("Killed", strsignal's
        # word) or with no status at all ("exited unexpectedly")
        if f.kind == "dataloader_killed" and f.get("signal") in (None, "Killed"):
            return f.line
    return g.relayed[0] if g.relayed else None


def _untied_oom(v: Verdict, g: LogRecords, k: KernelRecords) -> tuple[KernelOom, str] | None:
    """The kernel's OOM kill a SIGKILLed victim's logs give no pid to tie to it, and why it
    is the victim's all the same: the only one, where the launcher gave no pid (DeepSpeed,
    accelerate); or the only one of the command's name, where the shell's pid is its number
    in a container's pid namespace and the kernel's is the host's."""
    if not v.victim.pid:
        if len(k.ooms) == 1:
            return k.ooms[0], "; the launcher's log gives no pid to tie that kill to the rank."
        return None
    namesake = _namesake(v, g, k)
    if namesake is None:
        return None
    return namesake, (
        f": the only OOM kill of a process of that name; pid {v.victim.pid} is its number in another "
        "pid namespace (a container's), the kernel's is the host's."
    )


def _namesake(v: Verdict, g: LogRecords, k: KernelRecords) -> KernelOom | None:
    """The one kernel OOM kill whose process has the name of the command the logs say the
    victim's pid ran (a shell's ``943 Killed  /usr/bin/python3 train.py``), when no OOM
    kill names that pid: the kernel's comm is the first 15 characters of the name the
    program was run by. None when several kills have that name, or none does."""
    pid = str(v.victim.pid)
    commands = {
        hit.get("command") or ""
        for hit, _ in (*g.exits, *g.said)
        if hit.get("pid") == pid and hit.get("command")
    }
    names = {PurePosixPath(c.split()[0]).name[:15] for c in commands if c.split()}
    if len(names) != 1 or any(o.pid == v.victim.pid for o in k.ooms):
        return None
    same = [o for o in k.ooms if o.comm == next(iter(names))]
    return same[0] if len(same) == 1 else None


def _catalog_says(
    v: Verdict, g: LogRecords, k: KernelRecords, death: float | None
) -> tuple[Hit, Confidence] | None:
    """The message of a launcher, the kernel, a shell or a scheduler that decides how the
    victim died (``said.told_of``), among those not far in time from the death. A kernel
    record that names no process (an OOM report's call trace) belongs to one of the kills
    the log names, and none of them is this rank's."""
    near = [
        hit
        for hit, at in g.said
        if not _far(at, death) and not (hit.message.channel == "kernel" and hit.get("pid") is None and k.ooms)
    ]
    return told_of(near, v.victim.pid, v.victim.signal, v.victim.status)


def _death_time(v: Verdict, g: LogRecords) -> float | None:
    """The victim's death on the wall clock, where a line gave it."""
    return g.death_at.get(v.victim.label)


def _near(at: float | None, death: float | None, window: float = 120.0) -> bool:
    """A record ties to the death only when both have a wall-clock time and they are close:
    a kernel log or a journal can hold a day of other kills."""
    return at is not None and death is not None and abs(at - death) <= window


def _far(at: float | None, death: float | None, window: float = 120.0) -> bool:
    return at is not None and death is not None and abs(at - death) > window


def _with(
    v: Verdict,
    kind: Kind,
    confidence: Confidence,
    summary: str,
    items: list[EvidenceItem],
    all_torn_down: bool = False,
) -> Verdict:
    fates = dict(v.fates)
    if all_torn_down:
        fates = {label: Fate.TERMINATED_BY_AGENT for label in fates}
    return Verdict(v.victim, kind, confidence, summary, tuple(items), fates, v.oom)
