"""The floor under the daemon's cost: what waking up alone, and reading the files a
detailed round reads, cost a Python process at the same rate. Run beside the daemon by
``overhead.py``, on the same processes, over the same window.

    python benchmarks/floor.py --interval S --mode wake|reads

``wake``: a thread that waits on an event with a timeout, as the daemon's sampler does,
and does nothing else. ``reads``: the same thread reading, through held descriptors (one
``pread`` each, nothing parsed, nothing kept), the files the daemon's rounds read for the
bench tree (``fake_job.py``'s processes, found once at start), on the daemon's schedule:
once a second (every round at 1 Hz) what a detailed round reads: each rank's ``stat`` and
``status``, each descendant's ``statm``, the ranks' memory cgroup's counters (usage, limit,
peak, OOM counters, memory.stat; v1 or v2) and the host's meminfo, vmstat, memory PSI and
the /dev/shm statvfs; the rounds between, what they read: each rank's and descendant's
``statm`` and the cgroup's usage. What the daemon costs above ``reads`` is its Python:
parsing, the snapshot, judging, publishing.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from pathlib import Path

MARK = b"trainwatch-bench"


def _ranks_and_descendants() -> tuple[list[int], list[int]]:
    parents: dict[int, int] = {}
    ranks = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            stat = Path(f"/proc/{pid}/stat").read_bytes()
            parents[pid] = int(stat[stat.rindex(b")") + 2 :].split()[1])
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if MARK in cmd and b"--role\0rank" in cmd:
            ranks.append(pid)
    watched = set(ranks)
    descendants = []
    changed = True
    while changed:
        changed = False
        for pid, ppid in parents.items():
            if ppid in watched and pid not in watched:
                watched.add(pid)
                descendants.append(pid)
                changed = True
    return ranks, descendants


def _cgroup_files(pid: int) -> list[str]:
    lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    v1 = next((ln.split(":", 2)[2] for ln in lines if ":memory:" in ln), None)
    if v1 is not None and os.path.isdir("/sys/fs/cgroup/memory"):
        d = "/sys/fs/cgroup/memory" + (v1 if v1 != "/" else "")
        names = ["memory.usage_in_bytes", "memory.limit_in_bytes", "memory.max_usage_in_bytes"]
        names += ["memory.oom_control", "memory.stat", "memory.kmem.usage_in_bytes"]
    else:
        v2 = next((ln.split(":", 2)[2] for ln in lines if ln.startswith("0::")), "/")
        d = "/sys/fs/cgroup" + (v2 if v2 != "/" else "")
        names = ["memory.current", "memory.max", "memory.peak", "memory.events", "memory.stat"]
        names += ["memory.pressure"]
    return [f"{d}/{n}" for n in names if os.path.exists(f"{d}/{n}")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--interval", type=float, required=True)
    ap.add_argument("--mode", choices=("wake", "reads"), required=True)
    args = ap.parse_args()
    detailed: list[int] = []  # once a second
    light: list[int] = []  # the rounds between
    records: list[int] = []  # once a second, read to the end (over a page)

    def held(paths: list[str]) -> list[int]:
        return [os.open(p, os.O_RDONLY | os.O_CLOEXEC) for p in paths if os.path.exists(p)]

    if args.mode == "reads":
        ranks, descendants = _ranks_and_descendants()
        if not ranks:
            print("floor: no bench ranks found", file=sys.stderr)
            return 1
        cgroup = _cgroup_files(ranks[0])
        detailed = held(
            [f"/proc/{p}/{n}" for p in ranks for n in ("stat", "status")]
            + [f"/proc/{p}/statm" for p in descendants]
            + cgroup
            + ["/proc/meminfo", "/proc/pressure/memory"]
        )
        light = held([f"/proc/{p}/statm" for p in ranks + descendants] + cgroup[:1])
        records = held(["/proc/vmstat"])
    stop = threading.Event()
    interval = args.interval
    every = max(1, round(1 / interval))  # a detailed round once a second

    def loop() -> None:
        pread, statvfs = os.pread, os.statvfs
        n = 0
        while not stop.wait(interval):
            if n % every == 0:
                for fd in detailed:
                    pread(fd, 65536, 0)
                for fd in records:
                    offset = 0
                    while chunk := pread(fd, 65536, offset):
                        offset += len(chunk)
                if detailed:
                    statvfs("/dev/shm")
            else:
                for fd in light:
                    pread(fd, 65536, 0)
            n += 1

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    print("ready", flush=True)
    try:
        sys.stdin.read()  # until the benchmark closes it
    finally:
        stop.set()
        thread.join()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
