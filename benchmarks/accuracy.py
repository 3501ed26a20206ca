"""How close trainwatch's memory figures are to the kernel's, on a real torchrun job.

    python benchmarks/accuracy.py [--scrapes N]

Starts the real daemon and a 2-rank torchrun job (gloo, tests/workloads/rank.py: each rank
holds 300 MiB and two workers 120 MiB each), then N times reads /metrics and, right
after, VmRSS of every rank and worker from /proc/PID/status, and prints the relative
error of the rank RSS and tree RSS (max and mean). Needs torch (the test extras).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.e2e import DaemonProc, TorchrunJob, value, vm_rss, wait_for


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scrapes", type=int, default=30)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        with (
            DaemonProc(t, interval=0.5) as daemon,
            TorchrunJob(t, "acc", hold_mb=300, worker_mb=120, workers=2) as job,
        ):
            pids = job.ready()

            def key() -> str | None:
                for labels, _ in daemon.metrics().get("trainwatch_job_info", []):
                    if labels["agent_pid"] == str(job.agent_pid):
                        return labels["job"]
                return None

            k = wait_for(key, 30, "the job")
            time.sleep(1.5)
            rss_err, tree_err = [], []
            for _ in range(args.scrapes):
                m = daemon.metrics()
                for rank, (rank_pid, *workers) in pids.items():
                    truth = vm_rss(rank_pid)
                    tree_truth = truth + sum(vm_rss(w) for w in workers)
                    got = value(m, "trainwatch_rank_resident_memory_bytes", job=k, rank=str(rank))
                    tree = value(m, "trainwatch_rank_tree_resident_memory_bytes", job=k, rank=str(rank))
                    rss_err.append(abs(got - truth) / truth)
                    tree_err.append(abs(tree - tree_truth) / tree_truth)
                time.sleep(0.3)
            job.stop()
            daemon.stop()
    print(f"{len(rss_err)} rank readings against /proc/PID/status read right after the scrape:")
    print(f"  rank RSS error: max {max(rss_err):.4%}, mean {statistics.mean(rss_err):.4%}")
    print(f"  tree RSS error: max {max(tree_err):.4%}, mean {statistics.mean(tree_err):.4%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
