"""Kernel log records about OOM kills, in every kernel generation's format.

One record (one line of text) in, a typed event or None out; pure. Formats (EVIDENCE.md
§3.1-3.2):

* 5.0+ summary: ``oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,
  mems_allowed=0,oom_memcg=/probe_oom,task_memcg=/probe_oom,task=python3,pid=8366,uid=0``
  (``global_oom`` instead of ``oom_memcg=`` for the global killer). Rate-limited with the
  rest of the report, so it may be missing.
* the kill line, never rate-limited: ``Memory cgroup out of memory: Killed process 8366
  (python3) total-vm:119004kB, anon-rss:102016kB, file-rss:6600kB, shmem-rss:0kB, UID:0
  pgtables:268kB oom_score_adj:0``; prefix ``Out of memory`` for the global killer (none
  before 5.1; fields after ``file-rss`` appeared over 4.5-5.4);
* 4.x memcg attribution: ``Task in /a killed as a result of limit of /b``;
* before 4.19, the choice: ``Memory cgroup out of memory: Kill process 1234 (python) score
  1000 or sacrifice child`` (``Out of memory: ...`` for the global killer), followed by a
  ``Killed process`` line without a prefix;
* the header: ``python3 invoked oom-killer: gfp_mask=0xcc0(GFP_KERNEL), order=0,
  oom_score_adj=0``; the memcg state ``memory: usage 102400kB, limit 102400kB, failcnt 0``.

``parse_kmsg_record`` splits a /dev/kmsg record (``prio,seq,usec,flags;text``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = [
    "KmsgRecord",
    "OomHeader",
    "OomKill",
    "OomMemcgLimit",
    "OomMemcgUsage",
    "OomSummary",
    "XidRecord",
    "parse_kmsg_record",
    "parse_oom_line",
    "parse_xid_line",
]

KB = 1024


@dataclass(frozen=True, slots=True)
class KmsgRecord:
    """One /dev/kmsg record: syslog priority (facility*8+level), sequence number,
    microseconds on the printk (monotonic) clock, and the text with \\xNN unescaped."""

    priority: int
    sequence: int
    timestamp_us: int
    continuation: bool
    text: str

    @property
    def from_kernel(self) -> bool:
        """User space cannot write facility 0: prio < 8 means the kernel wrote it."""
        return self.priority < 8


@dataclass(frozen=True, slots=True)
class OomSummary:
    """The 5.0+ one-line summary. ``oom_memcg`` is None for the global killer."""

    constraint: str
    global_oom: bool
    oom_memcg: str | None
    task_memcg: str | None
    comm: str
    pid: int
    uid: int | None


@dataclass(frozen=True, slots=True)
class OomKill:
    """``Killed process N (comm) ...``; ``scope`` is ``global``, ``memcg`` or None (pre-5.1
    lines carry no prefix). Sizes in bytes, None where the kernel did not print them."""

    scope: str | None
    pid: int
    comm: str
    total_vm_bytes: int | None
    anon_rss_bytes: int | None
    file_rss_bytes: int | None
    shmem_rss_bytes: int | None
    uid: int | None
    oom_score_adj: int | None

    @property
    def rss_bytes(self) -> int | None:
        parts = [self.anon_rss_bytes, self.file_rss_bytes, self.shmem_rss_bytes]
        return sum(p for p in parts if p is not None) if self.anon_rss_bytes is not None else None


@dataclass(frozen=True, slots=True)
class OomMemcgLimit:
    """4.x: ``Task in <task_memcg> killed as a result of limit of <oom_memcg>``."""

    task_memcg: str
    oom_memcg: str


@dataclass(frozen=True, slots=True)
class OomHeader:
    """``<comm> invoked oom-killer: ...``: the allocating task, not necessarily the victim."""

    comm: str
    order: int | None
    oom_score_adj: int | None


@dataclass(frozen=True, slots=True)
class OomMemcgUsage:
    """``memory: usage XkB, limit YkB, failcnt N`` at the time of a memcg OOM."""

    usage_bytes: int
    limit_bytes: int


_SUMMARY = re.compile(
    r"oom-kill:constraint=(?P<constraint>[A-Z_]+)"
    r"(?:,[^,]*?)*?"
    r",(?:oom_memcg=(?P<oom_memcg>[^,]*)|(?P<global>global_oom))"
    r"(?:,task_memcg=(?P<task_memcg>[^,]*))?"
    r",task=(?P<comm>.*?),pid=(?P<pid>\d{1,20})(?:,uid=(?P<uid>\d{1,20}))?"
)
_KILLED = re.compile(
    r"(?:(?P<prefix>Out of memory(?: \(oom_kill_allocating_task\))?|Memory cgroup out of memory): )?"
    r"Killed process (?P<pid>\d{1,20}) \((?P<comm>.*?)\)"
    r"(?:,? total-vm:(?P<vm>\d{1,20})kB)?(?:, anon-rss:(?P<anon>\d{1,20})kB)?"
    r"(?:, file-rss:(?P<file>\d{1,20})kB)?"
    r"(?:, shmem-rss:(?P<shmem>\d{1,20})kB)?(?:, UID:(?P<uid>\d{1,20}))?(?: pgtables:\d+kB)?"
    r"(?: oom_score_adj:(?P<adj>-?\d{1,20}))?"
)
# the prefix and "Kill process N (comm)" are this line's alone, so a paste that cut it after
# the comm is still read
_CHOICE = re.compile(
    r"(?P<prefix>Out of memory|Memory cgroup out of memory): "
    r"Kill process (?P<pid>\d{1,20}) \((?P<comm>.*?)\)"
    r"(?:$| score -?\d+ or sacrifice child)"
)
_TASK_IN = re.compile(r"Task in (?P<task>\S+) killed as a result of limit of (?P<limit>\S+)")
# gfp_mask=0x140dca(GFP_HIGHUSER_MOVABLE|__GFP_ZERO|__GFP_COMP), order=0, ... (5.x+);
# gfp_mask=0x14200ca(GFP_HIGHUSER_MOVABLE), nodemask=(null), order=0, ... (4.x); every part
# bounded and free of nested repetition, so a glued or hostile line cannot make it backtrack
_HEADER = re.compile(
    r"(?<!\S)(?P<comm>\S{1,64}) invoked oom-killer: gfp_mask=[^ ]{1,256}(?: nodemask=[^ ]{1,256})?"
    r" order=(?P<order>-?\d{1,3}), oom_score_adj=(?P<adj>-?\d{1,4})"
)
LINE_MAX = 4096  # a kernel record is at most 1 KiB of text; longer is glued or hostile
_USAGE = re.compile(r"^memory: usage (?P<usage>\d{1,20})kB, limit (?P<limit>\d{1,20})kB")


def _int(value: str | None) -> int | None:
    return int(value) if value is not None else None


def _kb(value: str | None) -> int | None:
    return int(value) * KB if value is not None else None


@dataclass(frozen=True, slots=True)
class XidRecord:
    """``NVRM: Xid (PCI:0000:09:00): 79, pid=0, GPU has fallen off the bus.``: an error the
    NVIDIA driver saw on a GPU. ``pid`` is the process it blamed (None or 0: none)."""

    bus: str
    xid: int
    pid: int | None
    process: str | None
    detail: str


_XID = re.compile(
    r"NVRM: Xid \((?:PCI:)?([0-9a-fA-F:.]+)\): (\d{1,20})(?:, pid=(\d{1,20}|'<unknown>'))?"
    r"(?:, name=([^,]*))?,?\s*(.*)"
)
# Xids that mean the GPU (or its memory, or its link) failed, not the program on it.
GPU_FAULT_XIDS = frozenset({48, 61, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120, 121, 123, 140, 143, 154})


def parse_xid_line(text: str) -> XidRecord | None:
    m = _XID.search(text)
    if not m:
        return None
    pid = int(m[3]) if m[3] and m[3].isdigit() else None
    return XidRecord(m[1], int(m[2]), pid or None, (m[4] or "").strip() or None, m[5].strip())


def parse_oom_line(text: str) -> OomSummary | OomKill | OomMemcgLimit | OomHeader | OomMemcgUsage | None:
    """The OOM event a kernel log line carries, or None. ``text`` may have a timestamp or
    syslog prefix before the kernel's own text (the patterns are searched, not anchored).
    Only the first ``LINE_MAX`` characters are read."""
    text = text[:LINE_MAX]
    if "oom-kill:" in text:
        m = _SUMMARY.search(text)
        if m:
            return OomSummary(
                constraint=m["constraint"],
                global_oom=m["global"] is not None,
                oom_memcg=m["oom_memcg"],
                task_memcg=m["task_memcg"],
                comm=m["comm"],
                pid=int(m["pid"]),
                uid=_int(m["uid"]),
            )
    if "Killed process" in text:
        m = _KILLED.search(text)
        if m:
            prefix = m["prefix"]
            scope = None if prefix is None else ("memcg" if prefix.startswith("Memory cgroup") else "global")
            return OomKill(
                scope=scope,
                pid=int(m["pid"]),
                comm=m["comm"],
                total_vm_bytes=_kb(m["vm"]),
                anon_rss_bytes=_kb(m["anon"]),
                file_rss_bytes=_kb(m["file"]),
                shmem_rss_bytes=_kb(m["shmem"]),
                uid=_int(m["uid"]),
                oom_score_adj=_int(m["adj"]),
            )
    if "Kill process" in text:  # before 4.19: the choice, then an unprefixed "Killed process" line
        m = _CHOICE.search(text)
        if m:
            scope = "memcg" if m["prefix"].startswith("Memory cgroup") else "global"
            return OomKill(scope, int(m["pid"]), m["comm"], None, None, None, None, None, None)
    if "killed as a result of limit of" in text:
        m = _TASK_IN.search(text)
        if m:
            return OomMemcgLimit(m["task"], m["limit"])
    if "invoked oom-killer" in text:
        m = _HEADER.search(text)
        if m:
            return OomHeader(m["comm"].split()[-1], _int(m["order"]), _int(m["adj"]))
    if text.startswith("memory: usage "):
        m = _USAGE.search(text)
        if m:
            return OomMemcgUsage(int(m["usage"]) * KB, int(m["limit"]) * KB)
    return None


_ESCAPE = re.compile(r"\\x([0-9a-fA-F]{2})")


def parse_kmsg_record(raw: bytes) -> KmsgRecord | None:
    """Split a /dev/kmsg record; None when it is not one. Dictionary lines (after the
    first newline, starting with a space) are dropped; unknown prefix fields ignored."""
    text = raw.decode("utf-8", "replace")
    head, sep, rest = text.partition(";")
    if not sep:
        return None
    fields = head.split(",")
    if len(fields) < 3:
        return None
    try:
        priority, sequence, ts = int(fields[0]), int(fields[1]), int(fields[2])
    except ValueError:
        return None
    message = rest.split("\n", 1)[0]
    message = _ESCAPE.sub(lambda m: chr(int(m.group(1), 16)), message)
    return KmsgRecord(priority, sequence, ts, len(fields) > 3 and fields[3].startswith("c"), message)
