"""The ranks the logs name, for ``trainwatch diagnose``: the agent's failure table and
``failed (exitcode: N)`` line, its closing signals (those ranks it tore down), DeepSpeed's
and other launchers' exit lines, a shell's ``8156 Killed``; ranks a ``[rankN]:`` line
names; torn-down pids get the local rank their place in a run of consecutive pids gives,
said as inferred. Merged by pid (then by rank, then by local rank), with their exits and
the times their lines give."""

from __future__ import annotations

import re
import signal as _signal
import time

from sidecar.autopsy import EvidenceItem
from sidecar.autopsy.logrecords import LogRank, LogRecords
from sidecar.autopsy.peers import says_why
from sidecar.catalog import Hit
from sidecar.parse.logs import Dating, line_time
from sidecar.parse.ranks import Finding, line_stamp, stamp_to_epoch
from sidecar.parse.torchrun import ClosingSignal, DeathSignal, FailureEntry, WorkerFailed

__all__ = ["exit_of", "log_ranks", "when"]

_TABLE_TIME = re.compile(r"time\s*:?\s*(\d{4})-(\d\d)-(\d\d)[_ ](\d\d):(\d\d):(\d\d)")


def log_ranks(g: LogRecords) -> tuple[list[LogRank], list[EvidenceItem]]:
    """The ranks the logs name, merged by pid (then by rank, then by local rank): each step
    below in order, every one adding to the same book."""
    book = _Book()
    notes: list[EvidenceItem] = []
    _from_the_agent(book, g)
    # srun started the ranks, no launcher of their own (a torchrun agent's or DeepSpeed's
    # lines): its task ids are ranks (SLURM_PROCID); else a task is a node's launcher
    tasks_are_ranks = not g.agent and not any(j.source == "deepspeed" for j in g.jobs)
    srun_failed = _from_the_launchers(book, g, tasks_are_ranks)
    _deepspeed_starts(book, g)
    _named_by_their_lines(book, g, notes)
    _torn_down_locals(book, notes)
    _launcher_reports(book, notes)
    _reported_exits(book, g)
    ranks = book.ranks
    teardown_after_own_failure(ranks, g, notes)
    _the_worker_the_agent_reacted_to(ranks, g, notes)
    if tasks_are_ranks and not srun_failed:
        _the_task_srun_reacted_to(ranks, g, notes)
    return ranks, notes


class _Book:
    """The ranks found so far; ``get`` finds one by pid (then by rank, then by local rank)
    or adds it, and fills in what it did not know."""

    def __init__(self) -> None:
        self.ranks: list[LogRank] = []

    def get(self, pid: int | None, rank: int | None = None, local: int | None = None) -> LogRank:
        for r in self.ranks:
            if (
                (pid is not None and r.pid == pid)
                or ((pid is None or r.pid is None) and rank is not None and r.rank == rank)
                or (pid is None and rank is None and local is not None and r.local_rank == local)
            ):
                break
        else:
            r = LogRank(pid=pid)
            self.ranks.append(r)
        if rank is not None:
            r.rank = rank
        if local is not None:
            r.local_rank = local
        if r.pid is None:
            r.pid = pid
        return r


def _from_the_agent(book: _Book, g: LogRecords) -> None:
    """torchrun's agent: its failure table, its ``failed (exitcode: N)`` line and the
    ranks it sent its closing signal."""
    for rec in g.agent:
        if isinstance(rec, FailureEntry):
            r = book.get(rec.pid, rec.rank, rec.local_rank)
            r.returncode = rec.exitcode
            r.first = r.first or rec.root_cause
            m = _TABLE_TIME.search(f"time : {rec.time}" if rec.time else "")
            if m:
                r.at = time.mktime((*(int(m[i]) for i in range(1, 7)), 0, 0, -1))  # type: ignore[arg-type]
            r.lines.append(f"exitcode {rec.exitcode} (pid {rec.pid}): {rec.traceback or ''}".strip())
        elif isinstance(rec, WorkerFailed):
            r = book.get(rec.pid, None, rec.local_rank)
            r.returncode = rec.exitcode
            r.first = True
            r.lines.append(rec.line)
            r.at = r.at or when(rec.line, g.dating)  # when the agent noticed: within its monitor interval
        elif isinstance(rec, ClosingSignal):
            r = book.get(rec.pid)
            r.torn_down = True
            if r.returncode is None and rec.signal is not None:
                r.returncode = -rec.signal
            r.lines.append(rec.line)


def _from_the_launchers(book: _Book, g: LogRecords, tasks_are_ranks: bool) -> bool:
    """srun's, DeepSpeed's and other launchers' exit lines, a shell's ``Killed``. Whether
    srun reported a task's own failure (the kills it reports next are its teardown)."""
    srun_failed = False
    for job in g.jobs:
        if job.source == "slurm" and job.what == "oom_cgroup" and job.tasks and tasks_are_ranks:
            # srun's "task N: Out Of Memory": the task ended while the step's memory cgroup
            # counted an OOM kill (the status srun got carries the OOM flag; the task itself may
            # have exited of a child's kill), its own end: the kills srun reports after it are
            # its teardown. How it ended, the line does not say.
            for task in job.tasks:
                r = book.get(None, task, None)
                r.inferred_rank = True
                if r.returncode is None and not r.first:
                    r.first, r.torn_down = True, False
                    r.lines.append(job.line)
                    r.at = r.at or when(job.line, g.dating)
            srun_failed = True
            continue
        if job.source == "slurm" and job.what == "exit_code" and not tasks_are_ranks:
            continue  # a node's launcher exiting 1 after its worker failed: a report, not an end
        if (
            job.source == "slurm"
            and job.what in ("exit_signal", "exit_code")
            and job.tasks
            and tasks_are_ranks
        ):
            # srun reports each group of tasks as it ends, in order; after a task's bad exit it
            # ends the step (--kill-on-bad-exit; "_step_signal: Terminating", "Job step
            # aborted"), so the tasks it then reports Killed or Terminated are its teardown
            teardown = srun_failed and job.signal in (_signal.SIGKILL, _signal.SIGTERM)
            for task in job.tasks:
                # srun's task id is the rank (SLURM_PROCID) when srun started the ranks
                r = book.get(None, task, None)
                r.inferred_rank = True
                if r.returncode is not None:
                    continue
                r.returncode = -job.signal if job.signal else job.exit_code
                r.first, r.torn_down = not teardown, teardown
                r.lines.append(job.line)
                r.at = r.at or when(job.line, g.dating)
            # a task that failed of its own (an exit status, a fault), not one killed with others
            srun_failed = srun_failed or job.signal not in (_signal.SIGKILL, _signal.SIGTERM)
            continue
        if job.source == "deepspeed" and job.what == "teardown":
            r = book.get(job.pid)
            r.torn_down = True
            r.lines.append(job.line)
        elif job.what in ("exit_signal", "exit_code") and job.source in ("deepspeed", "launcher", "slurm"):
            r = book.get(None, None, job.local_rank) if job.local_rank is not None else book.get(None)
            r.returncode = -job.signal if job.signal else job.exit_code
            r.first = True
            r.lines.append(job.line)
            r.at = r.at or when(job.line, g.dating)
        elif job.what == "killed_by_shell" and job.pid is not None:
            r = book.get(job.pid)
            r.returncode = -(job.signal or 9)
            r.lines.append(job.line)
    return srun_failed


def _deepspeed_starts(book: _Book, g: LogRecords) -> None:
    """DeepSpeed's launcher names each worker's pid as it starts it, with its local rank on
    the command line (--local_rank=N): the ranks other lines named by one get the other,
    so a kernel record naming the pid is the rank's. No rank is made of a start alone."""
    spawned = [j for j in g.jobs if j.what == "spawned" and j.pid is not None and j.local_rank is not None]
    local_of = {j.pid: j.local_rank for j in spawned}
    pid_of = {j.local_rank: j.pid for j in spawned}
    if len(local_of) == len(spawned) and len(pid_of) == len(spawned):  # one node's starts, unambiguous
        for r in book.ranks:
            if r.pid is None and r.local_rank in pid_of:
                r.pid = pid_of[r.local_rank]
            elif r.local_rank is None and r.pid in local_of:
                r.local_rank = local_of[r.pid]
        _merge_by_pid(book.ranks)


def _named_by_their_lines(book: _Book, g: LogRecords, notes: list[EvidenceItem]) -> None:
    """Ranks whose own lines name them (the watchdog's [Rank N], a [rankN]: prefix). A global
    rank no table gave, on a rank whose local rank is the same number, is taken to be it
    (true on one node; said as inferred, so never certain)."""
    ranks = book.ranks
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


def _torn_down_locals(book: _Book, notes: list[EvidenceItem]) -> None:
    """Torn-down pids in one run of consecutive pids with a rank whose local rank is known:
    torchrun starts the workers in local-rank order."""
    ranks = book.ranks
    anchors = [r for r in ranks if r.local_rank is not None and r.pid is not None]
    if not anchors:
        return
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


def _launcher_reports(book: _Book, notes: list[EvidenceItem]) -> None:
    """A launcher's report of its child's exit that names no rank (subprocess's
    CalledProcessError of `torchrun ...`, a launcher's "exits with return code") is the
    whole job's exit when the logs name ranks: it is never a rank of its own, nor the reason."""
    ranks = book.ranks
    named = [r for r in ranks if r.pid is not None or r.rank is not None or r.local_rank is not None]
    if named:
        for r in [r for r in ranks if r not in named]:
            ranks.remove(r)
            notes += [
                EvidenceItem("launcher", None, f"the job's exit, as its launcher reported it: {line}")
                for line in r.lines
            ]


def _reported_exits(book: _Book, g: LogRecords) -> None:
    """When no structured record gave an exit: a launcher's, a shell's or a runtime's report
    of a process's exit status or signal is one (spawn's "process 1 terminated with signal
    SIGSEGV", mpirun's "exited on signal 9", a container's "Exit Code: 137")."""
    ranks = book.ranks
    if any(r.returncode is not None for r in ranks):
        return
    for hit, at in g.exits:
        code = exit_of(hit)
        who = [_int(hit.get(name)) for name in ("pid", "rank", "local_rank")]
        r = book.get(who[0], who[1], who[2]) if any(x is not None for x in who) else book.get(None)
        if r.returncode is None:
            r.returncode = code
            r.first = not any(o.first for o in ranks if o is not r)
            r.lines.append(hit.line)
            r.at = r.at or at


# what a process's own words can say of its own end and not of a peer's: a fault, an abort,
# its GPU's memory or its device
_OWN_ENDS = frozenset({"abort", "segfault", "bus_error", "gpu_error", "cuda_oom"})


def _own_end(f: Finding) -> bool:
    if f.kind in ("cuda_oom", "shm_bus_error"):
        return True
    return f.kind == "said" and f.get("layer") in ("mechanism", "symptom") and f.get("said_kind") in _OWN_ENDS


def _the_worker_the_agent_reacted_to(ranks: list[LogRank], g: LogRecords, notes: list[EvidenceItem]) -> None:
    """The agent sends its closing SIGTERM only to the workers still alive when it stops the
    group (torch.distributed.elastic's _close polls each one first), and stops it when a
    worker ended or when it was itself signalled (then it says so: "Received N death
    signal"). Where every rank the logs give is one it closed (or one whose own words only
    report a peer's failure) and it says no signal reached it, the worker whose end it
    reacted to is none of them: that worker is added, its exit unknown, so that words of a
    process's own end in lines that name no rank (faulthandler writes to the file descriptor,
    past torch's rank prefix) are its."""
    sigterm = -int(_signal.SIGTERM)

    def closed(r: LogRank) -> bool:  # the agent says it sent it its closing signal, and it died of it
        return r.torn_down and r.returncode in (sigterm, None)

    def reporting(r: LogRank) -> bool:  # named only by its own words, which report a peer's failure
        said = [f for _, f in g.findings if f.rank is not None and f.rank == r.rank]
        return r.returncode is None and r.pid is None and bool(said) and not says_why(said)

    if not any(closed(r) for r in ranks) or any(r.first or not (closed(r) or reporting(r)) for r in ranks):
        return
    # a SIGHUP or SIGINT it closes with is the one it received; it also closes the group when
    # the rendezvous fails (another node left): only a process's own end in the lines, not a
    # report or an exception (a peer's failure says itself so), tells a worker ended first
    if any(isinstance(rec, DeathSignal) for rec in g.agent) or not _an_unnamed_end(g):
        return
    _add_unnamed_first(
        ranks,
        notes,
        "torchrun",
        "the agent sent its closing SIGTERM to every process these logs name (or its words only "
        "report a peer's failure): the worker whose end it reacted to is another, which no line names",
    )


def _an_unnamed_end(g: LogRecords) -> bool:
    """A process's own end (a fault, an abort, a CUDA OOM) in lines that name no rank."""
    return any(label is None and _own_end(f) for label, f in g.findings)


def _add_unnamed_first(ranks: list[LogRank], notes: list[EvidenceItem], source: str, why: str) -> None:
    """The process whose end the launcher reacted to, which no line names: its exit unknown."""
    ranks.append(LogRank(first=True))
    notes.append(EvidenceItem(source, None, why))


def _the_task_srun_reacted_to(ranks: list[LogRank], g: LogRecords, notes: list[EvidenceItem]) -> None:
    """slurmstepd's ``*** STEP ... CANCELLED ***`` with no reason is a cancel from outside
    (scancel) or srun ending the step after a task's own failure (--kill-on-bad-exit); srun
    then reports the other tasks Killed or Terminated. Where every task srun reports ended so,
    no reason (a time limit, a preemption, a node failure) is given, and the lines that name
    no task hold a process's own end (a fault, an abort, a CUDA OOM, a GPU fault: a process
    scancel ends prints none of these), the task whose end srun reacted to is one the paste
    does not report: it is added, its exit unknown, and the tasks srun reports are its
    teardown."""
    killed = (-int(_signal.SIGKILL), -int(_signal.SIGTERM))
    reported = [r for r in ranks if r.inferred_rank and r.returncode is not None]
    if not reported or len(reported) != len(ranks) or any(r.returncode not in killed for r in reported):
        return
    slurm = [j for j in g.jobs if j.source == "slurm"]
    if any(j.what in ("time_limit", "preempted", "node_failure") for j in slurm):
        return
    if not any(j.what == "cancelled" for j in slurm) or not _an_unnamed_end(g):
        return
    for r in reported:
        r.first, r.torn_down = False, True
    _add_unnamed_first(
        ranks,
        notes,
        "slurm",
        "srun reports every task it names Killed or Terminated after the step was cancelled with no "
        "reason, and a process's own end is in lines that name no task: srun's teardown after that "
        "task's failure (--kill-on-bad-exit), not a cancel from outside",
    )


def _merge_by_pid(ranks: list[LogRank]) -> None:
    """Ranks found to be one process (a pid and a local rank joined late) made one: its
    exit and its lines kept; a launcher's kill of every worker after a failure is no
    teardown of the worker whose own exit it reacted to (DeepSpeed's sigkill_handler
    kills them all, the failed one too)."""
    kept: dict[int, LogRank] = {}
    for r in list(ranks):
        if r.pid is None:
            continue
        other = kept.get(r.pid)
        if other is None:
            kept[r.pid] = r
            continue
        other.rank = other.rank if other.rank is not None else r.rank
        other.local_rank = other.local_rank if other.local_rank is not None else r.local_rank
        other.returncode = other.returncode if other.returncode is not None else r.returncode
        other.at = other.at if other.at is not None else r.at
        other.first = other.first or r.first
        other.torn_down = (other.torn_down or r.torn_down) and not other.first
        other.lines += r.lines
        ranks.remove(r)


def teardown_after_own_failure(ranks: list[LogRank], g: LogRecords, notes: list[EvidenceItem]) -> None:
    """A rank a failure table shows ended by SIGTERM, while another rank of the job ended of
    a failure its own words name (an ECC error, a failed save, an exception that is not a
    peer's report): SIGTERM is what the agent sends every other rank when one fails, so the
    first is the agent's teardown and the other its reason, whichever the table calls the
    root cause (it is the first exit the agent observed, not the first failure). A SIGTERM
    from outside reaches every rank through the agent (all SIGTERM, no own failure), or
    leaves the others failing as its peers' reports, which name no cause of their own."""
    sigterm = -int(_signal.SIGTERM)
    termed = [r for r in ranks if r.first and r.returncode == sigterm and not r.torn_down]
    if not termed:
        return

    def words(r: LogRank) -> list[Finding]:
        return [
            f
            for _, f in g.findings
            if (f.rank is not None and f.rank == r.rank)
            or (f.rank is None and f.local_rank is not None and f.local_rank == r.local_rank)
        ]

    own = [r for r in ranks if r.returncode not in (None, 0, sigterm) and says_why(words(r))]
    if len(own) != 1:
        return
    for r in termed:
        r.first, r.torn_down = False, True
    own[0].first = True
    names = ", ".join(r.label for r in termed)
    notes.append(
        EvidenceItem(
            "inference",
            None,
            f"{names} ended by SIGTERM: the agent's teardown after {own[0].label}'s own failure "
            "(its words name a cause; the SIGTERMed ranks' name none)",
        )
    )


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


def when(line: str, dating: Dating) -> float | None:
    """A line's own wall-clock time: a syslog/ISO/DeepSpeed stamp, else glog's (no year:
    the one ``dating`` gives, near the paste's own dates and never after now)."""
    at = line_time(line, dating)
    if at is None:
        stamp = line_stamp(line.strip())
        at = stamp_to_epoch(stamp, dating.anchor, 400 * 86400, not_after=dating.now) if stamp else None
    return at
