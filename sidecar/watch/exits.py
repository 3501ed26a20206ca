"""Exit capture for processes trainwatch did not start: the netlink process connector.

The kernel multicasts an event for the exit of every task on the machine, with its exit
code (wait-status encoding) and a CLOCK_MONOTONIC timestamp, within a millisecond
(EVIDENCE.md §2.1). One event arrives per thread: only thread-group leaders
(``pid == tgid``) mean "the process died". It needs the initial user, PID and network
namespaces (and CAP_NET_ADMIN before Linux 6.6). On 6.6+ a per-socket filter asks for
non-zero exits only, which cuts the volume on busy hosts; older kernels get everything
and the reader filters.

Delivery is best effort: a reader that falls behind gets ENOBUFS and loses events, so
the caller is told (``on_overrun``) and resynchronises from /proc. When the connector is
unavailable the caller falls back to the zombie's exit code in /proc/PID/stat.

With ``discovery=True`` the same socket also carries what finds jobs without listing
/proc: forks of watched processes and processes renaming themselves ``pt_elastic``, and
every exit (zero too) of watched processes. A socket filter (``procfilter.py``) drops, in
the kernel, every event about a process that is not watched: the set is the caller's
(``watch()``), plus a new agent, which this thread adds the moment it sees the rename, so
the agent's first forks (its ranks) are not lost to the time the caller takes. A watched
process's new child is not added here (a rank that shells out in a loop would rebuild the
filter at every fork): its exit passes by its parent, and the caller adds it to the set at
its next round.
Those events queue for the caller (``drain()``).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import select
import socket
import struct
import threading
from collections.abc import Callable

from sidecar.model import decode_wait_status
from sidecar.model.events import ExitEvent
from sidecar.watch import procfilter

__all__ = [
    "DISCOVERY_EVENTS",
    "ProcConnector",
    "decode_wait_status",
    "parse_events",
    "parse_messages",
    "subscribe_message",
]

log = logging.getLogger(__name__)

NETLINK_CONNECTOR = 11
CN_IDX_PROC = 1
CN_VAL_PROC = 1
NLMSG_DONE = 3
RCVBUF = 8 << 20  # the default receive buffer (TRAINWATCH_CONNECTOR_BUFFER)
NLMSG_ERROR = 2
PROC_CN_MCAST_LISTEN = 1
PROC_CN_MCAST_IGNORE = 2
PROC_EVENT_NONE = 0
PROC_EVENT_FORK = 0x00000001
PROC_EVENT_COMM = 0x00000200
PROC_EVENT_EXIT = 0x80000000
PROC_EVENT_NONZERO_EXIT = 0x20000000
# what the death watch needs, and what discovery needs on top (6.6+ per-socket filter)
DEATH_EVENTS = PROC_EVENT_NONZERO_EXIT
DISCOVERY_EVENTS = PROC_EVENT_FORK | PROC_EVENT_COMM | PROC_EVENT_EXIT
QUEUE_LIMIT = 20000  # discovery events waiting for the sampler; past it: lost, rescan

_NLMSGHDR = struct.Struct("=IHHII")  # len, type, flags, seq, pid
_CN_MSG = struct.Struct("=IIIIHH")  # idx, val, seq, ack, len, flags
_EVENT_HEADER = struct.Struct("=IIQ")  # what, cpu, timestamp_ns
_EXIT = struct.Struct("=iiIIii")  # pid, tgid, exit_code, exit_signal, parent_pid, parent_tgid
_FORK = struct.Struct("=iiii")  # parent_pid, parent_tgid, child_pid, child_tgid
_COMM = struct.Struct("=ii16s")  # pid, tgid, comm


def subscribe_message(op: int, events: int | None, seq: int = 1) -> bytes:
    """The netlink message that starts (or stops) the subscription. ``events`` (a mask of
    PROC_EVENT_*) uses the 6.6+ ``struct proc_input`` form asking for those only; None the
    old form (every event)."""
    payload = struct.pack("=I", op) if events is None else struct.pack("=II", op, events)
    cn = _CN_MSG.pack(CN_IDX_PROC, CN_VAL_PROC, seq, 0, len(payload), 0) + payload
    return _NLMSGHDR.pack(_NLMSGHDR.size + len(cn), NLMSG_DONE, 0, seq, 0) + cn


def parse_messages(data: bytes) -> tuple[list[ExitEvent], list[int]]:
    """Parse one datagram (possibly several netlink messages). Returns the exits of
    thread-group leaders and the error codes of any subscription ACKs seen."""
    exits, _forks, _comms, acks = parse_events(data)
    return exits, acks


def parse_events(
    data: bytes,
) -> tuple[list[ExitEvent], list[tuple[int, int]], list[tuple[int, bytes]], list[int]]:
    """Parse one datagram: exits of leaders, forks of new processes as (parent tgid,
    child), renames of processes as (tgid, comm), and subscription ACKs."""
    exits: list[ExitEvent] = []
    forks: list[tuple[int, int]] = []
    comms: list[tuple[int, bytes]] = []
    acks: list[int] = []
    offset = 0
    while offset + _NLMSGHDR.size <= len(data):
        length, kind, _flags, _seq, _pid = _NLMSGHDR.unpack_from(data, offset)
        if length < _NLMSGHDR.size or offset + length > len(data):
            break
        body = offset + _NLMSGHDR.size
        if kind == NLMSG_DONE and length >= _NLMSGHDR.size + _CN_MSG.size + _EVENT_HEADER.size:
            idx, val, _s, _a, _clen, _f = _CN_MSG.unpack_from(data, body)
            if idx == CN_IDX_PROC and val == CN_VAL_PROC:
                ev = body + _CN_MSG.size
                what, _cpu, ts = _EVENT_HEADER.unpack_from(data, ev)
                payload = ev + _EVENT_HEADER.size
                if what == PROC_EVENT_EXIT and payload + _EXIT.size <= offset + length:
                    pid, tgid, code, _sig, ppid, _ptgid = _EXIT.unpack_from(data, payload)
                    if pid == tgid:
                        exits.append(ExitEvent(tgid, code, ppid, ts))
                elif what == PROC_EVENT_FORK and payload + _FORK.size <= offset + length:
                    _ppid, ptgid, child, ctgid = _FORK.unpack_from(data, payload)
                    if child == ctgid:
                        forks.append((ptgid, child))
                elif what == PROC_EVENT_COMM and payload + _COMM.size <= offset + length:
                    _pid, tgid, comm = _COMM.unpack_from(data, payload)
                    comms.append((tgid, comm.split(b"\0", 1)[0]))
                elif what == PROC_EVENT_NONE and payload + 4 <= offset + length:
                    acks.append(struct.unpack_from("=I", data, payload)[0])
        offset += (length + 3) & ~3
    return exits, forks, comms, acks


class ProcConnector:
    """Subscribes to the process connector and calls ``on_exit`` (from its own thread)
    for every leader that exits. ``start()`` raises OSError when the connector cannot be
    used here (no CONFIG_PROC_EVENTS, not in the initial namespaces, no privilege).

    ``discovery=True``: also queue, for ``drain()``, the events that find and follow jobs
    (see the module's text); ``on_agent`` is called when a process names itself
    ``pt_elastic``. ``discovering`` says whether that works here (the socket filter)."""

    def __init__(
        self,
        on_exit: Callable[[ExitEvent], None],
        on_overrun: Callable[[], None] = lambda: None,
        rcvbuf: int = RCVBUF,
        *,
        discovery: bool = False,
        on_agent: Callable[[], None] = lambda: None,
    ) -> None:
        self.on_exit = on_exit
        self.rcvbuf = rcvbuf
        self.on_overrun = on_overrun
        self.on_agent = on_agent
        self.sock: socket.socket | None = None
        self.filtered = False
        self.discovering = False
        self._want_discovery = discovery
        self.overruns = 0
        self._stop_r, self._stop_w = os.pipe()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._watched: frozenset[int] = frozenset()  # what the attached filter passes
        # ("fork", child, parent), ("agent", pid, 0), ("exit", pid, 0)
        self._queue: list[tuple[str, int, int]] = []
        self._lost = False
        self.filter_updates = 0

    @property
    def thread(self) -> threading.Thread | None:
        """The thread this runs on, once started (for its priority)."""
        return self._thread

    def start(self, timeout: float = 1.0) -> None:
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_CONNECTOR)
        try:
            try:
                sock.setsockopt(socket.SOL_SOCKET, 33, self.rcvbuf)  # SO_RCVBUFFORCE (root)
            except OSError:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.rcvbuf)
            sock.bind((0, CN_IDX_PROC))
            events = DEATH_EVENTS
            if self._want_discovery:
                # The filter goes on before the subscription, so the node's events never
                # reach this process; every exit passes while the subscription is proven.
                try:
                    procfilter.attach(sock, procfilter.program((), pass_exits=True))
                    events = DISCOVERY_EVENTS
                except OSError as exc:
                    log.warning("exits: no socket filter (%s): jobs are found by listing /proc", exc)
            # 6.6+: the filtered form. Its ACK is filtered out too (what == 0 matches no
            # filter bit), so success is "no error"; older kernels reject the 8-byte form
            # with an error ACK or ignore it, and get the plain form.
            if self._subscribe(sock, events, timeout=timeout):
                self.filtered = True
            elif not self._subscribe(sock, None, timeout=timeout):
                raise OSError(
                    errno.EPERM,
                    "the process connector did not acknowledge the subscription "
                    "(not in the initial PID/user namespace, or no CAP_NET_ADMIN before Linux 6.6)",
                )
            if events == DISCOVERY_EVENTS:
                procfilter.attach(sock, procfilter.program(()))
                self.discovering = True
        except OSError:
            sock.close()
            raise
        self._events = events
        self.sock = sock
        self._thread = threading.Thread(target=self._run, name="trainwatch-exits", daemon=True)
        self._thread.start()

    def _subscribe(self, sock: socket.socket, events: int | None, timeout: float) -> bool:
        sock.send(subscribe_message(PROC_CN_MCAST_LISTEN, events))
        if events is not None:
            # No ACK comes back for the filtered form. A kernel without filters treats the
            # first u32 as the op and still ACKs: look briefly for an ACK or an error.
            ready, _, _ = select.select([sock], [], [], 0.05)
            if not ready:
                return self._probe_filtered(sock, timeout)
            data = sock.recv(65536)
            _, acks = parse_messages(data)
            return not acks or acks[0] == 0
        ready, _, _ = select.select([sock], [], [], timeout)
        while ready:
            data = sock.recv(65536)
            _exits, acks = parse_messages(data)
            if acks:
                return acks[0] == 0
            ready, _, _ = select.select([sock], [], [], timeout)
        return False

    def _probe_filtered(self, sock: socket.socket, timeout: float) -> bool:
        """Prove the filtered subscription works: a child that exits non-zero must show up."""
        # posix_spawn, not fork: the daemon has threads by now
        pid = os.posix_spawnp("sh", ["sh", "-c", "exit 3"], dict(os.environ))
        os.waitpid(pid, 0)
        deadline = timeout
        while True:
            ready, _, _ = select.select([sock], [], [], deadline)
            if not ready:
                return False
            exits, _ = parse_messages(sock.recv(65536))
            if any(e.pid == pid for e in exits):
                return True

    # -- what discovery asks ----------------------------------------------------------

    def watch(self, pids: set[int]) -> None:
        """The processes to follow now (the caller's view after its last ``drain()``), plus
        what this thread queued since, which the caller has not seen yet."""
        if not self.discovering:
            return
        with self._lock:
            wanted = set(pids)
            wanted.update(pid for kind, pid, _ in self._queue if kind != "exit")
            self._refilter(frozenset(wanted))

    def drain(self) -> tuple[list[tuple[str, int, int]], bool]:
        """The queued events, oldest first, and whether some were lost since the last call
        (the caller then rescans /proc)."""
        with self._lock:
            queue, lost = self._queue, self._lost
            self._queue, self._lost = [], False
        return queue, lost

    def _refilter(self, wanted: frozenset[int]) -> None:  # under the lock
        if wanted == self._watched or self.sock is None:
            return
        try:
            procfilter.attach(self.sock, procfilter.program(wanted))
        except OSError as exc:  # cannot happen with a valid program; keep the old one
            log.error("exits: updating the socket filter failed: %s", exc)
            return
        self._watched = wanted
        self.filter_updates += 1

    def _queue_events(self, data: bytes) -> list[ExitEvent]:
        exits, forks, comms, _ = parse_events(data)
        if not self.discovering or not (exits or forks or comms):
            return exits
        agent = False
        with self._lock:
            watched = self._watched
            added = set()
            queue = self._queue
            for parent, child in forks:
                if parent in watched:
                    queue.append(("fork", child, parent))
            for pid, comm in comms:
                if comm == procfilter.AGENT_COMM_BYTES:
                    queue.append(("agent", pid, 0))
                    added.add(pid)
                    agent = True
            for event in exits:  # the filter passed it: a watched process's, or its child's
                queue.append(("exit", event.pid, 0))
            if len(queue) > QUEUE_LIMIT:
                del queue[:]
                self._lost = True
            if added:
                self._refilter(watched | added)
        if agent:
            self.on_agent()
        return exits

    def _run(self) -> None:
        assert self.sock is not None
        sock = self.sock
        fds: list[int] = [sock.fileno(), self._stop_r]
        while True:
            ready, _, _ = select.select(fds, [], [])
            if self._stop_r in ready:
                return
            try:
                data = sock.recv(65536)
            except OSError as exc:
                if exc.errno == errno.ENOBUFS:
                    self.overruns += 1
                    log.warning(
                        "process connector overrun (ENOBUFS): exits may have been missed; resynchronising"
                    )
                    with self._lock:
                        self._lost = True
                    self.on_overrun()
                    continue
                if exc.errno in (errno.EINTR, errno.EAGAIN):
                    continue
                log.error("process connector failed: %s", exc)
                return
            for event in self._queue_events(data):
                try:
                    self.on_exit(event)
                except Exception:
                    log.exception("exit handler failed for pid %d", event.pid)

    def stop(self) -> None:
        if self._thread is not None:
            os.write(self._stop_w, b"x")
            self._thread.join(5)
            self._thread = None
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.send(
                    subscribe_message(PROC_CN_MCAST_IGNORE, self._events if self.filtered else None)
                )
            self.sock.close()
            self.sock = None
        for fd in (self._stop_r, self._stop_w):
            with contextlib.suppress(OSError):
                os.close(fd)
