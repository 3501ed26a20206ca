"""The verdict: a pure function from a window of evidence to who killed each rank.

No I/O, no clock: everything arrives in ``Evidence``. Rules (CONTRACTS.md, EVIDENCE.md §9):

1. The root cause is the rank that died first by its *own* death time (the exit event),
   not by the time torchrun noticed.
2. A SIGKILL whose pid a kernel OOM record names is ``kernel_oom`` (``global_oom`` /
   ``Out of memory``) or ``cgroup_oom`` (``oom_memcg=`` / ``Memory cgroup out of
   memory``), ``certain``: a first-hand record names the pid.
3. A SIGKILL with no record but with the OOM counters moving across the death (the host's
   vmstat oom_kill and the rank's cgroup oom_kill) is an OOM at ``likely``.
4. A SIGKILL with no record and no counter movement is ``external_signal``, never an OOM.
5. Ranks that died after the root cause by SIGTERM, SIGKILL (torchrun escalates 30 s after
   an ignored SIGTERM) or a status a SIGTERM handler returns, with no OOM record of their
   own, were ended by the agent: ``terminated_by_agent``. Ranks an OOM record names too are
   ``same_cause``.
"""

from __future__ import annotations

import signal as _signal
from dataclasses import replace
from typing import Any

from sidecar.autopsy.evidence import (
    USERSPACE_OOM_DAEMONS,
    Evidence,
    EvidenceItem,
    Facts,
    KernelOom,
    RankState,
    Sender,
    SignalSent,
    UserspaceKill,
    Verdict,
    rank_label,
    rank_name,
    signal_name,
)
from sidecar.autopsy.said import WAITING, findings_of, fits, from_output, gpu_fault, told_of, weaker
from sidecar.autopsy.senders import slurm_detail, tool_of, words
from sidecar.catalog import Hit, catalog
from sidecar.model import Confidence, Fate, Kind
from sidecar.parse.ranks import Finding

__all__ = ["autopsy"]

TEARDOWN_WINDOW_NS = 45 * 10**9  # SIGTERM, then SIGKILL 30 s later, plus slack
OOM_RECORD_WINDOW_NS = 15 * 10**9  # an OOM record this close to a death may explain it
SIGNAL_WINDOW_NS = 5 * 10**9  # a signal this long before a death may have caused it


def _oom_for(rank: RankState, kernel: tuple[KernelOom, ...]) -> KernelOom | None:
    if rank.died_ns is None:
        return None
    pids = {rank.pid, *rank.ns_pids}
    matches = [k for k in kernel if k.pid in pids and abs(k.at_ns - rank.died_ns) <= OOM_RECORD_WINDOW_NS]
    return min(matches, key=lambda k: abs(k.at_ns - (rank.died_ns or 0))) if matches else None


def _kernel_record(victim: RankState, ev: Evidence) -> tuple[Kind, Confidence, str, EvidenceItem] | None:
    """The kernel's own record of this pid's end that the catalog names (``python[4242]:
    segfault at 0 ip ...``), when its kind can have ended the rank the way it ended: the
    kernel wrote it as it delivered the signal, first-hand for that pid."""
    pids = (victim.pid, *victim.ns_pids)
    for at_ns, pid, ident, text in ev.kernel_said:
        message = catalog().by_id.get(ident)
        if pid not in pids or message is None or not fits(message.kind, victim.signal, victim.status):
            continue
        who = rank_name(victim.label, victim.pid, ev.from_logs)
        confidence = message.confidence if message.first_hand else Confidence.LIKELY
        fields = next((h.fields for h in catalog().scan(text) if h.message.id == ident), ())
        return (
            message.kind or Kind.UNKNOWN,
            confidence,
            message.told(who, fields)[:-1] + "; the kernel's own record names the pid.",
            EvidenceItem("kmsg", at_ns if not ev.from_logs else None, text),
        )
    return None


def _job_log(
    victim: RankState, ev: Evidence, at_most: Confidence | None = None
) -> tuple[Kind, Confidence, str, EvidenceItem] | None:
    """What the job's own logs (the agent's stream, a launcher's, a shell's or a scheduler's
    lines among the ranks' output: Slurm's CANCELLED banner, a launcher's report of a child's
    signal) say of this rank's death, ranked as diagnose ranks them (``said.told_of``). Only
    when it is at least as sure as ``at_most``, the verdict it would replace."""
    hits = [h for ident, line in ev.job_said for h in catalog().scan(line) if h.message.id == ident]
    told = told_of(hits, victim.pid, victim.signal, victim.status)
    if told is None:
        return None
    hit, confidence = told
    if at_most is not None and weaker(confidence, at_most) != at_most:
        return None
    m = hit.message
    who = rank_name(victim.label, victim.pid, ev.from_logs)
    return (
        m.kind or Kind.UNKNOWN,
        confidence,
        m.told(who, hit.fields),
        EvidenceItem(m.emitter, None, hit.line),
    )


# how the agent ends its workers (SIGTERM, then SIGKILL after a grace period) and the
# signals a terminal or a scheduler sends to a process group: a rank ended by one of these,
# first of the job, after its agent was signalled from outside, was ended by that
_TEARDOWN_SIGNALS = frozenset({_signal.SIGTERM, _signal.SIGINT, _signal.SIGHUP})


def _agent_signalled(
    victim: RankState, ev: Evidence
) -> tuple[Confidence, str, EvidenceItem, Sender | None] | None:
    """The agent that tore the ranks down was itself sent an ending signal from outside: the
    tracepoint saw it (certain, with its sender), or the agent's own log says it received
    one (the catalog's agent messages of kind external_signal: torchelastic's "Received 15
    death signal", its SignalException naming its own pid: certain when that pid is the
    agent's, else likely)."""
    agent = ev.agent_pid
    if agent is None:
        return None
    until = (victim.died_ns or 0) + 10**8
    traced = [
        s
        for s in ev.signals
        if s.target_pid == agent and s.sender_pid != agent and (victim.died_ns is None or s.at_ns <= until)
    ]
    if traced:
        s = max(traced, key=lambda s: s.at_ns)
        return (
            Confidence.CERTAIN,
            f"was sent {signal_name(s.signal)} from outside by pid {s.sender_pid} ({s.sender_comm})",
            EvidenceItem(
                "tracepoint",
                s.at_ns,
                f"signal_generate: {s.sender_comm}-{s.sender_pid} sent {signal_name(s.signal)} to the agent "
                f"(pid {agent}, si_code {s.code})",
            ),
            s.sender or Sender(s.sender_pid, s.sender_comm, None, None, None, ()),
        )
    best: tuple[Confidence, Hit] | None = None
    for ident, line in ev.job_said:
        m = catalog().by_id.get(ident)
        if m is None or m.channel != "agent" or m.kind != Kind.EXTERNAL_SIGNAL or m.layer != "mechanism":
            continue
        for hit in (h for h in catalog().scan(line) if h.message.id == ident):
            pid = hit.get("pid")
            if pid is not None and pid.isdigit() and int(pid) != agent:
                continue  # another agent's (an earlier run's) line
            sure = Confidence.CERTAIN if pid is not None and m.first_hand else Confidence.LIKELY
            if best is None or (sure == Confidence.CERTAIN and best[0] != Confidence.CERTAIN):
                best = sure, hit
    if best is None:
        return None
    sure, hit = best
    number = hit.get("signal")
    sig = signal_name(int(number)) if number and number.isdigit() else (number or "a signal that ends it")
    return (
        sure,
        f"received {sig} from outside (its own log says so)",
        EvidenceItem(hit.message.emitter, None, hit.line),
        None,
    )


def _timeout_elsewhere(victim: RankState, ev: Evidence) -> tuple[str | None, str] | None:
    """Another rank's (or an unattributed) watchdog or backend timeout in the output read:
    (its rank label, its line)."""
    for label, f in ev.output:
        if label == victim.label:
            continue
        if f.kind in ("nccl_timeout", "gloo_timeout") or (
            f.kind == "said"
            and f.get("said_kind") == Kind.COLLECTIVE_TIMEOUT.value
            and f.get("layer") == "mechanism"
        ):
            return (label or (str(f.rank) if f.rank is not None else None)), f.line
    return None


def _describe_exit(rank: RankState) -> str:
    if rank.exit_code is None:
        return "exit status unknown"
    if rank.signal is not None:
        return f"killed by {signal_name(rank.signal)} (exit code -{rank.signal})"
    return f"exited with status {rank.status}"


# what a rank's output says of another's failure, not of its own: a peer that closed the
# connection, a communicator aborted because of an error elsewhere, the watchdog's progress
# report ("failure detected ... last enqueued work")
_REPORTING_FINDINGS = frozenset({"peer_closed", "nccl_aborted", "nccl_progress"})


def _decides(f: Finding) -> bool:
    if f.kind == "said":
        return bool(f.get("said_kind")) and f.get("layer") in ("mechanism", "symptom")
    return f.kind not in _REPORTING_FINDINGS


def _says_why(findings: list[Finding]) -> bool:
    """Whether these findings (one rank's output) say why it ended: a finding that decides,
    on a line that is not itself a report of another's failure (the gloo line "Connection
    closed by peer" is also an exception's last line; as such it reports, not decides)."""
    reporting = {f.line for f in findings if f.kind in _REPORTING_FINDINGS}
    return any(_decides(f) and f.line not in reporting for f in findings)


def reporters(ev: Evidence) -> frozenset[str]:
    """The ranks that only report the job's failure: their output holds findings, none of
    which says why they ended (a watchdog's "failure detected", the flight recorder's
    notes, a peer that closed the connection), while another rank's output says why. They
    are never the job's reason, whoever ended first: the rank whose words name a cause is
    (both paths; a job-level verdict)."""
    mine: dict[str, list[Finding]] = {}
    for label, f in ev.output:
        if label is not None:
            mine.setdefault(label, []).append(f)
    said = {label: _says_why(fs) for label, fs in mine.items()}
    if not any(said.values()):
        return frozenset()
    return frozenset(label for label, decided in said.items() if not decided)


# what a rank can die of when its cause is elsewhere: an exception, an abort, a timeout
_PEER_KINDS = frozenset({Kind.PYTHON_EXCEPTION, Kind.ABORT, Kind.COLLECTIVE_TIMEOUT, Kind.UNKNOWN})


def only_reports(ev: Evidence, label: str | None, kind: Kind) -> bool:
    """True when this rank's output holds findings and every one of them reports a failure
    elsewhere (a peer that closed the connection, a communicator aborted by another rank's
    error), and it died of what such a report leads to: its cause is on another rank,
    perhaps on another node. ``trainwatch story`` joins nodes on it (``killer.peer_failure``)."""
    if label is None or kind not in _PEER_KINDS:
        return False
    mine = [f for lab, f in ev.output if lab == label]
    return bool(mine) and not _says_why(mine)


def autopsy(ev: Evidence) -> Verdict | None:
    """The verdict for the first abnormal death in ``ev``, or None when no rank died."""
    dead = sorted((r for r in ev.ranks if r.abnormal), key=lambda r: (r.died_ns or 0, r.pid))
    if not dead:
        return None
    told = reporters(ev)
    own = [r for r in dead if r.pid not in ev.agent_teardown and r.label not in told]
    victim = own[0] if own else next((r for r in dead if r.pid not in ev.agent_teardown), dead[0])
    items: list[EvidenceItem] = [
        EvidenceItem(
            _EXIT_SOURCES.get(victim.exit_source or "", "exit" if ev.exits_first_hand else "proc"),
            victim.died_ns,
            f"{rank_name(victim.label, victim.pid, ev.from_logs)} {_describe_exit(victim)}"
            + (" (from the agent's log)" if victim.exit_source == "agent-log" else ""),
        )
    ]
    oom = _oom_for(victim, ev.kernel)
    facts: dict[str, Any] = {}
    kind, confidence, summary = _victim_verdict(victim, oom, ev, items, facts)
    facts["peer_failure"] = only_reports(ev, victim.label, kind)

    fates: dict[str, Fate] = {}
    for r in ev.ranks:
        if r is victim:
            fates[r.label] = Fate.ROOT_CAUSE
        elif not r.dead:
            fates[r.label] = Fate.RUNNING
        elif r.returncode == 0:
            fates[r.label] = Fate.EXITED_CLEANLY
        elif _same_cause(r, kind, ev) or (r.label in told and _died_of_its_own(r)):
            fates[r.label] = Fate.SAME_CAUSE
        elif r.pid in ev.agent_teardown or _ended_by_agent(r, victim):
            fates[r.label] = Fate.TERMINATED_BY_AGENT
        else:
            fates[r.label] = Fate.UNKNOWN
    # the cascade, in order: what the other ranks said as they died
    for r in sorted((r for r in dead if r is not victim), key=lambda r: r.died_ns or 0):
        said: dict[str, int | None] = {}  # a line printed twice (traceback, torchrun's summary) once
        for f in findings_of(r, ev, *WAITING, "exception"):
            said.setdefault(f"then {rank_label(r.label, ev.from_logs)}: {f.line}", f.at_ns)
        for line, at in list(said.items())[:2]:
            items.append(EvidenceItem("output", at or r.died_ns, line))
    # what the job named but could not be read safely, so the reader knows it was not used
    items += [EvidenceItem("skipped", None, why) for why in ev.skipped]
    return Verdict(victim, kind, confidence, summary, tuple(items), fates, oom, Facts(**facts))


def _lost_near(victim: RankState, ev: Evidence, window_ns: int = 60 * 10**9) -> int:
    """Kernel log records lost to an overrun within a minute of the victim's death."""
    if victim.died_ns is None:
        return 0
    return sum(n for at, n in ev.kernel_losses if abs(at - victim.died_ns) <= window_ns)


def _lost_item(lost: int) -> EvidenceItem:
    return EvidenceItem(
        "kmsg",
        None,
        f"{lost} kernel log records were overwritten before trainwatch read them, around this death: "
        "a record naming the pid may have been among them",
    )


def _same_cause(rank: RankState, kind: str, ev: Evidence) -> bool:
    """Killed by the same OOM as the victim (a kernel record or a userspace daemon's), or
    a rank that timed out waiting for the collective the victim's death (or hang) broke."""
    if kind in (Kind.KERNEL_OOM, Kind.CGROUP_OOM) and _oom_for(rank, ev.kernel) is not None:
        return True
    if kind == Kind.USERSPACE_OOM and _userspace_for(rank, ev) is not None:
        return True
    # it died of its own timeout (an exception, the watchdog's abort); a rank the agent
    # signalled while it waited was ended by the agent
    return _died_of_its_own(rank) and bool(findings_of(rank, ev, *WAITING))


def _died_of_its_own(rank: RankState) -> bool:
    """It failed (an exception, an abort), not by a signal the agent or a person sends."""
    by_agent = rank.signal in (_signal.SIGTERM, _signal.SIGKILL, _signal.SIGINT)
    return rank.returncode != 0 and not by_agent


_EXIT_SOURCES = {"connector": "exit", "pidfd": "pidfd", "proc": "proc", "agent-log": "agent-log"}


def _userspace_for(rank: RankState, ev: Evidence) -> tuple[UserspaceKill, str] | None:
    """The userspace OOM daemon's record that explains ``rank``'s death (pid-named first),
    with how it names it; a sender on the tracepoint that is such a daemon counts too."""
    if not rank.dead or rank.returncode == 0:
        return None
    if rank.signal is not None and rank.signal not in (_signal.SIGKILL, _signal.SIGTERM):
        return None
    best: tuple[UserspaceKill, str] | None = None
    for rec in ev.userspace:
        if rec.at_ns is not None and rank.died_ns is not None and abs(rec.at_ns - rank.died_ns) > 60 * 10**9:
            continue
        how = rec.names(rank)
        if how == "pid" and (rec.signal is None or rank.signal is None or rec.signal == rank.signal):
            return rec, how
        if how == "cgroup" and best is None:
            best = rec, how
    if best is None:
        sent = _sender(rank, ev.signals)
        if sent is not None and any(sent.sender_comm.startswith(d) for d in USERSPACE_OOM_DAEMONS):
            return (
                UserspaceKill(sent.sender_comm, rank.pid, None, sent.signal, sent.at_ns, "", "tracepoint"),
                "pid",
            )
    return best


def _sender(rank: RankState, signals: tuple[SignalSent, ...]) -> SignalSent | None:
    """The signal that killed ``rank``: the last one of its death signal sent to it
    shortly before it died."""
    if rank.died_ns is None or rank.signal is None:
        return None
    pids = {rank.pid, *rank.ns_pids}
    candidates = [
        s
        for s in signals
        if s.target_pid in pids
        and s.signal == rank.signal
        and rank.died_ns - SIGNAL_WINDOW_NS <= s.at_ns <= rank.died_ns + 10**8
    ]
    return max(candidates, key=lambda s: s.at_ns) if candidates else None


def _ended_by_agent(rank: RankState, victim: RankState) -> bool:
    if rank.died_ns is None or victim.died_ns is None:
        return False
    after = 0 <= rank.died_ns - victim.died_ns <= TEARDOWN_WINDOW_NS
    # SIGTERM's default action, SIGKILL after the 30 s grace, or a handler's exit status
    by_signal = rank.signal in (_signal.SIGTERM, _signal.SIGKILL, _signal.SIGINT)
    by_handler = rank.status is not None and rank.status in (1, 2, 130, 143)
    return after and (by_signal or by_handler)


def _counter_moved(ev: Evidence, victim: RankState) -> tuple[bool, bool, str | None]:
    host = (
        ev.host_oom_kills_before is not None
        and ev.host_oom_kills_after is not None
        and ev.host_oom_kills_after > ev.host_oom_kills_before
    )
    cgroup_path = None
    cgroup = False
    for path in (victim.cgroup, victim.cgroup_limited_by):
        before, after = ev.cgroup_oom_kills_before.get(path or ""), ev.cgroup_oom_kills_after.get(path or "")
        if before is not None and after is not None and after > before:
            cgroup, cgroup_path = True, path
            break
    return host, cgroup, cgroup_path


def _victim_verdict(
    victim: RankState,
    oom: KernelOom | None,
    ev: Evidence,
    items: list[EvidenceItem],
    facts: dict[str, Any],
) -> tuple[Kind, Confidence, str]:
    """(kind, confidence, summary); what the verdict found as data goes into ``facts``."""
    who = rank_name(victim.label, victim.pid, ev.from_logs)
    if oom is not None:
        for line in oom.lines:
            items.append(EvidenceItem("kmsg", oom.at_ns, line))
        is_global = oom.scope == "global" or (oom.oom_memcg is None and oom.scope != "memcg")
        if is_global and oom.oom_memcg is None:
            rss = f" holding {oom.rss_bytes / 2**30:.1f} GiB" if oom.rss_bytes else ""
            return (
                Kind.KERNEL_OOM,
                Confidence.CERTAIN,
                f"The kernel's OOM killer killed {who}{rss}: the whole machine ran out of memory.",
            )
        limit_cgroup = oom.oom_memcg or victim.cgroup_limited_by or victim.cgroup
        which = f"memory cgroup {limit_cgroup}" if limit_cgroup else "its memory cgroup"
        return (
            Kind.CGROUP_OOM,
            Confidence.CERTAIN,
            f"{who} was killed by the kernel because {which} reached its limit.",
        )
    sent = _sender(victim, ev.signals)
    fault = False  # the kernel delivered it for the rank's own fault (si_code > 0)
    if sent is not None and sent.sender_pid in (victim.pid, *victim.ns_pids):
        fault = sent.code > 0
        # the rank signalled itself: a fault (SIGSEGV, SIGBUS) or abort() (SIGABRT)
        items.append(
            EvidenceItem(
                "tracepoint",
                sent.at_ns,
                f"signal_generate: the rank itself raised {signal_name(sent.signal)} (si_code {sent.code})",
            )
        )
        sent = None
    if sent is not None and not (sent.code == 128 and victim.signal == _signal.SIGKILL):
        name = signal_name(sent.signal)
        sender = sent.sender or Sender(sent.sender_pid, sent.sender_comm, None, None, None, ())
        tool = tool_of(sender, ev.agent_pid, victim.cgroup)
        detail, said = slurm_detail(sender, victim.slurm_times) if tool == "slurm" else (None, words(tool))
        facts["sender"] = replace(sender, tool=tool, detail=detail)
        chain = ", ".join(f"{comm} ({pid})" for pid, comm, _ in sender.parents[:4])
        items.append(
            EvidenceItem(
                "tracepoint",
                sent.at_ns,
                f"signal_generate: {sent.sender_comm}-{sent.sender_pid} "
                f"sent {name} to pid {sent.target_pid} (si_code {sent.code})",
            )
        )
        if any(sent.sender_comm.startswith(d) for d in USERSPACE_OOM_DAEMONS):
            return (
                Kind.USERSPACE_OOM,
                Confidence.CERTAIN,
                f"{who} was killed by the userspace OOM daemon {sent.sender_comm} (pid {sent.sender_pid}), "
                f"which sent {name}.",
            )
        if ev.agent_pid is not None and sent.sender_pid == ev.agent_pid:
            upstream = _agent_signalled(victim, ev)
            if upstream is not None:
                confidence, how, item, agent_sender = upstream
                items.append(item)
                if agent_sender is not None:
                    facts["sender"] = replace(
                        agent_sender, tool=tool_of(agent_sender, ev.agent_pid, victim.cgroup), detail=None
                    )
                return (
                    Kind.EXTERNAL_SIGNAL,
                    confidence,
                    f"The torchrun agent (pid {ev.agent_pid}) {how} and shut the workers down: {who} was "
                    f"sent {name} by it before any rank died of its own.",
                )
            return (
                Kind.AGENT_TEARDOWN,
                Confidence.CERTAIN,
                f"{who} was sent {name} by the torchrun agent (pid {sent.sender_pid}) "
                "before any other rank died.",
            )
        if tool in ("unknown", "torchelastic"):
            return (
                Kind.EXTERNAL_SIGNAL,
                Confidence.CERTAIN,
                f"{who} was killed from outside: pid {sent.sender_pid} ({sent.sender_comm}) sent {name}"
                + (f" (started by {chain})." if chain else "."),
            )
        return (
            Kind.EXTERNAL_SIGNAL,
            Confidence.CERTAIN,
            f"{who} was killed from outside by {said}: pid {sent.sender_pid} ({sent.sender_comm}) "
            f"sent {name}" + (f" (started by {chain})." if chain else "."),
        )
    torn = victim.pid in ev.agent_teardown
    if sent is None and victim.signal is not None and (torn or victim.signal in _TEARDOWN_SIGNALS):
        # no rank died of its own first (the victim is the first death), the sender of its
        # signal is not traced, and the agent says it was itself signalled from outside
        upstream = _agent_signalled(victim, ev)
        if upstream is not None:
            confidence, how, item, _ = upstream
            items.append(item)
            ended = (
                f"its log says it sent {who} {signal_name(victim.signal)}"
                if torn
                else f"{who} ended by {signal_name(victim.signal)} as the job was shut down"
            )
            return (
                Kind.EXTERNAL_SIGNAL,
                weaker(confidence, Confidence.LIKELY),  # that the agent's signal ended it is inferred
                f"The torchrun agent (pid {ev.agent_pid}) {how} and shut the workers down; {ended}.",
            )
    found = _userspace_for(victim, ev)
    if found is not None:
        rec, how = found
        items.append(EvidenceItem(rec.source, rec.at_ns, rec.detail))
        did = f"sent {signal_name(rec.signal)}" if rec.signal else "killed it"
        if how == "pid":
            return (
                Kind.USERSPACE_OOM,
                Confidence.CERTAIN,
                f"{who} was killed by the userspace OOM daemon {rec.daemon}, whose own record names "
                f"the pid ({did}).",
            )
        return (
            Kind.USERSPACE_OOM,
            Confidence.LIKELY,
            f"{who} was killed with its cgroup {rec.cgroup} by the userspace OOM daemon {rec.daemon} "
            f"({rec.source} record); the record names the cgroup, not the pid.",
        )
    if victim.signal == _signal.SIGKILL:
        host, cgroup, path = _counter_moved(ev, victim)
        if host or cgroup:
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
                        f"{path} oom_kill {ev.cgroup_oom_kills_before[path]} -> "
                        f"{ev.cgroup_oom_kills_after[path]}",
                    )
                )
            missing = "no kernel log record named the pid" + (
                "" if ev.kernel_log_readable else " (the kernel log was not readable)"
            )
            lost = _lost_near(victim, ev)
            if lost:
                missing += f" ({lost} records near the death were overwritten unread)"
                items.append(_lost_item(lost))
            if cgroup and path and path != "/":
                limit = victim.cgroup_limited_by
                where = f"; the limit above it is {limit}'s" if limit and limit != path else ""
                return (
                    Kind.CGROUP_OOM,
                    Confidence.LIKELY,
                    f"{who} was SIGKILLed as the OOM counter of memory cgroup {path} moved{where}; "
                    f"{missing}.",
                )
            return (
                Kind.KERNEL_OOM,
                Confidence.LIKELY,
                f"{who} was SIGKILLed as the kernel's OOM counter moved; {missing}.",
            )
        why = "no kernel OOM record named it, no OOM counter moved"
        if not ev.kernel_log_readable:
            why = "the kernel log was not readable and no OOM counter moved"
        lost = _lost_near(victim, ev)
        if lost:
            why = f"no OOM counter moved, but {lost} kernel log records near the death were lost unread"
            items.append(_lost_item(lost))
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
        logged = _job_log(victim, ev, sure)
        if logged is not None:
            items.append(logged[3])
            return logged[:3]
        return (
            Kind.EXTERNAL_SIGNAL,
            sure,
            f"{who} was killed by a SIGKILL from outside: {why}. The sender is unknown.",
        )
    told_facts: dict[str, Any] = {}
    told = from_output(victim, ev, items, told_facts)
    if told is not None and told[0] != Kind.PYTHON_EXCEPTION:
        facts.update(told_facts)
        return told
    gpu = gpu_fault(victim, ev, items)
    if gpu is not None:
        return gpu
    if told is not None:
        facts.update(told_facts)
        return told
    recorded = _kernel_record(victim, ev)
    if recorded is not None:
        kind, confidence, summary, item = recorded
        items.append(item)
        return kind, confidence, summary
    sig = victim.signal
    sure = Confidence.CERTAIN if fault else Confidence.LIKELY
    # the job's logs decide what would otherwise be only possible (an abort, a signal from
    # outside, an exit status): a scheduler's cancel banner, a launcher's report
    logged = None if sig in (_signal.SIGSEGV, _signal.SIGBUS) else _job_log(victim, ev, Confidence.POSSIBLE)
    if sig == _signal.SIGSEGV:
        return Kind.SEGFAULT, sure, f"{who} crashed with a segmentation fault (SIGSEGV)."
    if sig == _signal.SIGBUS:
        return Kind.BUS_ERROR, sure, f"{who} crashed with SIGBUS (often /dev/shm exhausted)."
    if sig == _signal.SIGABRT:
        timed_out = _timeout_elsewhere(victim, ev)
        if timed_out is not None:
            # the watchdog takes the whole process down (abort) once a collective timed
            # out: another rank's word that one did explains this rank's SIGABRT
            label, line = timed_out
            items.append(EvidenceItem("output", None, line))
            return (
                Kind.COLLECTIVE_TIMEOUT,
                Confidence.LIKELY if ev.from_logs else Confidence.POSSIBLE,
                f"{who} aborted (SIGABRT) as the NCCL watchdog does after a collective timed out: "
                + (f"{rank_label(label, ev.from_logs)}" if label else "a rank")
                + " reported the timeout; this rank's own output gave no other cause.",
            )
        if logged is not None:
            items.append(logged[3])
            return logged[:3]
        return (
            Kind.ABORT,
            Confidence.POSSIBLE,
            f"{who} aborted (SIGABRT); no collective-timeout evidence was read.",
        )
    if logged is not None:
        items.append(logged[3])
        return logged[:3]
    if sig is not None:
        return (
            Kind.EXTERNAL_SIGNAL,
            Confidence.POSSIBLE,
            f"{who} was killed by {signal_name(sig)} from outside; the sender is unknown.",
        )
    if victim.exit_code is None:
        return (
            Kind.UNKNOWN,
            Confidence.POSSIBLE,
            f"{who} ended but its exit status could not be read (run trainwatch as root in the host's "
            "namespaces so the process connector reports exits).",
        )
    return (
        Kind.PYTHON_EXCEPTION,
        Confidence.POSSIBLE,
        f"{who} exited with status {victim.status}, as Python does after an uncaught exception; "
        + (
            "its output named no exception."
            if ev.output_read
            else "its output was not read (run it under `trainwatch run`, or send its output to a file)."
        ),
    )
