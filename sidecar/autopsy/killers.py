"""What ended the first death: each killer's rule, asked in the order that decides.

No I/O, no clock: everything arrives in ``Evidence``. In order: a kernel OOM record naming
the pid (``kernel_oom`` or ``cgroup_oom``, certain); the traced sender of its signal (a
userspace OOM daemon, the agent, itself signalled from outside, or another process); the
agent signalled from outside when the sender is not traced; a userspace OOM daemon's
record; a SIGKILL with the OOM counters moving (an OOM at ``likely``) or not (a signal
from outside, never an OOM); the rank's own words and the GPU (``said``); the kernel's own
line for the pid; then its signal or exit status, with the job's logs. The steps stand in
``_KILLERS`` in that order, because the order is the rule: the first that answers decides
(rules 2-4 of ``rules``). Each returns what it found (a ``Step``: the evidence it cites, the
facts, its verdict or None); ``victim_verdict`` alone gathers them. The records each rule
weighs are found by ``witnesses``.
"""

from __future__ import annotations

import signal as _signal
from dataclasses import dataclass, replace
from typing import Any

from sidecar.autopsy.evidence import (
    USERSPACE_OOM_DAEMONS,
    Evidence,
    EvidenceItem,
    KernelOom,
    RankState,
    SignalSent,
    Step,
    rank_label,
    rank_name,
    signal_name,
)
from sidecar.autopsy.peers import timeout_elsewhere
from sidecar.autopsy.ranking import weaker
from sidecar.autopsy.said import from_output, gpu_fault
from sidecar.autopsy.senders import slurm_detail, tool_of, words
from sidecar.autopsy.witnesses import (
    agent_signalled,
    counter_moved,
    job_log,
    kernel_record,
    lost_item,
    lost_near,
    sender_of,
    userspace_for,
)
from sidecar.model import Confidence, Kind
from sidecar.model.events import Sender

__all__ = ["victim_verdict"]

# how the agent ends its workers (SIGTERM, then SIGKILL after a grace period) and the
# signals a terminal or a scheduler sends to a process group: a rank ended by one of these,
# first of the job, after its agent was signalled from outside, was ended by that
_TEARDOWN_SIGNALS = frozenset({_signal.SIGTERM, _signal.SIGINT, _signal.SIGHUP})


def victim_verdict(
    victim: RankState,
    oom: KernelOom | None,
    ev: Evidence,
    items: list[EvidenceItem],
    facts: dict[str, Any],
) -> tuple[Kind, Confidence, str]:
    """(kind, confidence, summary); the evidence cited goes into ``items``, what the verdict
    found as data into ``facts``. Each step of ``_KILLERS`` in order returns what it found:
    the first with a verdict decides (the last always has one)."""
    who = rank_name(victim.label, victim.pid, ev.from_logs)
    c = _Case(victim, oom, ev, who, sender_of(victim, ev.signals))
    for step in _KILLERS:
        found = step(c)
        items.extend(found.items)
        facts.update(found.facts)
        if found.verdict is not None:
            return found.verdict
    raise AssertionError("the last step always answers")  # pragma: no cover


@dataclass(frozen=True, slots=True)
class _Case:
    """The first death being judged, and the signal traced to it (``traced``: the last of
    its death signal sent to it), which the steps read as ``sent`` and ``fault``."""

    victim: RankState
    oom: KernelOom | None
    ev: Evidence
    who: str
    traced: SignalSent | None

    @property
    def raised(self) -> bool:
        """The rank raised the traced signal itself: a fault (SIGSEGV, SIGBUS) or abort()."""
        return self.traced is not None and self.traced.sender_pid in (self.victim.pid, *self.victim.ns_pids)

    @property
    def sent(self) -> SignalSent | None:
        """The traced signal still unexplained: another process sent it."""
        return None if self.raised else self.traced

    @property
    def fault(self) -> bool:
        """The kernel delivered the traced signal for the rank's own fault (si_code > 0)."""
        return self.raised and self.traced is not None and self.traced.code > 0


def _kernel_oom_record(c: _Case) -> Step:
    """A kernel OOM record naming the pid: the machine's or a cgroup's, certain."""
    victim, oom, who = c.victim, c.oom, c.who
    if oom is not None:
        items = tuple(EvidenceItem("kmsg", oom.at_ns, line) for line in oom.lines)
        is_global = oom.scope == "global" or (oom.oom_memcg is None and oom.scope != "memcg")
        if is_global and oom.oom_memcg is None:
            rss = f" holding {oom.rss_bytes / 2**30:.1f} GiB" if oom.rss_bytes else ""
            why = f"The kernel's OOM killer killed {who}{rss}: the whole machine ran out of memory."
            return Step(items, verdict=(Kind.KERNEL_OOM, Confidence.CERTAIN, why))
        limit_cgroup = oom.oom_memcg or victim.cgroup_limited_by or victim.cgroup
        which = f"memory cgroup {limit_cgroup}" if limit_cgroup else "its memory cgroup"
        why = f"{who} was killed by the kernel because {which} reached its limit."
        return Step(items, verdict=(Kind.CGROUP_OOM, Confidence.CERTAIN, why))
    return Step()


def _self_signalled(c: _Case) -> Step:
    """The traced signal, when the rank raised it itself (a fault, abort()): cited, and left
    for its status (``_Case.sent`` is None, ``_Case.fault`` says whether it was a fault)."""
    sent = c.traced
    if sent is not None and c.raised:
        # the rank signalled itself: a fault (SIGSEGV, SIGBUS) or abort() (SIGABRT)
        said = f"the rank itself raised {signal_name(sent.signal)} (si_code {sent.code})"
        return Step((EvidenceItem("tracepoint", sent.at_ns, f"signal_generate: {said}"),))
    return Step()


def _traced_sender(c: _Case) -> Step:
    """The traced sender of its signal: an OOM daemon, the agent (itself signalled from
    outside or not), another process."""
    victim, ev, who, sent = c.victim, c.ev, c.who, c.sent
    if sent is not None and not (sent.code == 128 and victim.signal == _signal.SIGKILL):
        name = signal_name(sent.signal)
        sender = sent.sender or Sender(sent.sender_pid, sent.sender_comm, None, None, None, ())
        tool = tool_of(sender, ev.agent_pid, victim.cgroup)
        detail, said = slurm_detail(sender, victim.slurm_times) if tool == "slurm" else (None, words(tool))
        facts = {"sender": replace(sender, tool=tool, detail=detail)}
        chain = ", ".join(f"{comm} ({pid})" for pid, comm, _ in sender.parents[:4])
        items = [
            EvidenceItem(
                "tracepoint",
                sent.at_ns,
                f"signal_generate: {sent.sender_comm}-{sent.sender_pid} "
                f"sent {name} to pid {sent.target_pid} (si_code {sent.code})",
            )
        ]
        if any(sent.sender_comm.startswith(d) for d in USERSPACE_OOM_DAEMONS):
            why = (
                f"{who} was killed by the userspace OOM daemon {sent.sender_comm} (pid {sent.sender_pid}), "
                f"which sent {name}."
            )
            return Step(tuple(items), facts, (Kind.USERSPACE_OOM, Confidence.CERTAIN, why))
        if ev.agent_pid is not None and sent.sender_pid == ev.agent_pid:
            upstream = agent_signalled(victim, ev)
            if upstream is not None:
                confidence, how, item, agent_sender = upstream
                items.append(item)
                agent = f"{ev.agent_name[0].upper()}{ev.agent_name[1:]} (pid {ev.agent_pid}) {how}"
                if agent_sender is not None:
                    facts["sender"] = replace(
                        agent_sender, tool=tool_of(agent_sender, ev.agent_pid, victim.cgroup), detail=None
                    )
                    if any(agent_sender.comm.startswith(d) for d in USERSPACE_OOM_DAEMONS):
                        # the agent's own ending signal came from an OOM daemon (earlyoom's SIGTERM)
                        why = (
                            f"{agent}, a userspace OOM daemon, and shut the workers down: {who} was sent "
                            f"{name} by it."
                        )
                        return Step(tuple(items), facts, (Kind.USERSPACE_OOM, confidence, why))
                why = (
                    f"{agent} and shut the workers down: {who} was sent {name} by it before any rank died "
                    "of its own."
                )
                return Step(tuple(items), facts, (Kind.EXTERNAL_SIGNAL, confidence, why))
            why = (
                f"{who} was sent {name} by {ev.agent_name} (pid {sent.sender_pid}) "
                "before any other rank died."
            )
            return Step(tuple(items), facts, (Kind.AGENT_TEARDOWN, Confidence.CERTAIN, why))
        by = "" if tool in ("unknown", "torchelastic") else f" by {said}"
        why = f"{who} was killed from outside{by}: pid {sent.sender_pid} ({sent.sender_comm}) sent {name}"
        why += f" (started by {chain})." if chain else "."
        return Step(tuple(items), facts, (Kind.EXTERNAL_SIGNAL, Confidence.CERTAIN, why))
    return Step()


def _agent_signalled(c: _Case) -> Step:
    """A teardown signal nobody traced, from an agent that was itself signalled from outside."""
    victim, ev, who, sent = c.victim, c.ev, c.who, c.sent
    torn = victim.pid in ev.agent_teardown
    if sent is None and victim.signal is not None and (torn or victim.signal in _TEARDOWN_SIGNALS):
        # no rank died of its own first (the victim is the first death), the sender of its
        # signal is not traced, and the agent says it was itself signalled from outside
        upstream = agent_signalled(victim, ev)
        if upstream is not None:
            confidence, how, item, _ = upstream
            ended = (
                f"its log says it sent {who} {signal_name(victim.signal)}"
                if torn
                else f"{who} ended by {signal_name(victim.signal)} as the job was shut down"
            )
            why = (
                f"{ev.agent_name[0].upper()}{ev.agent_name[1:]} (pid {ev.agent_pid}) {how} and shut the "
                f"workers down; {ended}."
            )
            # that the agent's signal ended it is inferred
            return Step((item,), verdict=(Kind.EXTERNAL_SIGNAL, weaker(confidence, Confidence.LIKELY), why))
    return Step()


def _userspace_daemon(c: _Case) -> Step:
    """A userspace OOM daemon's own record, by pid or by cgroup."""
    victim, ev, who = c.victim, c.ev, c.who
    found = userspace_for(victim, ev)
    if found is not None:
        rec, how = found
        items = (EvidenceItem(rec.source, rec.at_ns, rec.detail),)
        did = f"sent {signal_name(rec.signal)}" if rec.signal else "killed it"
        if how == "pid":
            why = (
                f"{who} was killed by the userspace OOM daemon {rec.daemon}, whose own record names "
                f"the pid ({did})."
            )
            return Step(items, verdict=(Kind.USERSPACE_OOM, Confidence.CERTAIN, why))
        why = (
            f"{who} was killed with its cgroup {rec.cgroup} by the userspace OOM daemon {rec.daemon} "
            f"({rec.source} record); the record names the cgroup, not the pid."
        )
        return Step(items, verdict=(Kind.USERSPACE_OOM, Confidence.LIKELY, why))
    return Step()


def _sigkill(c: _Case) -> Step:
    """A SIGKILL: the OOM counters, the job's logs, a hang, else a signal from outside."""
    victim, ev, who = c.victim, c.ev, c.who
    if victim.signal == _signal.SIGKILL:
        counted = _by_counters(ev, victim, who)
        if counted.verdict is not None:
            return counted
        why = "no kernel OOM record named it, no OOM counter moved"
        if not ev.kernel_log_readable:
            why = "the kernel log was not readable and no OOM counter moved"
        items: list[EvidenceItem] = []
        lost = lost_near(victim, ev)
        if lost:
            why = f"no OOM counter moved, but {lost} kernel log records near the death were lost unread"
            items.append(lost_item(lost))
        items.append(EvidenceItem("counters", None, "vmstat oom_kill and the cgroup's oom_kill did not move"))
        for comm, pid in ev.oom_daemons:
            items.append(
                EvidenceItem(
                    "proc",
                    None,
                    f"{comm} (pid {pid}) runs on this machine and kills by signal: it may have sent this one",
                )
            )
        if ev.oom_daemons:
            names = ", ".join(f"{c} (pid {p})" for c, p in ev.oom_daemons)
            why += f"; {names} runs here and may have sent it"
        sure = (
            Confidence.LIKELY
            if ev.kernel_log_readable and not ev.oom_daemons and not lost
            else Confidence.POSSIBLE
        )
        logged = job_log(victim, ev, sure)
        if logged is not None:
            return Step((*items, logged[3]), verdict=logged[:3])
        hung = _hung_until_killed(victim, ev)
        if hung.verdict is not None:
            return Step((*items, *hung.items), hung.facts, hung.verdict)
        why = f"{who} was killed by a SIGKILL from outside: {why}. The sender is unknown."
        return Step(tuple(items), verdict=(Kind.EXTERNAL_SIGNAL, sure, why))
    return Step()


def _own_words(c: _Case) -> Step:
    """Its own words and its GPU: a named cause before a GPU fault, a GPU fault before a bare
    exception. The lines its own words cite stand, whichever decides."""
    told = from_output(c.victim, c.ev)
    if told.verdict is not None and told.verdict[0] != Kind.PYTHON_EXCEPTION:
        return told
    gpu = gpu_fault(c.victim, c.ev)
    if gpu.verdict is not None:
        return Step(told.items + gpu.items, verdict=gpu.verdict)
    return told


def _kernel_line(c: _Case) -> Step:
    """The kernel's own line for the pid (a fault record)."""
    recorded = kernel_record(c.victim, c.ev)
    if recorded is not None:
        kind, confidence, summary, item = recorded
        return Step((item,), verdict=(kind, confidence, summary))
    return Step()


def _by_status(c: _Case) -> Step:
    """Its signal or exit status, with the job's logs: always an answer."""
    victim, ev, who, fault = c.victim, c.ev, c.who, c.fault
    sig = victim.signal
    sure = Confidence.CERTAIN if fault else Confidence.LIKELY
    # the job's logs decide what would otherwise be only possible (an abort, a signal from
    # outside, an exit status): a scheduler's cancel banner, a launcher's report
    logged = None if sig in (_signal.SIGSEGV, _signal.SIGBUS) else job_log(victim, ev, Confidence.POSSIBLE)
    if sig == _signal.SIGSEGV:
        return Step(verdict=(Kind.SEGFAULT, sure, f"{who} crashed with a segmentation fault (SIGSEGV)."))
    if sig == _signal.SIGBUS:
        return Step(verdict=(Kind.BUS_ERROR, sure, f"{who} crashed with SIGBUS (often /dev/shm exhausted)."))
    if sig == _signal.SIGABRT:
        timed_out = timeout_elsewhere(victim, ev)
        if timed_out is not None:
            # the watchdog takes the whole process down (abort) once a collective timed
            # out: another rank's word that one did explains this rank's SIGABRT
            label, line = timed_out
            return Step(
                (EvidenceItem("output", None, line),),
                verdict=(
                    Kind.COLLECTIVE_TIMEOUT,
                    Confidence.LIKELY if ev.from_logs else Confidence.POSSIBLE,
                    f"{who} aborted (SIGABRT) as the NCCL watchdog does after a collective timed out: "
                    + (f"{rank_label(label, ev.from_logs)}" if label else "a rank")
                    + " reported the timeout; this rank's own output gave no other cause.",
                ),
            )
        if logged is not None:
            return Step((logged[3],), verdict=logged[:3])
        why = f"{who} aborted (SIGABRT); no collective-timeout evidence was read."
        return Step(verdict=(Kind.ABORT, Confidence.POSSIBLE, why))
    if logged is not None:
        return Step((logged[3],), verdict=logged[:3])
    if sig is not None:
        why = f"{who} was killed by {signal_name(sig)} from outside; the sender is unknown."
        return Step(verdict=(Kind.EXTERNAL_SIGNAL, Confidence.POSSIBLE, why))
    if victim.exit_code is None:
        why = (
            f"{who} ended but its exit status could not be read (run trainwatch as root in the host's "
            "namespaces so the process connector reports exits)."
        )
        return Step(verdict=(Kind.UNKNOWN, Confidence.POSSIBLE, why))
    read = (
        "its output named no exception."
        if ev.output_read
        else "its output was not read (run it under `trainwatch run`, or send its output to a file)."
    )
    why = f"{who} exited with status {victim.status}, as Python does after an uncaught exception; " + read
    return Step(verdict=(Kind.PYTHON_EXCEPTION, Confidence.POSSIBLE, why))


_KILLERS = (
    _kernel_oom_record,
    _self_signalled,
    _traced_sender,
    _agent_signalled,
    _userspace_daemon,
    _sigkill,
    _own_words,
    _kernel_line,
    _by_status,
)


def _hung_until_killed(victim: RankState, ev: Evidence) -> Step:
    """A SIGKILL no record explains, after the process's own words that it hung: its
    watchdog's timeout (SGLang's kills its whole process tree with SIGKILL; a collective
    that never completed leaves a rank to whoever kills it). A rank hung until it was killed
    died of the hang, at ``likely``: the sender of the SIGKILL is not known. Its words' lines
    and facts are cited only then."""
    told = from_output(victim, ev)
    if told.verdict is None or told.verdict[0] != Kind.COLLECTIVE_TIMEOUT:
        return Step()
    _, confidence, summary = told.verdict
    why = f"{summary.rstrip('.')}; it was then killed by SIGKILL (the sender is unknown)."
    return Step(told.items, told.facts, (Kind.COLLECTIVE_TIMEOUT, weaker(confidence, Confidence.LIKELY), why))


def _by_counters(ev: Evidence, victim: RankState, who: str) -> Step:
    """A SIGKILL no record explains, read by the OOM counters that moved across it (rule 3):
    the cgroup's own OOM where its counter moved and its limit was reached, the kernel's where
    only the host's moved or where no level above the rank has a limit to reach; an OOM killer
    outside the cgroup's limit, at ``possible``, where its counter moved but its limit was not
    reached (the global killer, or a wider limit above it); no verdict where no counter moved."""
    host, cgroup, path, reached = counter_moved(ev, victim)
    if not (host or cgroup):
        return Step()
    items: list[EvidenceItem] = []
    if ev.host_oom_kills_before is not None:
        items.append(
            EvidenceItem(
                "vmstat",
                None,
                f"/proc/vmstat oom_kill {ev.host_oom_kills_before} -> {ev.host_oom_kills_after}",
            )
        )
    if cgroup and path:
        items.append(
            EvidenceItem(
                "cgroup",
                None,
                f"{path} oom_kill {ev.cgroup_oom_kills_before[path]} -> {ev.cgroup_oom_kills_after[path]}",
            )
        )
        if reached is not None:
            hits = f"{ev.cgroup_limit_hits_before[path]} -> {ev.cgroup_limit_hits_after[path]}"
            items.append(
                EvidenceItem("cgroup", None, f"{path} limit reached (memory.events oom / failcnt) {hits}")
            )
    missing = "no kernel log record named the pid" + (
        "" if ev.kernel_log_readable else " (the kernel log was not readable)"
    )
    lost = lost_near(victim, ev)
    if lost:
        missing += f" ({lost} records near the death were overwritten unread)"
        items.append(lost_item(lost))
    limit = victim.cgroup_limited_by
    if cgroup and path and path != "/" and limit is not None and reached is not False:
        where = f"; the limit above it is {limit}'s" if limit != path else ""
        if reached:
            why = (
                f"{who} was SIGKILLed as the OOM counter of memory cgroup {path} moved and the cgroup "
                f"reached its limit{where}; {missing}."
            )
            return Step(tuple(items), verdict=(Kind.CGROUP_OOM, Confidence.LIKELY, why))
        why = (
            f"{who} was SIGKILLed as the OOM counter of memory cgroup {path} moved{where}; whether the "
            f"cgroup reached its limit could not be read (the global OOM killer moves the counter too); "
            f"{missing}."
        )
        # any OOM killer moves a cgroup's counter: its limit hits are unread
        return Step(tuple(items), verdict=(Kind.CGROUP_OOM, Confidence.POSSIBLE, why))
    if cgroup and limit is not None and reached is False:
        why = (
            f"{who} was SIGKILLed by an OOM killer: the OOM counter of memory cgroup {path} moved but the "
            f"cgroup never reached its limit ({limit}'s), so the kill was the kernel's global OOM killer's "
            f"or a wider limit's above it; {missing}."
        )
        # or a wider limit above the cgroup's, reached by its siblings
        return Step(tuple(items), verdict=(Kind.KERNEL_OOM, Confidence.POSSIBLE, why))
    why = (
        f"{who} was SIGKILLed as the kernel's OOM counter moved"
        + (f" (and memory cgroup {path}'s, which has no limit to reach)" if cgroup and limit is None else "")
        + f"; {missing}."
    )
    return Step(tuple(items), verdict=(Kind.KERNEL_OOM, Confidence.LIKELY, why))
