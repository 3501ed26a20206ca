"""What the PSS/USS sampler costs: the whole daemon with it against the whole daemon without
it, side by side on the same processes in one run.

    python benchmarks/pss_cost.py [--ranks 8] [--workers 7] [--hold-mb 256] [--window 180]
                                  [--name pss-cost]

A torchrun-shaped tree of real processes (``benchmarks/fake_job.py``: one agent, RANKS ranks
each holding HOLD_MB MiB and forking WORKERS "DataLoader workers" that map it: 64 processes
by default) is watched by two daemons at the default 1 s interval: one as shipped, one with
``--disable smaps``. After both have attached every rank (and the first has measured every
tree's PSS), both processes' utime+stime (all threads) is read over the window. Reported:
each daemon's CPU as a share of one core, their difference (what PSS/USS costs the user),
and the daemon's own account of the time it spent reading smaps_rollup
(``trainwatch_smaps_cpu_seconds_total``). The sampler's budget is 1 % of a core.

Results: ``benchmarks/results/NAME.json`` (machine, kernel, commit), rendered in docs/performance.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks import results  # noqa: E402
from benchmarks.overhead import Tree, cpu_seconds  # noqa: E402
from tests.support.e2e import DaemonProc, value, wait_for  # noqa: E402


def attached(daemon: DaemonProc, ranks: int, processes: int, pss: bool) -> bool:
    rows = [r for j in daemon.ranks()["jobs"] for r in j["ranks"]]
    ready = [r for r in rows if r["tree_processes"] >= processes and (not pss or r["tree_pss_bytes"])]
    return len(ready) >= ranks


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--workers", type=int, default=7)
    ap.add_argument("--hold-mb", type=int, default=256)
    ap.add_argument("--window", type=float, default=180.0)
    ap.add_argument("--name", default="pss-cost")
    args = ap.parse_args()
    processes = args.ranks * (1 + args.workers)
    tree = Tree(1, args.ranks, args.workers, hold_mb=args.hold_mb)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            t = Path(tmp)
            (t / "with").mkdir()
            (t / "without").mkdir()
            with (
                DaemonProc(t / "with", interval=1.0) as with_pss,
                DaemonProc(t / "without", "--disable", "smaps", interval=1.0) as without,
            ):
                wait_for(
                    lambda: attached(with_pss, args.ranks, 1 + args.workers, True), 120, "PSS of every tree"
                )
                wait_for(lambda: attached(without, args.ranks, 1 + args.workers, False), 120, "every rank")
                smaps0 = value(with_pss.metrics(), "trainwatch_smaps_cpu_seconds_total") or 0.0
                cpu0 = {n: cpu_seconds(d.proc.pid) for n, d in (("with", with_pss), ("without", without))}
                start = time.monotonic()
                time.sleep(args.window)  # the measuring window itself: nothing waits on the daemons here
                elapsed = time.monotonic() - start
                cpu1 = {n: cpu_seconds(d.proc.pid) for n, d in (("with", with_pss), ("without", without))}
                smaps1 = value(with_pss.metrics(), "trainwatch_smaps_cpu_seconds_total") or 0.0
                pss = sum(r["tree_pss_bytes"] or 0 for j in with_pss.ranks()["jobs"] for r in j["ranks"])
                rss = sum(r["tree_rss_bytes"] for j in with_pss.ranks()["jobs"] for r in j["ranks"])
    finally:
        tree.close()
    share = {n: (cpu1[n] - cpu0[n]) / elapsed for n in cpu0}
    row = {
        "processes": processes,
        "hold_mb_per_rank": args.hold_mb,
        "window_seconds": round(elapsed, 1),
        "core_share_with": round(share["with"], 5),
        "core_share_without": round(share["without"], 5),
        "core_share_difference": round(share["with"] - share["without"], 5),
        "smaps_core_share_own_account": round((smaps1 - smaps0) / elapsed, 5),
        "tree_rss_bytes": rss,
        "tree_pss_bytes": pss,
    }
    print(row)
    results.write(args.name, row)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
