"""The other ranks: whose output only reports a failure elsewhere, and how the ranks after
the first death ended.

No I/O, no clock: everything arrives in ``Evidence``. A rank whose output holds findings,
none of which says why it ended (a peer that closed the connection, a communicator aborted
by another rank's error), is never the job's reason (``reporters``, ``only_reports``);
another rank's collective timeout explains an abort (``timeout_elsewhere``); a rank that
died after the root cause died of the same cause or was ended by the agent's teardown
(rule 5 of ``rules``).
"""

from __future__ import annotations

import signal as _signal

from sidecar.autopsy.evidence import Evidence, RankState
from sidecar.autopsy.said import WAITING, findings_of
from sidecar.autopsy.witnesses import oom_for, userspace_for
from sidecar.model import Kind
from sidecar.parse.ranks import Finding

__all__ = [
    "TEARDOWN_WINDOW_NS",
    "died_of_its_own",
    "ended_by_agent",
    "left_behind",
    "only_reports",
    "reporters",
    "same_cause",
    "says_why",
    "timeout_elsewhere",
]

TEARDOWN_WINDOW_NS = 45 * 10**9  # SIGTERM, then SIGKILL 30 s later, plus slack


def timeout_elsewhere(victim: RankState, ev: Evidence) -> tuple[str | None, str] | None:
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


# what a rank's output says of another's failure, not of its own: a peer that closed the
# connection, a communicator aborted because of an error elsewhere, the watchdog's progress
# report ("failure detected ... last enqueued work"), any catalog report of the rank's output
# (Horovod's "has been shut down": parse/ranks.py's "reports")
_REPORTING_FINDINGS = frozenset({"peer_closed", "nccl_aborted", "nccl_progress", "reports"})


def _decides(f: Finding) -> bool:
    if f.kind == "said":
        return bool(f.get("said_kind")) and f.get("layer") in ("mechanism", "symptom")
    return f.kind not in _REPORTING_FINDINGS


def says_why(findings: list[Finding]) -> bool:
    """Whether these findings (one rank's output) say why it ended: a finding that decides,
    on a line that is not itself a report of another's failure (the gloo line "Connection
    closed by peer", Horovod's "has been shut down" are also an exception's last line; as
    such they report, not decide)."""
    reporting = {f.line for f in findings if f.kind in _REPORTING_FINDINGS}
    return any(_decides(f) and f.line not in reporting for f in findings)


def _by_rank(ev: Evidence) -> dict[str, list[Finding]]:
    """Each rank's findings in its output (unattributed lines left out), in order."""
    mine: dict[str, list[Finding]] = {}
    for label, f in ev.output:
        if label is not None:
            mine.setdefault(label, []).append(f)
    return mine


def reporters(ev: Evidence) -> frozenset[str]:
    """The ranks that only report the job's failure: their output holds findings, none of
    which says why they ended (a watchdog's "failure detected", the flight recorder's
    notes, a peer that closed the connection), while another rank's output says why. They
    are never the job's reason, whoever ended first: the rank whose words name a cause is
    (both paths; a job-level verdict)."""
    mine = _by_rank(ev)
    said = {label: says_why(fs) for label, fs in mine.items()}
    if not any(said.values()):
        return frozenset()
    return frozenset(label for label, decided in said.items() if not decided)


# The exits that order deaths to the millisecond (the kernel's exit event, a pidfd); a zombie
# seen in /proc or the agent's log only say when a death was noticed, one moment for several.
_TIMED = frozenset({"connector", "pidfd"})
# A launcher's teardown starts with SIGTERM (or SIGINT) and sends SIGKILL only a grace period
# later (torchrun 30 s, Slurm's KillWait 30 s): a SIGKILL closer than this to a rank's end
# was not the teardown of that rank's failure.
_BEFORE_ANY_GRACE_NS = 5 * 10**9


def left_behind(ev: Evidence, dead: list[RankState]) -> frozenset[str]:
    """The ranks whose output only reports that a peer's end of the connection went away
    (gloo's "Connection closed by peer", a reset or broken pipe under a read or a write:
    the peer's process ended first), while another rank of the job, whose output reports
    no such thing, was killed by a signal no teardown starts with (a SIGKILL, a crash)
    at a time the exits cannot put after theirs. That rank is the peer they report; they
    are never the job's reason. Where both exits are timed to the millisecond, the order
    decides and this changes nothing; where a death is only known when it was noticed (a
    zombie, the agent's failure table, whose "first observed failure" is the agent's
    order), the words do."""
    mine = _by_rank(ev)
    closed = {
        label for label, fs in mine.items() if any(f.kind == "peer_closed" for f in fs) and not says_why(fs)
    }
    out = set()
    for r in dead:
        if r.label not in closed or r.died_ns is None:
            continue
        for q in dead:
            if q is r or q.label in closed or q.pid in ev.agent_teardown or q.died_ns is None:
                continue
            if q.signal is None or q.signal in (_signal.SIGTERM, _signal.SIGINT):
                continue  # its own exit, or how a teardown starts: no word on who went first
            timed = r.exit_source in _TIMED and q.exit_source in _TIMED
            if (q.died_ns > r.died_ns) if timed else (q.died_ns - r.died_ns > _BEFORE_ANY_GRACE_NS):
                continue  # known to have died after it
            out.add(r.label)
            break
    return frozenset(out)


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
    return bool(mine) and not says_why(mine)


def same_cause(rank: RankState, kind: str, ev: Evidence) -> bool:
    """Killed by the same OOM as the victim (a kernel record or a userspace daemon's), or
    a rank that timed out waiting for the collective the victim's death (or hang) broke."""
    if kind in (Kind.KERNEL_OOM, Kind.CGROUP_OOM) and oom_for(rank, ev.kernel) is not None:
        return True
    if kind == Kind.USERSPACE_OOM and userspace_for(rank, ev) is not None:
        return True
    # it died of its own timeout (an exception, the watchdog's abort); a rank the agent
    # signalled while it waited was ended by the agent
    return died_of_its_own(rank) and bool(findings_of(rank, ev, *WAITING))


def died_of_its_own(rank: RankState) -> bool:
    """It failed (an exception, an abort), not by a signal the agent or a person sends."""
    by_agent = rank.signal in (_signal.SIGTERM, _signal.SIGKILL, _signal.SIGINT)
    return rank.returncode != 0 and not by_agent


def ended_by_agent(rank: RankState, victim: RankState) -> bool:
    if rank.died_ns is None or victim.died_ns is None:
        return False
    after = 0 <= rank.died_ns - victim.died_ns <= TEARDOWN_WINDOW_NS
    # SIGTERM's default action, SIGKILL after the 30 s grace, or a handler's exit status
    by_signal = rank.signal in (_signal.SIGTERM, _signal.SIGKILL, _signal.SIGINT)
    by_handler = rank.status is not None and rank.status in (1, 2, 130, 143)
    return after and (by_signal or by_handler)
