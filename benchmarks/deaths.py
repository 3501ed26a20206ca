"""Death-to-postmortem latency and the victim's RSS at death, over real deaths.

    python benchmarks/deaths.py [--deaths N] [--interval S] [--grow-mb MB] [--disable SOURCE]...

Runs N real torchrun jobs (gloo, 2 ranks) one after another under one real daemon; in
each, rank 1 grows by --grow-mb MiB every 20 ms inside a memory cgroup with a 1.5 GiB
limit until the kernel kills it (as root with a writable memory cgroup hierarchy; else
it is killed with SIGKILL from outside after 3 s). For each postmortem: latency =
created_at - victim.died_at (both the daemon's), and the victim's last sampled RSS
against the kernel's figure in its kill line. Prints p50/p95 and the RSS errors.
``--disable connector`` measures the pidfd fallback instead (its death time is when the
pidfd became readable, within a millisecond of the exit).
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

from sidecar.demo import join_cgroup, memory_cgroup, memory_hierarchy
from tests.e2e import DaemonProc, TorchrunJob, wait_for

GIB = 1 << 30


def ts(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--deaths", type=int, default=10)
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--grow-mb", type=int, default=4)
    ap.add_argument("--disable", action="append", default=[], help="passed to the daemon")
    args = ap.parse_args()
    latencies, rss_errors, kinds = [], [], []
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
