"""Torchrun-shaped process trees without torch, for the overhead benchmark.

    python benchmarks/fake_job.py --agents A --ranks R --workers W [--hold-mb M]

Starts A "agents" (processes whose main thread is named ``pt_elastic``, as torchrun's
is), each with R "ranks" (children exec'd with a torchrun worker's environment: RANK,
LOCAL_RANK, WORLD_SIZE, TORCHELASTIC_RUN_ID, ...), each holding M MiB and W forked
"DataLoader workers". Every process carries ``trainwatch-bench`` in its argv. The tree
lives until this process gets SIGTERM/SIGINT or its stdin closes.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time

MARK = "trainwatch-bench"


def set_thread_name(name: str) -> None:
    libc = ctypes.CDLL(None)
    libc.prctl(15, name.encode(), 0, 0, 0)  # PR_SET_NAME


def rank_main(hold_mb: int, workers: int) -> None:
    buf = bytearray(hold_mb << 20)
    for i in range(0, len(buf), 4096):
        buf[i] = 1
    kids = []
    for _ in range(workers):
        pid = os.fork()
        if pid == 0:
            parent = os.getppid()
            while os.getppid() == parent:
                time.sleep(2.0)
            os._exit(0)
        kids.append(pid)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    for k in kids:
        os.kill(k, signal.SIGTERM)


def agent_main(index: int, ranks: int, workers: int, hold_mb: int) -> None:
    set_thread_name("pt_elastic")
    procs = []
    for r in range(ranks):
        env = dict(
            os.environ,
            RANK=str(index * ranks + r),
            LOCAL_RANK=str(r),
            WORLD_SIZE=str(ranks),
            LOCAL_WORLD_SIZE=str(ranks),
            GROUP_RANK=str(index),
            ROLE_NAME="default",
            TORCHELASTIC_RUN_ID=f"bench-{index}",
            TORCHELASTIC_RESTART_COUNT="0",
            TORCHELASTIC_MAX_RESTARTS="0",
        )
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-u",
                    __file__,
                    MARK,
                    "--role",
                    "rank",
                    "--workers",
                    str(workers),
                    "--hold-mb",
                    str(hold_mb),
                ],
                env=env,
                start_new_session=True,
            )
        )
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    for p in procs:
        p.terminate()
    for p in procs:
        p.wait()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("mark", nargs="?")
    ap.add_argument("--role", default="top", choices=["top", "agent", "rank"])
    ap.add_argument("--index", type=int, default=0)
    ap.add_argument("--agents", type=int, default=1)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--workers", type=int, default=7)
    ap.add_argument("--hold-mb", type=int, default=4)
    args = ap.parse_args()
    if args.role == "rank":
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
        rank_main(args.hold_mb, args.workers)
        return 0
    if args.role == "agent":
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
        agent_main(args.index, args.ranks, args.workers, args.hold_mb)
        return 0
    agents = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                MARK,
                "--role",
                "agent",
                "--index",
                str(i),
                "--ranks",
                str(args.ranks),
                "--workers",
                str(args.workers),
                "--hold-mb",
                str(args.hold_mb),
            ]
        )
        for i in range(args.agents)
    ]
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    stop.wait()
    for a in agents:
        a.terminate()
    for a in agents:
        a.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
