"""The data model: frozen dataclasses with unit-suffixed fields, and no I/O.

A process is its pid *and* its start time (``ProcKey``), so a recycled pid is never
mistaken for the process that used to own it. Sizes are bytes, times are seconds
(wall-clock times are Unix epoch seconds, monotonic times say so in their name).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple, TypeVar

_T = TypeVar("_T")

__all__ = [
    "CgroupLevel",
    "CgroupSample",
    "Confidence",
    "Fate",
    "GpuDeviceSample",
    "GpuProcessSample",
    "HostSample",
    "JobSample",
    "Kind",
    "MemoryCharge",
    "MemoryLimit",
    "ProbeStatus",
    "ProcKey",
    "RankEnv",
    "RankProgress",
    "RankSample",
    "Snapshot",
    "Stranding",
    "TimelinePoint",
    "decode_wait_status",
    "evolve",
    "wait_status_from_returncode",
]


_set = object.__setattr__
_FIELDS: dict[type, tuple[tuple[str, ...], frozenset[str]]] = {}


def evolve(obj: _T, **changes: object) -> _T:
    """``dataclasses.replace`` for the frozen, slotted records below, without running their
    ``__init__`` again (half the cost; the sampling round makes a dozen a round). Only
    fields may change; values are not checked (they are the round's own)."""
    cls = type(obj)
    fields = _FIELDS.get(cls)
    if fields is None:
        names = tuple(cls.__slots__)  # type: ignore[attr-defined]
        fields = _FIELDS[cls] = (names, frozenset(names))
    if not changes.keys() <= fields[1]:
        raise TypeError(f"{cls.__name__} has no field {sorted(changes.keys() - fields[1])}")
    new = object.__new__(cls)
    for name in fields[0]:
        _set(new, name, changes[name] if name in changes else getattr(obj, name))
    return new


def decode_wait_status(code: int) -> tuple[int | None, int | None]:
    """A raw wait status (the process connector's, a zombie's field 52, ``PIDFD_GET_INFO``):
    (exit status, None) for a normal exit, (None, signal) for a death by signal."""
    sig = code & 0x7F
    if sig == 0:
        return (code >> 8) & 0xFF, None
    return None, sig


def wait_status_from_returncode(code: int) -> int:
    """torchrun's ``exitcode`` and ``Popen.returncode`` (-9, 143) as a raw wait status (9,
    143 << 8)."""
    return -code & 0x7F if code < 0 else (code & 0xFF) << 8


class _Word(str, Enum):
    """A str enum whose members compare, print, format and serialise as their value (the
    postmortem's JSON and the metrics' labels are unchanged)."""

    def __str__(self) -> str:
        return str.__str__(self)

    def __format__(self, spec: str) -> str:
        return str.__format__(self, spec)


class Kind(_Word):
    """``killer.kind``: who or what killed the rank."""

    KERNEL_OOM = "kernel_oom"
    CGROUP_OOM = "cgroup_oom"
    USERSPACE_OOM = "userspace_oom"
    COLLECTIVE_TIMEOUT = "collective_timeout"
    AGENT_TEARDOWN = "agent_teardown"
    EXTERNAL_SIGNAL = "external_signal"
    SEGFAULT = "segfault"
    BUS_ERROR = "bus_error"
    ABORT = "abort"
    CUDA_OOM = "cuda_oom"
    GPU_ERROR = "gpu_error"
    PYTHON_EXCEPTION = "python_exception"
    UNKNOWN = "unknown"


class Fate(_Word):
    """``ranks[].fate``: how each rank of the job ended, relative to the root cause."""

    ROOT_CAUSE = "root_cause"
    SAME_CAUSE = "same_cause"
    TERMINATED_BY_AGENT = "terminated_by_agent"
    EXITED_CLEANLY = "exited_cleanly"
    RUNNING = "running"
    # alive, making no progress, after another rank of its job died (stalls/stranded.py)
    STRANDED = "stranded"
    UNKNOWN = "unknown"


class Confidence(_Word):
    """``certain`` only when a first-hand record ties the pid to the killer; ``likely`` when
    counters and timing agree; ``possible`` when it is inference."""

    CERTAIN = "certain"
    LIKELY = "likely"
    POSSIBLE = "possible"


class ProcKey(NamedTuple):
    """A process: pid plus start time in clock ticks after boot (field 22 of /proc/PID/stat).

    A named tuple, not a dataclass: it keys the sampler's and the death watch's tables, and
    a tuple's hash is computed in C (a frozen dataclass's ``__hash__`` is Python, tens of
    calls a round)."""

    pid: int
    start_ticks: int


@dataclass(frozen=True, slots=True)
class RankEnv:
    """What a torchrun worker's environment (/proc/PID/environ) says about it."""

    rank: int | None
    local_rank: int | None
    world_size: int | None
    local_world_size: int | None
    group_rank: int | None
    role: str | None
    run_id: str | None
    restart_count: int
    max_restarts: int | None
    error_file: str | None
    # the NCCL flight recorder: (buffer size, 0 when off; dump file prefix)
    flight_recorder: tuple[int, str] = (0, "/tmp/nccl_trace_rank_")
    # TORCH_NCCL_DEBUG_INFO_PIPE_FILE: the prefix of the FIFO through which the rank's NCCL
    # monitor dumps its flight recorder on demand (``<prefix><rank>.pipe``); None when unset
    flight_pipe: str | None = None
    # SLURM_JOB_START_TIME, SLURM_JOB_END_TIME (epoch s): the allocation's start and its time
    # limit's end, where the rank runs in a Slurm job
    slurm_times: tuple[int, int] | None = None
    # TRAINWATCH_RUN_OUTPUT: the job runs under `trainwatch run`, which keeps its output there
    run_output: str | None = None
    node_rank: int | None = None  # NODE_RANK (Lightning's launcher gives it, and no RANK)
    rank_var: str = "RANK"  # the variable ``rank`` came from (MPI's: OMPI_COMM_WORLD_RANK, ...)

    @property
    def is_worker(self) -> bool:
        """True when the environment is that of a torchrun worker (not the agent's own)."""
        return self.run_id is not None and (self.rank is not None or self.local_rank is not None)


@dataclass(frozen=True, slots=True)
class CgroupLevel:
    """One level of a memory cgroup's ancestry and its limit (None: no limit)."""

    path: str
    limit_bytes: int | None


@dataclass(frozen=True, slots=True)
class MemoryCharge:
    """What a memory cgroup's charge is made of (``memory.stat``, parse/memstat.py)."""

    anon_bytes: int
    file_bytes: int  # page cache, shmem excluded
    shmem_bytes: int  # tmpfs, /dev/shm, shared anonymous mappings
    kernel_bytes: int | None  # slab, stacks, page tables, sockets; None where not told
    working_set_bytes: int | None  # usage - inactive_file, as kubelet computes it
    inactive_file_bytes: int

    @property
    def unreclaimable_bytes(self) -> int:
        """What reclaim cannot take back without swap: anon and shmem."""
        return self.anon_bytes + self.shmem_bytes


@dataclass(frozen=True, slots=True)
class MemoryLimit:
    """The limit whose exhaustion would kill a rank first: the tightest memory cgroup limit
    above it (``kind="cgroup"``, its path) or the host's memory (``kind="host"``, no path:
    a global OOM)."""

    kind: str
    path: str | None
    limit_bytes: int


@dataclass(frozen=True, slots=True)
class Warned:
    """A prediction warned about (an episode's first, or a later one that was news): what the
    postmortem's ``warnings`` lists."""

    at: float  # wall clock
    job: str
    rank: int | None
    rank_label: str
    restart: int
    exhaustion_seconds: float
    rate_bytes_per_second: float
    limit: MemoryLimit


@dataclass(frozen=True, slots=True)
class CgroupSample:
    """A memory cgroup as read at one instant.

    v1 reads memory.{usage_in_bytes,limit_in_bytes,max_usage_in_bytes,oom_control};
    v2 reads memory.{current,max,peak,events}. ``peak_bytes`` is None where the kernel
    keeps no high-water mark (v2 before 5.19). ``oom_kills`` counts processes of this
    cgroup killed by any OOM killer (kernel 4.13+). ``ancestors`` runs from the parent up
    to the hierarchy root; ``limited_by`` is the level (this one or an ancestor) with the
    tightest limit, None when no level has one.
    """

    path: str
    version: int
    usage_bytes: int | None
    limit_bytes: int | None
    peak_bytes: int | None
    oom_kills: int | None
    oom_events: int | None
    ancestors: tuple[CgroupLevel, ...] = ()
    limited_by: str | None = None
    effective_limit_bytes: int | None = None
    charge: MemoryCharge | None = None
    events: dict[str, int] = field(default_factory=dict)  # v2 memory.events: low, high, max, oom, oom_kill
    # v2 memory.pressure, the cgroup's own: (some avg10, full avg10) as 0..1, (some, full) totals in s
    pressure_ratio: tuple[float, float | None] | None = None
    pressure_stall_seconds: tuple[float, float | None] | None = None
    # foresight.py: seconds until this cgroup's own limit is reached at the trend of its
    # unreclaimable charge; None while that charge is not growing
    exhaustion_seconds: float | None = None
    # times this cgroup or the level limiting it reached its limit (CgroupReader.limit_hits):
    # what tells a cgroup OOM from another OOM killer's kill counted in ``oom_kills``
    limit_hits: int | None = None


@dataclass(frozen=True, slots=True)
class HostSample:
    """The host's memory state: /proc/meminfo, /proc/vmstat, /proc/pressure/memory, /dev/shm."""

    total_bytes: int
    available_bytes: int
    oom_kills: int | None
    psi_some_avg10_ratio: float | None
    psi_full_avg10_ratio: float | None
    psi_some_total_seconds: float | None
    psi_full_total_seconds: float | None
    shm_total_bytes: int | None
    shm_used_bytes: int | None


@dataclass(frozen=True, slots=True)
class GpuProcessSample:
    """One compute process NVML lists on a GPU. ``pid`` is a host (initial-namespace) pid."""

    pid: int
    used_bytes: int | None
    # NVML's per-process utilisation since the last round (nvmlDeviceGetProcessUtilization),
    # in percent: of the time a kernel of this process ran (SM), and the device memory was
    # read or written (memory). 0 when NVML had no sample of it (it ran nothing); None where
    # the device or driver does not report it.
    sm_percent: float | None = None
    memory_percent: float | None = None


@dataclass(frozen=True, slots=True)
class GpuDeviceSample:
    """One GPU. ``used_bytes`` excludes the driver's reservation where NVML can split it out."""

    index: int
    uuid: str | None
    name: str | None
    used_bytes: int | None
    total_bytes: int | None
    lost: bool = False
    processes: tuple[GpuProcessSample, ...] = ()


@dataclass(frozen=True, slots=True)
class RankSample:
    """One rank at one instant.

    ``rss_bytes`` and ``peak_rss_bytes`` are VmRSS and VmHWM of the rank itself;
    ``tree_rss_bytes`` adds the RSS of every descendant (DataLoader workers, compile
    workers), so pages shared between them are counted once per process, as RSS does.
    ``gpu_memory_bytes`` maps a GPU index to the memory NVML attributes to the rank's
    tree, empty when NVML gave nothing.
    """

    job: str
    rank: int | None
    rank_label: str
    local_rank: int | None
    restart: int
    key: ProcKey
    rss_bytes: int
    peak_rss_bytes: int | None
    cpu_seconds: float
    threads: int
    tree_rss_bytes: int
    tree_processes: int
    cgroup: str | None
    gpu_memory_bytes: dict[int, int] = field(default_factory=dict)
    ns_pids: tuple[int, ...] = ()
    flight_recorder: tuple[int, str] | None = None  # RankEnv's; None when the env was unreadable
    error_file: str | None = None  # TORCHELASTIC_ERROR_FILE: where @record writes the rank's exception
    uid: int | None = None  # its real user: the owner its error file and dump must have
    run_output: str | None = None  # RankEnv's: where `trainwatch run` keeps the job's output
    # the tree's PSS and USS (smaps_rollup; probes/pss.py), as last measured; None before
    tree_pss_bytes: int | None = None
    tree_uss_bytes: int | None = None
    # each descendant's (pid, USS, USS when first measured): copy-on-access growth per worker
    workers_uss: tuple[tuple[int, int, int], ...] = ()
    # what reclaim cannot take back: the rank's RssAnon + RssShmem plus its descendants' RSS
    # (their growth is what matters: a worker's shared libraries are a constant)
    tree_unreclaimable_bytes: int | None = None
    # foresight.py: the limit that binds the rank and the seconds until it is reached at its
    # charge's trend, while the rank's own unreclaimable memory grows (None otherwise)
    binding_limit: MemoryLimit | None = None
    exhaustion_seconds: float | None = None
    flight_pipe: str | None = None  # RankEnv's
    slurm_times: tuple[int, int] | None = None  # RankEnv's
    # the tree's GPU activity this round, the busiest of its processes on any GPU (percent;
    # None when NVML reports no utilisation for it: no GPU, or not supported)
    gpu_sm_percent: float | None = None
    gpu_memory_percent: float | None = None
    progress: RankProgress | None = None  # stalls/tracker.py's judgement of this rank
    # where its rank number came from: the launcher's variable (RANK, LOCAL_RANK), or
    # "order" (its place among the launcher's children, its environment unreadable)
    rank_source: str = "RANK"


@dataclass(frozen=True, slots=True)
class RankProgress:
    """Whether a rank makes progress (``sidecar/stalls/tracker.py``). ``stalled_seconds`` counts from
    the last window in which it did; ``reason`` says why it is judged stalled (None while it
    progresses). ``cpu_busy``/``gpu_busy``: its activity over the judging window (gpu_busy
    None without GPU utilisation). ``gpu_spinning_seconds``: how long its GPU has held a
    kernel without pause and without memory traffic (a polling loop: an NCCL kernel waiting
    for a peer), 0.0 when it does not."""

    stalled_seconds: float
    reason: str | None
    cpu_busy: bool
    gpu_busy: bool | None
    gpu_spinning_seconds: float = 0.0


@dataclass(frozen=True, slots=True)
class Stranding:
    """Ranks of a job left alive and making no progress after another rank of it died
    (``sidecar/stalls/stranded.py``). ``since``: wall-clock seconds, the earliest of the
    stranded ranks'; ``dead_ranks``/``ranks``: labels; ``pids``: the stranded ranks';
    ``gpu_memory_bytes``: what NVML attributes to their trees, held for nothing."""

    since: float
    dead_ranks: tuple[str, ...]
    ranks: tuple[str, ...]
    pids: tuple[int, ...]
    gpu_memory_bytes: int


@dataclass(frozen=True, slots=True)
class JobSample:
    """A distributed job (one launching process, its "agent", on this machine) and its live
    ranks. ``launcher``: which launcher started them (sampling/jobs.py)."""

    key: str
    agent: ProcKey
    run_id: str | None
    world_size: int | None
    restart_count: int
    max_restarts: int | None
    entrypoint: str | None
    started_at: float
    ranks: tuple[RankSample, ...]
    agent_alive: bool = True
    # sidecar/stalls/tracker.py: how long its longest-stalled rank has made no progress, and the
    # ranks the stalled ones are judged to wait for (labels)
    stalled_seconds: float = 0.0
    suspected_missing: tuple[str, ...] = ()
    # /dev/shm as the job sees it (its mount namespace): (size, used) bytes and the
    # monotonic time of the detailed round that read it; None where it could not be read
    shm: tuple[int, int, float] | None = None
    launcher: str = "torchrun"
    stranded: Stranding | None = None  # sidecar/stalls/stranded.py


@dataclass(frozen=True, slots=True)
class ProbeStatus:
    """How the last run of one probe went."""

    success: bool
    duration_seconds: float
    message: str | None = None


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything one sampling round saw. Scrapes and HTTP handlers read only this."""

    taken_at: float
    monotonic: float
    jobs: tuple[JobSample, ...]
    host: HostSample | None
    gpus: tuple[GpuDeviceSample, ...]
    cgroups: tuple[CgroupSample, ...]
    probes: dict[str, ProbeStatus]
    samples_total: int
    overruns_total: int
    sample_duration_seconds: float
    unreadable_processes: int
    nvml_unmatched_pids: tuple[int, ...] = ()
    smaps_cpu_seconds: float = 0.0  # CPU the PSS/USS sampler has spent (probes/pss.py)
    # every file read this round (else: status, host files and the cgroups' details are the
    # last detailed round's, at most DETAIL_SECONDS old; sampling/sampler.py)
    detail: bool = True


@dataclass(frozen=True, slots=True)
class TimelinePoint:
    """One entry of a job's memory history; rank keys are rank labels (``"0"``, ``"1"``...)."""

    at: float
    host_available_bytes: int | None
    cgroup_usage_bytes: int | None
    rss_bytes: dict[str, int]
    tree_rss_bytes: dict[str, int]
    gpu_memory_bytes: dict[str, int]
    # what the binding cgroup's charge was made of (anon, file, shmem, kernel); {} untold
    cgroup_charge_bytes: dict[str, int] = field(default_factory=dict)
    # each rank's descendants' USS together (rank label -> bytes), as last measured
    workers_uss_bytes: dict[str, int] = field(default_factory=dict)
