"""The connector's socket filter, on a real connector socket: the kernel passes the events
of watched processes (their forks, exits, a rename to pt_elastic) and drops the rest.

Events reach the socket in the order they happened (each is queued in the context of the
task that caused it), so "X never arrived" is checked by waiting for a watched event that
happened after X."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

from sidecar.model.events import ExitEvent
from sidecar.watch import procfilter
from sidecar.watch.exits import ProcConnector
from tests.support.skips import requires

RENAME = "import ctypes,sys; ctypes.CDLL(None).prctl(15, sys.argv[1].encode(), 0, 0, 0); sys.stdin.readline()"


def test_the_program_fits_and_degrades_past_its_limit():
    small = procfilter.program(range(1, 200))
    assert len(small) // 8 <= procfilter.BPF_MAXINSNS
    big = procfilter.program(range(1, 5000))  # past MAX_WATCHED: every leader's exit and fork pass
    assert len(big) < len(small) and len(big) // 8 <= procfilter.BPF_MAXINSNS
    edge = procfilter.program(range(1, procfilter.MAX_WATCHED + 1))
    assert len(edge) // 8 <= procfilter.BPF_MAXINSNS


class _Events:
    def __init__(self) -> None:
        self.exits: list[ExitEvent] = []
        self.agents = threading.Event()
        self.connector = ProcConnector(self.exits.append, discovery=True, on_agent=self.agents.set)
        self.queued: list[tuple[str, int, int]] = []

    def wait(self, pred, what: str, timeout: float = 10.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            queue, lost = self.connector.drain()
            assert not lost
            self.queued += queue
            if pred():
                return
            time.sleep(0.01)
        raise AssertionError(f"timed out waiting for {what}: {self.queued} {self.exits}")


@requires("connector")
def test_only_watched_processes_reach_the_socket():
    ev = _Events()
    ev.connector.start()
    procs: list[subprocess.Popen] = []
    try:
        assert ev.connector.discovering
        # a watched "agent": a shell that forks a child and a grandchild when told to
        agent = subprocess.Popen(
            ["sh", "-c", 'read x; sh -c "read y; exit 4" <&0; exit 0'], stdin=subprocess.PIPE, text=True
        )
        procs.append(agent)
        ev.connector.watch({agent.pid})
        # not watched: its fork and its failing exit must never arrive
        stranger = subprocess.Popen(["sh", "-c", "exit 3"])
        stranger.wait()
        assert agent.stdin is not None
        agent.stdin.write("go\n")
        agent.stdin.flush()
        ev.wait(lambda: any(k == "fork" and p == agent.pid for k, _, p in ev.queued), "the agent's fork")
        child = next(c for k, c, p in ev.queued if k == "fork" and p == agent.pid)
        agent.stdin.write("go\n")
        agent.stdin.close()
        agent.wait(10)
        ev.wait(lambda: {child, agent.pid} <= {e.pid for e in ev.exits}, "the child's and the agent's exits")
        by_pid = {e.pid: e for e in ev.exits}
        assert by_pid[child].status == 4 and by_pid[agent.pid].status == 0  # zero exits too, of watched ones
        assert stranger.pid not in by_pid
        assert not any(stranger.pid in (c, p) for _, c, p in ev.queued)
        assert ("exit", agent.pid, 0) in ev.queued and ("exit", child, 0) in ev.queued

        # a process naming itself pt_elastic is queued and wakes the caller; another name is not
        other = subprocess.Popen([sys.executable, "-c", RENAME, "pt_elasticX"], stdin=subprocess.PIPE)
        procs.append(other)
        renamed = subprocess.Popen([sys.executable, "-c", RENAME, "pt_elastic"], stdin=subprocess.PIPE)
        procs.append(renamed)
        assert ev.agents.wait(10)
        ev.wait(lambda: ("agent", renamed.pid, 0) in ev.queued, "the rename")
        assert not any(p == other.pid for _, p, _ in ev.queued)
        # the agent joined the filter at once: its fork passes before the caller saw it
        assert renamed.pid in ev.connector._watched
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            if p.stdin is not None:
                p.stdin.close()
        ev.connector.stop()


@requires("connector")
def test_a_watched_process_threads_are_not_forks():
    ev = _Events()
    ev.connector.start()
    code = "import threading,sys; sys.stdin.readline(); t=threading.Thread(target=print); t.start(); t.join()"
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE)
    try:
        ev.connector.watch({proc.pid})
        assert proc.stdin is not None
        proc.stdin.write(b"go\n")
        proc.stdin.close()
        proc.wait(10)
        ev.wait(lambda: proc.pid in {e.pid for e in ev.exits}, "the exit")
        assert not any(k == "fork" for k, _, _ in ev.queued)
    finally:
        ev.connector.stop()
