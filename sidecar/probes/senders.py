"""Who sent a signal: the sender's identity and its parents, read from /proc the moment the
signal tracepoint reports it (a ``kill`` exits within milliseconds; what is gone by then is
left out, never guessed). Only daemon-chosen paths under /proc are read, and never a
process's memory (no cmdline: it takes the target's mmap lock)."""

from __future__ import annotations

import os
import time

from sidecar.errors import ProbeError
from sidecar.model.events import Sender
from sidecar.probes.proc import read_stat

__all__ = ["describe_sender"]

PARENTS = 8  # how far up the chain goes (a session leader, a unit, a step daemon is within it)


def _uid(proc_root: str, pid: int) -> int | None:
    try:
        with open(f"{proc_root}/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Uid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup(proc_root: str, pid: int) -> str | None:
    """The memory controller's path (v1, or hybrid), else the v2 one (``0::``), else the first
    line's: where the limits that matter are."""
    try:
        with open(f"{proc_root}/{pid}/cgroup", "rb") as f:
            lines = f.read(8192).decode("utf-8", "replace").splitlines()
    except OSError:
        return None
    paths: dict[str, str] = {}
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(",") or [""]:
                paths.setdefault(controller, parts[2])
    return paths.get("memory") or paths.get("") or next(iter(paths.values()), None)


def _exe(proc_root: str, pid: int) -> str | None:
    try:
        return os.readlink(f"{proc_root}/{pid}/exe")
    except OSError:
        return None


def describe_sender(proc_root: str, pid: int, comm: str) -> Sender:
    """The sender as far as /proc still shows it (``comm`` from the tracepoint when the
    process is gone)."""
    try:
        st = read_stat(proc_root, pid)
    except (OSError, ProbeError):
        return Sender(pid, comm, None, None, None, (), seen_at=time.time())
    parents: list[tuple[int, str, str | None]] = []
    ppid = st.ppid
    while ppid > 0 and len(parents) < PARENTS:
        try:
            pst = read_stat(proc_root, ppid)
        except (OSError, ProbeError):
            break
        parents.append((ppid, pst.comm, _exe(proc_root, ppid)))
        if ppid == 1:
            break
        ppid = pst.ppid
    # a sender that exec'd since (a shell's last command) is the same process under another
    # name: the tracepoint's name stands, its executable is no longer the sender's
    same = st.comm == comm[:15] or not comm
    return Sender(
        pid,
        comm or st.comm,
        _exe(proc_root, pid) if same else None,
        _uid(proc_root, pid),
        _cgroup(proc_root, pid),
        tuple(parents),
        seen_at=time.time(),
    )
