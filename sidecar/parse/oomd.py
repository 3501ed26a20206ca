"""What userspace OOM daemons write when they kill (EVIDENCE.md §3.6). Pure.

* earlyoom: ``sending SIGTERM to process 1137 uid 0 "python": badness 666, VmRSS 4 MiB``
  (1.7; newer releases say ``oom_score`` and append ``cmdline "..."``; older ones have no
  uid). It names the pid.
* systemd-oomd (journal): ``Killed /user.slice/.../app.scope due to memory pressure for
  /user.slice/... being 52.34% > 50.00% for > 20s with reclaim activity`` (and a swap
  form, ``Killed ... due to swap used ...``). It names the cgroup.
* Meta's oomd (kernel log, written from user space): ``oomd kill: 81.28 80.05 42.78
  workload.slice/job.service 1000 ruleset:[...] ...``: three pressure averages, then the
  killed cgroup (relative to the cgroup2 root). It names the cgroup.
"""

from __future__ import annotations

import re
import signal as _signal
from dataclasses import dataclass

__all__ = ["UserspaceKillLine", "parse_userspace_oom_line"]


@dataclass(frozen=True, slots=True)
class UserspaceKillLine:
    daemon: str  # "earlyoom" | "systemd-oomd" | "oomd"
    pid: int | None  # the process it killed, when the line names one
    cgroup: str | None  # the cgroup it killed, absolute ("/..."), when the line names one
    signal: int | None
    comm: str | None
    rss_bytes: int | None
    text: str


_EARLYOOM = re.compile(
    r"sending (SIG[A-Z]+) to process (\d{1,20})(?: uid \d+)? \"(.*?)\": (?:badness|oom_score) -?\d+, "
    r"VmRSS (\d{1,20}) MiB"
)
_SYSTEMD_OOMD = re.compile(r"Killed (/\S*) due to (?:memory pressure|swap used)")
_OOMD = re.compile(r"oomd kill: \S+ \S+ \S+ (\S+)")


def parse_userspace_oom_line(text: str) -> UserspaceKillLine | None:
    line = text.strip()
    m = _EARLYOOM.search(line)
    if m:
        try:
            sig: int | None = int(_signal.Signals[m[1]])
        except KeyError:
            sig = None
        return UserspaceKillLine("earlyoom", int(m[2]), None, sig, m[3], int(m[4]) << 20, line)
    m = _SYSTEMD_OOMD.search(line)
    if m:
        return UserspaceKillLine("systemd-oomd", None, m[1], int(_signal.SIGKILL), None, None, line)
    m = _OOMD.search(line)
    if m:
        cgroup = m[1] if m[1].startswith("/") else "/" + m[1]
        return UserspaceKillLine("oomd", None, cgroup, int(_signal.SIGKILL), None, None, line)
    return None
