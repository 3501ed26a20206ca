"""What the kernel log, the signal tracepoint and NVML reported, kept for the death watch:
the kernel's OOM kills (each merged from its records), the signals sent to ranks, Meta's
oomd lines in the kernel log, NVRM Xid records, the kernel's other records of a process's
end that the emitter catalog names with a pid (a segfault record), and the GPUs NVML
reports lost. Each kind
is bounded; an autopsy takes them all and its rules pick the window around a death.
Not thread-safe: the death watch calls it under its lock (``parse`` needs no lock).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from sidecar.autopsy import SignalSent, UserspaceKill
from sidecar.autopsy.oom import OomFold
from sidecar.catalog import catalog
from sidecar.model import Snapshot
from sidecar.model.events import Sender, SignalEvent
from sidecar.parse.kernel import (
    KmsgRecord,
    OomKill,
    OomMemcgLimit,
    OomSummary,
    XidRecord,
    parse_oom_line,
    parse_xid_line,
)
from sidecar.parse.oomd import parse_userspace_oom_line

__all__ = ["EVERY_INCIDENT", "Parsed", "Records"]

EVERY_INCIDENT = -1  # what ``add`` returns when a record may matter to any open incident


@dataclass(frozen=True, slots=True)
class Parsed:
    """One kernel-log record worth keeping, parsed: exactly one field is set."""

    at_ns: int
    text: str
    oom: OomMemcgLimit | OomSummary | OomKill | None = None
    xid: XidRecord | None = None
    userspace: UserspaceKill | None = None
    said: tuple[int, str] | None = None  # (pid, catalog id): a kernel record the catalog names


class Records:
    def __init__(self) -> None:
        self.ooms = OomFold(maxlen=512)
        self.signals: deque[SignalSent] = deque(maxlen=1024)
        self.userspace: deque[UserspaceKill] = deque(maxlen=256)  # oomd's kernel-log lines
        self.xids: deque[tuple[int, XidRecord]] = deque(maxlen=256)  # (kernel time ns, record)
        # (kernel time ns, pid, catalog id, text) of the kernel's records of a process's end
        self.said: deque[tuple[int, int, str, str]] = deque(maxlen=256)
        self.lost_gpus: dict[int, tuple[int, str | None]] = {}  # GPU index -> (first seen lost, name)
        # kernel log records overwritten before they were read: (kernel time ns, how many)
        self.kmsg_losses: deque[tuple[int, int]] = deque(maxlen=256)

    @staticmethod
    def parse(record: KmsgRecord) -> Parsed | None:
        """The record, if it is one the autopsy uses: an OOM record, an Xid, or (written
        from user space) an oomd kill."""
        at_ns = record.timestamp_us * 1000
        if not record.from_kernel:
            line = parse_userspace_oom_line(record.text) if "oomd" in record.text else None
            if line is None:
                return None
            kill = UserspaceKill(line.daemon, line.pid, line.cgroup, line.signal, at_ns, line.text, "kmsg")
            return Parsed(at_ns, record.text, userspace=kill)
        if "NVRM: Xid" in record.text:
            xid = parse_xid_line(record.text)
            return Parsed(at_ns, record.text, xid=xid) if xid is not None else None
        oom = parse_oom_line(record.text)
        if isinstance(oom, (OomMemcgLimit, OomSummary, OomKill)):
            return Parsed(at_ns, record.text, oom=oom)
        for hit in catalog().part("kernel", deciding=True).scan(record.text):
            pid = hit.get("pid")
            if pid is not None and pid.isdigit() and len(pid) < 11:  # a record of one process's end
                return Parsed(at_ns, record.text, said=(int(pid), hit.message.id))
        return None

    def add(self, p: Parsed) -> int | None:
        """Keep a parsed record. Returns the pid of a completed OOM kill (an incident with
        that death should be judged again), ``EVERY_INCIDENT``, or None."""
        if p.userspace is not None:
            self.userspace.append(p.userspace)
            return EVERY_INCIDENT
        if p.xid is not None:
            self.xids.append((p.at_ns, p.xid))
            return EVERY_INCIDENT
        if p.said is not None:
            self.said.append((p.at_ns, p.said[0], p.said[1], p.text))
            return p.said[0]
        if p.oom is not None:
            merged = self.ooms.feed(p.oom, p.text, p.at_ns)
            return merged.pid if merged is not None else None
        return None

    def signal(self, event: SignalEvent, sender: Sender | None = None) -> None:
        self.signals.append(
            SignalSent(
                event.sender_comm or (sender.comm if sender is not None else "") or "?",
                event.sender_pid,
                event.target_pid,
                event.signal,
                event.code,
                event.monotonic_ns,
                sender,
            )
        )

    def gpus(self, snap: Snapshot, now_ns: int) -> None:
        """A GPU is lost from the first round that saw it lost until one sees it back."""
        for g in snap.gpus:
            if g.lost:
                self.lost_gpus.setdefault(g.index, (now_ns, g.name))
            else:
                self.lost_gpus.pop(g.index, None)
