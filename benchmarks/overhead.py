"""What the whole trainwatch daemon costs, beside prometheus-process-exporter on the same processes.

    python benchmarks/overhead.py [--quick] [--window-1hz S] [--window-10hz S] [--soak-seconds S]
    python benchmarks/overhead.py --baseline REV [--shapes 1x4x4,1x8x8] --name overhead-ab

For torchrun-shaped trees of real processes (``benchmarks/fake_job.py``: agents x ranks x
(1 rank + workers), from 3 to 520 processes) it starts, side by side in the same run:

* the real daemon (``python -m sidecar --attach-torchrun``) at 1 Hz and then at 10 Hz,
  scraped over HTTP once every 15 s as Prometheus would;
* Debian's ``prometheus-process-exporter`` (its defaults, one group per process of the
  tree) scraped at the same rate, 1 Hz and 10 Hz, so that one of its scrapes is one
  sampling round;

* the floor under the daemon (``benchmarks/floor.py``, not in an A/B run): a Python thread
  that only wakes at the interval, and one that also reads every file a detailed round
  reads, without parsing;

and reads both processes' utime+stime (all threads, ``/proc/PID/stat``) over the window:
CPU per watched process per round, and share of one core. Also per tree: ``GET /metrics``
latency (p50/p99 of 200 requests) and, labelled as such, the sampler alone in this
process (``Sampler.sample()``: what the daemon's rounds cost without HTTP, threads, or the
death watchers). Then the idle daemon (no job) and its RSS over a soak at 10 Hz.

With ``--baseline REV`` a second daemon, the one of commit REV (a git worktree of it), runs
beside this tree's over the same windows on the same processes, and the idle daemons side by
side too: a change's before and after in one run (these machines are too noisy to compare
separate runs). The sampler-only figures and the soak are left out then.

Results: ``benchmarks/results/overhead.json`` (machine, kernel, commit); the tables of
docs/performance.md are rendered from it (``python benchmarks/render.py``). Nothing is asserted.
"""

from __future__ import annotations

import argparse
import http.client
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

from benchmarks import results  # noqa: E402
from sidecar.daemon import Sampler  # noqa: E402
from sidecar.probes.gpu import GpuProbe  # noqa: E402
from sidecar.settings import Settings  # noqa: E402
from tests.support.e2e import DaemonProc, free_port  # noqa: E402

MARK = "trainwatch-bench"
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """CPU time of every thread of ``pid`` so far, in ns from each task's schedstat: stat's
    utime+stime count 10 ms ticks, which at 1 Hz over a minute is 8 us per process-round
    and for an idle daemon 0.017 % of a core, the size of what is measured. A thread that
    ended is missing from the sum (the daemon's threads live as long as it does; a
    flight-recorder probe's do not, and none runs here); ``cpu_ticks_seconds`` is the
    coarse whole-process figure to check it against."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            total += int(Path(f"/proc/{pid}/task/{task}/schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
    return total / 1e9


def cpu_ticks_seconds(pid: int) -> float:
    data = Path(f"/proc/{pid}/stat").read_text()
    fields = data[data.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def bench_pids() -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if MARK.encode() in cmd and b"--role\0rank" in cmd:
            out.append(int(entry))
    return out


class Tree:
    def __init__(self, agents: int, ranks: int, workers: int, hold_mb: int = 4) -> None:
        self.expected = agents * ranks * (1 + workers)
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(HERE / "fake_job.py"),
                "--agents",
                str(agents),
                "--ranks",
                str(ranks),
                "--workers",
                str(workers),
                "--hold-mb",
                str(hold_mb),
            ],
            stdin=subprocess.PIPE,
        )
        deadline = time.monotonic() + 120
        while len(bench_pids()) < self.expected:
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {len(bench_pids())} of {self.expected} processes started")
            time.sleep(0.2)

    def close(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)
        deadline = time.monotonic() + 30
        while bench_pids() and time.monotonic() < deadline:
            time.sleep(0.2)


def no_nvml() -> GpuProbe:
    def loader() -> object:
        raise ImportError("benchmark: NVML left out")

    return GpuProbe(loader=loader)


def _per_process(work, count: int, reps: int = 7) -> tuple[float, float]:
    """(median, min) CPU µs per unit over ``reps`` repetitions. This machine is shared and
    noisy: the minimum is the best estimate of the code's own cost, the median what a
    typical round costs here."""
    results = []
    for _ in range(reps):
        cpu0 = time.process_time()
        work()
        results.append((time.process_time() - cpu0) / count * 1e6)
    return statistics.median(results), min(results)


def sampler_cost(watched: int, rounds: int) -> tuple[float, float, float, int]:
    sampler = Sampler(Settings(), gpu=no_nvml())
    for _ in range(3):
        snap = sampler.sample()
    seen = sum(r.tree_processes for j in snap.jobs for r in j.ranks)

    def work() -> None:
        for _ in range(rounds):
            sampler.sample()

    wall0 = time.perf_counter()
    median, best = _per_process(work, rounds * watched)
    wall = (time.perf_counter() - wall0) / (7 * rounds)
    return median, best, wall * 1e3, seen


class Daemon(DaemonProc):
    """The real daemon (tests/support/e2e.py starts it) plus a kept-alive HTTP connection."""

    def __init__(self, interval: float, *args: str, cwd: Path | None = None) -> None:
        self.tmp = tempfile.mkdtemp()
        super().__init__(Path(self.tmp), *args, interval=interval, cwd=cwd)
        self.host, port = self.base.removeprefix("http://").split(":")
        self.port = int(port)
        self.conn = http.client.HTTPConnection(self.host, self.port, timeout=10)

    def scrape(self) -> str:
        """One GET /metrics on a kept-alive connection, reconnecting when the server closed
        it while idle (uvicorn does after 5 s, as a 15 s Prometheus scraper sees too)."""
        for attempt in (1, 2):
            try:
                self.conn.request("GET", "/metrics")
                return self.conn.getresponse().read().decode()
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                self.conn.close()
                self.conn = http.client.HTTPConnection(self.host, self.port, timeout=10)
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def wait_ranks(self, count: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while self.scrape().count("trainwatch_rank_info{") < count:
            if time.monotonic() > deadline:
                raise RuntimeError("daemon did not attach to every rank")
            time.sleep(0.2)

    def close(self) -> None:
        self.conn.close()
        self.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def samples_total(self) -> float:
        m = re.search(r"^trainwatch_samples_total (\S+)$", self.scrape(), re.M)
        return float(m.group(1)) if m else 0.0


class ProcessExporter:
    """Debian's prometheus-process-exporter, one group per process of the benchmark's
    trees (matched by the mark in their command lines), its other options at their defaults."""

    def __init__(self, binary: str) -> None:
        self.tmp = tempfile.mkdtemp()
        cfg = Path(self.tmp) / "config.yml"
        cfg.write_text(
            'process_names:\n  - name: "{{.Comm}}-{{.PID}}"\n    cmdline:\n    - \'' + MARK + "'\n"
        )
        self.port = free_port()
        self.proc = subprocess.Popen(
            [binary, "-config.path", str(cfg), "-web.listen-address", f"127.0.0.1:{self.port}"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 20
        while True:
            try:
                self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
                self.scrape()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def scrape(self) -> str:
        self.conn.request("GET", "/metrics")
        return self.conn.getresponse().read().decode()

    def close(self) -> None:
        self.conn.close()
        self.proc.terminate()
        self.proc.wait(10)
        shutil.rmtree(self.tmp, ignore_errors=True)


class Floor:
    """``benchmarks/floor.py``: a Python thread that only wakes at the interval (``wake``),
    or that also reads every file a detailed round reads (``reads``)."""

    def __init__(self, interval: float, mode: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "floor.py"), "--interval", str(interval), "--mode", mode],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != b"ready":
            raise RuntimeError(f"floor.py --mode {mode} did not start")

    def close(self) -> None:
        self.proc.communicate(timeout=30)


def side_by_side(
    watched: int,
    ranks: int,
    interval: float,
    window: float,
    exporter: str | None,
    baseline: Path | None = None,
) -> dict[str, Any]:
    """The daemon at ``interval`` (scraped every 15 s) and process-exporter scraped every
    ``interval``, both over the same ``window`` on the same processes; with ``baseline``
    (another commit's checkout) its daemon too, scraped alike."""
    d = Daemon(interval)
    b = Daemon(interval, cwd=baseline) if baseline is not None else None
    pe = ProcessExporter(exporter) if exporter else None
    floors: dict[str, Floor] = {}
    try:
        for daemon in (d, b):
            if daemon is not None:
                daemon.wait_ranks(ranks)
                daemon.wait_rounds(3)  # every worker found and settled
        if pe:
            pe.scrape()
        if b is None:  # the floor under the daemon's cost, beside it (not in an A/B run)
            floors = {mode: Floor(interval, mode) for mode in ("wake", "reads")}
        floor0 = {mode: cpu_seconds(f.proc.pid) for mode, f in floors.items()}
        rounds_b0 = b.samples_total() if b else 0.0
        cpu_b0 = cpu_seconds(b.proc.pid) if b else 0.0
        rounds0, cpu_d0 = d.samples_total(), cpu_seconds(d.proc.pid)
        ticks_d0 = cpu_ticks_seconds(d.proc.pid)
        cpu_p0 = cpu_seconds(pe.proc.pid) if pe else 0.0
        t0 = time.monotonic()
        next_scrape, next_pe, pe_scrapes = t0 + 15, t0 + interval, 0
        while True:
            now = time.monotonic()
            if now >= t0 + window:
                break
            if pe and now >= next_pe:
                pe.scrape()
                pe_scrapes += 1
                next_pe = max(next_pe + interval, time.monotonic())  # late scrapes are not made up
            if now >= next_scrape:
                d.scrape()
                if b:
                    b.scrape()
                next_scrape += 15
            time.sleep(
                max(0.0, min(next_pe if pe else t0 + window, next_scrape, t0 + window) - time.monotonic())
            )
        elapsed = time.monotonic() - t0
        cpu_d = cpu_seconds(d.proc.pid) - cpu_d0
        ticks_d = cpu_ticks_seconds(d.proc.pid) - ticks_d0
        cpu_p = (cpu_seconds(pe.proc.pid) - cpu_p0) if pe else None
        rounds = d.samples_total() - rounds0
        floor = {
            f"floor_{mode}_core_percent": (cpu_seconds(f.proc.pid) - floor0[mode]) / elapsed * 100
            for mode, f in floors.items()
        }
        base: dict[str, Any] = {}
        if b:
            cpu_b = cpu_seconds(b.proc.pid) - cpu_b0
            rounds_b = b.samples_total() - rounds_b0
            base = {
                "baseline_rounds": int(rounds_b),
                "baseline_cpu_seconds": round(cpu_b, 3),
                "baseline_us_per_process_round": cpu_b / rounds_b / watched * 1e6 if rounds_b else None,
                "baseline_core_percent": cpu_b / elapsed * 100,
            }
        return {
            **base,
            **floor,
            "interval_seconds": interval,
            "window_seconds": round(elapsed, 1),
            "trainwatch_rounds": int(rounds),
            "trainwatch_cpu_seconds": round(cpu_d, 4),
            "trainwatch_cpu_ticks_seconds": round(ticks_d, 2),
            "trainwatch_us_per_process_round": cpu_d / rounds / watched * 1e6 if rounds else None,
            "trainwatch_core_percent": cpu_d / elapsed * 100,
            "trainwatch_rss_bytes": rss_bytes(d.proc.pid),
            "exporter_scrapes": pe_scrapes if pe else None,
            "exporter_cpu_seconds": None if cpu_p is None else round(cpu_p, 3),
            "exporter_us_per_process_scrape": cpu_p / pe_scrapes / watched * 1e6
            if pe and pe_scrapes
            else None,
            "exporter_core_percent": None if cpu_p is None else cpu_p / elapsed * 100,
        }
    finally:
        for f in floors.values():
            f.close()
        if pe:
            pe.close()
        if b:
            b.close()
        d.close()


def metrics_latency(ranks: int, n: int = 200, fresh: int = 20) -> dict[str, float]:
    """``GET /metrics`` latency: ``n`` scrapes back to back (most find the body of their
    round already rendered), then ``fresh`` scrapes 1.05 s apart, each the first of its
    round (what a Prometheus scraping every 15 s sees: a rendering every time)."""
    d = Daemon(1.0)
    try:
        d.wait_ranks(ranks)
        d.wait_rounds(2)
        times = []
        size = 0
        for _ in range(n):
            t0 = time.perf_counter()
            size = len(d.scrape())
            times.append(time.perf_counter() - t0)
        times.sort()
        first = []
        for _ in range(fresh):
            time.sleep(1.05)
            t0 = time.perf_counter()
            d.scrape()
            first.append(time.perf_counter() - t0)
        first.sort()
        return {
            "metrics_p50_ms": statistics.median(times) * 1e3,
            "metrics_p99_ms": times[int(0.99 * (n - 1))] * 1e3,
            "metrics_fresh_p50_ms": statistics.median(first) * 1e3 if first else None,
            "metrics_fresh_max_ms": first[-1] * 1e3 if first else None,
            "metrics_bytes": size,
        }
    finally:
        d.close()


def idle(seconds: float, baseline: Path | None = None) -> dict[str, float]:
    """The daemon at 1 Hz with no job on the machine, scraped every 15 s (and the baseline's
    beside it)."""
    d = Daemon(1.0)
    b = Daemon(1.0, cwd=baseline) if baseline is not None else None
    try:
        d.wait_rounds(2)
        if b:
            b.wait_rounds(2)
        ticks0 = cpu_ticks_seconds(d.proc.pid)
        out, elapsed = scraped_window(seconds, d, b)
        out["ticks_core_percent"] = (cpu_ticks_seconds(d.proc.pid) - ticks0) / elapsed * 100
        return out
    finally:
        if b:
            b.close()
        d.close()


def scraped_window(seconds: float, d: Daemon, b: Daemon | None) -> tuple[dict[str, float], float]:
    """Both daemons' share of a core over ``seconds``, each scraped every 15 s; and the
    window's exact length."""
    cpu0, t0 = cpu_seconds(d.proc.pid), time.monotonic()
    cpu_b0 = cpu_seconds(b.proc.pid) if b else 0.0
    while time.monotonic() - t0 < seconds:
        time.sleep(min(15.0, seconds - (time.monotonic() - t0)))
        d.scrape()
        if b:
            b.scrape()
    elapsed = time.monotonic() - t0
    out = {"seconds": round(elapsed, 1), "core_percent": (cpu_seconds(d.proc.pid) - cpu0) / elapsed * 100}
    if b:
        out["baseline_core_percent"] = (cpu_seconds(b.proc.pid) - cpu_b0) / elapsed * 100
    return out, elapsed


def forks_total() -> int:
    """Processes created on the machine since boot (/proc/stat ``processes``)."""
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("processes "):
            return int(line.split()[1])
    return 0


def churn(seconds: float, baseline: Path | None = None, shells: int = 1) -> dict[str, float]:
    """The daemon at 1 Hz watching a small job (1 agent x 2 ranks) while ``shells`` loops
    on the node run ``/bin/false`` as fast as they can: a stream of short-lived failing
    processes, every one a fork, an exec and a non-zero exit (the baseline's beside it)."""
    tree = Tree(1, 2, 0)
    d = Daemon(1.0)
    b = Daemon(1.0, cwd=baseline) if baseline is not None else None
    loops: list[subprocess.Popen] = []
    try:
        for daemon in (d, b):
            if daemon is not None:
                daemon.wait_ranks(2)
                daemon.wait_rounds(3)
        loops = [subprocess.Popen(["sh", "-c", "while :; do /bin/false; done"]) for _ in range(shells)]
        time.sleep(1.0)  # the loops at full speed before the window opens
        forks0 = forks_total()
        out, elapsed = scraped_window(seconds, d, b)
        out["processes_per_second"] = round((forks_total() - forks0) / elapsed)
        return out
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()
        if b:
            b.close()
        d.close()
        tree.close()


def baseline_tree(rev: str, where: Path) -> Path:
    """A detached git worktree of ``rev`` at ``where`` (removed by the caller)."""
    subprocess.run(
        ["git", "-C", str(REPO), "worktree", "add", "--force", "--detach", str(where), rev], check=True
    )
    return where


def soak_rss(seconds: float) -> dict[str, float]:
    """RSS of a daemon at 10 Hz with ``--history 60`` (the same 600-entry ring as an hour at
    1 Hz with the default history) watching 8 ranks x 8 workers."""
    tree = Tree(1, 8, 8)
    try:
        d = Daemon(0.1, "--history", "60")
        try:
            d.wait_ranks(8)
            start = rss_bytes(d.proc.pid)
            rounds0 = d.samples_total()
            t0 = time.monotonic()
            while time.monotonic() - t0 < seconds:
                time.sleep(1.5)
                d.scrape()  # a scrape every 15 rounds, as Prometheus at 15 s against 1 Hz
            return {
                "rounds": int(d.samples_total() - rounds0),
                "rss_start_bytes": start,
                "rss_end_bytes": rss_bytes(d.proc.pid),
            }
        finally:
            d.close()
    finally:
        tree.close()


SHAPES = [(1, 2, 0), (1, 4, 4), (1, 8, 8), (2, 8, 7), (4, 8, 7), (8, 8, 7)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="two shapes, short windows (a smoke run)")
    ap.add_argument("--window-1hz", type=float, default=60.0, help="seconds measured at 1 Hz")
    ap.add_argument("--window-10hz", type=float, default=30.0, help="seconds measured at 10 Hz")
    ap.add_argument("--idle-seconds", type=float, default=300.0)
    ap.add_argument(
        "--churn-seconds", type=float, default=60.0, help="seconds measured with failing processes churning"
    )
    ap.add_argument("--churn-shells", type=int, default=1, help="shell loops running /bin/false at once")
    ap.add_argument("--soak-seconds", type=float, default=360.0, help="soak length (360 s = 3600 rounds)")
    ap.add_argument("--name", default="overhead", help="results file name (benchmarks/results/NAME.json)")
    ap.add_argument("--baseline", metavar="REV", help="a commit whose daemon runs beside this tree's")
    ap.add_argument("--shapes", help="agents x ranks x workers, comma-separated (e.g. 1x4x4,1x8x8)")
    args = ap.parse_args()
    shapes = SHAPES
    if args.shapes:
        shapes = [tuple(int(n) for n in s.split("x")) for s in args.shapes.split(",")]  # type: ignore[misc]
    base_dir = Path(tempfile.mkdtemp(prefix="trainwatch-baseline-")) / "tree" if args.baseline else None
    baseline = baseline_tree(args.baseline, base_dir) if base_dir is not None else None
    try:
        return run(args, shapes, baseline)
    finally:
        if base_dir is not None:
            subprocess.run(
                ["git", "-C", str(REPO), "worktree", "remove", "--force", str(base_dir)], check=False
            )


def run(args: argparse.Namespace, shapes: list[tuple[int, int, int]], baseline: Path | None) -> int:
    if args.quick:
        shapes = [(1, 2, 0), (1, 4, 4)]
        args.window_1hz, args.window_10hz, args.idle_seconds, args.churn_seconds = 15.0, 8.0, 10.0, 10.0
        args.soak_seconds = min(args.soak_seconds, 20)
    exporter = shutil.which("prometheus-process-exporter")
    if exporter is None:
        print("prometheus-process-exporter not found: its columns stay empty (scripts/dev-setup installs it)")
    rows = []
    for agents, ranks, workers in shapes:
        tree = Tree(agents, ranks, workers)
        try:
            watched = tree.expected + agents
            row: dict[str, Any] = {"agents": agents, "ranks": agents * ranks, "workers_per_rank": workers}
            row["processes"] = watched
            for interval, window in ((1.0, args.window_1hz), (0.1, args.window_10hz)):
                row[f"{1 / interval:g}hz"] = side_by_side(
                    watched, agents * ranks, interval, window, exporter, baseline
                )
            row.update(metrics_latency(agents * ranks))
            if baseline is None:
                median, best, wall_ms, _seen = sampler_cost(watched, 20 if args.quick else 50)
                row["sampler_only_us_per_process_round"] = median
                row["sampler_only_us_per_process_round_min"] = best
                row["sampler_only_round_ms"] = wall_ms
        finally:
            tree.close()
        rows.append(row)
        print(
            f"{watched:4d} processes: "
            + "; ".join(
                f"{k}: trainwatch {row[k]['trainwatch_us_per_process_round']:.1f} µs "
                f"({row[k]['trainwatch_core_percent']:.2f}% core), exporter "
                + (
                    "n/a"
                    if row[k]["exporter_us_per_process_scrape"] is None
                    else f"{row[k]['exporter_us_per_process_scrape']:.1f} µs "
                    f"({row[k]['exporter_core_percent']:.2f}% core)"
                )
                + (
                    f", baseline {row[k]['baseline_us_per_process_round']:.1f} µs "
                    f"({row[k]['baseline_core_percent']:.2f}% core)"
                    if baseline is not None
                    else ""
                )
                for k in ("1hz", "10hz")
            )
            + f"; /metrics p99 {row['metrics_p99_ms']:.2f} ms",
            flush=True,
        )
    idle_row = idle(args.idle_seconds, baseline)
    print(f"idle daemon: {idle_row['core_percent']:.3f}% of one core; {idle_row}", flush=True)
    churn_row = churn(args.churn_seconds, baseline, args.churn_shells)
    print(f"churn: {churn_row}", flush=True)
    soak = soak_rss(args.soak_seconds) if baseline is None else None
    print(f"soak: {soak}", flush=True)
    exporter_version = None
    if exporter:
        out = subprocess.run([exporter, "-version"], capture_output=True, text=True)
        exporter_version = (
            (out.stdout + out.stderr).strip().splitlines()[0] if (out.stdout + out.stderr) else None
        )
    results.write(
        args.name,
        {
            "quick": args.quick,
            "baseline": None
            if baseline is None
            else subprocess.run(
                ["git", "-C", str(baseline), "rev-parse", "--short=12", "HEAD"],
                capture_output=True,
                text=True,
            ).stdout.strip(),
            "exporter": exporter_version,
            "rows": rows,
            "idle": idle_row,
            "churn": churn_row,
            "soak": soak,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
