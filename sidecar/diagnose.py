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
the clocks say. Then the daemon's path: the same autopsy, the rules for logs on top
(``autopsy.logs``), the same advice and the same document builder.
"""

from __future__ import annotations

import os
import re
import signal as _signal
import socket
import sys
import time
from dataclasses import dataclass, replace
from typing import Any, BinaryIO

from sidecar.autopsy import (
    Evidence,
    EvidenceItem,
    RankState,
    UserspaceKill,
    Verdict,
    autopsy,
)
from sidecar.autopsy.advice import advice
from sidecar.autopsy.logs import (
    COLLECT_DAEMON,
    COLLECT_KERNEL,
    COLLECT_RANK_LOGS,
    KernelRecords,
    LogRank,
    LogRecords,
    logs_rules,
)
from sidecar.autopsy.oom import OomFold
from sidecar.catalog import Hit, catalog
from sidecar.model import Confidence, Fate, wait_status_from_returncode
from sidecar.parse.jobs import parse_job_line
from sidecar.parse.kernel import (
    OomKill,
    OomMemcgLimit,
    OomSummary,
    parse_oom_line,
    parse_xid_line,
)
from sidecar.parse.logs import KernelLine, kernel_lines, line_time, parse_task_row
from sidecar.parse.oomd import parse_userspace_oom_line
from sidecar.parse.pasted import plain_all
from sidecar.parse.ranks import line_stamp, parse_rank_output, stamp_to_epoch
from sidecar.parse.torchrun import (
    ClosingSignal,
    FailureEntry,
    WorkerFailed,
    parse_agent_text,
)
from sidecar.postmortem.document import Cited, HostAtDeath, JobInfo, Parts, RankRow, Victim, build, make_id

__all__ = ["DiagnoseError", "LogInput", "diagnose", "read_inputs"]

MAX_BYTES = 64 << 20  # of each input, the tail that is read
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


_TABLE_TIME = re.compile(r"time\s*:?\s*(\d{4})-(\d\d)-(\d\d)[_ ](\d\d):(\d\d):(\d\d)")
_HOST = re.compile(r"^\s*host\s*:\s*(\S+)", re.M)
_GENERATION = (
    (re.compile(r"^(?:WARNING|ERROR|INFO):torch\.distributed", re.M), "torch 1.9-2.0"),
    (re.compile(r"^\[\d{4}-\d\d-\d\d [\d:,]+\] torch\.distributed\.elastic", re.M), "torch 2.1-2.3"),
    (re.compile(r"^[IWEF]\d{4} [\d:.]+ \d+ \S*torch/distributed/", re.M), "torch 2.4+"),
)


def _gather(inputs: list[LogInput]) -> LogRecords:
    g = LogRecords({}, [], [], [], [], [], False)
    for inp, text in zip(inputs, plain_all([inp.text for inp in inputs]), strict=True):
        kinds: list[str] = []
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
        others = catalog().part("agent", "kernel", "shell", "scheduler")
        lines = text.splitlines()
        for line, hits in zip(lines, others.scan_lines(lines), strict=True):
            for hit in hits:
                if hit.message.decides:
                    g.said.append((hit, line_time(line)))
                elif hit.message.channel != "kernel" and exit_of(hit) is not None:
                    g.exits.append((hit, line_time(line)))
                else:
                    continue
                if hit.message.emitter not in _NAMED_ALREADY:
                    sources.add(hit.message.emitter)
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


# emitters whose texts the structured readers above already name as a kind of input
_NAMED_ALREADY = frozenset({"linux", "nvrm", "torchelastic"})


def _ranks(g: LogRecords) -> tuple[list[LogRank], list[EvidenceItem]]:
    """The ranks the logs name, merged by pid (then by rank, then by local rank)."""
    ranks: list[LogRank] = []
    notes: list[EvidenceItem] = []

    def get(pid: int | None, rank: int | None = None, local: int | None = None) -> LogRank:
        for r in ranks:
            if (
                (pid is not None and r.pid == pid)
                or (pid is None and rank is not None and r.rank == rank)
                or (pid is None and rank is None and local is not None and r.local_rank == local)
            ):
                break
        else:
            r = LogRank(pid=pid)
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
            ranks.append(LogRank(rank=f.rank, local_rank=f.local_rank))
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
    # A launcher's report of its child's exit that names no rank (subprocess's
    # CalledProcessError of `torchrun ...`, a launcher's "exits with return code") is the
    # whole job's exit when the logs name ranks: it is never a rank of its own, nor the reason
    named = [r for r in ranks if r.pid is not None or r.rank is not None or r.local_rank is not None]
    if named:
        for r in [r for r in ranks if r not in named]:
            ranks.remove(r)
            notes += [
                EvidenceItem("launcher", None, f"the job's exit, as its launcher reported it: {line}")
                for line in r.lines
            ]
    if not any(r.returncode is not None for r in ranks):
        # no structured record gave an exit: a launcher's, a shell's or a runtime's report of
        # a process's exit status or signal is one (spawn's "process 1 terminated with signal
        # SIGSEGV", mpirun's "exited on signal 9", a container's "Exit Code: 137")
        for hit, at in g.exits:
            code = exit_of(hit)
            who = [_int(hit.get(name)) for name in ("pid", "rank", "local_rank")]
            r = get(who[0], who[1], who[2]) if any(x is not None for x in who) else get(None)
            if r.returncode is None:
                r.returncode = code
                r.first = not any(o.first for o in ranks if o is not r)
                r.lines.append(hit.line)
                r.at = r.at or at
    return ranks, notes


def _int(text: str | None) -> int | None:
    return int(text) if text is not None and text.lstrip("-").isdigit() and len(text) < 12 else None


_SIGNAL_WORDS = {
    **{_signal.strsignal(n) or "": n for n in range(1, 32) if _signal.strsignal(n)},
    **{s.name: int(s) for s in _signal.Signals},
    "Killed": _signal.SIGKILL,
}


def exit_of(hit: Hit) -> int | None:
    """The exit a report of a process's end gives, as torchrun writes it (-N for signal N,
    else the status); a status of 128+N from a shell or a container runtime is signal N.
    None when the message names no killer-less exit (a message of a kind decides instead)."""
    m = hit.message
    if m.kind is not None or m.layer not in ("symptom", "report"):
        return None
    for name in ("signum", "signal", "signame", "sigdesc"):
        value = (hit.get(name) or "").strip().strip("<>")
        if not value:
            continue
        number = _int(value.removeprefix("Unknown signal ").strip())
        if number is None:
            number = _SIGNAL_WORDS.get(value) or _SIGNAL_WORDS.get(value.split(" (")[0])
        if number is not None and 0 < number < 65:
            return -number
    code = _int(hit.get("exit_code"))
    if code is None or code == 0:
        return None
    return -(code - 128) if 128 < code <= 128 + 64 else code


def _when(line: str) -> float | None:
    """A line's own wall-clock time: a syslog/ISO/DeepSpeed stamp, else glog's (no year:
    the one nearest now)."""
    at = line_time(line)
    if at is None:
        stamp = line_stamp(line.strip())
        at = stamp_to_epoch(stamp, time.time(), 400 * 86400) if stamp else None
    return at


_PARTIAL = re.compile(r"oom-kill:constraint=(CONSTRAINT_[A-Z]+)")
_PAGES_RAM = re.compile(r"^(\d+) pages RAM$")
# Mem-Info: the machine's counters in pages, then each NUMA node's in kB
_MEMINFO_PAGES = re.compile(r"^active_anon:(\d{1,20}) inactive_anon:(\d{1,20}) ")
_MEMINFO_NODE_KB = re.compile(r"^Node \d{1,5} active_anon:(\d{1,20})kB inactive_anon:(\d{1,20})kB ")
PAGE_SIZES = (4096, 8192, 16384, 65536)  # x86, sparc, arm64 16K, arm64/ppc64 64K


def infer_page_size(observations: list[tuple[int, int]]) -> int | None:
    """The page size an OOM report was counted in, from what it printed twice: once in
    pages and once in kB (``[(bytes, pages), ...]``). The task table's ``rss`` is pages,
    the kill line's anon-rss + file-rss + shmem-rss of the same pid is kB; Mem-Info's
    ``active_anon:N`` is pages, its ``Node 0 active_anon:NkB`` kB. The report's host may
    not be this one (a log from an arm64 host with 64 KiB pages): None when nothing pairs,
    or the pairs do not agree on one size."""
    sizes = set()
    for size_bytes, pages in observations:
        if pages < 16 or size_bytes <= 0:  # too few pages to tell 4 KiB from 8 KiB
            continue
        ratio = size_bytes / pages
        near = min(PAGE_SIZES, key=lambda page: abs(ratio / page - 1))
        if abs(ratio / near - 1) > 0.2:
            return None
        sizes.add(near)
    return sizes.pop() if len(sizes) == 1 else None


def _kernel(lines: list[KernelLine]) -> KernelRecords:
    k = KernelRecords([], [], {}, [], None)
    fold = OomFold()  # every line at time 0: the records of one pid are one kill
    pages_ram: int | None = None
    meminfo_pages: int | None = None
    node_kb = 0
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
            k.tasks[row.pid] = (row.rss_pages, row.comm)
            continue
        xid = parse_xid_line(line.text) if "NVRM" in line.text else None
        if xid is not None:
            k.xids.append((line, xid))
            continue
        text = line.text.strip()
        m = _PAGES_RAM.match(text)
        if m:
            pages_ram = int(m[1])
            continue
        m = _MEMINFO_PAGES.match(text)
        if m and meminfo_pages is None:
            meminfo_pages = int(m[1]) + int(m[2])
            continue
        m = _MEMINFO_NODE_KB.match(text)
        if m and meminfo_pages is not None:
            node_kb += int(m[1]) + int(m[2])
    k.ooms = list(fold.kills)
    pairs = [(o.rss_bytes, k.tasks[o.pid][0]) for o in k.ooms if o.rss_bytes is not None and o.pid in k.tasks]
    if meminfo_pages is not None and node_kb:
        pairs.append((node_kb * 1024, meminfo_pages))
    k.page_size = infer_page_size(pairs)
    if pages_ram is not None and k.page_size is not None:
        k.host_total = pages_ram * k.page_size
    return k


# -- the verdict ------------------------------------------------------------------------


@dataclass(slots=True)
class _Outcome:
    verdict: Verdict | None
    collect: list[str]
    ranks: list[LogRank]
    kernel: KernelRecords
    notes: list[EvidenceItem]


def _synthetic_victim(k: KernelRecords, g: LogRecords, t0: int) -> list[LogRank]:
    """No rank named anywhere: the processes the logs say died. Each process the kernel's
    OOM killer took is one, the first record the first death."""
    if k.ooms:
        return [LogRank(pid=o.pid, returncode=-9, first=i == 0) for i, o in enumerate(k.ooms)]
    shells = [j for j in g.jobs if j.what == "killed_by_shell"]
    if shells:
        return [LogRank(pid=shells[0].pid, returncode=-(shells[0].signal or 9), first=True)]
    exits = [j for j in g.jobs if j.what == "exit_code" and j.exit_code is not None]
    if exits:  # a container's "exit code 137" is 128 + SIGKILL
        e = exits[0]
        return [LogRank(returncode=-e.signal if e.signal else e.exit_code, first=True, lines=[e.line])]
    return [LogRank(first=True)]


def _decide(g: LogRecords, now: float) -> _Outcome:
    ranks, notes = _ranks(g)
    k = _kernel(g.kernel)
    t0 = int(now * S)
    if not ranks:
        if not (k.ooms or k.partial or k.xids or g.findings or g.jobs or g.userspace or g.said or g.exits):
            return _Outcome(None, [COLLECT_KERNEL, COLLECT_RANK_LOGS, COLLECT_DAEMON], ranks, k, notes)
        ranks = _synthetic_victim(k, g, t0)
    # times: a line's own if it has one, else the agent's order (the first failure, then the
    # ranks it tore down); a kernel record naming a rank's pid is that rank's death
    first_at = min((r.at for r in ranks if r.at is not None), default=None)
    base = int((first_at or now) * S)
    states: list[RankState] = []
    # ranks no record times are ordered by the first stamped line they wrote, not by where
    # their lines sit in the files (one file per rank, or one interleaved file); a glog
    # stamp has no year, so the order is month, day and time of day
    said_at: dict[tuple[int | None, int | None], tuple[int, ...]] = {}
    for _, f in g.findings:
        if f.stamp is not None:
            key, at = (f.rank, f.local_rank), tuple(f.stamp[1:])
            said_at[key] = min(at, said_at.get(key, at))
    never = (99,)

    def wrote(r: LogRank) -> tuple[int, ...]:
        found = [
            t
            for (rank, local), t in said_at.items()
            if (rank is not None and rank == r.rank)
            or (rank is None and local is not None and local == r.local_rank)
        ]
        return min(found, default=never)

    # ... then by pid (start order), then by rank: never by which file came first
    def order(r: LogRank) -> tuple[Any, ...]:
        return (not r.first, r.torn_down, wrote(r), r.pid or 0, r.rank if r.rank is not None else 1 << 30)

    for i, r in enumerate(sorted(ranks, key=order)):
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
        kernel_said=tuple(
            (victim_ns, int(pid), hit.message.id, hit.line)
            for hit, _ in g.said
            if hit.message.channel == "kernel"
            and (pid := hit.get("pid")) is not None
            and pid.isdigit()
            and len(pid) < 11
        ),
        from_logs=True,
    )
    v = autopsy(ev)
    if v is not None:  # the daemon's own measurements (counters, /proc) are not in logs
        kept = tuple(e for e in v.evidence if e.source not in ("counters", "vmstat", "cgroup", "proc"))
        v = replace(v, evidence=kept)
    collect: list[str] = []
    if v is None:
        return _Outcome(None, [COLLECT_KERNEL, COLLECT_RANK_LOGS, COLLECT_DAEMON], ranks, k, notes)
    v = logs_rules(v, g, k, kernel_given, collect)
    guessed = next((r for r in ranks if r.label == v.victim.label and r.inferred_rank), None)
    if guessed is not None and v.confidence == Confidence.CERTAIN:
        v = replace(v, confidence=Confidence.LIKELY)
    return _Outcome(v, collect, ranks, k, notes)


def _sentence(text: str) -> str:
    """A summary that starts with a rank named by its pid alone starts a sentence."""
    return "T" + text[1:] if text.startswith("the process") else text


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
            rss_bytes=out.kernel.task_rss_bytes(r.pid),
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
            stall=None,
            advice=tips,
            extra={
                "collect": collect,
                "inputs": [{"name": name, "kinds": kinds} for name, kinds in g.kinds.items()],
                "diagnosed_by": f"trainwatch diagnose on {socket.gethostname()}",
            },
        )
    )
