"""Ports for the jobs and servers the tests start, that no one else takes meanwhile.

A port the kernel hands out for ``bind(0)`` comes from its ephemeral range, which every
outgoing connection on the machine draws from too (gloo's, the tests' HTTP clients',
Prometheus' scrapes). Between the test closing its probe socket and the job binding the
port, any of them may take it: a TCPStore then fails with EADDRINUSE (seen on CI, a Slurm
step that never came up). So the ports come from outside that range (read from
/proc/sys/net/ipv4/ip_local_port_range, whatever it is here), where only a program that
names a port binds one; each pytest worker draws from its own share, in turn, and a port
something already listens on is passed over.
"""

from __future__ import annotations

import itertools
import os
import socket
from collections.abc import Iterator

RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
LOWEST = 10_000  # below: ports many services are configured to use


def ephemeral_range(path: str = RANGE_FILE) -> tuple[int, int]:
    try:
        with open(path) as f:
            lo, hi = (int(x) for x in f.read().split()[:2])
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def pool(ephemeral: tuple[int, int], worker: int, workers: int) -> range:
    """This worker's share of the larger stretch outside the ephemeral range."""
    lo, hi = ephemeral
    below, above = range(LOWEST, max(LOWEST, lo)), range(max(hi + 1, LOWEST), 65536)
    stretch = below if len(below) >= len(above) else above
    share = len(stretch) // max(1, workers)
    if share < 16:  # the ephemeral range takes (nearly) everything: the kernel's choice it is
        return range(0)
    start = stretch.start + (worker % max(1, workers)) * share
    return range(start, start + share)


def _worker() -> tuple[int, int]:
    name = os.environ.get("PYTEST_XDIST_WORKER", "")  # gw0, gw1, ...
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    index = int(name[2:]) if name.startswith("gw") and name[2:].isdigit() else 0
    return index, count


def _free(port: int) -> bool:
    with socket.socket() as s:  # a job's store listens on every address
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def _kernel_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _turns() -> Iterator[int]:
    ports = pool(ephemeral_range(), *_worker())
    if not ports:
        while True:
            yield _kernel_port()
    # processes of one worker (a test's own helpers) start at different places in its share
    offset = os.getpid() % len(ports)
    yield from itertools.cycle([*ports[offset:], *ports[:offset]])


_TURNS: Iterator[int] | None = None


def free_port() -> int:
    """A port nothing listens on now, that no outgoing connection will be given."""
    global _TURNS
    if _TURNS is None:
        _TURNS = _turns()
    for _ in range(4096):
        port = next(_TURNS)
        if _free(port):
            return port
    return _kernel_port()
