"""Death-to-postmortem latency, and trainwatch's memory figures against the kernel's, over
real OOM deaths.

    python benchmarks/deaths.py [--deaths N] [--interval S] [--grow-mb MB] [--disable SOURCE]...
                                [--name NAME]

Runs N real torchrun jobs (gloo, 2 ranks) one after another under one real daemon; in
each, rank 1 grows by --grow-mb MiB every 20 ms inside a memory cgroup with a 1.5 GiB
limit until the kernel kills it (as root with a writable memory cgroup hierarchy; else
it is killed with SIGKILL from outside after 3 s). For each postmortem: latency =
created_at - victim.died_at (both the daemon's), and the victim's last sampled RSS
against the kernel's figure in its kill line (anon + file + shmem RSS of the victim at the
moment of the kill), and the sum of the ranks' tree RSS in that last sample against the
cgroup's charge (``memory.usage_in_bytes`` / ``memory.current``) read in the same round.
The second is expected to differ: RSS counts pages shared between processes (the torch
libraries every rank maps) once per process, and the charge holds the agent, page cache
and kernel memory; the figure says by how much. ``--disable connector`` measures the
pidfd fallback instead (its death time is when the pidfd became readable, within a
millisecond of the exit). Results: ``benchmarks/results/NAME.json`` (default ``deaths``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import results
from sidecar.front.demo import join_cgroup, memory_cgroup, memory_hierarchy
from tests.support.e2e import DaemonProc, TorchrunJob, wait_for

GIB = 1 << 30


def ts(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--deaths", type=int, default=10)
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--grow-mb", type=int, default=4)
    ap.add_argument("--disable", action="append", default=[], help="passed to the daemon")
    ap.add_argument("--name", default="deaths", help="results file name (benchmarks/results/NAME.json)")
    args = ap.parse_args()
    latencies, rss_errors, kinds = [], [], []
    per_death: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        t = Path(tmp)
        child = None
        if memory_hierarchy() is not None:
            _, _, child = stack.enter_context(memory_cgroup(int(1.5 * GIB), "trainwatch-bench"))
        extra = [a for source in args.disable for a in ("--disable", source)]
        with DaemonProc(t, *extra, interval=args.interval) as daemon:
            for i in range(args.deaths):
                wrap = join_cgroup(child) if child else None
                grow = {"grow_rank": 1, "grow_after": 3, "grow_mb": args.grow_mb} if child else {}
                with TorchrunJob(t, f"job{i}", hold_mb=50, workers=0, wrap=wrap, **grow) as job:
                    pids = job.ready()
                    if child is None:
                        time.sleep(3)
                        os.kill(pids[1][0], signal.SIGKILL)

                    def newest(job=job):
                        status, body = daemon.get("/postmortem")
                        doc = json.loads(body) if status == 200 else None
                        return doc if doc and doc["job"]["agent_pid"] == job.agent_pid else None

                    doc = wait_for(newest, 120, f"postmortem {i}")
                    job.proc.wait(90)
                latency = ts(doc["created_at"]) - ts(doc["victim"]["died_at"])
                latencies.append(latency)
                kinds.append(doc["killer"]["kind"])
                victim = next(r for r in doc["ranks"] if r["pid"] == doc["victim"]["pid"])
                kernel = doc["victim"].get("kernel_rss_bytes")
                if kernel and victim["rss_bytes"]:
                    rss_errors.append((victim["rss_bytes"] - kernel) / kernel)
                cgroup = (doc.get("memory") or {}).get("cgroup") or {}
                charge = cgroup.get("usage_bytes_at_death")
                tree_sum = sum(r["tree_rss_bytes"] or 0 for r in doc["ranks"])
                per_death.append(
                    {
                        "killer": doc["killer"]["kind"],
                        "confidence": doc["killer"]["confidence"],
                        "latency_ms": round(latency * 1000, 1),
                        "victim_sampled_rss_bytes": victim["rss_bytes"],
                        "victim_kernel_rss_bytes": kernel,
                        "ranks_tree_rss_bytes": tree_sum,
                        "cgroup_charge_bytes": charge,
                    }
                )
                print(
                    f"death {i}: {doc['killer']['kind']} ({doc['killer']['confidence']}), "
                    f"latency {latency * 1000:.0f} ms, sampled RSS {victim['rss_bytes']}, "
                    f"kernel RSS {kernel}",
                    flush=True,
                )
            daemon.stop()
    latencies.sort()
    p95 = latencies[min(len(latencies) - 1, round(0.95 * (len(latencies) - 1)))]
    print(
        f"\n{len(latencies)} deaths ({', '.join(sorted(set(kinds)))}), interval {args.interval} s, "
        f"growth {args.grow_mb} MiB / 20 ms"
    )
    print(
        f"death -> postmortem: p50 {statistics.median(latencies) * 1000:.0f} ms, p95 {p95 * 1000:.0f} ms, "
        f"max {latencies[-1] * 1000:.0f} ms"
    )
    if rss_errors:
        print(
            f"victim RSS, last sample vs the kernel's kill line: mean {statistics.mean(rss_errors):+.1%}, "
            f"worst {max(rss_errors, key=abs):+.1%}"
        )
    charge_ratios = [
        d["ranks_tree_rss_bytes"] / d["cgroup_charge_bytes"] for d in per_death if d["cgroup_charge_bytes"]
    ]
    if charge_ratios:
        print(
            "ranks' tree RSS / the cgroup's charge in the same round: "
            f"mean {statistics.mean(charge_ratios):.3f}, "
            f"range {min(charge_ratios):.3f} to {max(charge_ratios):.3f}"
        )
    results.write(
        args.name,
        {
            "deaths": len(latencies),
            "interval_seconds": args.interval,
            "grow_mib_per_20ms": args.grow_mb,
            "disabled": args.disable,
            "cgroup_limit_bytes": int(1.5 * GIB) if memory_hierarchy() is not None else None,
            "latency_p50_ms": statistics.median(latencies) * 1000,
            "latency_p95_ms": p95 * 1000,
            "latency_max_ms": latencies[-1] * 1000,
            "victim_rss_error_mean": statistics.mean(rss_errors) if rss_errors else None,
            "victim_rss_error_worst": max(rss_errors, key=abs) if rss_errors else None,
            "tree_rss_to_charge_mean": statistics.mean(charge_ratios) if charge_ratios else None,
            "tree_rss_to_charge_min": min(charge_ratios) if charge_ratios else None,
            "tree_rss_to_charge_max": max(charge_ratios) if charge_ratios else None,
            "per_death": per_death,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
