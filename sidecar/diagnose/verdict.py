"""The verdict from the logs, for ``trainwatch diagnose``: the ranks and the kernel's records
made ``Evidence`` (the pid is the link: a kernel record naming a rank's pid is that rank's
death, whatever the clocks say; ranks no record times are ordered by the agent's order and
the first stamped line they wrote), then the daemon's path: the same autopsy, the rules for
logs on top (``autopsy.logs``)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from sidecar.autopsy import Evidence, EvidenceItem, RankState, Verdict, autopsy
from sidecar.autopsy.evidence import rank_label
from sidecar.autopsy.logrecords import KernelRecords, LogRank, LogRecords
from sidecar.autopsy.logs import COLLECT_DAEMON, COLLECT_KERNEL, COLLECT_RANK_LOGS, logs_rules
from sidecar.diagnose.kernel import kernel_records
from sidecar.diagnose.ranks import log_ranks
from sidecar.model import Confidence, wait_status_from_returncode
from sidecar.parse.ranks import Finding

__all__ = ["Outcome", "decide"]

S = 10**9


@dataclass(slots=True)
class Outcome:
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


def _stream_times(g: LogRecords) -> list[tuple[Finding, tuple[int, ...] | None, Finding]]:
    """Each finding with the time it sorts by, and the finding that time is from: its own
    stamp, else the next stamped finding's of the same input (one stream is written in
    order, so a line came no later than the stamped line after it), ahead of that line."""
    out: list[tuple[Finding, tuple[int, ...] | None, Finding]] = []
    after: dict[int, tuple[tuple[int, ...], Finding]] = {}  # input -> the next stamped finding
    inputs = g.finding_inputs if len(g.finding_inputs) == len(g.findings) else [0] * len(g.findings)
    for (_, f), where in zip(reversed(g.findings), reversed(inputs), strict=True):
        if f.stamp is not None:
            own: tuple[int, ...] = (*f.stamp[1:], 1)
            after[where] = own, f
            out.append((f, own, f))
        elif where in after:
            at, by = after[where]
            out.append((f, (*at[:-1], 0), by))
        else:
            out.append((f, None, f))
    out.reverse()
    return out


def _note_bounded(
    ordered: list[LogRank],
    said_at: dict[tuple[int | None, int | None], tuple[int, ...]],
    bounded: dict[tuple[int | None, int | None], Finding],
    notes: list[EvidenceItem],
) -> None:
    """Say so where the first rank in the order is first only by a line of another rank
    that its own unstamped lines came before."""
    if len(ordered) < 2 or ordered[0].first or ordered[0].at is not None:
        return
    r = ordered[0]
    key = next(
        (
            k
            for k in said_at
            if k in bounded
            and (
                (k[0] is not None and k[0] == r.rank)
                or (k[0] is None and k[1] is not None and k[1] == r.local_rank)
            )
        ),
        None,
    )
    if key is None:
        return
    by, who = bounded[key], rank_label(r.label, True)
    notes.append(
        EvidenceItem(
            "inference",
            None,
            f"{who}'s lines carry no time; they were written before this later line of the same log, "
            f"so {who} failed first: {by.line[:200]}",
        )
    )


def decide(g: LogRecords, now: float) -> Outcome:
    ranks, notes = log_ranks(g)
    k = kernel_records(g.kernel)
    t0 = int(now * S)
    if not ranks:
        if not (k.ooms or k.partial or k.xids or g.findings or g.jobs or g.userspace or g.said or g.exits):
            return Outcome(None, [COLLECT_KERNEL, COLLECT_RANK_LOGS, COLLECT_DAEMON], ranks, k, notes)
        ranks = _synthetic_victim(k, g, t0)
    # times: a line's own if it has one, else the agent's order (the first failure, then the
    # ranks it tore down); a kernel record naming a rank's pid is that rank's death
    first_at = min((r.at for r in ranks if r.at is not None), default=None)
    base = int((first_at or now) * S)
    states: list[RankState] = []
    # ranks no record times are ordered by the first stamped line they wrote, not by where
    # their lines sit in the files (one file per rank, or one interleaved file); a glog
    # stamp has no year, so the order is month, day and time of day. A line with no stamp (a
    # traceback) was written before the next stamped line of its input: dated by it, ahead
    said_at: dict[tuple[int | None, int | None], tuple[int, ...]] = {}
    bounded: dict[tuple[int | None, int | None], Finding] = {}  # dated by another's line
    for f, at, by in _stream_times(g):
        key = (f.rank, f.local_rank)
        if at is not None and at < said_at.get(key, (99,)):
            said_at[key] = at
            if by is not f:
                bounded[key] = by
            else:
                bounded.pop(key, None)
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

    ordered = sorted(ranks, key=order)
    _note_bounded(ordered, said_at, bounded, notes)
    for i, r in enumerate(ordered):
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

    def label_of(f: Finding) -> str | None:  # by its global rank, else its local rank (0 too)
        if f.rank is not None:
            return labels.get(f.rank)
        return None if f.local_rank is None else locals_.get(f.local_rank)

    findings = tuple((label_of(f), f) for _, f in g.findings)
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
        output_streams=tuple(g.finding_inputs) if len(g.finding_inputs) == len(findings) else (),
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
        return Outcome(None, [COLLECT_KERNEL, COLLECT_RANK_LOGS, COLLECT_DAEMON], ranks, k, notes)
    v = logs_rules(v, g, k, kernel_given, collect)
    guessed = next((r for r in ranks if r.label == v.victim.label and r.inferred_rank), None)
    if guessed is not None and v.confidence == Confidence.CERTAIN:
        v = replace(v, confidence=Confidence.LIKELY)
    return Outcome(v, collect, ranks, k, notes)
