"""Another process's stdout/stderr, where they are regular files (``> train.log 2>&1``,
Slurm's output file, a service's log file): found through /proc/PID/fd/1 and /2.

Reading /proc/PID/fd needs the same access as ptrace-read (the same user, or root). A
terminal or a pipe cannot be read back; journald's socket neither. Reads are bounded
(``limit`` bytes from the end), never block the writer, and go through
``sidecar.saferead``: a regular file, opened read-only on its own file description.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

from sidecar import saferead
from sidecar.errors import ProbeError, read_bytes
from sidecar.probes.proc import read_stat

__all__ = ["OutputFile", "read_output", "regular_outputs", "run_spool"]

DEFAULT_LIMIT = 1 << 20
SPOOL_ANCESTORS = 4  # how far up from a job's agent `trainwatch run` is looked for


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


def run_spool(proc_root: str, agent_pid: int, path: str, uid: int | None) -> OutputFile | None:
    """The file where ``trainwatch run`` keeps a job's output (``TRAINWATCH_RUN_OUTPUT`` in
    the job's environment names it), found among the descriptors of the agent's ancestors
    (``run`` itself, or a few levels up when a script started torchrun): a path a job merely
    names is never opened. It must be a regular file such a process holds open under exactly
    that name, owned by the job's user, in a process of that user. None otherwise."""
    pid = agent_pid
    for _ in range(SPOOL_ANCESTORS):
        try:
            pid = read_stat(proc_root, pid).ppid
        except (OSError, ProbeError):
            return None
        if pid <= 1:
            return None
        found = _held(proc_root, pid, path, uid)
        if found is not None:
            return found
    return None


def _held(proc_root: str, pid: int, path: str, uid: int | None) -> OutputFile | None:
    try:  # daemon-chosen /proc files only: the path the job named is compared, never opened
        status = read_bytes(f"{proc_root}/{pid}/status")
        fds = os.listdir(f"{proc_root}/{pid}/fd")
    except (OSError, ProbeError):
        return None
    uids = next((line.split()[1:] for line in status.splitlines() if line.startswith(b"Uid:")), [])
    if uid is not None and (not uids or int(uids[0]) != uid):
        return None
    for name in fds:
        link = f"{proc_root}/{pid}/fd/{name}"
        try:
            if os.readlink(link) != path:
                continue
            st = os.stat(link)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode) and (uid is None or st.st_uid == uid):
            return OutputFile(pid, int(name), path, st.st_dev, st.st_ino, 0)
    return None


def read_output(
    proc_root: str,
    out: OutputFile,
    limit: int = DEFAULT_LIMIT,
    since_offset: bool = True,
    deadline_s: float = saferead.DEFAULT_DEADLINE_S,
) -> str:
    """The text written since ``out.offset`` (at most the last ``limit`` bytes; the whole
    tail when ``since_offset`` is False): through the process's own descriptor while it
    lives, else by the path the daemon saw it at. Either way it goes through the safe-read
    helper (no blocking open, a regular file, read with a deadline) and must still be the
    same file (device and inode), so a path swapped for a FIFO, a symlink or another file
    reads nothing. "" when it cannot be read."""
    since = out.offset if since_offset else 0
    same = (out.device, out.inode)
    try:
        got = saferead.read_fd_file(
            proc_root, out.pid, out.fd, owner=None, cap=limit, expect=same, since=since, deadline_s=deadline_s
        )
    except (OSError, saferead.Refused):
        try:
            got = saferead.read_job_file(
                saferead.HOST_ROOT,
                out.path,
                owner=None,
                cap=limit,
                tail=True,
                expect=same,
                since=since,
                deadline_s=deadline_s,
            )
        except (OSError, saferead.Refused):
            return ""
    return got.data.decode("utf-8", "replace")
