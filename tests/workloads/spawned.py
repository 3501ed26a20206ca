"""tests/workloads/rank.py under ``torch.multiprocessing.spawn``, the way PyTorch's DDP
tutorial launches a job: ``python spawned.py --nprocs N --port P [rank.py's options]``.

The parent only calls ``mp.spawn``; each child, given its index ``i``, sets MASTER_ADDR,
MASTER_PORT, RANK, LOCAL_RANK and WORLD_SIZE in its own ``os.environ`` (which
``/proc/PID/environ`` never shows: nothing in any process's environment says it is a rank)
and runs rank.py's main. When a child fails, mp.spawn's ``join`` terminates the others and
raises in the parent (``ProcessExitedException``, ``ProcessRaisedException``).
"""

from __future__ import annotations

import argparse
import os
import sys


def run(index: int, nprocs: int, port: int, argv: list[str]) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(index),
        LOCAL_RANK=str(index),
        WORLD_SIZE=str(nprocs),
    )
    sys.argv = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "rank.py"), *argv]
    import rank  # beside this file (a spawned child starts with its parent's sys.path)

    code = rank.main()
    if code:
        sys.exit(code)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nprocs", type=int, default=2)
    ap.add_argument("--port", type=int, required=True)
    args, rest = ap.parse_known_args()
    import torch.multiprocessing as mp

    mp.spawn(run, args=(args.nprocs, args.port, rest), nprocs=args.nprocs)


if __name__ == "__main__":
    main()
