"""pidfds on real processes: a kill told with its status, a reused pid ignored, the status after
the reap."""

from __future__ import annotations

import fcntl
import functools
import os
import select
import signal
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from sidecar.model.events import ExitEvent
from sidecar.watch.pidfds import PidfdWatcher, pidfd_exit_status
from tests.support.skips import met, requires, skip

pytestmark = requires("pidfd")


@functools.lru_cache(maxsize=1)
def _exit_info() -> bool:
    """Whether this kernel gives a reaped process's wait status through PIDFD_GET_INFO
    (PIDFD_INFO_EXIT: Linux 6.15+, or a kernel that backports it; not gVisor), asked of the
    kernel itself rather than read off its version string (gVisor says 4.4.0, a distribution
    kernel keeps its old number). The request is built here from the uapi header's
    definitions, _IOWR(PIDFS_IOCTL_MAGIC 0xFF, 11, a 64-byte struct pidfd_info), not taken
    from sidecar.watch.pidfds, whose numbers these tests check."""
    child = subprocess.Popen(["sh", "-c", "exit 5"])
    fd = os.pidfd_open(child.pid)
    try:
        child.wait()
        select.select([fd], [], [], 2.0)
        info = bytearray(64)
        struct.pack_into("=Q", info, 0, 1 << 3)  # PIDFD_INFO_EXIT
        try:
            fcntl.ioctl(fd, (3 << 30) | (64 << 16) | (0xFF << 8) | 11, info)
        except OSError:
            return False
        return bool(struct.unpack_from("=Q", info, 0)[0] & 1 << 3)
    finally:
        os.close(fd)


def _start_ticks(pid: int) -> int:
    data = Path(f"/proc/{pid}/stat").read_bytes()
    return int(data[data.rindex(b")") + 2 :].split()[19])


class _Collect:
    def __init__(self) -> None:
        self.exits: list[ExitEvent] = []
        self.unknown: list[int] = []
        self.done = threading.Event()

    def on_exit(self, e: ExitEvent) -> None:
        self.exits.append(e)
        self.done.set()

    def on_unknown(self, pid: int, ns: int) -> None:
        self.unknown.append(pid)
        self.done.set()


@pytest.mark.parametrize("reap_at_once", [False, True])
def test_pidfd_watcher_tells_a_kill_with_its_status(reap_at_once):
    """A real process SIGKILLed: the status comes from the zombie, or (reaped at once,
    before the watcher looks) from PIDFD_GET_INFO on 6.15+; otherwise it is unknown. The
    watcher may see the zombie either way, so the kernel must show its status."""
    if not met("zombie-exit-code"):
        skip("zombie-exit-code")
    got = _Collect()
    watcher = PidfdWatcher(got.on_exit, got.on_unknown)
    watcher.start()
    try:
        p = subprocess.Popen(["sleep", "60"])
        watcher.track(p.pid, _start_ticks(p.pid))
        assert watcher.watched == 1
        os.kill(p.pid, signal.SIGKILL)
        if reap_at_once:
            p.wait()
        assert got.done.wait(5)
        if not reap_at_once:
            p.wait()
        if got.exits:
            e = got.exits[0]
            assert (e.pid, e.exit_code, e.source, e.signal) == (p.pid, 9, "pidfd", 9)
        else:
            assert got.unknown == [p.pid] and not _exit_info()
        assert watcher.watched == 0
    finally:
        watcher.stop()


def test_pidfd_watcher_ignores_a_reused_pid_and_reports_clean_exits():
    got = _Collect()
    watcher = PidfdWatcher(got.on_exit, got.on_unknown)
    watcher.start()
    try:
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
        watcher.track(p.pid, _start_ticks(p.pid) + 1)  # not the process we meant
        assert watcher.watched == 0
        watcher.track(p.pid, _start_ticks(p.pid))
        watcher.track(p.pid, _start_ticks(p.pid))  # idempotent
        assert watcher.watched == 1
        assert got.done.wait(5)
        p.wait()
        assert got.exits and got.exits[0].exit_code == 0 and got.exits[0].returncode == 0
    finally:
        watcher.stop()


def test_pidfd_exit_status_after_the_reap():
    p = subprocess.Popen(["sh", "-c", "exit 3"])
    fd = os.pidfd_open(p.pid)
    try:
        p.wait()
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        assert poller.poll(2000)
        code = pidfd_exit_status(fd)
        assert code == (3 << 8 if _exit_info() else None)
    finally:
        os.close(fd)
