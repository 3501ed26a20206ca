"""The verdict: a pure function from a window of evidence to who killed each rank.

This module orders the deaths, picks the first of a rank's own (``peers`` rules out
the ranks that only report another's failure), asks ``killers`` what ended it and gives
every rank its fate; ``witnesses`` finds the records the rules weigh.

No I/O, no clock: everything arrives in ``Evidence``. Rules (CONTRACTS.md, EVIDENCE.md §9):

1. The root cause is the rank that died first by its *own* death time (the exit event),
   not by the time torchrun noticed. A rank whose words only report a peer's end gone
   (gloo's "Connection closed by peer") died after that peer: where the exits cannot order
   them (noticed, not timed), a rank killed then by SIGKILL or a crash is that peer.
2. A SIGKILL whose pid a kernel OOM record names is ``kernel_oom`` (``global_oom`` /
   ``Out of memory``) or ``cgroup_oom`` (``oom_memcg=`` / ``Memory cgroup out of
   memory``), ``certain``: a first-hand record names the pid.
3. A SIGKILL with no record but with the OOM counters moving across the death (the rank's
   cgroup oom_kill; the host's vmstat oom_kill only where the kernel log could not be read or
   lost records near the death) is an OOM at ``likely``. A cgroup's oom_kill counts kills by
   any OOM killer: it is a cgroup OOM only where the cgroup's limit was reached across the
   death (its limit hits), else the kernel's (``killers._by_counters``).
4. A SIGKILL with no record and no counter movement is ``external_signal``, never an OOM.
5. Ranks that died after the root cause by SIGTERM, SIGKILL (torchrun escalates 30 s after
   an ignored SIGTERM) or a status a SIGTERM handler returns, with no OOM record of their
   own, were ended by the agent: ``terminated_by_agent``. Ranks an OOM record names too are
   ``same_cause``.
6. A collective timeout is the consequence of a rank that never waited in it and whose own
   words say it failed (an exception, a fault, a CUDA OOM), alive or not: that failure is
   the verdict, at most ``likely``, unless the lines' times or order put it after.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from sidecar.autopsy.evidence import (
    Evidence,
    EvidenceItem,
    Facts,
    RankState,
    Verdict,
    rank_label,
    rank_name,
    signal_name,
)
from sidecar.autopsy.killers import victim_verdict
from sidecar.autopsy.peers import (
    died_of_its_own,
    ended_by_agent,
    left_behind,
    only_reports,
    reporters,
    same_cause,
    says_why,
)
from sidecar.autopsy.ranking import weaker
from sidecar.autopsy.said import WAITING, findings_of, from_output
from sidecar.autopsy.witnesses import oom_for
from sidecar.model import Confidence, Fate, Kind
from sidecar.parse.ranks import Finding

__all__ = ["autopsy"]

_EXIT_SOURCES = {"connector": "exit", "pidfd": "pidfd", "proc": "proc", "agent-log": "agent-log"}


def _describe_exit(rank: RankState) -> str:
    if rank.exit_code is None:
        return "exit status unknown"
    if rank.signal is not None:
        return f"killed by {signal_name(rank.signal)} (exit code -{rank.signal})"
    return f"exited with status {rank.status}"


# what a rank's own words can say it failed of, alive or not, that keeps it from the next
# collective: never a timeout (it waited too), a signal or nothing said
_OWN_FAILURES = frozenset(
    {Kind.PYTHON_EXCEPTION, Kind.ABORT, Kind.SEGFAULT, Kind.BUS_ERROR, Kind.CUDA_OOM, Kind.GPU_ERROR}
)


def _failed_and_never_arrived(
    victim: RankState, ev: Evidence, told: frozenset[str]
) -> tuple[RankState, tuple[Kind, Confidence, str], list[EvidenceItem], dict[str, Any]] | None:
    """The victim's collective timed out; a rank that never waited in it says in its own words
    that it failed (an exception, a fault, a CUDA OOM), alive or not: that failure is why it
    never arrived, and the timeout its consequence (a process can outlive its traceback, a
    non-daemon thread holding it, its sockets open, until the agent ends it after the peer's
    timeout). Its verdict, at most likely (which came first, the words order, not a clock);
    none when the lines' own times put that failure after the timeout."""
    waited = findings_of(victim, ev, "nccl_timeout", "gloo_timeout")
    timed_out = min((f.at_ns for f in waited if f.at_ns is not None), default=None)
    for r in ev.ranks:
        if r is victim or r.label in told or findings_of(r, ev, *WAITING):
            continue
        own = [f for f in findings_of(r, ev) if f.kind != "nccl_progress"]
        if not own or not says_why(own):
            continue
        said_at = min((f.at_ns for f in own if f.at_ns is not None), default=None)
        if timed_out is not None and said_at is not None and said_at > timed_out:
            continue
        if waited and _written_after(own, waited[0], ev):
            continue  # the same stream wrote its failure after the peer's timeout
        items: list[EvidenceItem] = [
            _exit_item(r, ev),
            EvidenceItem(
                "output",
                None,
                f"{rank_name(r.label, r.pid, ev.from_logs)} failed on its own and never reached the "
                "collective its peers waited in",
            ),
        ]
        # what its words say it failed of, whatever ended it after (the agent's SIGTERM)
        got = from_output(replace(r, exit_code=None), ev)
        if got.verdict is None or got.verdict[0] not in _OWN_FAILURES:
            continue
        items += got.items
        facts = dict(got.facts)
        kind, confidence, summary = got.verdict
        for f in waited[:1]:
            items.append(
                EvidenceItem(
                    "output",
                    f.at_ns,
                    f"then {rank_label(victim.label, ev.from_logs)} timed out waiting for it: {f.line}",
                )
            )
        return r, (kind, weaker(confidence, Confidence.LIKELY), summary), items, facts
    return None


def _written_after(own: list[Finding], timeout: Finding, ev: Evidence) -> bool:
    """Every one of ``own`` was written after ``timeout`` in the stream that holds both (one
    input of ``diagnose``); False where no stream holds both, or none is known."""
    if len(ev.output_streams) != len(ev.output):
        return False
    where = {
        id(f): (stream, n)
        for n, ((_, f), stream) in enumerate(zip(ev.output, ev.output_streams, strict=True))
    }
    t = where.get(id(timeout))
    places = [where.get(id(f)) for f in own]
    if t is None or any(p is None or p[0] != t[0] for p in places):
        return False
    return all(p[1] > t[1] for p in places if p is not None)


def _exit_item(rank: RankState, ev: Evidence) -> EvidenceItem:
    return EvidenceItem(
        _EXIT_SOURCES.get(rank.exit_source or "", "exit" if ev.exits_first_hand else "proc"),
        rank.died_ns,
        f"{rank_name(rank.label, rank.pid, ev.from_logs)} {_describe_exit(rank)}"
        + (" (from the agent's log)" if rank.exit_source == "agent-log" else ""),
    )


def autopsy(ev: Evidence) -> Verdict | None:
    """The verdict for the first abnormal death in ``ev``, or None when no rank died."""
    dead = sorted((r for r in ev.ranks if r.abnormal), key=lambda r: (r.died_ns or 0, r.pid))
    if not dead:
        return None
    told = reporters(ev) | left_behind(ev, dead)
    own = [r for r in dead if r.pid not in ev.agent_teardown and r.label not in told]
    victim = own[0] if own else next((r for r in dead if r.pid not in ev.agent_teardown), dead[0])
    items: list[EvidenceItem] = [_exit_item(victim, ev)]
    oom = oom_for(victim, ev.kernel)
    facts: dict[str, Any] = {}
    kind, confidence, summary = victim_verdict(victim, oom, ev, items, facts)
    if kind == Kind.COLLECTIVE_TIMEOUT:
        before = _failed_and_never_arrived(victim, ev, told)
        if before is not None:
            victim, (kind, confidence, summary), items, facts = before
            oom = None
    facts["peer_failure"] = only_reports(ev, victim.label, kind)

    fates: dict[str, Fate] = {}
    for r in ev.ranks:
        if r is victim:
            fates[r.label] = Fate.ROOT_CAUSE
        elif not r.dead:
            fates[r.label] = Fate.RUNNING
        elif r.returncode == 0:
            fates[r.label] = Fate.EXITED_CLEANLY
        elif same_cause(r, kind, ev) or (r.label in told and died_of_its_own(r)):
            fates[r.label] = Fate.SAME_CAUSE
        elif r.pid in ev.agent_teardown or ended_by_agent(r, victim):
            fates[r.label] = Fate.TERMINATED_BY_AGENT
        else:
            fates[r.label] = Fate.UNKNOWN
    # the cascade, in order: what the other ranks said as they died
    for r in sorted((r for r in dead if r is not victim), key=lambda r: r.died_ns or 0):
        said: dict[str, int | None] = {}  # a line printed twice (traceback, torchrun's summary) once
        for f in findings_of(r, ev, *WAITING, "exception"):
            if any(e.detail.endswith(f.line) for e in items):
                continue  # cited already (the timeout a peer's failure left it in)
            said.setdefault(f"then {rank_label(r.label, ev.from_logs)}: {f.line}", f.at_ns)
        for line, at in list(said.items())[:2]:
            items.append(EvidenceItem("output", at or r.died_ns, line))
    # what the job named but could not be read safely, so the reader knows it was not used
    items += [EvidenceItem("skipped", None, why) for why in ev.skipped]
    return Verdict(victim, kind, confidence, summary, tuple(items), fates, oom, Facts(**facts))
