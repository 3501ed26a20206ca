"""Advice: what to change, chosen from the verdict's kind and facts (``Verdict.facts``) and
the numbers of the document (the ranks' memory, the binding cgroup, the host), never from
the verdict's words. The live daemon and ``trainwatch diagnose`` share it (``live``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sidecar.autopsy.evidence import Verdict
from sidecar.model import CgroupSample, Kind

if TYPE_CHECKING:
    from sidecar.postmortem.document import RankRow

__all__ = ["advice"]


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.1f} GiB"


def advice(
    v: Verdict,
    ranks: list[RankRow],
    cg: CgroupSample | None,
    host_total: int | None,
    output_read: bool = True,
    flight_enabled: bool | None = None,
    *,
    live: bool = True,
) -> list[str]:
    """What to change, from the verdict's kind and facts and the numbers. ``live`` False:
    for ``trainwatch diagnose``, which leaves out what only the daemon's setup could change."""
    out: list[str] = []
    rss = [r.rss_bytes for r in ranks if r.rss_bytes]
    trees = [(r.rss_bytes, r.tree_rss_bytes) for r in ranks if r.rss_bytes and r.tree_rss_bytes]
    if (
        v.kind in (Kind.KERNEL_OOM, Kind.CGROUP_OOM)
        and len(rss) > 1
        and max(rss) > 1 << 30
        and min(rss) > 0.75 * max(rss)
    ):
        out.append(
            f"Every rank held about the same host memory ({_gib(min(rss))} to {_gib(max(rss))}): each "
            "process loads its own full copy. Load the weights once (low_cpu_mem_usage=True, meta-device or "
            "ZeRO-3 init), load them straight to the GPU, or stagger loading across ranks."
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
    if trees and any(t > 2 * r and t - r > 1 << 30 for r, t in trees):
        out.append(
            "The ranks' child processes (DataLoader workers) held much of the memory: lower num_workers, "
            "avoid copying the dataset into each worker, or use shared memory for it."
        )
    if v.kind == Kind.EXTERNAL_SIGNAL:
        out.append(
            "Nothing on this machine recorded an OOM. Look at who sends signals here: the scheduler "
            "(Slurm time limit, Kubernetes eviction or preemption), an operator, a watchdog."
        )
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
    own_words = (Kind.PYTHON_EXCEPTION, Kind.ABORT, Kind.SEGFAULT, Kind.BUS_ERROR, Kind.UNKNOWN)
    if not output_read and v.kind in own_words:
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
