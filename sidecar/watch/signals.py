"""Who sent a signal: the kernel's ``signal:signal_generate`` tracepoint, read through a
private tracefs instance (root; no eBPF toolchain needed).

Each event names the target (``comm``, ``pid``), the signal, its ``si_code`` (0 SI_USER:
kill(2) and friends; 128 SI_KERNEL: e.g. the OOM killer; -6 SI_TKILL) and, in the line's
prefix, the task that generated it, i.e. the sender. The instance uses the ``mono`` trace
clock so its times order with the process connector's (EVIDENCE.md §2.3). Only the
signals that end processes are recorded (a filter in the kernel), and the instance is
removed on stop. tracefs must be mounted (``mount -t tracefs nodev /sys/kernel/tracing``);
trainwatch never mounts anything itself.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import select
import threading
from collections.abc import Callable

from sidecar.model.events import ENDING_SIGNALS, SignalEvent

__all__ = ["SignalWatcher", "find_tracefs", "parse_trace_line"]

log = logging.getLogger(__name__)

TRACEFS = "/sys/kernel/tracing"
# where tracefs is found: its own mount point (Linux 4.1+), else inside debugfs (older
# kernels, and machines that mount only debugfs)
TRACEFS_PLACES = (TRACEFS, "/sys/kernel/debug/tracing")


def find_tracefs(places: tuple[str, ...] = TRACEFS_PLACES) -> str:
    """The first of ``places`` that has the signal tracepoint, else the first (where the
    error then says it is not mounted)."""
    for place in places:
        if os.path.isdir(f"{place}/events/signal/signal_generate"):
            return place
    return places[0]


BUFFER_KB = 64
# the signals recorded, ENDING_SIGNALS (model/events.py): the kernel filters out every other
FILTER = " || ".join(f"sig == {s}" for s in sorted(ENDING_SIGNALS))
_LINE = re.compile(
    r"^\s*(?P<scomm>.+?)-(?P<spid>\d+)\s+(?:\(\s*[-\d]+\)\s+)?\[\d+\]\s+\S+\s+(?P<ts>\d+\.\d+):\s+signal_generate:\s+"
    r"sig=(?P<sig>-?\d+) errno=-?\d+ code=(?P<code>-?\d+) comm=(?P<comm>.*?) pid=(?P<pid>\d+) grp=\d+"
    r" res=(?P<res>\d+)"
)


def parse_trace_line(line: str) -> SignalEvent | None:
    """One line of trace_pipe, e.g. ``kill-8787 [001] d..1. 721.695636: signal_generate:
    sig=9 errno=0 code=0 comm=sleep pid=8784 grp=1 res=0``."""
    m = _LINE.match(line)
    if m is None:
        return None
    seconds, _, frac = m["ts"].partition(".")
    scomm = m["scomm"].strip()
    return SignalEvent(
        "" if scomm == "<...>" else scomm,  # "<...>": the trace buffer had no name for the pid
        int(m["spid"]),
        m["comm"],
        int(m["pid"]),
        int(m["sig"]),
        int(m["code"]),
        int(m["res"]),
        int(seconds) * 10**9 + int(frac.ljust(9, "0")[:9]),
    )


class SignalWatcher:
    """Calls ``on_signal`` from its own thread. ``start()`` raises OSError when tracefs
    is not mounted or not writable (not root)."""

    def __init__(self, on_signal: Callable[[SignalEvent], None], tracefs: str | None = None) -> None:
        tracefs = tracefs if tracefs is not None else find_tracefs()
        self.on_signal = on_signal
        self.instance = f"{tracefs}/instances/trainwatch-{os.getpid()}"
        self.tracefs = tracefs
        self._fd: int | None = None
        self._stop_r, self._stop_w = os.pipe()
        self._thread: threading.Thread | None = None

    def _write(self, rel: str, value: str) -> None:
        with open(f"{self.instance}/{rel}", "w") as f:
            f.write(value)

    def _remove_stale(self) -> None:
        """Instances left by a trainwatch that was SIGKILLed (it could not clean up): each
        holds a ring buffer of kernel memory. Remove those whose owner is gone."""
        try:
            names = os.listdir(f"{self.tracefs}/instances")
        except OSError:
            return
        for name in names:
            owner = name.removeprefix("trainwatch-")
            if name.startswith("trainwatch-") and owner.isdigit() and not os.path.exists(f"/proc/{owner}"):
                try:
                    os.rmdir(f"{self.tracefs}/instances/{name}")
                    log.info("removed the tracefs instance %s of a trainwatch that is gone", name)
                except OSError:
                    pass

    @property
    def thread(self) -> threading.Thread | None:
        """The thread this runs on, once started (for its priority)."""
        return self._thread

    def start(self) -> None:
        if not os.path.isdir(f"{self.tracefs}/events/signal/signal_generate"):
            raise OSError(2, f"tracefs is not mounted at {self.tracefs}")
        self._remove_stale()
        os.mkdir(self.instance)
        try:
            # A few signals a second at most: a small ring (per CPU) is plenty.
            self._write("buffer_size_kb", str(BUFFER_KB))
            self._write("trace_clock", "mono")
            self._write("events/signal/signal_generate/filter", FILTER)
            self._write("events/signal/signal_generate/enable", "1")
            self._fd = os.open(f"{self.instance}/trace_pipe", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            self._remove()
            raise
        self._thread = threading.Thread(target=self._run, name="trainwatch-signals", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        assert self._fd is not None
        fd = self._fd
        pending = b""
        while True:
            ready, _, _ = select.select([fd, self._stop_r], [], [])
            if self._stop_r in ready:
                return
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                continue
            except OSError as exc:
                log.error("signal tracepoint: read failed: %s", exc)
                return
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for raw in lines:
                event = parse_trace_line(raw.decode("utf-8", "replace"))
                if event is not None:
                    try:
                        self.on_signal(event)
                    except Exception:
                        log.exception("signal handler failed")

    def _remove(self) -> None:
        with contextlib.suppress(OSError):
            self._write("events/signal/signal_generate/enable", "0")
        try:
            os.rmdir(self.instance)
        except OSError as exc:
            log.warning("could not remove tracefs instance %s: %s", self.instance, exc.strerror)

    def stop(self) -> None:
        if self._thread is not None:
            os.write(self._stop_w, b"x")
            self._thread.join(5)
            self._thread = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            self._remove()
        for fd in (self._stop_r, self._stop_w):
            with contextlib.suppress(OSError):
                os.close(fd)
