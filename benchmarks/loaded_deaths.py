"""Death -> postmortem on a loaded machine, with and without the daemon's self-protection,
side by side in one run.

    python benchmarks/loaded_deaths.py [--runs N] [--busy K] [--kinds cgroup,global]

Two daemons watch the same jobs: one as shipped (oom_score_adj -1000 where permitted,
mlockall, nice -10 for its threads), one with ``--no-self-protection --oom-score-adj
keep``. K processes spin on the CPU the whole time (default 2: both cores of this
machine). Each run starts a real torchrun job (gloo, 2 ranks) whose rank 1 grows until a
kernel OOM kills it: ``cgroup`` inside a memory cgroup with a 1.5 GiB limit, ``global``
with no limit until the whole machine is out of memory (the victim has oom_score_adj
1000; as root with no swap). Latency = the postmortem's created_at - the victim's
died_at, both the daemon's own clock. Results: ``benchmarks/results/loaded-deaths.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import results
from sidecar.front.demo import join_cgroup, memory_cgroup
from tests.support.e2e import DaemonProc, TorchrunJob, wait_for

GIB = 1 << 30
SPIN = "while True:\n    pass\n"


def _ts(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()


def _postmortem(daemon: DaemonProc, job: TorchrunJob) -> dict | None:
    status, body = daemon.get("/postmortems")
    if status != 200:
        return None
    for entry in json.loads(body):
        doc = json.loads(daemon.get(f"/postmortems/{entry['id']}")[1])
        if doc["job"]["agent_pid"] == job.agent_pid:
            return doc
    return None


def _summary(values: list[float]) -> dict[str, float]:
    v = sorted(values)
    p95 = v[min(len(v) - 1, round(0.95 * (len(v) - 1)))]
    return {"p50_ms": statistics.median(v) * 1000, "p95_ms": p95 * 1000, "max_ms": v[-1] * 1000, "n": len(v)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--busy", type=int, default=2, help="processes spinning on the CPU throughout")
    ap.add_argument("--kinds", default="cgroup,global")
    ap.add_argument("--name", default="loaded-deaths")
    args = ap.parse_args()
    kinds = args.kinds.split(",")
    lat: dict[str, dict[str, list[float]]] = {k: {"protected": [], "unprotected": []} for k in kinds}
    verdicts: dict[str, list[str]] = {k: [] for k in kinds}
    grants: dict[str, str] = {}
    keep = os.environ.get("TRAINWATCH_KEEP_BENCH_DIR")  # keep the daemons' logs and postmortems
    with contextlib.ExitStack() as stack:
        t = Path(keep) if keep else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        t.mkdir(parents=True, exist_ok=True)
        (t / "a").mkdir()
        (t / "b").mkdir()
        spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(args.busy)]
        try:
            protected = stack.enter_context(DaemonProc(t / "a"))
            plain = stack.enter_context(
                DaemonProc(t / "b", "--no-self-protection", "--oom-score-adj", "keep")
            )
            grants = {
                line.split("self-protection: ", 1)[1]: ""
                for line in protected.log().splitlines()
                if "self-protection: " in line
            }
            for i in range(args.runs):
                for kind in kinds:
                    with contextlib.ExitStack() as job_stack:
                        wrap = None
                        grow = {"grow_rank": 1, "grow_after": 2, "duration": 600}
                        if kind == "cgroup":
                            _, _, child = job_stack.enter_context(
                                memory_cgroup(int(1.5 * GIB), f"trainwatch-loaded-{i}")
                            )
                            wrap = join_cgroup(child)
                        else:
                            grow["grow_mb"] = 128
                        job = job_stack.enter_context(
                            TorchrunJob(t, f"{kind}{i}", hold_mb=50, workers=0, wrap=wrap, **grow)
                        )
                        job.ready()
                        docs = {
                            name: wait_for(
                                lambda d=d, j=job: _postmortem(d, j), 300, f"{name} postmortem {kind} {i}"
                            )
                            for name, d in (("protected", protected), ("unprotected", plain))
                        }
                        job.proc.wait(120)
                    for name, doc in docs.items():
                        latency = _ts(doc["created_at"]) - _ts(doc["victim"]["died_at"])
                        lat[kind][name].append(latency)
                    verdicts[kind].append(
                        f"{docs['protected']['killer']['kind']}/{docs['protected']['killer']['confidence']}"
                    )
                    print(
                        f"run {i} {kind}: {verdicts[kind][-1]}, protected "
                        f"{lat[kind]['protected'][-1] * 1000:.0f} ms, unprotected "
                        f"{lat[kind]['unprotected'][-1] * 1000:.0f} ms",
                        flush=True,
                    )
        finally:
            for p in spinners:
                p.kill()
                p.wait()
    out = {
        "runs": args.runs,
        "busy_processes": args.busy,
        "grants": sorted(grants),
        "kinds": {
            k: {
                "verdicts": verdicts[k],
                "protected": _summary(lat[k]["protected"]),
                "unprotected": _summary(lat[k]["unprotected"]),
                "protected_ms": [round(x * 1000, 1) for x in lat[k]["protected"]],
                "unprotected_ms": [round(x * 1000, 1) for x in lat[k]["unprotected"]],
            }
            for k in kinds
        },
    }
    for k in kinds:
        for name in ("protected", "unprotected"):
            s = out["kinds"][k][name]
            print(f"{k} {name}: p50 {s['p50_ms']:.0f} ms, p95 {s['p95_ms']:.0f} ms, max {s['max_ms']:.0f} ms")
    results.write(args.name, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
