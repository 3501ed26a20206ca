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
from dataclasses import dataclass

from sidecar.model import decode_wait_status

__all__ = [
    "ExitEvent",
    "ProcConnector",
    "decode_wait_status",
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
PROC_EVENT_EXIT = 0x80000000
PROC_EVENT_NONZERO_EXIT = 0x20000000

_NLMSGHDR = struct.Struct("=IHHII")  # len, type, flags, seq, pid
_CN_MSG = struct.Struct("=IIIIHH")  # idx, val, seq, ack, len, flags
_EVENT_HEADER = struct.Struct("=IIQ")  # what, cpu, timestamp_ns
_EXIT = struct.Struct("=iiIIii")  # pid, tgid, exit_code, exit_signal, parent_pid, parent_tgid


@dataclass(frozen=True, slots=True)
class ExitEvent:
    """A process (thread-group leader) exited. ``monotonic_ns`` is CLOCK_MONOTONIC;
    ``exit_code`` is the raw wait status; pids are initial-namespace pids. ``source``
    says who told: "connector" (the kernel, at the exit), "pidfd", or "proc" (a zombie
    seen in /proc by the sampler)."""

    pid: int
    exit_code: int
    parent_pid: int
    monotonic_ns: int
    source: str = "connector"

    @property
    def signal(self) -> int | None:
        return decode_wait_status(self.exit_code)[1]

    @property
    def status(self) -> int | None:
        return decode_wait_status(self.exit_code)[0]

    @property
    def returncode(self) -> int:
        """As ``Popen.returncode`` and torchrun print it: -N for signal N, else the status."""
        status, sig = decode_wait_status(self.exit_code)
        return -sig if sig is not None else (status or 0)


def subscribe_message(op: int, filtered: bool, seq: int = 1) -> bytes:
    """The netlink message that starts (or stops) the subscription. ``filtered`` uses the
    6.6+ ``struct proc_input`` form asking for non-zero exits only."""
    payload = struct.pack("=II", op, PROC_EVENT_NONZERO_EXIT) if filtered else struct.pack("=I", op)
    cn = _CN_MSG.pack(CN_IDX_PROC, CN_VAL_PROC, seq, 0, len(payload), 0) + payload
    return _NLMSGHDR.pack(_NLMSGHDR.size + len(cn), NLMSG_DONE, 0, seq, 0) + cn


def parse_messages(data: bytes) -> tuple[list[ExitEvent], list[int]]:
    """Parse one datagram (possibly several netlink messages). Returns the exits of
    thread-group leaders and the error codes of any subscription ACKs seen."""
    exits: list[ExitEvent] = []
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
                elif what == PROC_EVENT_NONE and payload + 4 <= offset + length:
                    acks.append(struct.unpack_from("=I", data, payload)[0])
        offset += (length + 3) & ~3
    return exits, acks


class ProcConnector:
    """Subscribes to the process connector and calls ``on_exit`` (from its own thread)
    for every leader that exits. ``start()`` raises OSError when the connector cannot be
    used here (no CONFIG_PROC_EVENTS, not in the initial namespaces, no privilege)."""

    def __init__(
        self,
        on_exit: Callable[[ExitEvent], None],
        on_overrun: Callable[[], None] = lambda: None,
        rcvbuf: int = RCVBUF,
    ) -> None:
        self.on_exit = on_exit
        self.rcvbuf = rcvbuf
        self.on_overrun = on_overrun
        self.sock: socket.socket | None = None
        self.filtered = False
        self.overruns = 0
        self._stop_r, self._stop_w = os.pipe()
        self._thread: threading.Thread | None = None

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
            # 6.6+: the filtered form. Its ACK is filtered out too (what == 0 matches no
            # filter bit), so success is "no error"; older kernels reject the 8-byte form
            # with an error ACK or ignore it, and get the plain form.
            if self._subscribe(sock, filtered=True, timeout=timeout):
                self.filtered = True
            elif not self._subscribe(sock, filtered=False, timeout=timeout):
                raise OSError(
                    errno.EPERM,
                    "the process connector did not acknowledge the subscription "
                    "(not in the initial PID/user namespace, or no CAP_NET_ADMIN before Linux 6.6)",
                )
        except OSError:
            sock.close()
            raise
        self.sock = sock
        self._thread = threading.Thread(target=self._run, name="trainwatch-exits", daemon=True)
        self._thread.start()

    def _subscribe(self, sock: socket.socket, filtered: bool, timeout: float) -> bool:
        sock.send(subscribe_message(PROC_CN_MCAST_LISTEN, filtered))
        if filtered:
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
                    self.on_overrun()
                    continue
                if exc.errno in (errno.EINTR, errno.EAGAIN):
                    continue
                log.error("process connector failed: %s", exc)
                return
            exits, _ = parse_messages(data)
            for event in exits:
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
                self.sock.send(subscribe_message(PROC_CN_MCAST_IGNORE, self.filtered))
            self.sock.close()
            self.sock = None
        for fd in (self._stop_r, self._stop_w):
            with contextlib.suppress(OSError):
                os.close(fd)
