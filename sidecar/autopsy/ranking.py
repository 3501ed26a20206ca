"""Which catalog message decides how a process died, and how sure it may be: a message
whose kind can have ended the process the way it ended (``fits``), a mechanism before a
symptom before a report, a first-hand word before another's, a specific one before a
generic one, any kind before an abort (``precedence``), never a fatal signal caught after
the process's first (``strongest``). ``said`` (the rank's own words), ``logs`` and
``witnesses`` (other lines) rank by these. Pure.
"""

from __future__ import annotations

import signal as _signal

from sidecar.catalog import Hit, Message, catalog
from sidecar.model import Confidence, Kind
from sidecar.parse.ranks import Finding

__all__ = ["ends_with", "fits", "precedence", "strongest", "told_of", "weaker"]

_ORDER = {Confidence.CERTAIN: 0, Confidence.LIKELY: 1, Confidence.POSSIBLE: 2}


def weaker(a: Confidence, b: Confidence) -> Confidence:
    return max(a, b, key=_ORDER.__getitem__)


def precedence(message: Message, ceiling: Confidence) -> tuple[bool, bool, bool, int]:
    """How a catalog message ranks among others of its layer about one death (lower first):
    a first-hand one before another's word, a specific message before a generic one (any
    exception's last line, any terminate: the catalog's ``generic``), any kind before an
    abort (SIGABRT is how a process ends when something it found fatal calls abort()), then
    the higher confidence it may carry. Both paths (the rank's output here, other lines in
    ``logs.py``) rank by it."""
    return (not message.first_hand, message.generic, message.kind == Kind.ABORT, _ORDER[ceiling])


def told_of(
    hits: list[Hit], pid: int | None, signal: int | None, status: int | None
) -> tuple[Hit, Confidence] | None:
    """The message of a launcher, a shell, a scheduler or the kernel (a line that is not the
    rank's own output) that decides how the process ``pid`` died: one whose kind can have
    ended it the way it ended and that is not about another pid. A mechanism before a
    symptom before a report, then ``precedence``. Its confidence is the message's ceiling
    when it names this pid and is first-hand, else at most likely (it names a container, a
    step or nobody), and possible where a kernel record names a pid and the victim's is
    unknown; a report of what happened elsewhere is possible at most. Both paths
    rank by it: ``logs.py`` for diagnose, ``witnesses.py`` for the job's logs read live."""
    found: list[tuple[int, tuple[bool, bool, bool, int], int, Hit, Confidence]] = []
    for hit in hits:
        m = hit.message
        named_pid = hit.get("pid")
        if not m.decides or not fits(m.kind, signal, status):
            continue
        if named_pid is not None and named_pid.isdigit() and pid and int(named_pid) != pid:
            continue
        named = named_pid is not None and named_pid.isdigit() and pid == int(named_pid)
        ceiling = m.confidence if (named and m.first_hand) else weaker(m.confidence, Confidence.LIKELY)
        if m.layer == "report" or m.untold_sigterm(hit.get("signal")):
            ceiling = Confidence.POSSIBLE
        elif not pid and m.channel == "kernel" and named_pid is not None and named_pid.isdigit():
            # the kernel's record about some pid, where no line gives the victim's: nothing
            # ties the two (the kernel logs every process's faults, the job's and any other's)
            ceiling = Confidence.POSSIBLE
        found.append(
            (
                ("mechanism", "symptom", "report").index(m.layer),
                precedence(m, ceiling),
                len(found),
                hit,
                ceiling,
            )
        )
    if not found:
        return None
    best = min(found, key=lambda t: t[:3])
    return best[3], best[4]


# How each killer ends a process: the signals (or an exit status, 0 here) it can leave. A
# message whose kind cannot end the process the way it ended is about something else (an
# earlier, caught error; another process).
_ENDS: dict[Kind, frozenset[int]] = {
    Kind.KERNEL_OOM: frozenset({_signal.SIGKILL}),
    Kind.CGROUP_OOM: frozenset({_signal.SIGKILL}),
    Kind.USERSPACE_OOM: frozenset({_signal.SIGKILL, _signal.SIGTERM, _signal.SIGINT}),
    Kind.EXTERNAL_SIGNAL: frozenset(range(1, 65)),
    Kind.AGENT_TEARDOWN: frozenset({_signal.SIGKILL, _signal.SIGTERM, _signal.SIGINT}),
    # the watchdog aborts (SIGABRT) or raises (exit 1); a hung rank is killed
    Kind.COLLECTIVE_TIMEOUT: frozenset({0, _signal.SIGABRT, _signal.SIGKILL, _signal.SIGTERM}),
    Kind.SEGFAULT: frozenset({_signal.SIGSEGV}),
    Kind.BUS_ERROR: frozenset({_signal.SIGBUS, 0}),  # the DataLoader raises for its worker's SIGBUS
    Kind.ABORT: frozenset({_signal.SIGABRT}),
    # raised in Python (exit 1), or in a C++ thread (terminate: SIGABRT)
    Kind.CUDA_OOM: frozenset({0, _signal.SIGABRT}),
    # raised, aborted or crashed on; or, its CUDA context lost, hung until killed (the
    # agent's SIGTERM or the SIGKILL after it), as a rank hung in a collective is
    Kind.GPU_ERROR: frozenset(
        {0, _signal.SIGABRT, _signal.SIGSEGV, _signal.SIGBUS, _signal.SIGKILL, _signal.SIGTERM}
    ),
    Kind.PYTHON_EXCEPTION: frozenset({0, _signal.SIGABRT}),
}


_FROM_OUTSIDE = frozenset(
    {Kind.EXTERNAL_SIGNAL, Kind.AGENT_TEARDOWN, Kind.USERSPACE_OOM, Kind.KERNEL_OOM, Kind.CGROUP_OOM}
)


def ends_with(kind: Kind, signal: int) -> bool:
    """``kind`` is something the process does to itself that ends it by ``signal`` (a
    killer from outside is never told by the victim's own unprefixed lines)."""
    return signal in _ENDS.get(kind, frozenset()) and kind not in _FROM_OUTSIDE


def fits(kind: Kind | None, signal: int | None, status: int | None) -> bool:
    """Whether ``kind`` can have ended a process that ended so (``signal``, or a non-zero
    ``status``; both None: not known, anything fits). A shell's status 128+N is signal N."""
    if kind is None:
        return False
    if signal is None and status is not None and 128 < status < 128 + 65:
        signal = status - 128
    if signal is None and status is None:
        return True
    ends = _ENDS.get(kind)
    if ends is None:
        return True
    return (signal if signal is not None else 0) in ends


def _after_the_first_caught(said: list[Finding]) -> set[int]:
    """The fatal signals a handler reported after the first one it reported of the same
    process (the catalog's ``caught``; a pid the lines name, where they name one): a process
    dies of the first fatal signal it catches; one caught later (a SIGSEGV while an abort
    unwinds through a crashed library) came while it died. ``id()`` of those findings."""
    firsts: list[tuple[str | None, str]] = []  # each process's first: (its pid or None, kind)
    later: set[int] = set()
    for f in said:
        m = catalog().by_id.get(f.get("id") or "")
        if m is None or not m.caught:
            continue
        pid, kind = f.get("pid"), m.kind.value if m.kind else ""
        first = next((k for p, k in firsts if p is None or pid is None or p == pid), None)
        if first is None:
            firsts.append((pid, kind))
        elif first != kind:
            later.add(id(f))
    return later


def strongest(said: list[Finding], layer: str) -> Finding | None:
    """Of the catalog's messages found, the one of ``layer`` that decides (``precedence``;
    the first said among equals), but never a fatal signal caught after the process's first
    (``_after_the_first_caught``)."""
    later = _after_the_first_caught(said)
    found = [
        (f, m)
        for f in said
        if f.get("layer") == layer
        and f.get("said_kind")
        and id(f) not in later
        and (m := catalog().by_id.get(f.get("id") or ""))
    ]
    if not found:
        return None
    return min(found, key=lambda fm: precedence(fm[1], Confidence(fm[0].get("ceiling") or "possible")))[0]
