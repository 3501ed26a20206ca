"""The verdict: a pure function from a window of evidence to who killed each rank.

This module orders the deaths, picks the first of a rank's own (``peers`` rules out
the ranks that only report another's failure), asks ``killers`` what ended it and gives
every rank its fate; ``witnesses`` finds the records the rules weigh.

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
from sidecar.autopsy.peers import died_of_its_own, ended_by_agent, only_reports, reporters, same_cause
from sidecar.autopsy.said import WAITING, findings_of
from sidecar.autopsy.witnesses import oom_for
from sidecar.model import Fate

__all__ = ["autopsy"]

_EXIT_SOURCES = {"connector": "exit", "pidfd": "pidfd", "proc": "proc", "agent-log": "agent-log"}


def _describe_exit(rank: RankState) -> str:
    if rank.exit_code is None:
        return "exit status unknown"
    if rank.signal is not None:
        return f"killed by {signal_name(rank.signal)} (exit code -{rank.signal})"
    return f"exited with status {rank.status}"


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
    oom = oom_for(victim, ev.kernel)
    facts: dict[str, Any] = {}
    kind, confidence, summary = victim_verdict(victim, oom, ev, items, facts)
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
            said.setdefault(f"then {rank_label(r.label, ev.from_logs)}: {f.line}", f.at_ns)
        for line, at in list(said.items())[:2]:
            items.append(EvidenceItem("output", at or r.died_ns, line))
    # what the job named but could not be read safely, so the reader knows it was not used
    items += [EvidenceItem("skipped", None, why) for why in ev.skipped]
    return Verdict(victim, kind, confidence, summary, tuple(items), fates, oom, Facts(**facts))
