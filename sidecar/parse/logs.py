"""Kernel logs as people paste them: every timestamp style, terminal-wrapped lines. Pure.

Styles (one prefix per record, then the kernel's own text):

* raw ``dmesg``: ``[2059991.491436] oom-kill:...`` (seconds since boot);
* ``dmesg -T``: ``[Wed Dec  2 11:53:34 2026] oom-kill:...``;
* ``journalctl -k`` and syslog's ``kern.log``: ``Dec 02 11:53:34 node-17 kernel: ...``, maybe
  with the raw stamp after ``kernel:``; ``journalctl -o short-iso`` and rsyslog's high
  precision format: ``2026-12-02T11:53:34.123456+00:00 node-17 kernel: ...``;
* ``dmesg -x``: ``kern  :err   : [...] ...``; /dev/kmsg-like ``<4>[...] ...``.

Syslog's and journalctl's stamps carry no year (nor glog's, parse/ranks.py): a ``Dating``
gives them one, the year that puts the stamp nearest its anchor (the paste's own dated
lines, else the file's time, else now: ``dating_of``) and never after now.

A line with no prefix right after a record is its continuation: a terminal wrapped it, or
the kernel indented a multi-line message. It is joined without a space when the break fell
inside a word (``total-vm:53312244`` + ``kB, anon-rss...``), with one otherwise. A run of 40
or more spaces inside a record is what a wrap turned into when copied: it is removed
(``cpuset=/,me      ...      ms_allowed=0``).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

__all__ = [
    "Dating",
    "KernelLine",
    "TaskRow",
    "dating_of",
    "kernel_lines",
    "line_time",
    "looks_like_kernel_log",
    "parse_task_row",
]

_MONTHS = {
    m: i
    for i, m in enumerate(
        ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"], 1
    )
}


@dataclass(frozen=True, slots=True)
class KernelLine:
    """One kernel record: its text with the prefix removed; ``uptime`` (seconds since boot)
    when the raw stamp was there; ``at`` (epoch seconds, this machine's zone when the style
    has none) when a wall-clock stamp was; ``host`` when syslog named it."""

    text: str
    uptime: float | None
    at: float | None
    host: str | None
    style: str


_RAW = re.compile(r"^(?:<\d+>)?\[\s*(\d+\.\d+)\]\s?(.*)$")
_LEVEL = re.compile(r"^[a-z]+\s*:[a-z]+\s*:\s\[\s*(\d+\.\d+)\]\s?(.*)$")  # dmesg -x
_HUMAN = re.compile(
    r"^\[(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun) ([A-Z][a-z]{2}) +(\d{1,20}) (\d\d):(\d\d):(\d\d) (\d{4})\]\s?(.*)$"
)
_SYSLOG = re.compile(
    r"^([A-Z][a-z]{2}) +(\d{1,20}) (\d\d):(\d\d):(\d\d) (\S+) kernel: (?:\[\s*(\d+\.\d+)\]\s?)?(.*)$"
)
_ISO = re.compile(
    r"^(\d{4})-(\d\d)-(\d\d)[T ](\d\d):(\d\d):(\d\d)(\.\d+)?(Z|[+-]\d\d:?\d\d)? (\S+) kernel: "
    r"(?:\[\s*(\d+\.\d+)\]\s?)?(.*)$"
)
# lines that start something else: never a kernel record's continuation
_OTHER_START = re.compile(
    r"^(?:[IWEF]\d{4} \d\d:|\d{4}-\d\d-\d\d|\[(?:rank|default)\d+\]|Traceback|\[?\d{4}-|[A-Za-z_.]+Error\b|"
    r"(?:WARNING|ERROR|INFO):torch)"
)
_WRAP_GAP = re.compile(r"(?<=\S) {40,}(?=\S)")
_KERNEL_WORDS = re.compile(
    r"oom-kill:|Out of memory|Killed process|invoked oom-killer|Memory cgroup out of memory|NVRM: Xid|"
    r"oom_reaper|Call Trace:|Tasks state \(memory values in pages\)|"
    # a memory cgroup's counters, printed only in the report of an OOM inside it
    r"^(?:memory|memory\+swap|swap|kmem): usage \d{1,20}kB, limit \d{1,20}kB"
)


def _local(y: int, mon: int, d: int, hh: int, mm: int, ss: int) -> float | None:
    try:
        return time.mktime((y, mon, d, hh, mm, ss, 0, 0, -1))
    except (OverflowError, ValueError):
        return None


@dataclass(frozen=True, slots=True)
class Dating:
    """How a stamp without a year is dated: the year that puts it nearest ``anchor``, never
    one that puts it after ``now`` (a log is read after it was written)."""

    anchor: float
    now: float

    @classmethod
    def at_now(cls) -> Dating:
        now = time.time()
        return cls(now, now)

    def year_less(self, mon: int, day: int, hh: int, mm: int, ss: int) -> float | None:
        base = time.localtime(self.anchor).tm_year
        best: float | None = None
        for y in (base - 1, base, base + 1):
            t = _local(y, mon, day, hh, mm, ss)
            if t is None or t > self.now:
                continue
            if best is None or abs(t - self.anchor) < abs(best - self.anchor):
                best = t
        return best


# a stamp with its year anywhere in a line: ISO (Python logging, DeepSpeed, journalctl -o
# short-iso, torchrun's failure table "2024-12-09_06:53:34"), dmesg -T's "[Mon Dec  9 ... 2024]"
_DATED_ISO = re.compile(r"(?<!\d)(\d{4})-(\d\d)-(\d\d)[T _](\d\d):(\d\d):(\d\d)(?!\d)")
_DATED_HUMAN = re.compile(r"\b([A-Z][a-z]{2}) +(\d{1,2}) (\d\d):(\d\d):(\d\d) (\d{4})\]")


def dating_of(texts: list[str], file_times: list[float] | None = None, now: float | None = None) -> Dating:
    """The dating of a paste's year-less stamps: anchored at the latest stamp with a year its
    texts hold (none after now), else at the newest file time given, else at now."""
    now = time.time() if now is None else now
    latest: float | None = None
    for text in texts:
        for m in _DATED_ISO.finditer(text):
            at = _local(*(int(m[i]) for i in range(1, 7)))
            if at is not None and at <= now and (latest is None or at > latest):
                latest = at
        for m in _DATED_HUMAN.finditer(text):
            if m[1] in _MONTHS:
                at = _local(int(m[6]), _MONTHS[m[1]], int(m[2]), int(m[3]), int(m[4]), int(m[5]))
                if at is not None and at <= now and (latest is None or at > latest):
                    latest = at
    if latest is None:
        latest = min(max(file_times), now) if file_times else now
    return Dating(latest, now)


def _prefix(line: str, dating: Dating) -> KernelLine | None:
    m = _RAW.match(line)
    if m:
        return KernelLine(m[2], float(m[1]), None, None, "dmesg")
    m = _LEVEL.match(line)
    if m:
        return KernelLine(m[2], float(m[1]), None, None, "dmesg -x")
    m = _HUMAN.match(line)
    if m and m[1] in _MONTHS:
        at = _local(int(m[6]), _MONTHS[m[1]], int(m[2]), int(m[3]), int(m[4]), int(m[5]))
        return KernelLine(m[7], None, at, None, "dmesg -T")
    m = _ISO.match(line)
    if m:
        parts = [int(m[i]) for i in range(1, 7)]
        at = _local(*parts)
        if at is not None:
            at += float(m[7] or 0)
            zone = m[8]
            if zone:  # the stamp's own zone, not this machine's
                offset = (
                    0
                    if zone == "Z"
                    else (1 if zone[0] == "+" else -1) * (int(zone[1:3]) * 3600 + int(zone[-2:]) * 60)
                )
                at = _utc(*parts) - offset + float(m[7] or 0)
        return KernelLine(m[11], float(m[10]) if m[10] else None, at, m[9], "syslog-iso")
    m = _SYSLOG.match(line)
    if m and m[1] in _MONTHS:
        at = dating.year_less(_MONTHS[m[1]], int(m[2]), int(m[3]), int(m[4]), int(m[5]))
        return KernelLine(m[8], float(m[7]) if m[7] else None, at, m[6], "syslog")
    return None


def _utc(y: int, mon: int, d: int, hh: int, mm: int, ss: int) -> float:
    import calendar

    return float(calendar.timegm((y, mon, d, hh, mm, ss, 0, 0, 0)))


def kernel_lines(text: str, dating: Dating | None = None) -> list[KernelLine]:
    """The kernel records in ``text``, prefix removed, wrapped lines joined. Lines that are
    neither prefixed nor a continuation are kept when they carry kernel words (a bare
    ``oom-kill:...`` pasted alone), with no time. Year-less stamps dated by ``dating``
    (default: near now)."""
    dating = dating or Dating.at_now()
    out: list[KernelLine] = []
    open_record = False
    for raw in text.splitlines():
        line = raw.rstrip("\r\n")
        if not line.strip():
            open_record = False
            continue
        rec = _prefix(line, dating)
        if rec is not None:
            out.append(KernelLine(_WRAP_GAP.sub("", rec.text), rec.uptime, rec.at, rec.host, rec.style))
            open_record = True
            continue
        if open_record and out and not _OTHER_START.match(line):
            piece = _WRAP_GAP.sub("", line.strip())
            prev = out[-1]
            if (line[:1].isspace() and re.match(r"[A-Z]{3,}: ", piece)) or piece.startswith("-- "):
                # the kernel's own indented continuation of a multi-line message, a new tag
                out.append(KernelLine(piece, prev.uptime, prev.at, prev.host, prev.style))
                continue
            glue = "" if prev.text[-1:].isalnum() and piece[:1].isalnum() and not piece[:1].isupper() else " "
            if prev.text.endswith((",", "=", ":", "-", "(")):
                glue = ""
            out[-1] = KernelLine(prev.text + glue + piece, prev.uptime, prev.at, prev.host, prev.style)
            continue
        if _KERNEL_WORDS.search(line):
            out.append(KernelLine(_WRAP_GAP.sub("", line.strip()), None, None, None, "bare"))
    return out


def looks_like_kernel_log(text: str) -> bool:
    """Whether ``text`` holds kernel records of any style (for telling what a file is)."""
    return any(k.style != "bare" or _KERNEL_WORDS.search(k.text) for k in kernel_lines(text[: 1 << 20]))


@dataclass(frozen=True, slots=True)
class TaskRow:
    """A row of the OOM report's task table (``Tasks state (memory values in pages)``)."""

    pid: int
    rss_pages: int
    oom_score_adj: int
    comm: str


# [ pid ] uid tgid total_vm rss [rss_anon rss_file rss_shmem] pgtables_bytes swapents oom_score_adj name
_TASK = re.compile(r"^\[\s*(\d{1,20})\]\s+\d+\s+\d+\s+\d+\s+(\d{1,20})((?:\s+-?\d+)+)\s+(\S.*)$")


def parse_task_row(text: str) -> TaskRow | None:
    m = _TASK.match(text.strip())
    if not m:
        return None
    rest = m[3].split()
    return TaskRow(int(m[1]), int(m[2]), int(rest[-1]), m[4].strip())


_ANY_SYSLOG = re.compile(r"^([A-Z][a-z]{2}) +(\d{1,20}) (\d\d):(\d\d):(\d\d) \S+ \S+?(?:\[\d+\])?: ")
_ANY_ISO = re.compile(r"^\[?(\d{4})-(\d\d)-(\d\d)[T _](\d\d):(\d\d):(\d\d)")


def line_time(line: str, dating: Dating | None = None) -> float | None:
    """The wall-clock time a log line starts with, in any of the styles above or a program's
    journal/syslog prefix (``Dec 02 11:53:35 node-17 systemd-oomd[612]: ...``), a Python
    logging or DeepSpeed stamp (``[2026-12-02 11:53:34,123]``); local time. None without one.
    Year-less stamps dated by ``dating`` (default: near now)."""
    dating = dating or Dating.at_now()
    rec = _prefix(line, dating)
    if rec is not None and rec.at is not None:
        return rec.at
    m = _ANY_SYSLOG.match(line)
    if m and m[1] in _MONTHS:
        return dating.year_less(_MONTHS[m[1]], int(m[2]), int(m[3]), int(m[4]), int(m[5]))
    m = _ANY_ISO.match(line)
    if m:
        return _local(*(int(m[i]) for i in range(1, 7)))
    return None
