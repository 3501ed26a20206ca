"""The autopsy's inputs and output, as types: each rank's end (``RankState``), the kernel's
OOM kills, the signals sent, userspace OOM daemons' kills, everything else gathered for one
incident (``Evidence``, built live by ``deaths``/``gather`` or from logs by ``diagnose``),
what one rule of a cascade finds (``Step``) and the verdict with its structured facts. Also
how ranks and signals are named in sentences.
"""

from __future__ import annotations

import signal as _signal
from collections.abc import Mapping
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from sidecar.model import Confidence, Fate, Kind, decode_wait_status
from sidecar.model.events import Sender
from sidecar.parse.flight import FlightVerdict
from sidecar.parse.kernel import XidRecord
from sidecar.parse.ranks import Finding

__all__ = [
    "USERSPACE_OOM_DAEMONS",
    "Evidence",
    "EvidenceItem",
    "Facts",
    "KernelOom",
    "RankState",
    "SignalSent",
    "Step",
    "UserspaceKill",
    "Verdict",
    "agent_name",
    "rank_label",
    "rank_name",
    "signal_name",
]


def signal_name(number: int | None) -> str | None:
    """``SIGKILL`` for 9; never raises."""
    if number is None:
        return None
    try:
        return _signal.Signals(number).name
    except ValueError:
        return f"SIG{number}"


def rank_label(label: str, from_logs: bool = False) -> str:
    """``rank 3``; from logs, a label the launcher never gave ("local1": the agent's local
    rank) is said as what it is: ``local rank 1``."""
    if from_logs and label.startswith("local") and label[5:].isdigit():
        return f"local rank {label[5:]}"
    return f"rank {label}"


def rank_name(label: str, pid: int, from_logs: bool = False) -> str:
    """``rank 3 (pid 4390)``; from logs, only what they told: ``the process`` (neither rank
    nor pid), ``the process (pid 4390)`` (a pid only), ``rank 3`` (no pid)."""
    if not from_logs:
        return f"rank {label} (pid {pid})"
    if label == "?" and not pid:
        return "the process"
    if label == f"pid{pid}":
        return f"the process (pid {pid})"
    return rank_label(label, True) + (f" (pid {pid})" if pid else "")


@dataclass(frozen=True, slots=True)
class RankState:
    """A rank as the autopsy sees it. ``exit_code`` is the raw wait status (None: alive,
    or exit unknown when ``died_ns`` is set); ``died_ns`` is CLOCK_MONOTONIC."""

    label: str
    rank: int | None
    local_rank: int | None
    pid: int
    ns_pids: tuple[int, ...] = ()
    exit_code: int | None = None
    died_ns: int | None = None
    cgroup: str | None = None
    cgroup_limited_by: str | None = None
    # who told the exit status: "connector", "pidfd", "proc" (a zombie), "agent-log"
    exit_source: str | None = None
    gpus: tuple[int, ...] = ()  # the GPU indices NVML ever attributed memory of the rank's tree to
    # SLURM_JOB_START_TIME and SLURM_JOB_END_TIME of its environment (epoch s): its allocation
    slurm_times: tuple[int, int] | None = None

    @property
    def dead(self) -> bool:
        return self.died_ns is not None

    @property
    def signal(self) -> int | None:
        return None if self.exit_code is None else decode_wait_status(self.exit_code)[1]

    @property
    def status(self) -> int | None:
        return None if self.exit_code is None else decode_wait_status(self.exit_code)[0]

    @property
    def returncode(self) -> int | None:
        """-N for signal N, else the exit status (as torchrun prints ``exitcode``)."""
        if self.exit_code is None:
            return None
        return -self.signal if self.signal is not None else self.status

    @property
    def abnormal(self) -> bool:
        return self.dead and (self.exit_code is None or self.returncode != 0)


@dataclass(frozen=True, slots=True)
class KernelOom:
    """What the kernel log said about one OOM kill: merged summary and kill line."""

    pid: int
    at_ns: int
    scope: str | None  # "global" | "memcg" | None (pre-5.1 kill line without prefix)
    oom_memcg: str | None
    task_memcg: str | None
    comm: str
    rss_bytes: int | None
    lines: tuple[str, ...] = ()

    def merged(self, fresh: KernelOom) -> KernelOom:
        """One OOM kill told by several records (the summary, the kill line): what each adds."""
        return KernelOom(
            pid=fresh.pid,
            at_ns=min(self.at_ns, fresh.at_ns),
            scope=fresh.scope or self.scope,
            oom_memcg=fresh.oom_memcg or self.oom_memcg,
            task_memcg=fresh.task_memcg or self.task_memcg,
            comm=fresh.comm,
            rss_bytes=fresh.rss_bytes if fresh.rss_bytes is not None else self.rss_bytes,
            lines=(*self.lines, *fresh.lines),
        )


@dataclass(frozen=True, slots=True)
class SignalSent:
    """From the signal:signal_generate tracepoint: who sent which signal to whom."""

    sender_comm: str
    sender_pid: int
    target_pid: int
    signal: int
    code: int
    at_ns: int
    sender: Sender | None = None  # the sender and its parents, where /proc still had them


USERSPACE_OOM_DAEMONS = ("earlyoom", "systemd-oomd", "oomd", "nohang")


@dataclass(frozen=True, slots=True)
class UserspaceKill:
    """A userspace OOM daemon's own record of a kill: its log line (``pid`` named), its
    kernel-log line or the xattrs it sets on the cgroup it killed (``cgroup`` named)."""

    daemon: str
    pid: int | None
    cgroup: str | None
    signal: int | None
    at_ns: int | None
    detail: str
    source: str  # "log" | "kmsg" | "xattr"

    def names(self, rank: RankState) -> str | None:
        """ "pid" when it names the rank's pid, "cgroup" when the rank's cgroup is (under)
        the one it killed, else None."""
        if self.pid is not None:
            return "pid" if self.pid in (rank.pid, *rank.ns_pids) else None
        if self.cgroup and rank.cgroup:
            top = self.cgroup.rstrip("/") or "/"
            if rank.cgroup == top or rank.cgroup.startswith(top.rstrip("/") + "/"):
                return "cgroup"
        return None


@dataclass(frozen=True, slots=True)
class Evidence:
    """Everything the autopsy may use, gathered live (deaths/) or from logs (diagnose/).
    The ranks come first; every other field is named where it is built."""

    ranks: tuple[RankState, ...]
    _: KW_ONLY
    kernel: tuple[KernelOom, ...] = ()
    signals: tuple[SignalSent, ...] = ()
    agent_pid: int | None = None
    agent_name: str = "the torchrun agent"  # the launching process, as a verdict names it (agent_name)
    oom_daemons: tuple[tuple[str, int], ...] = ()  # userspace OOM daemons running here: (comm, pid)
    host_oom_kills_before: int | None = None
    host_oom_kills_after: int | None = None
    cgroup_oom_kills_before: dict[str, int] = field(default_factory=dict)
    cgroup_oom_kills_after: dict[str, int] = field(default_factory=dict)
    # the times each cgroup (or the level limiting it) reached its limit (CgroupSample.limit_hits):
    # a cgroup's oom_kill counts kills by any OOM killer, only these say its own limit was hit
    cgroup_limit_hits_before: dict[str, int] = field(default_factory=dict)
    cgroup_limit_hits_after: dict[str, int] = field(default_factory=dict)
    kernel_log_readable: bool = True
    exits_first_hand: bool = True  # exit codes came from the kernel (process connector)
    userspace: tuple[UserspaceKill, ...] = ()
    # pids the agent's log says it sent a closing signal to: torn down, never the root
    # cause (matters when death times are only when a death was noticed)
    agent_teardown: frozenset[int] = frozenset()
    # what the ranks wrote: (rank label or None when unattributed, finding), in order
    output: tuple[tuple[str | None, Finding], ...] = ()
    # the stream (an input of ``diagnose``) each of ``output`` was read from, in step with it:
    # within one stream the order of ``output`` is the order its lines were written. Empty
    # where no order is known (the daemon reads each rank's output on its own)
    output_streams: tuple[int, ...] = ()
    output_read: bool = False  # some output of the job could be read
    run_output: str | None = None  # the job runs under `trainwatch run`, which keeps its output there
    world_size: int | None = None
    flight: FlightVerdict | None = None  # the flight recorder's dumps, summarised
    flight_enabled: bool | None = None
    # the ranks' /dev/shm in their mount namespace: (size, used) bytes, and how many seconds
    # before the first death it was read (None: at the autopsy)
    shm: tuple[int, int, float | None] | None = None
    xids: tuple[tuple[int, XidRecord], ...] = ()  # (monotonic ns, record) of NVRM Xid kernel records
    # the kernel's own records of a process's end that the emitter catalog names and that
    # name the pid ("python[4242]: segfault at 0 ip ..."): (monotonic ns, pid, catalog id,
    # the record's text)
    kernel_said: tuple[tuple[int, int, str, str], ...] = ()
    # the job's logs read live (the agent's stream, launcher, shell and scheduler lines among the
    # ranks' output) that the catalog names: (message id, line)
    job_said: tuple[tuple[str, str], ...] = ()
    # GPUs NVML reports lost (NVML_ERROR_GPU_IS_LOST: off the bus): (monotonic ns first seen
    # lost, index, name)
    lost_gpus: tuple[tuple[int, int, str | None], ...] = ()
    # The ranks' labels and pids come from logs (trainwatch diagnose): a rank is named by what
    # the logs told ("the process (pid 4242)", "local rank 1"), never by an invented label or pid.
    from_logs: bool = False
    # files the job named that were not read (a FIFO, a link, another user's file, too big,
    # too slow), each with why: shown with the evidence, never used as evidence
    skipped: tuple[str, ...] = ()
    # kernel log records overwritten before they were read: (kernel time ns, how many); near
    # a death, the absence of an OOM record there is no longer evidence of no OOM
    kernel_losses: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True, slots=True)
class EvidenceItem:
    source: str
    at_ns: int | None
    detail: str


@dataclass(frozen=True, slots=True)
class Facts:
    """What the verdict found, as data: advice and the document are chosen from these and
    the kind, never from the summary's words."""

    backend: str | None = None  # the collective's backend: "nccl" or "gloo"
    # every rank reached the collective (the flight recorder shows it, or the job is a world
    # of one): the collective itself, or GPU work ahead of it, did not finish
    all_entered: bool = False
    shm_exhausted: bool = False  # the failure is /dev/shm running out (a bus error, no space)
    sender: Sender | None = None  # who sent the signal that killed the rank, with its tool
    # the victim's own words only report a failure elsewhere (peers.only_reports)
    peer_failure: bool = False


@dataclass(frozen=True, slots=True)
class Step:
    """What one rule of a cascade found (``killers``' ``_KILLERS``, ``said``'s ``_OWN_WORDS``):
    the evidence it cites, in order, the facts it found (``Facts``' fields) and its verdict,
    or None where the next rule goes on. A rule returns it; the cascade's driver alone
    gathers the items and facts, so each rule reads and tests alone."""

    items: tuple[EvidenceItem, ...] = ()
    facts: Mapping[str, Any] = field(default_factory=dict)
    verdict: tuple[Kind, Confidence, str] | None = None


@dataclass(frozen=True, slots=True)
class Verdict:
    victim: RankState
    kind: Kind
    confidence: Confidence
    summary: str
    evidence: tuple[EvidenceItem, ...]
    fates: dict[str, Fate]
    oom: KernelOom | None = None
    facts: Facts = Facts()


# how a verdict names a job's launching process, by its launcher (sampling/jobs.py's names)
_AGENT_NAMES = {
    "torchrun": "the torchrun agent",
    "deepspeed": "DeepSpeed's launcher",
    "spawn": "the process that called mp.spawn",
    "lightning": "Lightning's launcher (rank 0)",
    "mpi": "the MPI launcher",
    "slurm": "Slurm's slurmstepd",
}


def agent_name(launcher: str) -> str:
    return _AGENT_NAMES.get(launcher, "the job's launcher")
