"""Who saw a rank's death: each record that can name what ended it, found for one rank.

No I/O, no clock: everything arrives in ``Evidence``. The kernel's OOM record naming the
pid near the death, the traced sender of its death signal, a userspace OOM daemon's record
(naming the pid, else the cgroup), the kernel's own line for the pid (a segfault), what the
job's logs say of it, the agent's word that it was itself signalled from outside, the OOM
counters across the death and the kernel records lost near it. The killers' rules
(``killers``) weigh them; ``peers`` asks some of them of the other ranks.
"""

from __future__ import annotations

import signal as _signal

from sidecar.autopsy.evidence import (
    USERSPACE_OOM_DAEMONS,
    Evidence,
    EvidenceItem,
    KernelOom,
    RankState,
    SignalSent,
    UserspaceKill,
    rank_name,
    signal_name,
)
from sidecar.autopsy.ranking import fits, told_of, weaker
from sidecar.catalog import Hit, catalog
from sidecar.model import Confidence, Kind
from sidecar.model.events import Sender

__all__ = [
    "OOM_RECORD_WINDOW_NS",
    "SIGNAL_WINDOW_NS",
    "agent_signalled",
    "counter_moved",
    "job_log",
    "kernel_record",
    "lost_item",
    "lost_near",
    "oom_for",
    "sender_of",
    "userspace_for",
]

OOM_RECORD_WINDOW_NS = 15 * 10**9  # an OOM record this close to a death may explain it
SIGNAL_WINDOW_NS = 5 * 10**9  # a signal this long before a death may have caused it


def oom_for(rank: RankState, kernel: tuple[KernelOom, ...]) -> KernelOom | None:
    if rank.died_ns is None:
        return None
    pids = {rank.pid, *rank.ns_pids}
    matches = [k for k in kernel if k.pid in pids and abs(k.at_ns - rank.died_ns) <= OOM_RECORD_WINDOW_NS]
    return min(matches, key=lambda k: abs(k.at_ns - (rank.died_ns or 0))) if matches else None


def kernel_record(victim: RankState, ev: Evidence) -> tuple[Kind, Confidence, str, EvidenceItem] | None:
    """The kernel's own record of this pid's end that the catalog names (``python[4242]:
    segfault at 0 ip ...``), when its kind can have ended the rank the way it ended: the
    kernel wrote it as it delivered the signal, first-hand for that pid."""
    pids = (victim.pid, *victim.ns_pids)
    for at_ns, pid, ident, text in ev.kernel_said:
        message = catalog().by_id.get(ident)
        if pid not in pids or message is None or not fits(message.kind, victim.signal, victim.status):
            continue
        who = rank_name(victim.label, victim.pid, ev.from_logs)
        # another's word is at most likely, and never surer than the catalog says the message is
        confidence = (
            message.confidence if message.first_hand else weaker(message.confidence, Confidence.LIKELY)
        )
        fields = next((h.fields for h in catalog().scan(text) if h.message.id == ident), ())
        return (
            message.kind or Kind.UNKNOWN,
            confidence,
            message.told(who, fields)[:-1] + "; the kernel's own record names the pid.",
            EvidenceItem("kmsg", at_ns if not ev.from_logs else None, text),
        )
    return None


def job_log(
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


def agent_signalled(
    victim: RankState, ev: Evidence
) -> tuple[Confidence, str, EvidenceItem, Sender | None] | None:
    """The agent that tore the ranks down was itself sent an ending signal from outside: the
    tracepoint saw it (certain, with its sender), or the agent's own log says it received
    one (the catalog's agent messages of kind external_signal: torchelastic's "Received 15
    death signal", its SignalException naming its own pid: likely at most, the messages'
    ceiling, for the log does not say who sent it; a SIGTERM possible, for an OOM daemon's
    or an eviction's reads the same)."""
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
            # at most the message's ceiling: the agent's word says a signal came, not who sent
            # it (an OOM daemon's SIGTERM or an eviction's is another killer)
            sure = weaker(
                m.confidence, Confidence.CERTAIN if pid is not None and m.first_hand else Confidence.LIKELY
            )
            if best is None or (sure == Confidence.CERTAIN and best[0] != Confidence.CERTAIN):
                best = sure, hit
    if best is None:
        return None
    sure, hit = best
    number = hit.get("signal")
    if hit.message.untold_sigterm(number):  # an OOM daemon's or an eviction's reads the same
        sure = weaker(sure, Confidence.POSSIBLE)
    sig = signal_name(int(number)) if number and number.isdigit() else (number or "a signal that ends it")
    return (
        sure,
        f"received {sig} from outside (its own log says so)",
        EvidenceItem(hit.message.emitter, None, hit.line),
        None,
    )


def lost_near(victim: RankState, ev: Evidence, window_ns: int = 60 * 10**9) -> int:
    """Kernel log records lost to an overrun within a minute of the victim's death."""
    if victim.died_ns is None:
        return 0
    return sum(n for at, n in ev.kernel_losses if abs(at - victim.died_ns) <= window_ns)


def lost_item(lost: int) -> EvidenceItem:
    return EvidenceItem(
        "kmsg",
        None,
        f"{lost} kernel log records were overwritten before trainwatch read them, around this death: "
        "a record naming the pid may have been among them",
    )


def userspace_for(rank: RankState, ev: Evidence) -> tuple[UserspaceKill, str] | None:
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
        sent = sender_of(rank, ev.signals)
        if sent is not None and any(sent.sender_comm.startswith(d) for d in USERSPACE_OOM_DAEMONS):
            return (
                UserspaceKill(sent.sender_comm, rank.pid, None, sent.signal, sent.at_ns, "", "tracepoint"),
                "pid",
            )
    return best


def sender_of(rank: RankState, signals: tuple[SignalSent, ...]) -> SignalSent | None:
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


def counter_moved(ev: Evidence, victim: RankState) -> tuple[bool, bool, str | None, bool | None]:
    """Which OOM counters moved across the victim's death: (the host's vmstat oom_kill, the
    oom_kill of its memory cgroup or the level limiting it, that cgroup's path, whether that
    cgroup reached its limit meanwhile: None where its limit hits could not be read).

    A cgroup's oom_kill counts its processes killed by *any* OOM killer (cgroup v2's
    memory.events says so; v1's memory.oom_control counts the same event): the global OOM
    killer's kill of a rank moves its cgroup's counter too. Only the limit hits
    (``CgroupSample.limit_hits``) say the cgroup's own limit was reached."""
    before, after = ev.host_oom_kills_before, ev.host_oom_kills_after
    rise = after - before if before is not None and after is not None else 0
    host = rise > 0
    if host and ev.kernel_log_readable and not lost_near(victim, ev) and victim.died_ns is not None:
        # /proc/vmstat's oom_kill counts every OOM kill on the host, each container's too, and
        # the kernel writes "Killed process <pid>" for every kill it counts (never rate-limited,
        # unlike the report before it): where the log was read and lost nothing near the death,
        # a rise no record of this pid explains is another process's kill (another job's cgroup
        # OOM on a shared node, whose record may reach the reader after the counter moved)
        host = any(o.pid == victim.pid for o in ev.kernel)
    for path in (victim.cgroup, victim.cgroup_limited_by):
        before, after = ev.cgroup_oom_kills_before.get(path or ""), ev.cgroup_oom_kills_after.get(path or "")
        if before is not None and after is not None and after > before:
            hits = ev.cgroup_limit_hits_before.get(path or ""), ev.cgroup_limit_hits_after.get(path or "")
            reached = None if hits[0] is None or hits[1] is None else hits[1] > hits[0]
            return host, True, path, reached
    return host, False, None, None
