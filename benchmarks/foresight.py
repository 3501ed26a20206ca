"""How well trainwatch sees an OOM coming: the predicted time left against the real one, on
real leaking jobs, and the false alarms on jobs that do not leak.

    python benchmarks/foresight.py [--rates 20,100,500] [--kinds cgroup,global]
                                   [--quiet-seconds 600] [--interval 1] [--name foresight]

Leaks (as root): for each kind and rate, a real torchrun job (gloo, 2 ranks) whose rank 1
leaks anonymous memory at about RATE MB/s (the nominal rate; the measured one is reported)
until the kernel kills it, watched by a fresh daemon at its default interval:

- ``cgroup``: inside a memory cgroup whose limit leaves the leak about a minute (less where
  the machine's memory does not allow it);
- ``global``: no limit; a ballast process first takes the host's memory down so that the
  leak has about a minute left before a global OOM (the leaking rank has
  oom_score_adj=1000, so it is the kernel's choice).

This process polls ``/ranks`` five times a second and records the leaking rank's
``exhaustion_seconds``. The reference is the kill: the time of the kernel's kill record in
the postmortem's evidence (the limit was reached then; a process of many GiB takes a second
or two more to exit, which is the postmortem's ``died_at``, used only where no record was
read). For a lead of 30, 10 and 3 s before the kill: the last prediction seen at or before
that moment against the time that really was left (error = predicted / real - 1; none when
there was no prediction then), and how long before the kill the first warning came. The
polls are kept in the results file, so other leads can be computed from it.

Quiet jobs (false alarms): two jobs side by side for ``--quiet-seconds``, each under a
6 GiB cgroup limit: a steady one (2 ranks, a worker each, all-reduce every 0.2 s) and one
that loads a 2 GiB checkpoint into each rank once, after a minute, as fast as memory
takes it. Counted: polls with any prediction, episodes (a run of such polls), and the
daemon's WARNING lines for each job.

Results: ``benchmarks/results/NAME.json`` (default ``foresight``), rendered in docs/performance.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import results
from sidecar.front.demo import join_cgroup, memory_cgroup, memory_hierarchy
from sidecar.trend import theil_sen
from tests.support.e2e import DaemonProc, TorchrunJob, wait_for

GIB = 1 << 30
MB = 10**6
LEADS = (30, 10, 3)
TARGET_LIFE_S = 60.0  # what a leak is given before the limit, where memory allows
BALLAST = """
import os, sys, time
n = int(sys.argv[1]); buf = bytearray(n)
for i in range(0, n, 4096):
    buf[i] = 1
open(sys.argv[2], "w").close()
while True:
    time.sleep(1)
"""


def ts(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()


def available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise SystemExit("no MemAvailable")


def grow_args(rate_mb: float) -> dict[str, Any]:
    """--grow-mb and --grow-interval for about ``rate_mb`` MB/s, in chunks of at most 64 MiB
    and at least 5 a second."""
    chunk = max(1, min(64, round(rate_mb * MB / 5 / 2**20)))
    return {"grow_mb": chunk, "grow_interval": chunk * 2**20 / (rate_mb * MB)}


def rank_view(daemon: DaemonProc, agent_pid: int, rank: int) -> dict[str, Any] | None:
    for entry in daemon.ranks()["jobs"]:
        if entry["agent_pid"] == agent_pid:
            for r in entry["ranks"]:
                if r["rank"] == rank:
                    return dict(r)
    return None


def postmortem_of(daemon: DaemonProc, agent_pid: int) -> dict[str, Any] | None:
    status, body = daemon.get("/postmortems")
    if status != 200:
        return None
    for entry in json.loads(body):
        doc = json.loads(daemon.get(f"/postmortems/{entry['id']}")[1])
        if doc["job"]["agent_pid"] == agent_pid and doc["victim"]["rank"] is not None:
            return dict(doc)
    return None


def leak_run(tmp: Path, kind: str, rate_mb: float, interval: float) -> dict[str, Any]:
    name = f"{kind}-{rate_mb:g}"
    go = tmp / f"{name}.go"
    polls: list[tuple[float, float | None, int | None, str | None]] = []  # t, predicted, rss, limit kind
    with contextlib.ExitStack() as stack:
        wrap = None
        limit = None
        if kind == "cgroup":
            room = min(rate_mb * MB * TARGET_LIFE_S, available() - 3 * GIB)
            limit = int(1 * GIB + room)  # the two ranks' own ~1 GiB, then the leak's room
            _, _, child = stack.enter_context(memory_cgroup(limit, f"trainwatch-foresight-{name}"))
            wrap = join_cgroup(child)
        else:
            ballast = max(0, available() - int(1.2 * GIB + rate_mb * MB * TARGET_LIFE_S))
            ready = tmp / f"{name}.ballast"
            proc = subprocess.Popen([sys.executable, "-c", BALLAST, str(ballast), str(ready)])
            stack.callback(lambda: (proc.kill(), proc.wait()))
            wait_for(ready.exists, 300, "the ballast to take its memory", 0.2)
        daemon = stack.enter_context(DaemonProc(tmp, interval=interval))
        job = stack.enter_context(
            TorchrunJob(
                tmp, name, hold_mb=50, workers=0, wrap=wrap, grow_rank=1, grow_after=0,
                grow_file=str(go), duration=3600, **grow_args(rate_mb),
            )
        )  # fmt: skip
        pids = job.ready()
        daemon.wait_sampled(job, pids)
        go.touch()
        started = time.time()
        doc = None
        while doc is None and time.time() - started < 900:
            r = rank_view(daemon, job.agent_pid, 1)
            if r is not None and r["rss_bytes"]:
                limit_kind = (r.get("binding_limit") or {}).get("kind")
                polls.append((time.time(), r["exhaustion_seconds"], r["rss_bytes"], limit_kind))
            if job.proc.poll() is not None:
                doc = wait_for(lambda job=job: postmortem_of(daemon, job.agent_pid), 60, "the postmortem")
            time.sleep(0.2)
        if doc is None:
            raise SystemExit(f"{name}: no death within 900 s")
    exited = ts(doc["victim"]["died_at"])
    records = [ts(e["at"]) for e in doc["killer"]["evidence"] if e["source"] == "kmsg" and e["at"]]
    died = min(records) if records else exited  # the kill, where the kernel's record was read
    at: dict[str, Any] = {}
    for lead in LEADS:
        before = [p for p in polls if p[0] <= died - lead]
        if not before:  # the leak lived less than that
            at[str(lead)] = None
            continue
        t, predicted, _, _ = before[-1]
        real = died - t
        at[str(lead)] = {
            "predicted_s": predicted,
            "real_s": round(real, 2),
            "error": None if predicted is None else round(predicted / real - 1, 4),
        }
    leaking = [(t, float(rss)) for t, _, rss, _ in polls if rss is not None and t <= died]
    warned = [w for w in doc.get("warnings") or [] if w["rank"] == 1]
    return {
        "kind": kind,
        "rate_mb_s": rate_mb,
        "measured_rate_mb_s": round(theil_sen(leaking[-50:]) / MB, 1) if len(leaking) > 2 else None,
        "limit_bytes": limit,
        "life_s": round(died - started, 1),
        "killed_at": died,
        "exit_after_kill_s": round(exited - died, 2),
        "killer": doc["killer"]["kind"],
        "confidence": doc["killer"]["confidence"],
        "first_prediction_lead_s": next((round(died - t, 1) for t, p, _, _ in polls if p is not None), None),
        "first_warning_lead_s": round(died - ts(warned[0]["at"]), 1) if warned else None,
        "binding_limit": next((k for _, p, _, k in reversed(polls) if p is not None), None),
        "at": at,
        # (seconds before the kill, predicted seconds or None, rank 1's RSS) of every poll
        "polls": [(round(died - t, 2), p, rss) for t, p, rss, _ in polls],
    }


def quiet_runs(tmp: Path, seconds: float, interval: float) -> dict[str, Any]:
    with contextlib.ExitStack() as stack:
        daemon = stack.enter_context(DaemonProc(tmp, interval=interval))
        jobs = {}
        for name, extra in (
            ("steady", {"workers": 1, "worker_mb": 32}),
            ("checkpoint", {"workers": 0, "load_mb": 2048, "load_interval": 0.0, "load_after": 60}),
        ):
            _, _, child = stack.enter_context(memory_cgroup(6 * GIB, f"trainwatch-quiet-{name}"))
            jobs[name] = stack.enter_context(
                TorchrunJob(tmp, name, hold_mb=50, wrap=join_cgroup(child), duration=seconds, **extra)
            )
        for job in jobs.values():
            daemon.wait_sampled(job, job.ready())
        keys: dict[str, str] = {}
        stats = {n: {"polls": 0, "predicted_polls": 0, "episodes": 0, "max_rss_bytes": 0} for n in jobs}
        was = dict.fromkeys(jobs, False)
        while any(j.proc.poll() is None for j in jobs.values()):
            entries = {e["agent_pid"]: e for e in daemon.ranks()["jobs"]}
            for name, job in jobs.items():
                e = entries.get(job.agent_pid)
                if e is None or not e["ranks"]:
                    continue
                keys[name] = e["job"]
                s = stats[name]
                s["polls"] += 1
                now = any(r["exhaustion_seconds"] is not None for r in e["ranks"])
                s["predicted_polls"] += now
                s["episodes"] += now and not was[name]
                s["max_rss_bytes"] = max([s["max_rss_bytes"], *(r["rss_bytes"] for r in e["ranks"])])
                was[name] = now
            time.sleep(0.5)
        log = daemon.log()
    for name, key in keys.items():
        stats[name]["warnings"] = len(
            re.findall(rf"WARNING sidecar.foresight: .* of job {re.escape(key)} ", log)
        )
        stats[name]["seconds"] = seconds
    return stats


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rates", default="20,100,500", help="MB/s, comma-separated")
    ap.add_argument("--kinds", default="cgroup,global")
    ap.add_argument("--quiet-seconds", type=float, default=600.0)
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--name", default="foresight")
    args = ap.parse_args()
    if memory_hierarchy() is None:
        raise SystemExit("needs root and a writable memory cgroup hierarchy")
    kinds = args.kinds.split(",")
    if "global" in kinds:
        from tests.support.skips import global_oom_allowed  # (pytest: not needed for cgroup runs alone)

        ok, why = global_oom_allowed()
        if not ok:
            raise SystemExit(f"a global OOM is not allowed here: {why}")
    leaks = []
    keep = os.environ.get("TRAINWATCH_KEEP_BENCH_DIR")  # keep the daemons' logs and postmortems
    with contextlib.ExitStack() as stack:
        tmp = Path(keep) if keep else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        tmp.mkdir(parents=True, exist_ok=True)
        for kind in kinds:
            for rate in (float(r) for r in args.rates.split(",")):
                row = leak_run(tmp, kind, rate, args.interval)
                print(json.dumps(row), flush=True)
                leaks.append(row)
        quiet = quiet_runs(tmp, args.quiet_seconds, args.interval) if args.quiet_seconds > 0 else {}
        print(json.dumps(quiet), flush=True)
    results.write(args.name, {"interval_seconds": args.interval, "leaks": leaks, "quiet": quiet})
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
