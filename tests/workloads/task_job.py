"""tests/workloads/rank.py as a task of a launcher that starts any program, as their users
start a PyTorch job: ``mpirun -np N python task_job.py --port P [rank.py's options]``, or
``srun -n N python task_job.py ...``.

Each rank reads its identity from its launcher's environment (Open MPI's
OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_LOCAL_RANK, OMPI_COMM_WORLD_SIZE; MPICH's PMI_RANK,
MPI_LOCALRANKID, PMI_SIZE; Slurm's SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS), sets RANK,
LOCAL_RANK, WORLD_SIZE and MASTER_* in its own ``os.environ`` (as such scripts do before
init_process_group) and runs rank.py's main; rank 0 serves the store.
"""

from __future__ import annotations

import argparse
import os
import sys


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    args, rest = ap.parse_known_args()
    env = os.environ
    os.environ.update(
        RANK=env.get("OMPI_COMM_WORLD_RANK") or env.get("PMI_RANK") or env["SLURM_PROCID"],
        LOCAL_RANK=env.get("OMPI_COMM_WORLD_LOCAL_RANK")
        or env.get("MPI_LOCALRANKID")
        or env["SLURM_LOCALID"],
        WORLD_SIZE=env.get("OMPI_COMM_WORLD_SIZE") or env.get("PMI_SIZE") or env["SLURM_NTASKS"],
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(args.port),
    )
    sys.argv = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "rank.py"), *rest]
    import rank  # beside this file

    return rank.main()


if __name__ == "__main__":
    sys.exit(main())
