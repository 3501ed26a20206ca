"""Real GPU failures for the device machine (benchmarks/gpu_failures.sh), one rank each:

* ``nccl-timeout``: an NCCL all_reduce queued behind a long kernel (``torch.cuda._sleep``)
  cannot finish within the process group's 5 s timeout: the watchdog reports it, the
  flight recorder dumps (when TORCH_FR_* / TORCH_NCCL_DUMP_ON_TIMEOUT are set), and the
  rank aborts (SIGABRT);
* ``cuda-oom``: the rank asks for more GPU memory than there is: torch.OutOfMemoryError.
"""

from __future__ import annotations

import argparse
import datetime
import time

import torch
import torch.distributed as dist


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("nccl-timeout", "cuda-oom"), required=True)
    args = ap.parse_args()
    torch.cuda.set_device(0)
    if args.mode == "cuda-oom":
        keep = torch.empty(8 << 30, dtype=torch.uint8, device="cuda")
        keep.fill_(1)
        total = torch.cuda.get_device_properties(0).total_memory
        huge = torch.empty(total, dtype=torch.uint8, device="cuda")  # raises
        print(huge.shape, keep.shape)
        return 0
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=5))
    t = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    print("warm-up all_reduce ok", flush=True)
    torch.cuda._sleep(int(1e12))  # hours of GPU time ahead of the next collective
    dist.all_reduce(t)
    print("second all_reduce enqueued; host sleeping", flush=True)
    time.sleep(600)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
