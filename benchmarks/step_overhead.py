"""The daemon's cost to a real training loop: step time with and without trainwatch.

    python benchmarks/step_overhead.py [--mode alternate|runs] [--nproc N] [--steps S] [--out DIR]

Both modes run benchmarks/train_step.py (a small transformer, bf16, DDP) under torchrun.

--mode alternate (the default): one training run per sampling rate (1 Hz, 10 Hz), the
daemon watching it and paused (SIGSTOP) and resumed (SIGCONT) every --phase seconds, so
each stretch with the daemon at work has a stretch without it beside it in the same run.
Steps within 0.3 s of a switch are dropped; the overhead is the mean of the paired
differences of the stretches' median step times, with a 95% interval. Run-to-run
differences (the GPU's clocks, where the process landed) cancel out, which a comparison
of separate runs cannot do: on the H200 machine separate runs without the daemon differed
by up to 20%.

--mode runs: separate runs of benchmarks/train_step.py under torchrun (--nproc ranks,
default one per GPU, or 2 on CPU) in three conditions: no daemon, the daemon at 1 Hz and
at 10 Hz (--interval 1 and 0.1), --reps times each, the order rotated every repetition so
drift spreads over all three. Each run's figure is its median step time (warm-up excluded). The overhead of a
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
import bisect
import contextlib
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
sys.path.insert(0, str(REPO))

from benchmarks import results as bench_results  # noqa: E402

T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}


def t95(df: int) -> float:
    """Student's two-sided 95% quantile: the table to 9 degrees of freedom, then
    1.96 + 2.4/df (within 0.3% of the exact value from 10 on)."""
    return T95.get(df) or 1.96 + 2.4 / df


def gpu_count() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return len([line for line in out.splitlines() if line.startswith("GPU ")])


class Daemon:
    def __init__(self, workdir: Path, interval: float, extra: tuple[str, ...] = ()) -> None:
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
                *extra,
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
        self.proc.kill()  # leave nothing running behind a failed benchmark
        self.proc.wait()
        self._log.close()
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


FLIGHT_RECORDER = False  # --flight-recorder: the job opens NCCL's debug FIFO (the stall probe's)


def flight_recorder_env(workdir: Path, tag: str) -> dict[str, str]:
    """What a job sets for NCCL's flight recorder and its on-demand dump FIFO: with these,
    the daemon asks every rank for a dump every third of --stall-after while every GPU is
    busy (the stall probe), and that cost is part of what is measured."""
    fr = workdir / f"fr-{tag}"
    fr.mkdir(parents=True, exist_ok=True)
    return {
        "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_FR_DUMP_TEMP_FILE": str(fr / "nccl_trace_rank_"),
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(fr / "nccl_trace_rank_"),
        "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": str(fr / "pipe_rank_"),
    }


def launch(workdir: Path, nproc: int, steps: int, tag: str) -> subprocess.Popen[bytes]:
    """torchrun of train_step.py; its output in DIR/torchrun-TAG.log."""
    # ranks x threads within the cores: an oversubscribed OpenMP pool turns any other
    # runnable thread (the daemon's included) into a straggler at every barrier
    threads = max(1, min(4, (os.cpu_count() or 1) // nproc))
    env = dict(
        os.environ, OMP_NUM_THREADS=str(threads), NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1"
    )
    if FLIGHT_RECORDER:
        env.update(flight_recorder_env(workdir, tag))
    torchrun = str(Path(sys.executable).parent / "torchrun")
    with open(workdir / f"torchrun-{tag}.log", "w") as log:
        return subprocess.Popen(
            [
                torchrun,
                "--standalone",
                f"--nproc-per-node={nproc}",
                str(HERE / "train_step.py"),
                f"--steps={steps}",
                f"--out={workdir / f'steps-{tag}.json'}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )


def sees(daemon: Daemon, job: subprocess.Popen[bytes]) -> bool:
    """The daemon lists the job's ranks."""
    mine = [j for j in json.loads(daemon.get("/ranks")).get("jobs", []) if j.get("agent_pid") == job.pid]
    return bool(mine and mine[0].get("ranks"))


def gpu_view(daemon: Daemon, workdir: Path, tag: str, nproc: int) -> dict | None:
    """Once every rank wrote what torch says of its GPU memory: that, and trainwatch's figure now."""
    halfway = list(workdir.glob(f"steps-{tag}.json.gpu*.json"))
    if len(halfway) != nproc:
        return None
    metrics = daemon.get("/metrics").splitlines()
    return {
        "torch": [json.loads(p.read_text()) for p in halfway],
        "metrics": [line for line in metrics if line.startswith("trainwatch_rank_gpu_memory_bytes")],
    }


def print_gpu_view(view: dict) -> None:
    for t in sorted(view["torch"], key=lambda t: t["rank"]):
        print(
            f"  torch: rank {t['rank']} pid {t['pid']} cuda:{t['device']}: "
            f"allocated {t['allocated_bytes']}, reserved {t['reserved_bytes']}"
        )
    for line in view["metrics"]:
        print("  trainwatch: " + line)


def finished(workdir: Path, job: subprocess.Popen[bytes], tag: str) -> dict:
    """The run's step times, or exit with the end of its log when it failed."""
    if job.wait() != 0:
        raise SystemExit(f"the training run failed:\n{(workdir / f'torchrun-{tag}.log').read_text()[-3000:]}")
    return dict(json.loads((workdir / f"steps-{tag}.json").read_text()))


def run_once(workdir: Path, nproc: int, steps: int, interval: float | None, tag: str) -> dict:
    daemon = Daemon(workdir, interval) if interval else None
    cpu0 = daemon.cpu_seconds() if daemon else 0.0
    job = launch(workdir, nproc, steps, tag)
    seen, view = False, None
    t0 = time.monotonic()
    while job.poll() is None:
        time.sleep(0.5)
        if daemon is not None:
            seen = seen or sees(daemon, job)
            view = view or gpu_view(daemon, workdir, tag, nproc)
    wall = time.monotonic() - t0
    cpu = daemon.cpu_seconds() - cpu0 if daemon else 0.0
    if daemon:
        daemon.stop()  # before finished(), which exits when the run failed
    result = finished(workdir, job, tag)
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
        row["daemon_cpu_s"] = cpu
        row["daemon_saw_job"] = seen
        row["gpu_view"] = view
    return row


def ci95(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% interval (Student t)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, 0.0
    return mean, t95(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))


def median_ci95(values: list[float]) -> tuple[float, float, float]:
    """Median and a distribution-free interval of at least 95% around it (order statistics,
    the sign test's binomial): stretches hit by an unrelated slowdown do not widen it as
    they widen the mean's."""
    xs = sorted(values)
    n = len(xs)
    if n < 6:
        return statistics.median(xs), xs[0], xs[-1]
    k = 0  # the widest k with P(Binomial(n, 1/2) <= k) <= 2.5%
    while sum(math.comb(n, i) for i in range(k + 2)) / 2**n <= 0.025:
        k += 1
    return statistics.median(xs), xs[k], xs[n - 1 - k]


def alternate(
    workdir: Path, nproc: int, steps: int, interval: float, phase: float, extra: tuple[str, ...] = ()
) -> dict:
    """One training run watched by a daemon that is paused and resumed every ``phase`` s."""
    tag = f"alt-{interval}"
    daemon = Daemon(workdir, interval, extra)
    cpu0 = daemon.cpu_seconds()  # its start-up (imports) is not the job's cost
    job = launch(workdir, nproc, steps, tag)
    switches: list[tuple[float, bool]] = [(time.time(), True)]  # (when, daemon running)
    seen, view = False, None
    dumps: set[tuple[str, int]] = set()  # (file, mtime): each flight-recorder dump the job wrote
    next_switch = time.monotonic() + phase
    while job.poll() is None:
        time.sleep(0.05)
        if FLIGHT_RECORDER:
            for f in (workdir / f"fr-{tag}").glob("nccl_trace_rank_*"):
                with contextlib.suppress(OSError):
                    dumps.add((f.name, f.stat().st_mtime_ns))
        running = switches[-1][1]
        if running:
            seen = seen or sees(daemon, job)
            view = view or gpu_view(daemon, workdir, tag, nproc)
        if time.monotonic() >= next_switch:
            os.kill(daemon.proc.pid, signal.SIGSTOP if running else signal.SIGCONT)
            switches.append((time.time(), not running))
            next_switch += phase
    os.kill(daemon.proc.pid, signal.SIGCONT)
    cpu = daemon.cpu_seconds() - cpu0
    daemon.stop()
    result = finished(workdir, job, tag)
    # each timed step to the stretch it started in; steps near or across a switch dropped
    stretches: dict[int, list[float]] = {}
    times = [t for t, _ in switches] + [math.inf]
    for d, end in zip(result["step_seconds"], result["step_end"], strict=True):
        start = end - d
        k = bisect.bisect_right(times, start) - 1
        if k < 0 or start - times[k] < 0.3 or end > times[k + 1]:
            continue
        stretches.setdefault(k, []).append(d)
    medians = {k: statistics.median(ds) for k, ds in stretches.items() if len(ds) >= 10}
    # non-overlapping neighbours (0, 1), (2, 3)...: each stretch in one pair only
    pairs = []
    for k in range(0, len(switches) - 1, 2):
        if k in medians and k + 1 in medians:
            on, off = (k, k + 1) if switches[k][1] else (k + 1, k)
            pairs.append(100 * (medians[on] / medians[off] - 1))
    mean, half = ci95(pairs)
    median, low, high = median_ci95(pairs) if pairs else (0.0, 0.0, 0.0)
    on_steps = [d for k, ds in stretches.items() if switches[k][1] for d in ds]
    off_steps = [d for k, ds in stretches.items() if not switches[k][1] for d in ds]
    return {
        "interval": interval,
        "phase_s": phase,
        "switches": len(switches) - 1,
        "pairs": len(pairs),
        "overhead_pct_mean": mean,
        "overhead_pct_ci95": [mean - half, mean + half],
        "overhead_pct": pairs,
        "overhead_pct_median": median,
        "overhead_pct_median_ci95": [low, high],
        "median_step_on_s": statistics.median(on_steps),
        "median_step_off_s": statistics.median(off_steps),
        "steps_on": len(on_steps),
        "steps_off": len(off_steps),
        "daemon_cpu_s": cpu,
        "daemon_saw_job": seen,
        "gpu_view": view,
        "cuda": result["cuda"],
        "world_size": result["world_size"],
        "daemon_args": list(extra),
        "flight_recorder": FLIGHT_RECORDER,
        # the dumps the daemon's stall probe asked for, as the job wrote them
        "flight_recorder_dumps": len(dumps) if FLIGHT_RECORDER else None,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("alternate", "runs"), default="alternate")
    ap.add_argument("--nproc", type=int, default=0, help="ranks (default: one per GPU, 2 without)")
    ap.add_argument(
        "--steps", type=int, default=0, help="timed steps a run (default 2000 alternate, 400 runs)"
    )
    ap.add_argument("--reps", type=int, default=4, help="--mode runs: repetitions")
    ap.add_argument("--phase", type=float, default=3.0, help="--mode alternate: seconds between switches")
    ap.add_argument("--out", default=None, help="directory for the JSON results (default: a temp dir)")
    ap.add_argument(
        "--flight-recorder",
        action="store_true",
        help="the job opens NCCL's flight recorder and its dump FIFO, so the daemon's stall probe runs",
    )
    ap.add_argument("--daemon-arg", action="append", default=[], help="an extra daemon argument (repeatable)")
    args = ap.parse_args()
    global FLIGHT_RECORDER
    FLIGHT_RECORDER = args.flight_recorder
    gpus = gpu_count()
    nproc = args.nproc or gpus or 2
    workdir = Path(args.out or tempfile.mkdtemp(prefix="tw-steps-"))
    workdir.mkdir(parents=True, exist_ok=True)
    if args.mode == "alternate":
        return main_alternate(workdir, nproc, args.steps or 2000, args.phase, tuple(args.daemon_arg))
    args.steps = args.steps or 400
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
        mean, half = ci95(diffs)
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
            print(f"\nGPU memory per rank halfway through ({r['condition']}):")
            print_gpu_view(r["gpu_view"])
    (workdir / "step_overhead.json").write_text(json.dumps({"rows": rows, "summary": summary}, indent=1))
    print(f"\nwritten: {workdir / 'step_overhead.json'}")
    return 0


def main_alternate(workdir: Path, nproc: int, steps: int, phase: float, extra: tuple[str, ...] = ()) -> int:
    results = []
    for interval in (1.0, 0.1):
        r = alternate(workdir, nproc, steps, interval, phase, extra)
        results.append(r)
        lo, hi = r["overhead_pct_ci95"]
        mlo, mhi = r["overhead_pct_median_ci95"]
        print(
            f"daemon every {interval:g} s: step {r['median_step_off_s'] * 1e3:.3f} ms paused, "
            f"{r['median_step_on_s'] * 1e3:.3f} ms at work; over {r['pairs']} paired stretches the "
            f"overhead's median {r['overhead_pct_median']:+.2f}% [{mlo:+.2f}%, {mhi:+.2f}%], "
            f"mean {r['overhead_pct_mean']:+.2f}% [{lo:+.2f}%, {hi:+.2f}%]; "
            f"daemon CPU {r['daemon_cpu_s']:.2f} s, saw the job: {r['daemon_saw_job']}, "
            f"flight-recorder dumps: {r['flight_recorder_dumps']}",
            flush=True,
        )
        if r["gpu_view"]:
            print_gpu_view(r["gpu_view"])
    world = results[0]["world_size"]
    print(
        f"\n{world} ranks, {'CUDA' if results[0]['cuda'] else 'CPU'}, {steps} timed steps a run, "
        f"switching every {phase:g} s"
    )
    (workdir / "step_overhead.json").write_text(
        json.dumps({"mode": "alternate", "results": results}, indent=1)
    )
    print(f"written: {workdir / 'step_overhead.json'}")
    keep = (
        "pairs",
        "overhead_pct_mean",
        "overhead_pct_ci95",
        "overhead_pct_median",
        "overhead_pct_median_ci95",
        "median_step_on_s",
        "median_step_off_s",
        "daemon_cpu_s",
        "daemon_saw_job",
        "cuda",
        "world_size",
        "daemon_args",
        "flight_recorder",
        "flight_recorder_dumps",
    )
    rows = []
    for interval, r in zip((1.0, 0.1), results, strict=True):
        row = {k: r.get(k) for k in keep}
        row["interval_seconds"] = interval
        row["gpu_view"] = r.get("gpu_view")
        rows.append(row)
    device = None
    if results[0]["cuda"]:
        import torch

        device = torch.cuda.get_device_name(0)
    bench_results.write(
        "steps",
        {"mode": "alternate", "steps": steps, "phase_seconds": phase, "device": device, "rows": rows},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
