"""tests/workloads/rank.py under Lightning's own launcher, as Lightning users start a job:
``python lightning_job.py --devices N [rank.py's options]`` (Fabric, strategy "ddp", CPU).

This process is rank 0: Fabric's launcher re-runs this script once per other local rank
with LOCAL_RANK=i in its environment, then sets up the gloo group; each process then runs
rank.py's main in that group (RANK set from Fabric's global rank in its own ``os.environ``).
"""

from __future__ import annotations

import argparse
import os
import sys


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, default=2)
    args, rest = ap.parse_known_args()
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=args.devices, strategy="ddp", num_nodes=1)
    fabric.launch()
    os.environ["RANK"] = str(fabric.global_rank)
    sys.argv = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "rank.py"), *rest]
    import rank  # beside this file

    return rank.main()


if __name__ == "__main__":
    sys.exit(main())
