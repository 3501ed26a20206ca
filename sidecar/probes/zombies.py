"""Whether this kernel gives a zombie's wait status in /proc/PID/stat (field 52, Linux 3.5+):
gVisor writes 0 for every zombie, so a SIGKILLed rank would read as a clean exit and open no
postmortem. Asked once at the daemon's start (``ask_zombie_status``, a child that exits 3);
until then, a zombie's status is taken as written.
"""

from __future__ import annotations

import subprocess
import sys
import time

from sidecar.errors import ParseError, ProbeError, read_bytes
from sidecar.probes.proc import ProcStat, parse_stat

__all__ = ["ask_zombie_status", "zombie_status"]

_zombie_status_told = True


def ask_zombie_status(proc_root: str = "/proc", timeout_s: float = 2.0) -> bool:
    """Ask the kernel once whether a zombie's wait status reads in ``proc_root``: a child
    that exits 3 is read as a zombie before it is reaped. Started at the daemon's start,
    never on the sampling or death path. Where the child cannot be read there (``proc_root``
    is not this machine's /proc), nothing is learned and the answer stays as it was."""
    global _zombie_status_told
    try:
        child = subprocess.Popen(
            [sys.executable, "-S", "-E", "-c", "import os; os._exit(3)"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    except OSError:
        return _zombie_status_told
    told: bool | None = None
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                st = parse_stat(read_bytes(f"{proc_root}/{child.pid}/stat"))
            except (ProbeError, ParseError):
                break  # not this /proc
            if st.state == "Z":
                told = st.exit_code == 3 << 8
                break
            time.sleep(0.005)
    finally:
        child.wait()
    if told is not None:
        _zombie_status_told = told
    return _zombie_status_told


def zombie_status(st: ProcStat) -> int | None:
    """A zombie's wait status as /proc gives it; None (not known) where this kernel does not
    give it (``ask_zombie_status``)."""
    return st.exit_code if _zombie_status_told else None
