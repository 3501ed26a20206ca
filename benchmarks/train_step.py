"""A real training loop for the step-time overhead benchmark (benchmarks/step_overhead.py):
a small transformer encoder trained with AdamW, bf16 autocast on CUDA (one rank per GPU,
DDP over NCCL) or float32 on CPU (gloo). Run under torchrun; rank 0 writes each timed
step's duration and end (wall clock) to --out as JSON, and every rank writes what torch says of its GPU memory
halfway through to --out.gpu<RANK>.json (for comparison with trainwatch's per-rank figure).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    rank = int(os.environ.get("RANK", "0"))
    if cuda:
        torch.cuda.set_device(local % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group("nccl", device_id=device)
        d_model, layers, batch, seq = 1024, 8, 16, 512
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
        d_model, layers, batch, seq = 128, 2, 4, 64
    layer = nn.TransformerEncoderLayer(
        d_model, nhead=16 if cuda else 4, dim_feedforward=4 * d_model, batch_first=True
    )
    model = nn.TransformerEncoder(layer, num_layers=layers).to(device)
    ddp = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    x = torch.randn(batch, seq, d_model, device=device)
    times: list[float] = []
    ends: list[float] = []  # wall time at the end of each timed step
    for step in range(args.warmup + args.steps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = ddp(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
            ends.append(time.time())
        if cuda and step == args.warmup + args.steps // 2:
            with open(f"{args.out}.gpu{rank}.json", "w") as f:
                json.dump(
                    {
                        "rank": rank,
                        "pid": os.getpid(),
                        "device": device.index,
                        "allocated_bytes": torch.cuda.memory_allocated(),
                        "reserved_bytes": torch.cuda.memory_reserved(),
                        "at": time.time(),
                    },
                    f,
                )
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(
                {"step_seconds": times, "step_end": ends, "world_size": dist.get_world_size(), "cuda": cuda},
                f,
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
