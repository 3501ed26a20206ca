"""A torchrun worker for the GPU check (benchmarks/gpu_check.sh): gloo for the process
group, CUDA only to hold a known amount of device memory. Rank R allocates (2 + R) GiB on
cuda:0, writes what torch reports to ``<out>/torch_rank<R>.json`` and waits for
``<out>/stop``."""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist


def main() -> int:
    out = sys.argv[1]
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    size = (2 + rank) << 30
    held = torch.empty(size, dtype=torch.uint8, device="cuda:0")
    held.fill_(1)
    torch.cuda.synchronize()
    report = {
        "rank": rank,
        "pid": os.getpid(),
        "requested_bytes": size,
        "memory_allocated": torch.cuda.memory_allocated(0),
        "memory_reserved": torch.cuda.memory_reserved(0),
        "mem_get_info_free_total": torch.cuda.mem_get_info(0),
        "torch": torch.__version__,
    }
    with open(os.path.join(out, f"torch_rank{rank}.json.tmp"), "w") as f:
        json.dump(report, f)
    os.rename(os.path.join(out, f"torch_rank{rank}.json.tmp"), os.path.join(out, f"torch_rank{rank}.json"))
    while True:
        # every rank leaves in the same round: one that left alone would fail its peers'
        # next collective
        flag = torch.tensor([1.0 if os.path.exists(os.path.join(out, "stop")) else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() > 0:
            break
        time.sleep(0.5)
    del held
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
