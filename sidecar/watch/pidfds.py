"""Exit capture without the process connector: one pidfd per watched process.

Where the connector is refused (not root, or in a container's own PID, user or network
namespace: a Kubernetes sidecar with ``shareProcessNamespace``), a pidfd still works: it
needs only to see the pid, and it cannot be fooled by pid reuse (EVIDENCE.md §2.2).

* The fd becomes readable (POLLIN) when the process has exited and is a zombie; its exit
  status is then in /proc/PID/stat (field 52) until the parent reaps it. The torchrun
  agent reaps within its 0.1 s monitor interval, so the status is read at once.
* When the parent reaped first, Linux 6.15+ gives the status through the
  ``PIDFD_GET_INFO`` ioctl (``PIDFD_INFO_EXIT``) once the fd reports POLLHUP.
* Otherwise the death is still known, with its time, and its status is unknown.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import select
import struct
import threading
import time
from collections.abc import Callable

from sidecar.errors import ProbeError
from sidecar.model.events import ExitEvent
from sidecar.probes.proc import read_stat
from sidecar.probes.zombies import zombie_status

__all__ = ["PIDFD_GET_INFO", "PidfdWatcher", "pidfd_exit_status"]

log = logging.getLogger(__name__)

# _IOWR(0xFF, 11, struct pidfd_info) with the 64-byte first version of the struct
PIDFD_GET_INFO = 0xC040FF0B
PIDFD_INFO_EXIT = 1 << 3
_INFO_SIZE = 64
_EXIT_CODE_OFFSET = 60  # mask u64, cgroupid u64, 11 x u32 ids, then exit_code s32
HUP_WAIT_S = 2.0  # how long to wait for the parent to reap before giving up on the status


def pidfd_exit_status(fd: int) -> int | None:
    """The wait status of a reaped process through PIDFD_GET_INFO (Linux 6.15+), else None."""
    buf = bytearray(_INFO_SIZE)
    struct.pack_into("=Q", buf, 0, PIDFD_INFO_EXIT)
    try:
        fcntl.ioctl(fd, PIDFD_GET_INFO, buf)
    except OSError:
        return None
    (mask,) = struct.unpack_from("=Q", buf, 0)
    if not mask & PIDFD_INFO_EXIT:
        return None
    code: int = struct.unpack_from("=i", buf, _EXIT_CODE_OFFSET)[0]
    return code


def _zombie_status(proc_root: str, pid: int, start_ticks: int) -> tuple[int, int] | None:
    """(wait status, ppid) of the zombie ``pid`` of that start time, or None."""
    try:
        st = read_stat(proc_root, pid)
    except ProbeError:
        return None
    status = zombie_status(st)
    if st.state not in ("Z", "X") or st.start_ticks != start_ticks or status is None:
        return None
    return status, st.ppid


class PidfdWatcher:
    """``track(pid, start_ticks)`` processes; ``on_exit`` gets an ExitEvent (source
    "pidfd") when the status is known, ``on_unknown(pid, monotonic_ns)`` when it is not."""

    def __init__(
        self,
        on_exit: Callable[[ExitEvent], None],
        on_unknown: Callable[[int, int], None],
        proc_root: str = "/proc",
    ) -> None:
        self.on_exit = on_exit
        self.on_unknown = on_unknown
        self.proc_root = proc_root
        self._lock = threading.Lock()
        self._fds: dict[int, tuple[int, int]] = {}  # fd -> (pid, start_ticks)
        self._by_pid: dict[tuple[int, int], int] = {}
        self._exited: dict[int, int] = {}  # fd -> monotonic ns of POLLIN (waiting for the reap)
        self._poll = select.poll()
        self._wake_r, self._wake_w = -1, -1
        self._thread: threading.Thread | None = None
        self._stop = False

    @property
    def thread(self) -> threading.Thread | None:
        """The thread this runs on, once started (for its priority)."""
        return self._thread

    def start(self) -> None:
        """Raises OSError when pidfds do not work here (Linux < 5.3, a seccomp filter)."""
        if not hasattr(os, "pidfd_open"):
            raise OSError(errno.ENOSYS, "os.pidfd_open is missing (Python 3.9+ on Linux 5.3+)")
        os.close(os.pidfd_open(os.getpid()))
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._poll.register(self._wake_r, select.POLLIN)
        self._thread = threading.Thread(target=self._run, name="trainwatch-pidfd", daemon=True)
        self._thread.start()

    def track(self, pid: int, start_ticks: int) -> None:
        """Watch ``pid`` (which started at ``start_ticks``); a no-op when already watched
        or gone (a process reaped before this call is not seen: the caller's /proc scan
        notices it)."""
        key = (pid, start_ticks)
        with self._lock:
            if key in self._by_pid or self._stop:
                return
        try:
            fd = os.pidfd_open(pid)
        except OSError:
            return
        # the pid may have been reused between the caller's scan and pidfd_open
        try:
            same = read_stat(self.proc_root, pid).start_ticks == start_ticks
        except ProbeError:
            same = False
        if not same:
            os.close(fd)
            return
        with self._lock:
            self._fds[fd] = key
            self._by_pid[key] = fd
            self._poll.register(fd, select.POLLIN)
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    @property
    def watched(self) -> int:
        with self._lock:
            return len(self._fds)

    def stop(self) -> None:
        with self._lock:
            self._stop = True
        if self._wake_w >= 0:
            with contextlib.suppress(OSError):
                os.write(self._wake_w, b"x")
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None
        with self._lock:
            for fd in list(self._fds):
                self._close(fd)
            for fd in (self._wake_r, self._wake_w):
                if fd >= 0:
                    os.close(fd)
            self._wake_r = self._wake_w = -1

    def _close(self, fd: int) -> None:
        key = self._fds.pop(fd, None)
        if key is not None:
            self._by_pid.pop(key, None)
        self._exited.pop(fd, None)
        with contextlib.suppress(KeyError, ValueError):
            self._poll.unregister(fd)
        os.close(fd)

    def _run(self) -> None:
        while True:
            with self._lock:
                if self._stop:
                    return
                waiting = dict(self._exited)
            timeout_ms = 500 if waiting else None
            try:
                ready = self._poll.poll(timeout_ms)
            except InterruptedError:
                continue
            now = time.monotonic_ns()
            for fd, mask in ready:
                if fd == self._wake_r:
                    with contextlib.suppress(OSError):
                        os.read(self._wake_r, 4096)
                    continue
                self._handle(fd, mask, now)
            # processes that exited but were not reaped in time: the status stays unknown
            for fd, since in waiting.items():
                if now - since > HUP_WAIT_S * 1e9:
                    with self._lock:
                        key = self._fds.get(fd)
                        if key is None:
                            continue
                        self._close(fd)
                    self.on_unknown(key[0], since)

    def _handle(self, fd: int, mask: int, now: int) -> None:
        with self._lock:
            key = self._fds.get(fd)
            since = self._exited.get(fd, now)
        if key is None:
            return
        pid, start_ticks = key
        zombie = _zombie_status(self.proc_root, pid, start_ticks) if fd not in self._exited else None
        if zombie is not None:
            with self._lock:
                self._close(fd)
            self.on_exit(ExitEvent(pid, zombie[0], zombie[1], since, source="pidfd"))
            return
        if mask & select.POLLHUP:  # reaped: the kernel may still tell the status
            code = pidfd_exit_status(fd)
            with self._lock:
                self._close(fd)
            if code is not None:
                self.on_exit(ExitEvent(pid, code, 0, since, source="pidfd"))
            else:
                self.on_unknown(pid, since)
            return
        # exited, reaped neither by now nor readable as a zombie: wait for POLLHUP only
        with self._lock:
            if fd in self._fds and fd not in self._exited:
                self._exited[fd] = now
                self._poll.modify(fd, 0)
