"""What the userspace OOM daemons said, read at a death: the daemons running now as root
(earlyoom, systemd-oomd, oomd, ...: a process any user can start and name ``earlyoom`` is
not one, and its log could name another user's rank), the kill lines of their own output
files, and the cgroups whose oomd xattrs went up since the daemon first saw them
(systemd-oomd and oomd mark the cgroup they kill). Part of the gather (``gather.py``).
"""

from __future__ import annotations

import os
from collections.abc import Callable

from sidecar import saferead
from sidecar.autopsy import USERSPACE_OOM_DAEMONS, UserspaceKill
from sidecar.errors import ProbeError, read_bytes
from sidecar.model import Snapshot
from sidecar.parse.oomd import parse_userspace_oom_line
from sidecar.probes.outputs import read_output, regular_outputs

__all__ = ["kill_lines", "marked_kills", "oom_daemons"]

LOG_TAIL_BYTES = 256 << 10


def oom_daemons(proc_root: str) -> tuple[tuple[str, int], ...]:
    """(comm, pid) of each userspace OOM daemon running as root (a /proc scan, done only
    when a rank died)."""
    found = []
    try:
        names = [n for n in os.listdir(proc_root) if n.isdigit()]
    except OSError:
        return ()
    for name in names:
        try:
            comm = read_bytes(f"{proc_root}/{name}/comm", 64).decode("utf-8", "replace").strip()
        except ProbeError:
            continue
        if comm in USERSPACE_OOM_DAEMONS:
            try:
                if os.stat(f"{proc_root}/{name}").st_uid != 0:
                    continue
            except OSError:
                continue
            found.append((comm, int(name)))
    return tuple(sorted(found))


def kill_lines(proc_root: str, comm: str, pid: int, deadline: Callable[[], float]) -> list[UserspaceKill]:
    """The kill lines of a daemon's stdout/stderr where those are regular files, each read
    within ``deadline()`` (the round's budget: a Refused from it ends the reading)."""
    lines: list[UserspaceKill] = []
    for f in regular_outputs(proc_root, pid):
        try:
            deadline_s = deadline()
        except saferead.Refused:
            break
        text = read_output(proc_root, f, LOG_TAIL_BYTES, since_offset=False, deadline_s=deadline_s)
        for raw in text.splitlines():
            parsed = parse_userspace_oom_line(raw)
            if parsed is not None:
                lines.append(
                    UserspaceKill(
                        parsed.daemon,
                        parsed.pid,
                        parsed.cgroup,
                        parsed.signal,
                        None,
                        f"{comm} (pid {pid}) log {f.path}: {parsed.text}",
                        "log",
                    )
                )
    return lines


def marked_kills(
    before: Snapshot | None,
    baseline: dict[tuple[str, int], dict[str, int]],
    read_marks: Callable[[str, int], dict[str, int]],
) -> list[UserspaceKill]:
    """The cgroups (the ranks' and their ancestors, as the snapshot before the death saw
    them) whose oomd xattrs went up since ``baseline``."""
    found: list[UserspaceKill] = []
    seen: set[str] = set()
    for cg in before.cgroups if before else ():
        was_marks = baseline.get((cg.path, cg.version))
        if was_marks is None:
            continue
        for level, count in read_marks(cg.path, cg.version).items():
            name, _, path = level.partition(" ")
            was = was_marks.get(level, 0)
            if count > was and path not in seen:
                seen.add(path)
                daemon = "systemd-oomd" if name.startswith("user.") else "oomd"
                found.append(
                    UserspaceKill(
                        daemon, None, path, None, None, f"{path}: xattr {name} {was} -> {count}", "xattr"
                    )
                )
    return found
