"""Diagnose after the fact: the daemon's verdict from logs alone (``trainwatch diagnose``).

Every input is read whole (the last ``MAX_BYTES`` of a bigger file) and every parser runs
on all of it, so a file's kind comes from what it holds, not its name, and a file that
mixes the agent's lines, the ranks' tracebacks and a pasted ``dmesg`` is read for all
three. From the records:

* the ranks: the agent's failure table and ``failed (exitcode: N)`` line, its closing
  signals (those ranks it tore down), DeepSpeed's and other launchers' exit lines, a
  shell's ``8156 Killed``; ranks a ``[rankN]:`` line names; torn-down pids get the local
  rank their place in a run of consecutive pids gives, said as inferred;
* the kernel's OOM records (any timestamp style, wrapped lines joined), its task table
  (each rank's RSS), ``N pages RAM``, NVRM Xids; schedulers', containers', Ray's and
  userspace OOM daemons' records.

The pid is the link: a kernel record naming a rank's pid is that rank's death, whatever
the clocks say. Then the same autopsy as the daemon's runs, and the rules for logs
follow: a SIGKILL nothing explains is ``unknown`` unless a kernel log was given (then
``external_signal``, ``possible``); a scheduler's own record (Slurm's oom-kill event,
Kubernetes' OOMKilled or eviction, Ray's memory monitor, a time limit) explains a SIGKILL
at ``likely``; a torchrun agent that says it was signalled is ``external_signal``. When
the logs cannot decide, the document lists what to collect next time.
"""

from __future__ import annotations

import os
import re
import signal as _signal
import socket
import sys
import time
from dataclasses import dataclass, field, replace
from typing import Any, BinaryIO

from sidecar.advice import advice
from sidecar.autopsy import (
    Evidence,
    EvidenceItem,
    KernelOom,
    RankState,
    UserspaceKill,
    Verdict,
    autopsy,
    rank_name,
    signal_name,
)
from sidecar.model import Confidence, Fate, Kind, wait_status_from_returncode
from sidecar.oom import OomFold
from sidecar.parse.jobs import JobRecord, parse_job_line
from sidecar.parse.kernel import (
    OomKill,
    OomMemcgLimit,
    OomSummary,
    XidRecord,
    parse_oom_line,
    parse_xid_line,
)
from sidecar.parse.logs import KernelLine, kernel_lines, line_time, parse_task_row
from sidecar.parse.oomd import parse_userspace_oom_line
from sidecar.parse.ranks import Finding, line_stamp, parse_rank_output, stamp_to_epoch
from sidecar.parse.torchrun import (
    ClosingSignal,
    DeathSignal,
    FailureEntry,
    WorkerFailed,
    parse_agent_text,
)
from sidecar.postmortem.document import Cited, HostAtDeath, JobInfo, Parts, RankRow, Victim, build, make_id

__all__ = ["DiagnoseError", "LogInput", "diagnose", "read_inputs"]

MAX_BYTES = 64 << 20  # of each input, the tail that is read
PAGE = 4096
S = 10**9


class DiagnoseError(Exception):
    """An input that cannot be read: one line, exit status 2."""


@dataclass(frozen=True, slots=True)
class LogInput:
    name: str
    text: str
    truncated: bool = False


_CONTROL = bytes(b for b in range(32) if b not in (9, 10, 12, 13, 27))


def _decode(name: str, data: bytes, truncated: bool) -> LogInput:
    text = data.decode("utf-8", "replace")
    sample = data[: 1 << 16]
    odd = len(sample) - len(sample.translate(None, _CONTROL)) + text[: 1 << 16].count("\ufffd")
    if sample and odd > len(sample) // 10:
        raise DiagnoseError(f"{name}: not a text log (binary data)")
    return LogInput(name, text, truncated)


def read_inputs(paths: list[str], stdin: BinaryIO | None = None) -> list[LogInput]:
    """Each path's text, ``-`` for standard input. Raises DiagnoseError for the first one
    that cannot be read."""
    out = []
    for path in paths or ["-"]:
        if path == "-":
            stream = stdin if stdin is not None else sys.stdin.buffer
            data = stream.read()
            truncated = len(data) > MAX_BYTES
            out.append(_decode("<stdin>", data[-MAX_BYTES:], truncated))
            continue
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size > MAX_BYTES:
                    f.seek(size - MAX_BYTES)
                data = f.read(MAX_BYTES)
        except IsADirectoryError:
            raise DiagnoseError(f"{path}: is a directory (give the log files in it)") from None
        except OSError as exc:
            raise DiagnoseError(f"{path}: {exc.strerror or exc}") from None
        out.append(_decode(path, data, size > MAX_BYTES))
    return out


# -- what the inputs hold -------------------------------------------------------------


@dataclass(slots=True)
class _Rank:
    rank: int | None = None
    local_rank: int | None = None
    pid: int | None = None
    returncode: int | None = None  # torchrun's: -N for signal N, else the exit status
    at: float | None = None  # epoch seconds, when a line gave it
    first: bool = False  # the agent's "Root Cause (first observed failure)", or its "failed" line
    torn_down: bool = False
    inferred_local: bool = False
    inferred_rank: bool = False
    lines: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        if self.rank is not None:
            return str(self.rank)
        if self.local_rank is not None:
            return f"local{self.local_rank}"
        return f"pid{self.pid}" if self.pid is not None else "?"


@dataclass(slots=True)
class _Gathered:
    kinds: dict[str, list[str]]
    agent: list[Any]
    findings: list[tuple[str | None, Finding]]
    kernel: list[KernelLine]
    jobs: list[JobRecord]
    userspace: list[UserspaceKill]
    output_read: bool
    host: str | None = None
    userspace_at: list[float | None] = field(default_factory=list)  # each userspace kill's line time
    death_at: dict[str, float] = field(default_factory=dict)  # rank label -> its death, where known


_TABLE_TIME = re.compile(r"time\s*:?\s*(\d{4})-(\d\d)-(\d\d)[_ ](\d\d):(\d\d):(\d\d)")
_HOST = re.compile(r"^\s*host\s*:\s*(\S+)", re.M)
_GENERATION = (
    (re.compile(r"^(?:WARNING|ERROR|INFO):torch\.distributed", re.M), "torch 1.9-2.0"),
    (re.compile(r"^\[\d{4}-\d\d-\d\d [\d:,]+\] torch\.distributed\.elastic", re.M), "torch 2.1-2.3"),
    (re.compile(r"^[IWEF]\d{4} [\d:.]+ \d+ \S*torch/distributed/", re.M), "torch 2.4+"),
)


def _gather(inputs: list[LogInput]) -> _Gathered:
    g = _Gathered({}, [], [], [], [], [], False)
    for inp in inputs:
        kinds: list[str] = []
        text = inp.text
        agent = parse_agent_text(text)
        if agent:
            gen = next((name for rx, name in _GENERATION if rx.search(text)), None)
            kinds.append("torchrun agent" + (f" ({gen})" if gen else ""))
            g.agent += agent
            host = _HOST.search(text)
            if host and g.host is None:
                g.host = host[1]
        found = parse_rank_output(text)
        if found:
            kinds.append("rank output")
            g.output_read = True
        g.findings += [(None, f) for f in found]
        klines = kernel_lines(text)
        if klines:
            styles = sorted({k.style for k in klines if k.style != "bare"})
            kinds.append("kernel log" + (f" ({', '.join(styles)})" if styles else ""))
            g.kernel += klines
            if g.host is None:
                g.host = next((k.host for k in klines if k.host), None)
        sources: set[str] = set()
        for line in text.splitlines():
            rec = parse_job_line(line)
            if rec is not None:
                g.jobs.append(rec)
                sources.add(rec.source)
            if "oom" in line.lower() or "earlyoom" in line:
                u = parse_userspace_oom_line(line)
                if u is not None:
                    g.userspace.append(
                        UserspaceKill(u.daemon, u.pid, u.cgroup, u.signal, None, u.text, "log")
                    )
                    g.userspace_at.append(line_time(line))
                    sources.add(u.daemon)
        kinds += sorted(sources)
        if inp.truncated:
            kinds.append(f"(its last {MAX_BYTES >> 20} MiB read)")
        g.kinds[inp.name] = kinds or ["nothing recognised"]
    return g


def _ranks(g: _Gathered) -> tuple[list[_Rank], list[EvidenceItem]]:
    """The ranks the logs name, merged by pid (then by rank, then by local rank)."""
    ranks: list[_Rank] = []
    notes: list[EvidenceItem] = []

    def get(pid: int | None, rank: int | None = None, local: int | None = None) -> _Rank:
        for r in ranks:
            if (
                (pid is not None and r.pid == pid)
                or (pid is None and rank is not None and r.rank == rank)
                or (pid is None and rank is None and local is not None and r.local_rank == local)
            ):
                break
        else:
            r = _Rank(pid=pid)
            ranks.append(r)
        if rank is not None:
            r.rank = rank
        if local is not None:
            r.local_rank = local
        if r.pid is None:
            r.pid = pid
        return r

    for rec in g.agent:
        if isinstance(rec, FailureEntry):
            r = get(rec.pid, rec.rank, rec.local_rank)
            r.returncode = rec.exitcode
            r.first = r.first or rec.root_cause
            m = _TABLE_TIME.search(f"time : {rec.time}" if rec.time else "")
            if m:
                r.at = time.mktime((*(int(m[i]) for i in range(1, 7)), 0, 0, -1))  # type: ignore[arg-type]
            r.lines.append(f"exitcode {rec.exitcode} (pid {rec.pid}): {rec.traceback or ''}".strip())
        elif isinstance(rec, WorkerFailed):
            r = get(rec.pid, None, rec.local_rank)
            r.returncode = rec.exitcode
            r.first = True
            r.lines.append(rec.line)
            r.at = r.at or _when(rec.line)  # when the agent noticed: within its monitor interval
        elif isinstance(rec, ClosingSignal):
            r = get(rec.pid)
            r.torn_down = True
            if r.returncode is None and rec.signal is not None:
                r.returncode = -rec.signal
            r.lines.append(rec.line)
    for job in g.jobs:
        if job.source == "deepspeed" and job.what == "teardown":
            r = get(job.pid)
            r.torn_down = True
            r.lines.append(job.line)
        elif job.what in ("exit_signal", "exit_code") and job.source in ("deepspeed", "launcher", "slurm"):
            r = get(None, None, job.local_rank) if job.local_rank is not None else get(None)
            r.returncode = -job.signal if job.signal else job.exit_code
            r.first = True
            r.lines.append(job.line)
            r.at = r.at or _when(job.line)
        elif job.what == "killed_by_shell" and job.pid is not None:
            r = get(job.pid)
            r.returncode = -(job.signal or 9)
            r.lines.append(job.line)
    # ranks whose own lines name them (the watchdog's [Rank N], a [rankN]: prefix). A global
    # rank no table gave, on a rank whose local rank is the same number, is taken to be it
    # (true on one node; said as inferred, so never certain)
    for _, f in g.findings:
        if f.rank is None or any(r.rank == f.rank for r in ranks):
            continue
        same = [r for r in ranks if r.rank is None and r.local_rank == f.rank]
        if len(same) == 1 and not any(r.rank is not None for r in ranks):
            same[0].rank, same[0].inferred_rank = f.rank, True
            notes.append(
                EvidenceItem(
                    "inference",
                    None,
                    f"the [rank{f.rank}] lines taken to be local rank {f.rank}'s (true when the job ran on "
                    "one node)",
                )
            )
        else:
            ranks.append(_Rank(rank=f.rank, local_rank=f.local_rank))
    # torn-down pids in one run of consecutive pids with a rank whose local rank is known:
    # torchrun starts the workers in local-rank order
    anchors = [r for r in ranks if r.local_rank is not None and r.pid is not None]
    if anchors:
        base = anchors[0].local_rank, anchors[0].pid
        for r in ranks:
            if r.local_rank is None and r.pid is not None and r.torn_down:
                local = base[0] + (r.pid - base[1])  # type: ignore[operator]
                if 0 <= local < 64 and not any(o.local_rank == local for o in ranks):
                    r.local_rank, r.inferred_local = local, True
        if any(r.inferred_local for r in ranks):
            notes.append(
                EvidenceItem(
                    "inference",
                    None,
                    "local ranks of the torn-down pids inferred from their place in the run of "
                    "consecutive pids "
                    f"(local rank {base[0]} is pid {base[1]})",
                )
            )
    return ranks, notes


def _when(line: str) -> float | None:
    """A line's own wall-clock time: a syslog/ISO/DeepSpeed stamp, else glog's (no year:
    the one nearest now)."""
    at = line_time(line)
    if at is None:
        stamp = line_stamp(line.strip())
        at = stamp_to_epoch(stamp, time.time(), 400 * 86400) if stamp else None
    return at


@dataclass(slots=True)
class _Kernel:
    ooms: list[KernelOom]
    partial: list[tuple[str, KernelLine]]  # (constraint, line): summaries cut before the pid
    tasks: dict[int, tuple[int, str]]  # pid -> (rss bytes, comm) from the OOM report's table
    xids: list[tuple[KernelLine, XidRecord]]
    host_total: int | None
    oom_at: dict[int, float] = field(default_factory=dict)  # pid -> wall time of its kill line


_PARTIAL = re.compile(r"oom-kill:constraint=(CONSTRAINT_[A-Z]+)")
_PAGES_RAM = re.compile(r"^(\d+) pages RAM$")


def _kernel(lines: list[KernelLine]) -> _Kernel:
    k = _Kernel([], [], {}, [], None)
    fold = OomFold()  # every line at time 0: the records of one pid are one kill
    for line in lines:
        parsed = parse_oom_line(line.text)
        if isinstance(parsed, (OomMemcgLimit, OomSummary, OomKill)):
            merged = fold.feed(parsed, line.text, 0)
            if merged is not None and line.at is not None:
                k.oom_at.setdefault(merged.pid, line.at)
            continue
        m = _PARTIAL.search(line.text)
        if m:
            k.partial.append((m[1], line))
            continue
        row = parse_task_row(line.text)
        if row is not None:
            k.tasks[row.pid] = (row.rss_pages * PAGE, row.comm)
            continue
        xid = parse_xid_line(line.text) if "NVRM" in line.text else None
        if xid is not None:
            k.xids.append((line, xid))
            continue
        m = _PAGES_RAM.match(line.text.strip())
        if m:
            k.host_total = int(m[1]) * PAGE
    k.ooms = list(fold.kills)
    return k


# -- the verdict ------------------------------------------------------------------------


@dataclass(slots=True)
class _Outcome:
    verdict: Verdict | None
    collect: list[str]
    ranks: list[_Rank]
    kernel: _Kernel
    notes: list[EvidenceItem]


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


def _synthetic_victim(k: _Kernel, g: _Gathered, t0: int) -> list[_Rank]:
    """No rank named anywhere: the one process the logs say died."""
    if len(k.ooms) == 1:
        return [_Rank(pid=k.ooms[0].pid, returncode=-9, first=True)]
    shells = [j for j in g.jobs if j.what == "killed_by_shell"]
    if shells:
        return [_Rank(pid=shells[0].pid, returncode=-(shells[0].signal or 9), first=True)]
    exits = [j for j in g.jobs if j.what == "exit_code" and j.exit_code is not None]
    if exits:  # a container's "exit code 137" is 128 + SIGKILL
        e = exits[0]
        return [_Rank(returncode=-e.signal if e.signal else e.exit_code, first=True, lines=[e.line])]
    return [_Rank(first=True)]


def _decide(g: _Gathered, now: float) -> _Outcome:
    ranks, notes = _ranks(g)
    k = _kernel(g.kernel)
    t0 = int(now * S)
    if not ranks:
        if not (k.ooms or k.partial or k.xids or g.findings or g.jobs or g.userspace):
            return _Outcome(None, [COLLECT_KERNEL, COLLECT_RANK_LOGS, COLLECT_DAEMON], ranks, k, notes)
        ranks = _synthetic_victim(k, g, t0)
    # times: a line's own if it has one, else the agent's order (the first failure, then the
    # ranks it tore down); a kernel record naming a rank's pid is that rank's death
    first_at = min((r.at for r in ranks if r.at is not None), default=None)
    base = int((first_at or now) * S)
    states: list[RankState] = []
    for i, r in enumerate(sorted(ranks, key=lambda r: (not r.first, r.torn_down, r.pid or 0))):
        died = int(r.at * S) if r.at is not None else base + (S if r.torn_down else 0) + i
        if r.at is not None:
            g.death_at[r.label] = r.at
        code = wait_status_from_returncode(r.returncode) if r.returncode is not None else None
        states.append(
            RankState(r.label, r.rank, r.local_rank, r.pid or 0, (), code, died, None, None, "agent-log")
        )
    died_by_pid = {s.pid: s.died_ns or 0 for s in states if s.pid}
    ooms = [replace(o, at_ns=died_by_pid.get(o.pid, 0)) for o in k.ooms]
    victim_ns = min((s.died_ns for s in states if s.died_ns is not None), default=t0)
    xids = tuple((victim_ns, x) for _, x in k.xids)
    kernel_given = bool(g.kernel) and any(line.style != "bare" for line in g.kernel)
    labels = {r.rank: r.label for r in ranks if r.rank is not None}
    locals_ = {r.local_rank: r.label for r in ranks if r.local_rank is not None}
    findings = tuple(
        (labels.get(f.rank) if f.rank is not None else locals_.get(f.local_rank or -1), f)
        for _, f in g.findings
    )
    if len(states) == 1:  # one process: its unattributed lines are its own
        findings = tuple((label or states[0].label, f) for label, f in findings)
    ev = Evidence(
        tuple(states),
        kernel=tuple(ooms),
        kernel_log_readable=kernel_given,
        exits_first_hand=False,
        userspace=tuple(g.userspace),
        agent_teardown=frozenset(r.pid for r in ranks if r.torn_down and r.pid),
        output=findings,
        output_read=g.output_read,
        xids=xids,
        from_logs=True,
    )
    v = autopsy(ev)
    if v is not None:  # the daemon's own measurements (counters, /proc) are not in logs
        kept = tuple(e for e in v.evidence if e.source not in ("counters", "vmstat", "cgroup", "proc"))
        v = replace(v, evidence=kept)
    collect: list[str] = []
    if v is None:
        return _Outcome(None, [COLLECT_KERNEL, COLLECT_RANK_LOGS, COLLECT_DAEMON], ranks, k, notes)
    v = _logs_rules(v, g, k, kernel_given, collect)
    guessed = next((r for r in ranks if r.label == v.victim.label and r.inferred_rank), None)
    if guessed is not None and v.confidence == Confidence.CERTAIN:
        v = replace(v, confidence=Confidence.LIKELY)
    return _Outcome(v, collect, ranks, k, notes)


def _who(v: Verdict) -> str:
    return rank_name(v.victim.label, v.victim.pid, from_logs=True)


def _logs_rules(v: Verdict, g: _Gathered, k: _Kernel, kernel_given: bool, collect: list[str]) -> Verdict:
    """What logs can and cannot say, on top of the autopsy's verdict."""
    who = _who(v)
    items = list(v.evidence)
    sigkill = v.victim.signal == _signal.SIGKILL or (v.victim.exit_code is None and v.kind == Kind.UNKNOWN)
    weak = v.kind in (Kind.EXTERNAL_SIGNAL, Kind.UNKNOWN) or (
        v.kind == Kind.ABORT and v.confidence == Confidence.POSSIBLE
    )
    signalled = next((rec for rec in g.agent if isinstance(rec, DeathSignal)), None)
    if signalled is not None and weak:
        name = signal_name(signalled.signal) or "a signal"
        items.append(EvidenceItem("torchrun", None, signalled.line))
        hint = " (the terminal or SSH session it ran in closed)" if signalled.signal == _signal.SIGHUP else ""
        return _with(
            v,
            Kind.EXTERNAL_SIGNAL,
            Confidence.CERTAIN,
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
            src = {"slurm": "Slurm", "kubernetes": "Kubernetes", "docker": "Docker"}.get(
                job.source, job.source
            )
            unit = {"slurm": "step", "kubernetes": "container", "docker": "container"}.get(
                job.source, "cgroup"
            )
            scope = f" in {job.scope}" if job.scope else ""
            return _with(
                v, kind, Confidence.LIKELY, text.format(src=src, scope=scope, who=who, unit=unit), items
            )
    death = _death_time(v, g)
    if (
        weak
        and sigkill
        and not v.victim.pid
        and len(k.ooms) == 1
        and not _far(k.oom_at.get(k.ooms[0].pid), death)
    ):
        # the launcher gave no pid (DeepSpeed, accelerate): one OOM kill in the kernel log
        oom = k.ooms[0]
        items += [EvidenceItem("kmsg", None, line) for line in oom.lines]
        memcg = oom.scope == "memcg" or oom.oom_memcg is not None
        return _with(
            v,
            Kind.CGROUP_OOM if memcg else Kind.KERNEL_OOM,
            Confidence.LIKELY if _near(k.oom_at.get(oom.pid), death) else Confidence.POSSIBLE,
            f"{who} was SIGKILLed and the kernel's OOM killer killed pid {oom.pid} ({oom.comm})"
            + (f" for the limit of memory cgroup {oom.oom_memcg}" if oom.oom_memcg else "")
            + "; the launcher's log gives no pid to tie that kill to the rank.",
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
        if biggest is not None:
            pid, (rss, comm) = biggest
            items.append(
                EvidenceItem("kmsg", None, f"task table: largest process {comm} (pid {pid}), {_gib(rss)} RSS")
            )
        memcg = constraint == "CONSTRAINT_MEMCG"
        tail = (
            f"; the largest process in its task table was {biggest[1][1]} (pid {biggest[0]}) "
            f"with {_gib(biggest[1][0])} RSS"
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


def _death_time(v: Verdict, g: _Gathered) -> float | None:
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


def _sentence(text: str) -> str:
    """A summary that starts with a rank named by its pid alone starts a sentence."""
    return "T" + text[1:] if text.startswith("the process") else text


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


# -- the document --------------------------------------------------------------------------


def diagnose(inputs: list[LogInput], now: float | None = None) -> dict[str, Any]:
    """The postmortem document (trainwatch.postmortem/v1) the logs support; fields they
    cannot fill are null. ``inputs``, ``collect`` and ``diagnosed_by`` are extra fields."""
    now = time.time() if now is None else now
    g = _gather(inputs)
    out = _decide(g, now)
    v = out.verdict
    by_label = {r.label: r for r in out.ranks}
    kernel_at = {line.text: line.at for line in g.kernel if line.at is not None}
    out.ranks.sort(key=lambda r: (r.rank is None and r.local_rank is None, r.rank or 0, r.local_rank or 0))
    rows = [
        RankRow(
            rank=r.rank,
            local_rank=r.local_rank,
            pid=r.pid,
            exit_code=r.returncode,
            signal=-r.returncode if r.returncode is not None and r.returncode < 0 else None,
            died_at=r.at,
            fate=v.fates.get(r.label, Fate.UNKNOWN) if v else Fate.UNKNOWN,
            rss_bytes=out.kernel.tasks.get(r.pid or -1, (None, ""))[0],
            local_rank_inferred=r.inferred_local,
        )
        for r in out.ranks
    ]
    host_total = out.kernel.host_total
    vr = by_label.get(v.victim.label) if v else None
    cited: list[Cited] = []
    tips: list[str] = []
    if v is not None:
        if vr is not None and vr.lines:
            cited.append(Cited(source="torchrun", at=_when(vr.lines[0]), detail=vr.lines[0]))
        cited += [
            Cited(source=e.source, at=kernel_at.get(e.detail), detail=e.detail)
            for e in (*v.evidence[1:], *out.notes)  # the first item is the synthetic exit line
        ]
        # what only the daemon could change is left out: "collect" says what logs need
        tips = advice(v, rows, None, host_total, True, None, live=False)
    collect = list(dict.fromkeys([*out.collect, *([COLLECT_DAEMON] if out.collect else [])]))
    died = vr.at if vr is not None else None
    ident = make_id(died or now, 0, (v.victim.label if v else "x").replace("?", "x"), g.host or "logs")
    return build(
        Parts(
            ident=ident,
            created_at=now,
            updated_at=None,
            host=g.host,
            job=JobInfo(),
            verdict=v,
            summary=_sentence(v.summary) if v else None,
            victim=Victim(exit_code=vr.returncode if vr else None, died_at=died),
            evidence=cited,
            ranks=rows,
            host_memory=HostAtDeath(total_bytes=host_total),
            cgroup=None,
            timeline=[],
            stacks=None,
            advice=tips,
            extra={
                "collect": collect,
                "inputs": [{"name": name, "kinds": kinds} for name, kinds in g.kinds.items()],
                "diagnosed_by": f"trainwatch diagnose on {socket.gethostname()}",
            },
        )
    )
