"""Per launcher: how soon the daemon lists a job's ranks, how soon a rank's death is told,
and how soon a survivor the death left waiting is reported stranded.

    python benchmarks/launchers.py [--runs N] [--name NAME] [--only LAUNCHER]...

For each launcher (torchrun, DeepSpeed's, torch.multiprocessing.spawn, Lightning's, Open
MPI's mpirun, a step of the test Slurm: tests/support/slurm.py), N real jobs of two ranks (gloo on
CPU, tests/workloads/), one after another, each watched by a real daemon sampling every
second:

- **attach**: for each rank, the first ``GET /ranks`` (polled every 50 ms) that lists it,
  less the rank process's start (its start time in ``/proc``). A spawned rank is a rank once
  it has joined its process group, after its interpreter's start and its imports: its figure
  holds them; so the figure from its group join (the start of the first thread c10d started
  for it) is given too.
- **death to postmortem**: rank 1 is SIGKILLed from outside; the postmortem's ``created_at``
  less the victim's ``died_at`` (both the daemon's clock), with its verdict and the other
  rank's fate (for a stranded survivor, once its stranding reached the postmortem). Lightning's
  rank 0 is the user's script: it is known as one when it starts rank 1, after its imports.
- **death to stranded** (Slurm, ``--kill-on-bad-exit=0``; the ranks hand off through rank 0's
  store, so rank 0 is left waiting for rank 1): the first ``GET /ranks`` that reports rank 0
  stranded, less the kill.

A launcher that cannot run here (its package missing) is listed as skipped. Results:
``benchmarks/results/NAME.json`` (default ``launchers``), rendered into docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import results
from sidecar.sampling.spawned import GROUP_THREAD_PREFIXES
from tests.support import slurm
from tests.support.e2e import (
    DaemonProc,
    DeepSpeedJob,
    LightningJob,
    MpichJob,
    MpiJob,
    SlurmJob,
    SpawnJob,
    TorchrunJob,
    job_postmortem,
    settled_postmortem,
    wait_for,
)
from tests.support.skips import met

TICKS = os.sysconf("SC_CLK_TCK")
BOOT = next(
    float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime")
)
# launcher -> (the job's class, its extra arguments, the skip key it needs)
LAUNCHERS: dict[str, tuple[Any, dict[str, Any], str | None]] = {
    "torchrun": (TorchrunJob, {}, None),
    "deepspeed": (DeepSpeedJob, {}, "deepspeed"),
    "spawn": (SpawnJob, {}, None),
    "lightning": (LightningJob, {}, "lightning"),
    "openmpi": (MpiJob, {}, "openmpi"),
    "mpich": (MpichJob, {}, "mpich"),
    "slurm": (SlurmJob, {"kill_on_bad_exit": True}, "slurm"),
}


def _started(pid: int) -> float:
    """The process's start, epoch seconds (its /proc start time: boot time + ticks)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return BOOT + int(stat.rsplit(")", 1)[1].split()[19]) / TICKS


def _joined(pid: int) -> float | None:
    """When the rank joined its process group: the start of the first thread c10d started
    for it (sampling/spawned.py names them), epoch seconds; None if none is seen."""
    starts = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            comm = (task / "comm").read_text().strip()
            stat = (task / "stat").read_text()
        except OSError:
            continue
        if comm.startswith(GROUP_THREAD_PREFIXES):
            starts.append(BOOT + int(stat.rsplit(")", 1)[1].split()[19]) / TICKS)
    return min(starts) if starts else None


def _epoch(iso: str) -> float:
    return datetime.fromisoformat(iso).timestamp()


def _watch_ranks(daemon: DaemonProc, seen: dict[int, float], until: Any, timeout: float) -> None:
    """Poll /ranks every 50 ms, noting when each rank pid is first listed, until ``until()``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status, body = daemon.get("/ranks")
        now = time.time()
        if status == 200:
            for job in json.loads(body)["jobs"]:
                for r in job["ranks"]:
                    seen.setdefault(r["pid"], now)
        if until():
            return
        time.sleep(0.05)
    raise TimeoutError("the ranks were not listed")


def one(launcher: str, tmp: Path, stranded: bool = False) -> dict[str, Any]:
    cls, extra, _key = LAUNCHERS[launcher]
    kwargs: dict[str, Any] = {"hold_mb": 50, "workers": 1, **extra}
    if stranded:
        kwargs.update(kill_on_bad_exit=False, handoff=1, workers=0)
    out: dict[str, Any] = {"launcher": launcher, "stranded_run": stranded}
    with DaemonProc(tmp) as daemon, cls(tmp, f"{launcher}{'-strand' if stranded else ''}", **kwargs) as job:
        seen: dict[int, float] = {}
        pids: dict[int, list[int]] = {}

        def listed() -> bool:
            if not pids:
                files = sorted(job.dir.glob("rank*.r0"))
                if len(files) == 2:
                    pids.update(
                        {
                            int(f.name[4:].split(".")[0]): [int(p) for p in f.read_text().split()]
                            for f in files
                        }
                    )
            return bool(pids) and all(p[0] in seen for p in pids.values())

        _watch_ranks(daemon, seen, listed, 180)
        out["attach_s"] = [round(seen[p[0]] - _started(p[0]), 3) for _, p in sorted(pids.items())]
        joined = [_joined(p[0]) for _, p in sorted(pids.items())]
        out["attach_after_join_s"] = [
            round(seen[p[0]] - j, 3)
            for (_, p), j in zip(sorted(pids.items()), joined, strict=True)
            if j is not None
        ]
        agent = job.agent_pid
        os.kill(pids[1][0], signal.SIGKILL)
        killed = time.time()
        if stranded:

            def strand() -> bool:
                status, body = daemon.get("/ranks")
                jobs = json.loads(body)["jobs"] if status == 200 else []
                return any(j["agent_pid"] == agent and j["stranded"] for j in jobs)

            wait_for(strand, 60, "rank 0 stranded", 0.05)
            out["death_to_stranded_s"] = round(time.time() - killed, 3)
        doc = job_postmortem(daemon, victim_rank=None, want_fates=1 if stranded else 2, job=job)
        if stranded:  # the survivor's fate, once the stranding reached the postmortem
            doc = settled_postmortem(daemon, doc, lambda d: any(r["fate"] == "stranded" for r in d["ranks"]))
        out["death_to_postmortem_s"] = round(_epoch(doc["created_at"]) - _epoch(doc["victim"]["died_at"]), 3)
        out["killer"] = f"{doc['killer']['kind']} ({doc['killer']['confidence']})"
        out["victim_right"] = doc["victim"]["pid"] == pids[1][0]
        out["survivor_fate"] = next(r["fate"] for r in doc["ranks"] if r["pid"] == pids[0][0])
        if stranded:
            job.cancel()  # type: ignore[attr-defined]
        job.proc.wait(90)
    return out


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    attach = [a for r in runs for a in r["attach_s"]]
    after_join = [a for r in runs for a in r["attach_after_join_s"]]
    post = [r["death_to_postmortem_s"] for r in runs]
    s: dict[str, Any] = {
        "runs": len(runs),
        "attach_s_median": round(statistics.median(attach), 3),
        "attach_s_max": max(attach),
        "attach_after_join_s_median": round(statistics.median(after_join), 3) if after_join else None,
        "attach_after_join_s_max": max(after_join) if after_join else None,
        "death_to_postmortem_s_median": round(statistics.median(post), 3),
        "death_to_postmortem_s_max": max(post),
        "killers": sorted({r["killer"] for r in runs}),
        "victims_right": sum(r["victim_right"] for r in runs),
        "survivor_fates": sorted({r["survivor_fate"] for r in runs}),
    }
    strand = [r["death_to_stranded_s"] for r in runs if "death_to_stranded_s" in r]
    if strand:
        s["death_to_stranded_s_median"] = round(statistics.median(strand), 3)
        s["death_to_stranded_s_max"] = max(strand)
    return s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--name", default="launchers")
    ap.add_argument("--only", action="append", choices=sorted(LAUNCHERS), help="these launchers only")
    args = ap.parse_args()
    per: dict[str, Any] = {}
    try:
        for launcher in args.only or list(LAUNCHERS):
            key = LAUNCHERS[launcher][2]
            if key is not None and not met(key):
                per[launcher] = {"skipped": f"{key} is not available here"}
                print(f"{launcher}: skipped ({key})", flush=True)
                continue
            runs = []
            variants = [False, True] if launcher == "slurm" else [False]
            for stranded in variants:
                for i in range(args.runs):
                    with tempfile.TemporaryDirectory(prefix="tw-launchers-") as tmp:
                        r = one(launcher, Path(tmp), stranded)
                    print(f"{launcher} {'stranded ' if stranded else ''}run {i + 1}: {r}", flush=True)
                    runs.append(r)
            per[launcher] = {"summary": _summary(runs), "runs": runs}
    finally:
        slurm.stop()
    path = results.write(args.name, {"interval_seconds": 1.0, "launchers": per})
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
