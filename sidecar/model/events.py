"""The events the watchers hear and the senders they trace: the vocabulary both flows speak
(the sampling flow's exits, the death flow's exits, signals and senders), produced by
``watch/`` and ``probes/senders.py``, read by ``sampling/``, ``deaths/`` and ``autopsy/``."""

from __future__ import annotations

import signal
from dataclasses import dataclass

from sidecar.model import decode_wait_status

__all__ = ["ENDING_SIGNALS", "ExitEvent", "Sender", "SignalEvent"]

# the signals recorded by the tracepoint (the kernel filters out every other): those whose
# default action ends the process, as a kill, a fault or a request to stop (SIGCHLD, SIGCONT,
# the stops and the like never end one, and a rank's children send it a SIGCHLD each as they exit)
ENDING_SIGNALS = frozenset(
    int(s)
    for s in (
        signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGHUP, signal.SIGABRT,
        signal.SIGSEGV, signal.SIGBUS, signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM, signal.SIGXCPU,
    )
)  # fmt: skip


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


@dataclass(frozen=True, slots=True)
class SignalEvent:
    """``sender_pid`` (thread id of the sender, as the trace prints it) sent ``signal`` to
    ``target_pid`` at ``monotonic_ns``; ``code`` is the siginfo si_code."""

    sender_comm: str
    sender_pid: int
    target_comm: str
    target_pid: int
    signal: int
    code: int
    result: int
    monotonic_ns: int

    @property
    def from_kernel(self) -> bool:
        return self.code == 128  # SI_KERNEL


@dataclass(frozen=True, slots=True)
class Sender:
    """A signal's sender as /proc showed it when the tracepoint reported the signal: its
    parents (pid, comm, exe) from the nearest up; ``tool`` is what the catalogue
    (autopsy/senders.py) makes of the chain."""

    pid: int
    comm: str
    exe: str | None
    uid: int | None
    cgroup: str | None
    parents: tuple[tuple[int, str, str | None], ...]
    tool: str = "unknown"
    seen_at: float | None = None  # wall-clock time /proc was read (just after the signal)
    # what the tool was doing, where the catalogue can tell: "time_limit", "cancelled"
    detail: str | None = None
