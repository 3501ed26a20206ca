"""The kernel log, live: /dev/kmsg, one record per read(), from the start of the daemon
(or, after a restart, from the start of the ranks it knew: ``start(history_since_us)``).

Each record's timestamp is microseconds on the printk clock (monotonic since boot), so it
orders with the process connector's CLOCK_MONOTONIC exit times (a few ms apart at most).
When the ring buffer overwrote records before they were read, read() fails with EPIPE
and the reader carries on from the oldest record left, counting what was lost from the
sequence numbers. Needs read access to /dev/kmsg (root, or CAP_SYSLOG when
kernel.dmesg_restrict=1).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import select
import threading
import time
from collections.abc import Callable

from sidecar.parse.kernel import KmsgRecord, parse_kmsg_record

__all__ = ["KmsgWatcher"]

log = logging.getLogger(__name__)


class KmsgWatcher:
    """Calls ``on_record`` (from its own thread) for every kernel record written after
    ``start()``. ``start()`` raises OSError when /dev/kmsg cannot be opened."""

    def __init__(
        self,
        on_record: Callable[[KmsgRecord], None],
        path: str = "/dev/kmsg",
        on_loss: Callable[[int, int], None] | None = None,
    ) -> None:
        """``on_loss(count, timestamp_us)``: records were overwritten before they were read;
        the timestamp is the first record read after them."""
        self.on_record = on_record
        self.on_loss = on_loss
        self.path = path
        self.lost = 0
        self._fd: int | None = None
        self._last_seq: int | None = None
        self.history = 0  # records of the ring's history handed on at start
        self._stop_r, self._stop_w = os.pipe()
        self._thread: threading.Thread | None = None
        self._reading = threading.Lock()  # one reader at a time: its thread or catch_up()

    @property
    def thread(self) -> threading.Thread | None:
        """The thread this runs on, once started (for its priority)."""
        return self._thread

    def start(self, history_since_us: int | None = None) -> None:
        """From now on; or, with ``history_since_us``, first the records still in the ring
        from that kernel time on (read here, before this returns: a restarted daemon judges
        the deaths it missed from them), then on from there."""
        fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            # The ring is read through even when its history is not wanted (everything is
            # older than now): the last record's sequence number is what tells, later, how
            # many records an overrun took (a reader that seeks to the end never knows).
            since = history_since_us if history_since_us is not None else time.monotonic_ns() // 1000
            self.history = self._drain(fd, since)
        except OSError:
            os.close(fd)
            raise
        self._fd = fd
        self._thread = threading.Thread(target=self._run, name="trainwatch-kmsg", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        assert self._fd is not None
        fd = self._fd
        while True:
            ready, _, _ = select.select([fd, self._stop_r], [], [])
            if self._stop_r in ready:
                return
            try:
                with self._reading:
                    self._drain(fd)
            except OSError as exc:
                log.error("kernel log: read failed: %s; no more kernel evidence", exc)
                return

    def catch_up(self) -> None:
        """Hand on, from the caller's thread, every record written until now that the
        reader's thread has not handed on yet. The kernel writes its OOM report (the
        ``oom-kill:`` line naming the pid) before it sends the SIGKILL, so once an exit is
        known, a catch-up has that record even where the reader's thread was slow to run
        (a machine thrashing in a global OOM). Non-blocking reads of a bounded ring."""
        fd = self._fd
        if fd is None:
            return
        try:
            with self._reading:
                self._drain(fd)
        except OSError as exc:
            log.warning("kernel log: catching up failed: %s", exc)

    def _drain(self, fd: int, since_us: int = 0) -> int:
        """Read every record there is now; hand on those from ``since_us`` on. Returns
        how many were handed on."""
        handed = 0
        while True:
            try:
                raw = os.read(fd, 16384)
            except BlockingIOError:
                return handed
            except OSError as exc:
                if exc.errno == errno.EPIPE:
                    log.warning("kernel log: records were overwritten before trainwatch read them")
                    continue
                if exc.errno == errno.EINTR:
                    continue
                raise
            if not raw:
                return handed
            record = parse_kmsg_record(raw)
            if record is None:
                continue
            if self._last_seq is not None and record.sequence > self._last_seq + 1:
                gap = record.sequence - self._last_seq - 1
                self.lost += gap
                if self.on_loss is not None:
                    try:
                        self.on_loss(gap, record.timestamp_us)
                    except Exception:
                        log.exception("kernel log loss handler failed")
            self._last_seq = record.sequence
            if record.timestamp_us < since_us:
                continue
            handed += 1
            try:
                self.on_record(record)
            except Exception:
                log.exception("kernel log handler failed")

    def stop(self) -> None:
        if self._thread is not None:
            os.write(self._stop_w, b"x")
            self._thread.join(5)
            self._thread = None
        for fd in (self._fd, self._stop_r, self._stop_w):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._fd = None
