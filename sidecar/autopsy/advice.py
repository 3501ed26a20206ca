"""Advice: what to change, chosen from the verdict's kind and facts (``Verdict.facts``) and
the numbers of the document (the ranks' memory, the binding cgroup, the host), never from
the verdict's words. The live daemon and ``trainwatch diagnose`` share it (``live``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from sidecar.autopsy.evidence import Verdict
from sidecar.autopsy.filled import Filling
from sidecar.model import CgroupSample, Kind
from sidecar.units import gib, gib_or_mib

__all__ = ["RankMemory", "advice"]


class RankMemory(NamedTuple):
    """The numbers advice reads of a rank: its own RSS and its tree's (DataLoader workers
    included), as last known; None where unknown."""

    rss_bytes: int | None
    tree_rss_bytes: int | None


def _gib(n: int | None) -> str:
    return "?" if n is None else gib(n)


OOM_KINDS = (Kind.KERNEL_OOM, Kind.CGROUP_OOM, Kind.USERSPACE_OOM)
# what to look at once the sender's tool is known (autopsy/senders.py), by tool
SENDER_ADVICE = {
    "slurm": "Slurm ended the step: `sacct -j $SLURM_JOB_ID -o JobID,State,Elapsed,Timelimit` says whether "
    "it reached its time limit (raise --time, or checkpoint and requeue) or was cancelled (scancel, a "
    "preemption).",
    "kubelet": "Kubernetes stopped the pod: `kubectl describe pod` and `kubectl get events` say why (an "
    "eviction under node memory pressure, a preemption, a deletion or a rollout); requests equal to "
    "limits keep a pod from being evicted first.",
    "containerd": "The container runtime stopped the container: the orchestrator's log (or `crictl "
    "inspect`) says who asked it to.",
    "docker": "Docker stopped the container: `docker events` and `docker inspect` say who and when.",
    "systemd": "systemd stopped the rank's unit: `journalctl -u UNIT` says who stopped it; TimeoutStopSec "
    "decides when its SIGTERM becomes SIGKILL.",
    "nvrx": "NVIDIA Resiliency Extension's monitor killed a rank it judged hung (no heartbeat within its "
    "timeout): its log names the rank; raise its timeouts if the steps were only slow.",
    "ray": "Ray killed the worker: its memory monitor kills at 95 % of the node's memory by default "
    "(RAY_memory_usage_threshold); the raylet's log says why.",
    "user": "It was killed from a shell on this node (uid {uid}): the sender's parents name the session "
    "(sshd, tmux, cron, a script).",
}
SENDER_DETAIL_ADVICE: dict[tuple[str, str | None], str] = {
    (
        "slurm",
        "time_limit",
    ): "The job ran out of its Slurm time limit: raise --time, or save a checkpoint before "
    "the end (`#SBATCH --signal=B:USR1@300` sends a signal 5 minutes before) and requeue.",
    ("slurm", "cancelled"): "Slurm cancelled the job before its time limit: `sacct -j $SLURM_JOB_ID -o "
    "JobID,State,Reason` says whether it was scancel (and by whom), a preemption or a node failure.",
}
EVERY_RANK_ADVICE = (
    "each process loads its own full copy. Load the weights once (low_cpu_mem_usage=True, meta-device or "
    "ZeRO-3 init), load them straight to the GPU, or stagger loading across ranks."
)


def _filled(f: Filling) -> str:
    """The advice for what filled the limit (autopsy/filled.py)."""
    if f.kind == "shmem":
        return " ".join(
            (
                f"Shared memory filled the limit: {gib_or_mib(f.part_bytes)} of the"
                f" {gib_or_mib(f.total_bytes)}",
                "charged at the kill was shmem (files in /dev/shm or another tmpfs, shared tensors),",
                "which counts toward the limit and no reclaim frees. Look for what the job keeps in",
                "/dev/shm (a dataset copied there, tensors shared between processes, files left by",
                "earlier runs), lower the DataLoader's num_workers or prefetch_factor, or raise the",
                "limit to cover it.",
            )
        )
    if f.kind == "page_cache":
        return " ".join(
            (
                f"Page cache filled the limit: {gib_or_mib(f.part_bytes)} of the {gib_or_mib(f.total_bytes)}",
                "charged at the kill was file pages, which cgroup v1 counts toward the limit; the kernel",
                "kills when it cannot reclaim them fast enough (dirty pages of a checkpoint being",
                "written, mapped dataset files). Write checkpoints in pieces and flush them (os.fsync),",
                "read datasets without keeping them mapped, or leave headroom above the job's own",
                "memory for its I/O (cgroup v2 reclaims earlier and throttles at memory.high).",
            )
        )
    if f.kind == "one_rank":
        # its last stretch's rate, where it still grew (flat before the kill: no "at 0 MiB/s")
        shown = gib_or_mib(f.rate_bytes_per_second or 0.0)
        rate = f" at {shown}/s" if shown != gib_or_mib(0) else ""
        return " ".join(
            (
                f"Rank {f.rank} alone grew, by {gib_or_mib(f.grown_bytes)} in {f.seconds:.0f} s{rate}, while",
                "the other ranks stayed flat: a leak in what only that rank does (rank-0 logging or",
                "evaluation, metrics or losses kept as tensors with their graph, a cache that never",
                "evicts). tracemalloc or memray on that rank shows where.",
            )
        )
    if f.kind == "workers":
        return " ".join(
            (
                f"The ranks' child processes (DataLoader workers) grew by {gib_or_mib(f.grown_bytes)}",
                "of memory of their own (USS) in" if f.unique else "in",
                f"{f.seconds:.0f} s while the ranks did not: copy-on-access, each worker un-sharing the",
                "dataset's pages as it touches Python objects (their reference counts are written).",
                "Keep the dataset in numpy arrays, Arrow or tensors instead of lists and dicts of",
                "Python objects, lower num_workers, or load the data in the worker instead of before",
                "the fork.",
            )
        )
    held = sorted(f.held.values())
    return (
        f"Every rank grew alike and held about the same host memory ({_gib(held[0])} to {_gib(held[-1])}): "
        + EVERY_RANK_ADVICE
    )


def _memory(
    v: Verdict,
    ranks: Sequence[RankMemory],
    cg: CgroupSample | None,
    host_total: int | None,
    filling: Filling | None,
) -> list[str]:
    """For an OOM: what filled the limit, every rank alike, the limit or the machine, the workers."""
    out: list[str] = []
    if filling is not None and v.kind in OOM_KINDS:
        out.append(_filled(filling))
    rss = [r.rss_bytes for r in ranks if r.rss_bytes]
    trees = [(r.rss_bytes, r.tree_rss_bytes) for r in ranks if r.rss_bytes and r.tree_rss_bytes]
    if (
        v.kind in (Kind.KERNEL_OOM, Kind.CGROUP_OOM)
        and (filling is None or filling.kind not in ("every_rank", "one_rank", "workers"))
        and len(rss) > 1
        and max(rss) > 1 << 30
        and min(rss) > 0.75 * max(rss)
    ):
        out.append(
            f"Every rank held about the same host memory ({_gib(min(rss))} to {_gib(max(rss))}): "
            + EVERY_RANK_ADVICE
        )
    if v.kind == Kind.CGROUP_OOM and cg is not None and cg.effective_limit_bytes:
        total = sum(r.tree_rss_bytes or 0 for r in ranks)
        out.append(
            f"The limit of memory cgroup {cg.path} is {_gib(cg.effective_limit_bytes)}"
            + (f"; the job's processes held {_gib(total)} in RSS before the kill" if total else "")
            + ". Raise that limit (container or pod memory, Slurm --mem) or reduce host memory per rank."
        )
    if v.kind == Kind.KERNEL_OOM and host_total:
        out.append(
            f"The machine has {_gib(host_total)} of RAM and no limit stopped the job first: reduce host "
            "memory per rank or run fewer ranks per node; a memory limit on the job turns this into a "
            "contained failure."
        )
    if (filling is None or filling.kind != "workers") and any(
        t > 2 * r and t - r > 1 << 30 for r, t in trees
    ):
        out.append(
            "The ranks' child processes (DataLoader workers) held much of the memory: lower num_workers, "
            "avoid copying the dataset into each worker, or use shared memory for it."
        )
    return out


def _signalled(v: Verdict) -> list[str]:
    """For a signal from outside: what its sender (and what it was doing) says to look at."""
    out: list[str] = []
    sender = v.facts.sender
    if (
        v.kind == Kind.EXTERNAL_SIGNAL
        and sender is not None
        and (sender.tool, sender.detail) in SENDER_DETAIL_ADVICE
    ):
        out.append(SENDER_DETAIL_ADVICE[(sender.tool, sender.detail)])
    elif v.kind == Kind.EXTERNAL_SIGNAL and sender is not None and sender.tool in SENDER_ADVICE:
        out.append(SENDER_ADVICE[sender.tool].format(uid=sender.uid))
    elif v.kind == Kind.EXTERNAL_SIGNAL:
        out.append(
            "Nothing on this machine recorded an OOM. Look at who sends signals here: the scheduler "
            "(Slurm time limit, Kubernetes eviction or preemption), an operator, a watchdog."
        )
    return out


def _timed_out(v: Verdict, flight_enabled: bool | None) -> list[str]:
    """For a collective timeout: where to look, and the flight recorder."""
    out: list[str] = []
    if v.kind == Kind.COLLECTIVE_TIMEOUT:
        nccl = v.facts.backend == "nccl"
        if v.facts.all_entered:
            out.append(
                "Every rank reached the collective and it still did not finish: look at the GPU work queued "
                "before it (a kernel that runs far longer than a step, or hangs), the network between the "
                "ranks (NCCL_DEBUG=INFO shows the transport), and the kernel log for GPU errors (Xid)."
            )
        else:
            out.append(
                "A collective timed out because a rank never reached it. Look at what the missing rank was "
                "doing (py-spy dump --pid PID while it hangs); typical causes are a rank-dependent branch "
                "that skips a collective, uneven data (one rank runs out of batches first), or a rank stuck "
                "in I/O."
            )
        if flight_enabled and nccl:
            out.append(
                "The flight recorder was on: its dumps (TORCH_FR_DUMP_TEMP_FILE<rank>) hold each rank's "
                "last collectives; compare them with torch's fr_trace tool for the whole job."
            )
        elif nccl:
            out.append(
                ("Turn on" if flight_enabled is False else "Unless it was on, turn on")
                + " the flight recorder so the next postmortem names the rank that never entered the "
                "collective: TORCH_FR_BUFFER_SIZE=2000 TORCH_NCCL_DUMP_ON_TIMEOUT=1 "
                "TORCH_FR_DUMP_TEMP_FILE=/tmp/nccl_trace_rank_ (a dump per rank on timeout)."
            )
        else:
            out.append(
                "The flight recorder records NCCL only; for gloo, TORCH_DISTRIBUTED_DEBUG=DETAIL makes a "
                "mismatch between ranks' collectives visible."
            )
        out.append("Raise the timeout (init_process_group(timeout=...)) only when a step truly takes longer.")
    return out


def _by_kind(v: Verdict) -> list[str]:
    """For a GPU fault, a CUDA OOM, /dev/shm, an exception: the one thing to change."""
    out: list[str] = []
    if v.kind == Kind.GPU_ERROR:
        out.append(
            "The GPU failed, not the program: drain the node and have it checked (nvidia-smi -q, "
            "nvidia-bug-report.sh; Xid 79 and NVML's GPU_IS_LOST are a GPU off the bus, 48/94/95 "
            "uncorrectable memory errors); "
            "restart the job elsewhere from its last checkpoint."
        )
    if v.kind == Kind.CUDA_OOM:
        out.append(
            "Reduce GPU memory per step: a smaller micro-batch with gradient accumulation, activation "
            "checkpointing, bf16, or sharding (FSDP/ZeRO); PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
            "helps when free memory is fragmented."
        )
    if v.kind == Kind.BUS_ERROR or (v.kind == Kind.PYTHON_EXCEPTION and v.facts.shm_exhausted):
        out.append(
            "DataLoader workers pass batches through /dev/shm: give the container more "
            "(docker --shm-size=16g, "
            "or a Kubernetes emptyDir with medium: Memory on /dev/shm), or use fewer workers."
        )
    if v.kind == Kind.PYTHON_EXCEPTION:
        out.append("The exception is the rank's own: fix it from the traceback in the rank's output.")
    return out


def _unread(
    v: Verdict, output_read: bool, run_output: str | None, live: bool, host_total: int | None
) -> list[str]:
    """When the ranks' own words were not read, or only the daemon's setup could tell."""
    out: list[str] = []
    own_words = (Kind.PYTHON_EXCEPTION, Kind.ABORT, Kind.SEGFAULT, Kind.BUS_ERROR, Kind.UNKNOWN)
    if not output_read and v.kind in own_words and run_output is not None:
        out.append(  # never tell a user to do what they already did
            f"The job runs under `trainwatch run`, which keeps its output in {run_output}; this daemon "
            "could not read it, so the ranks' last words are missing here. The postmortem `trainwatch run` "
            "printed when the job ended has them."
        )
    elif not output_read and v.kind in own_words:
        out.append(
            "The ranks' output could not be read, so their own last words are missing here. Next time run "
            "the job under `trainwatch run -- torchrun ...`, or give torchrun --log-dir DIR --redirects 3 "
            "(or send its stdout/stderr to a file): trainwatch reads those files. Decorating the "
            "entrypoint with torch.distributed.elastic.multiprocessing.errors.record also writes each "
            "rank's exception to its TORCHELASTIC_ERROR_FILE, which trainwatch reads."
        )
    if v.kind == Kind.UNKNOWN and live:
        out.append("Run trainwatch as root in the host's PID and network namespaces so exits are captured.")
    if v.kind == Kind.KERNEL_OOM and not host_total and not live:
        out.append(
            "The whole machine ran out of memory: reduce host memory per rank or run fewer ranks "
            "per node; a memory limit on the job turns this into a contained failure."
        )
    return out


def advice(
    v: Verdict,
    ranks: Sequence[RankMemory],
    *,
    cg: CgroupSample | None = None,
    host_total: int | None = None,
    output_read: bool = True,
    flight_enabled: bool | None = None,
    live: bool = True,
    filling: Filling | None = None,
    run_output: str | None = None,
) -> list[str]:
    """What to change, from the verdict's kind and facts and the numbers. ``live`` False:
    for ``trainwatch diagnose``, which leaves out what only the daemon's setup could change.
    ``filling``: what filled the limit, for an OOM (autopsy/filled.py)."""
    return [
        *_memory(v, ranks, cg, host_total, filling),
        *_signalled(v),
        *_timed_out(v, flight_enabled),
        *_by_kind(v),
        *_unread(v, output_read, run_output, live, host_total),
    ]
