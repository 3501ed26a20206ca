"""Another process's stdout/stderr, where they are regular files (``> train.log 2>&1``,
Slurm's output file, a service's log file): found through /proc/PID/fd/1 and /2.

Reading /proc/PID/fd needs the same access as ptrace-read (the same user, or root). A
terminal or a pipe cannot be read back; journald's socket neither. Reads are bounded
(``limit`` bytes from the end) and never block the writer: a regular file is opened
read-only on its own file description.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

__all__ = ["OutputFile", "read_output", "regular_outputs"]

DEFAULT_LIMIT = 1 << 20


@dataclass(frozen=True, slots=True)
class OutputFile:
    """A regular file a process writes to: ``offset`` is its size when first seen (the
    text before that belongs to earlier runs)."""

    pid: int
    fd: int
    path: str
    device: int
    inode: int
    offset: int


def regular_outputs(proc_root: str, pid: int, fds: tuple[int, ...] = (1, 2)) -> list[OutputFile]:
    """The process's stdout/stderr that are regular files (one entry per file), or []
    when they are terminals, pipes, sockets or cannot be read."""
    found: list[OutputFile] = []
    seen: set[tuple[int, int]] = set()
    for fd in fds:
        link = f"{proc_root}/{pid}/fd/{fd}"
        try:
            st = os.stat(link)
            target = os.readlink(link)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) in seen:
            continue
        seen.add((st.st_dev, st.st_ino))
        found.append(OutputFile(pid, fd, target, st.st_dev, st.st_ino, st.st_size))
    return found


def read_output(
    proc_root: str, out: OutputFile, limit: int = DEFAULT_LIMIT, since_offset: bool = True
) -> str:
    """The text written since ``out.offset`` (at most the last ``limit`` bytes; the whole
    tail when ``since_offset`` is False), through the process's own descriptor while it
    lives, else by path; "" when the file is gone or is another file now."""
    for candidate in (f"{proc_root}/{out.pid}/fd/{out.fd}", out.path):
        try:
            with open(candidate, "rb") as f:
                st = os.fstat(f.fileno())
                if (st.st_dev, st.st_ino) != (out.device, out.inode):
                    continue
                start = out.offset if since_offset and out.offset <= st.st_size else 0
                start = max(start, st.st_size - limit)
                f.seek(start)
                return f.read(limit).decode("utf-8", "replace")
        except OSError:
            continue
    return ""
