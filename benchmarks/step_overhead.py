"""The daemon's cost to a real training loop: step time with and without trainwatch.

    python benchmarks/step_overhead.py [--nproc N] [--steps 400] [--reps 4] [--out DIR]

Runs benchmarks/train_step.py under torchrun (--nproc ranks, default one per GPU, or 2 on
CPU) in three conditions: no daemon, the daemon at 1 Hz and at 10 Hz (--interval 1 and
0.1), --reps times each, the order rotated every repetition so drift spreads over all
three. Each run's figure is its median step time (warm-up excluded). The overhead of a
condition is its paired difference to the run without the daemon in the same repetition;
the table gives the mean, the spread and a 95% interval over repetitions (Student t), so
a 1% difference is visible when the interval is narrower than 1%.

Also, on a GPU machine, once per daemon condition: each rank's GPU memory as torch reports
it halfway through the run next to trainwatch_rank_gpu_memory_bytes read at that moment,
and the daemon's own CPU time over the run. Nothing is asserted; figures are printed and
written to DIR/step_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}


def gpu_count() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return len([line for line in out.splitlines() if line.startswith("GPU ")])


class Daemon:
    def __init__(self, workdir: Path, interval: float) -> None:
        self.log_path = workdir / f"daemon-{interval}.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "sidecar",
                "--attach-torchrun",
                "--port",
                "0",
                "--interval",
                str(interval),
                "--postmortem-dir",
                str(workdir / "pm"),
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            m = re.search(r"serving http://([\d.]+):(\d+)/metrics", self.log_path.read_text())
            if m:
                self.base = f"http://{m[1]}:{m[2]}"
                return
            time.sleep(0.1)
        raise SystemExit(f"the daemon did not start:\n{self.log_path.read_text()}")

    def get(self, path: str) -> str:
        with urllib.request.urlopen(self.base + path, timeout=10) as r:
            return str(r.read().decode())

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(30)
        self._log.close()


def run_once(workdir: Path, nproc: int, steps: int, interval: float | None, tag: str) -> dict:
    out = workdir / f"steps-{tag}.json"
    daemon = Daemon(workdir, interval) if interval else None
    cpu0 = daemon.cpu_seconds() if daemon else 0.0
    env = dict(os.environ, OMP_NUM_THREADS="4", NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    torchrun = str(Path(sys.executable).parent / "torchrun")
    job = subprocess.Popen(
        [
            torchrun,
            "--standalone",
            f"--nproc-per-node={nproc}",
            str(HERE / "train_step.py"),
            f"--steps={steps}",
            f"--out={out}",
        ],
        stdout=open(workdir / f"torchrun-{tag}.log", "w"),  # noqa: SIM115
        stderr=subprocess.STDOUT,
        env=env,
    )
    seen, gpu_view = False, None
    t0 = time.monotonic()
    while job.poll() is None:
        time.sleep(0.5)
        if daemon is None:
            continue
        ranks = json.loads(daemon.get("/ranks"))
        mine = [j for j in ranks.get("jobs", []) if j.get("agent_pid") == job.pid]
        seen = seen or bool(mine and mine[0].get("ranks"))
        halfway = list(workdir.glob(f"steps-{tag}.json.gpu*.json"))
        if gpu_view is None and len(halfway) == nproc:
            gpu_view = {
                "torch": [json.loads(p.read_text()) for p in halfway],
                "metrics": [
                    line
                    for line in daemon.get("/metrics").splitlines()
                    if line.startswith("trainwatch_rank_gpu_memory_bytes")
                ],
            }
    wall = time.monotonic() - t0
    if job.returncode != 0:
        raise SystemExit(f"the training run failed:\n{(workdir / f'torchrun-{tag}.log').read_text()[-3000:]}")
    result = json.loads(out.read_text())
    times = result["step_seconds"]
    row = {
        "tag": tag,
        "interval": interval,
        "median_step_s": statistics.median(times),
        "mean_step_s": statistics.fmean(times),
        "steps": len(times),
        "wall_s": wall,
        "world_size": result["world_size"],
        "cuda": result["cuda"],
    }
    if daemon:
        row["daemon_cpu_s"] = daemon.cpu_seconds() - cpu0
        row["daemon_saw_job"] = seen
        row["gpu_view"] = gpu_view
        daemon.stop()
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=0, help="ranks (default: one per GPU, 2 without)")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--out", default=None, help="directory for the JSON results (default: a temp dir)")
    args = ap.parse_args()
    gpus = gpu_count()
    nproc = args.nproc or gpus or 2
    workdir = Path(args.out or tempfile.mkdtemp(prefix="tw-steps-"))
    workdir.mkdir(parents=True, exist_ok=True)
    conditions: list[tuple[str, float | None]] = [("none", None), ("1hz", 1.0), ("10hz", 0.1)]
    rows = []
    for rep in range(args.reps):
        order = conditions[rep % 3 :] + conditions[: rep % 3]
        for name, interval in order:
            row = run_once(workdir, nproc, args.steps, interval, f"{name}-r{rep}")
            row["rep"], row["condition"] = rep, name
            rows.append(row)
            print(
                f"rep {rep} {name:>5}: median step {row['median_step_s'] * 1e3:8.3f} ms"
                + (
                    f"  daemon CPU {row['daemon_cpu_s']:.2f} s over {row['wall_s']:.0f} s, saw the job: "
                    f"{row['daemon_saw_job']}"
                    if interval
                    else ""
                ),
                flush=True,
            )
    base = {r["rep"]: r["median_step_s"] for r in rows if r["condition"] == "none"}
    summary = {}
    print(
        f"\n{nproc} ranks, {'CUDA' if rows[0]['cuda'] else 'CPU'}, {args.steps} timed steps a run, "
        f"{args.reps} repetitions"
    )
    print(
        f"{'condition':>10} {'median step':>12} {'overhead mean':>14} {'95% interval':>20} {'min..max':>18}"
    )
    for name, _ in conditions:
        meds = [r["median_step_s"] for r in rows if r["condition"] == name]
        diffs = [100 * (r["median_step_s"] / base[r["rep"]] - 1) for r in rows if r["condition"] == name]
        mean = statistics.fmean(diffs)
        half = (
            T95.get(len(diffs) - 1, 2.0) * statistics.stdev(diffs) / math.sqrt(len(diffs))
            if len(diffs) > 1
            else 0
        )
        summary[name] = {
            "median_step_s": statistics.median(meds),
            "overhead_pct_mean": mean,
            "overhead_pct_ci95": [mean - half, mean + half],
            "overhead_pct": diffs,
        }
        interval = f"[{mean - half:+.2f}%, {mean + half:+.2f}%]"
        spread = f"{min(diffs):+.2f}..{max(diffs):+.2f}%"
        print(
            f"{name:>10} {statistics.median(meds) * 1e3:9.3f} ms {mean:+13.2f}% {interval:>20} {spread:>18}"
        )
    for r in rows:
        if r.get("gpu_view") and r["rep"] == 0:
            print(f"\nGPU memory per rank halfway through ({r['condition']}): torch, then trainwatch")
            for t in sorted(r["gpu_view"]["torch"], key=lambda t: t["rank"]):
                print(
                    f"  rank {t['rank']} pid {t['pid']} cuda:{t['device']}: "
                    f"allocated {t['allocated_bytes']}, reserved {t['reserved_bytes']}"
                )
            for line in r["gpu_view"]["metrics"]:
                print("  " + line)
    (workdir / "step_overhead.json").write_text(json.dumps({"rows": rows, "summary": summary}, indent=1))
    print(f"\nwritten: {workdir / 'step_overhead.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
