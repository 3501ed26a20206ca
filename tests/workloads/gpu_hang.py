"""A torchrun worker for the GPU stall run (benchmarks/gpu_stall.py): two NCCL ranks on one
GPU, then a collective one rank never joins.

NCCL refuses two ranks of one host on one device ("Duplicate GPU detected"); each rank sets
its own ``NCCL_HOSTID``, so NCCL takes them for two hosts and carries their traffic over
its socket transport on loopback, while both run their kernels on cuda:0. The collectives
are NCCL's own: the all_reduce kernel of a rank whose peer never comes spins on the GPU.

Phases, each announced in ``<out>/phase_rank<R>`` (name and time):
``big`` (bf16 matmuls and a 64 MiB all_reduce a step), ``small`` (a small MLP's steps:
short kernels, launch-bound), then ``hang``. MODE ``missing``: rank 1 sleeps outside every
collective while rank 0 enters an all_reduce and waits for it in ``torch.cuda.synchronize()``.
MODE ``crossed``: each rank enters an all_reduce of a different process group (the collectives'
order differs between ranks, a classic bug): both kernels spin, both GPUs busy, forever.

Deaths (benchmarks/gpu_stranded.py, each rank under its own torchrun agent, so that no agent
ends the others): MODE ``killed``: rank 1 SIGKILLs itself at the hang while rank 0 enters an
all_reduce with it. MODE ``killed-other`` (three ranks): rank 1 SIGKILLs itself; rank 0
enters an all_reduce of the group [0, 2], which rank 2 never joins: it keeps its GPU busy
with matmuls of its own (a survivor that works on), while rank 0's kernel spins.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta


def phase(out: str, rank: int, name: str) -> None:
    with open(f"{out}/phase_rank{rank}", "a") as f:
        f.write(f"{name} {time.time():.3f} {os.getpid()}\n")


def done(end: float, dist, torch) -> bool:  # the modules, imported late
    """Whether the phase is over, agreed by every rank (each step runs the same collectives)."""
    flag = torch.tensor([1.0 if time.monotonic() >= end else 0.0], device="cuda")
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def main() -> int:
    out, big_s, small_s = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
    mode = sys.argv[4] if len(sys.argv) > 4 else "missing"
    rank = int(os.environ["RANK"])
    os.environ["NCCL_HOSTID"] = f"trainwatch-stall-host-{rank}"
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", timeout=timedelta(seconds=900))
    other = dist.new_group([0, 1])
    if rank in (0, 1):
        dist.barrier(group=other, device_ids=[0])  # its communicator made now, not at the hang
    pair02 = dist.new_group([0, 2]) if dist.get_world_size() == 3 else None
    if pair02 is not None and rank in (0, 2):
        dist.barrier(group=pair02, device_ids=[0])
    grad = torch.ones(16 << 20, device="cuda")  # 64 MiB
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    phase(out, rank, "big")
    end = time.monotonic() + big_s
    while not done(end, dist, torch):
        for _ in range(4):
            a = (a @ a).clamp_(-1, 1)
        dist.all_reduce(grad)
        torch.cuda.synchronize()
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(64, 256, device="cuda")
    phase(out, rank, "small")
    end = time.monotonic() + small_s
    while not done(end, dist, torch):
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            assert p.grad is not None
            dist.all_reduce(p.grad)
        loss.item()
    dist.barrier()
    phase(out, rank, "hang")
    if mode in ("killed", "killed-other") and rank == 1:
        os.kill(os.getpid(), 9)  # SIGKILL: no exception, no exit handler
    if mode == "killed-other":
        if rank == 2:
            while True:  # works on, never joining rank 0's collective
                a = (a @ a).clamp_(-1, 1)
                torch.cuda.synchronize()
        dist.all_reduce(grad, group=pair02)
    elif mode == "killed":
        dist.all_reduce(grad)
    elif mode == "crossed":
        dist.all_reduce(grad, group=other if rank == 1 else None)
    elif rank == 1:
        while True:
            time.sleep(1)  # never in a collective again
    else:
        dist.all_reduce(grad)
    torch.cuda.synchronize()  # waits here until the timeout
    return 0


if __name__ == "__main__":
    sys.exit(main())
