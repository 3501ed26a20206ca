"""The worker of ``trainwatch demo`` (run by torchrun, needs torch): rank 1 allocates
memory until a limit stops it, or until it is killed from outside; the others all-reduce
and wait. Not imported by the daemon."""

from __future__ import annotations

import os
import sys
import time


def main() -> int:
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    grow = len(sys.argv) > 1 and sys.argv[1] == "grow"
    held = []
    t = torch.ones(4)
    start = time.monotonic()
    if rank == 1 and grow:
        with open("/proc/self/oom_score_adj", "w") as f:  # be the one the OOM killer picks
            f.write("1000")
    while time.monotonic() - start < 120:
        if rank == 1 and grow and time.monotonic() - start > 3:
            block = bytearray(16 << 20)
            for i in range(0, len(block), 4096):
                block[i] = 1
            held.append(block)
            time.sleep(0.02)
            continue
        dist.all_reduce(t)
        time.sleep(0.2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
