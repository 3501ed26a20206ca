"""A training loop whose DataLoader worker grows until a memory limit's OOM killer takes it:
the main process then ends on torch's own word for the worker's death (``DataLoader worker
(pid N) is killed by signal: Killed.``), which says how the worker died, not why. The worker
makes itself the OOM killer's choice (``oom_score_adj`` 1000, as the global-OOM tests' victims
do), so the limit kills it and not the main process. It grows before it sends any batch: a
worker killed while its queue's feeder thread is sending leaves the main process an EOFError
on a half-read pipe instead (a race under load). Prints ``worker PID`` once it runs."""

from __future__ import annotations

import os
import sys
import time

import torch
from torch.utils.data import DataLoader, Dataset


class Growing(Dataset):
    def __len__(self) -> int:
        return 1_000_000

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.zeros(4)


held: list[bytearray] = []


def _victim(_worker_id: int) -> None:
    with open("/proc/self/oom_score_adj", "w") as f:
        f.write("1000")
    print(f"worker {os.getpid()}", flush=True)
    while True:  # until the limit's OOM killer ends it, before it sends anything
        held.append(bytearray(32 << 20))  # touched: bytearray zero-fills its pages
        time.sleep(0.02)


def main() -> int:
    loader = DataLoader(Growing(), batch_size=1, num_workers=1, worker_init_fn=_victim)
    for _batch in loader:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
