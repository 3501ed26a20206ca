"""trainwatch's overhead, measured on real processes in torchrun-shaped trees.

    python benchmarks/overhead.py [--quick] [--soak-seconds S] [--json OUT]

For 16 to 512 watched processes (agents x 8 ranks x (1 rank + 7 workers)):

* trainwatch's sampler, in this process: CPU time per watched process per sampling round
  (discovery of all of /proc included), and wall time per round;
* ``GET /metrics`` latency (p50/p99 over 200 requests) of a real daemon watching them;
* prometheus-process-exporter (Debian package), configured per process (a group per
  PID, its defaults otherwise) and scraped: its CPU time per process per scrape;
* the baselines: a naive psutil loop and reading statm+stat from Python (the floor).

Then a real daemon at 1 Hz watching 8 ranks x 8 workers: CPU share of one core over 60 s,
and its RSS after 3600 sampling rounds (an hour at 1 Hz, run at 10 Hz with the same ring
size: --interval 0.1 --history 60). Figures are printed as a table; nothing is asserted.
"""

from __future__ import annotations

import argparse
import http.client
import json
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

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

from sidecar.daemon import Sampler  # noqa: E402
from sidecar.probes.gpu import GpuProbe  # noqa: E402
from sidecar.settings import Settings  # noqa: E402
from tests.e2e import DaemonProc  # noqa: E402

MARK = "trainwatch-bench"
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
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
    def __init__(self, agents: int, ranks: int, workers: int) -> None:
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


def naive_psutil(pids: list[int], rounds: int) -> tuple[float, float]:
    import psutil

    def work() -> None:
        for _ in range(rounds):
            for pid in pids:
                try:
                    p = psutil.Process(pid)
                    p.memory_info()
                    p.cpu_times()
                    p.num_threads()
                    p.ppid()
                except psutil.Error:
                    pass

    return _per_process(work, rounds * len(pids))


def floor_statm_stat(pids: list[int], rounds: int) -> tuple[float, float]:
    def work() -> None:
        for _ in range(rounds):
            for pid in pids:
                try:
                    for name in ("statm", "stat"):
                        fd = os.open(f"/proc/{pid}/{name}", os.O_RDONLY)
                        os.read(fd, 4096)
                        os.close(fd)
                except OSError:
                    pass

    return _per_process(work, rounds * len(pids))


class Daemon(DaemonProc):
    """The real daemon (tests/e2e.py starts it) plus a kept-alive HTTP connection."""

    def __init__(self, interval: float, *args: str) -> None:
        self.tmp = tempfile.mkdtemp()
        super().__init__(Path(self.tmp), *args, interval=interval)
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


def metrics_latency(ranks: int, n: int = 200) -> tuple[float, float, int]:
    d = Daemon(1.0)
    try:
        d.wait_ranks(ranks)
        times = []
        size = 0
        for _ in range(n):
            t0 = time.perf_counter()
            size = len(d.scrape())
            times.append(time.perf_counter() - t0)
        times.sort()
        return statistics.median(times) * 1e3, times[int(0.99 * (n - 1))] * 1e3, size
    finally:
        d.close()


def process_exporter(watched: int, scrapes: int) -> float | None:
    binary = shutil.which("prometheus-process-exporter")
    if binary is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "config.yml"
        cfg.write_text(
            'process_names:\n  - name: "{{.Comm}}-{{.PID}}"\n    cmdline:\n    - \'' + MARK + "'\n"
        )
        port = 19256
        proc = subprocess.Popen(
            [binary, "-config.path", str(cfg), "-web.listen-address", f"127.0.0.1:{port}"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 20
            while True:
                try:
                    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
                    conn.request("GET", "/metrics")
                    conn.getresponse().read()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        return None
                    time.sleep(0.1)
            for _ in range(2):
                conn.request("GET", "/metrics")
                conn.getresponse().read()
            cpu0 = cpu_seconds(proc.pid)
            for _ in range(scrapes):
                conn.request("GET", "/metrics")
                conn.getresponse().read()
            cpu = cpu_seconds(proc.pid) - cpu0
            conn.close()
            return cpu / scrapes / watched * 1e6
        finally:
            proc.terminate()
            proc.wait(10)


def daemon_at_1hz(seconds: float) -> tuple[float, float]:
    tree = Tree(1, 8, 8)
    try:
        d = Daemon(1.0)
        try:
            d.wait_ranks(8)
            cpu0, t0 = cpu_seconds(d.proc.pid), time.monotonic()
            while time.monotonic() - t0 < seconds:
                d.scrape()
                time.sleep(15 if seconds >= 60 else seconds / 4)
            share = (cpu_seconds(d.proc.pid) - cpu0) / (time.monotonic() - t0)
            return share * 100, rss_bytes(d.proc.pid) / (1 << 20)
        finally:
            d.close()
    finally:
        tree.close()


def soak_rss(seconds: float) -> tuple[float, float, int]:
    tree = Tree(1, 8, 8)
    try:
        d = Daemon(0.1, "--history", "60")
        try:
            d.wait_ranks(8)
            start = rss_bytes(d.proc.pid)
            t0 = time.monotonic()
            while time.monotonic() - t0 < seconds:
                d.scrape()  # a scrape every 15 rounds, as Prometheus at 15 s against 1 Hz
                time.sleep(1.5)
            text = d.scrape()
            m = re.search(r"^trainwatch_samples_total (\S+)$", text, re.M)
            rounds = int(float(m.group(1))) if m else 0
            return start / (1 << 20), rss_bytes(d.proc.pid) / (1 << 20), rounds
        finally:
            d.close()
    finally:
        tree.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer rounds and shapes, a short soak")
    ap.add_argument("--soak-seconds", type=float, default=360.0, help="soak length (360 s = 3600 rounds)")
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument(
        "--only", choices=["table", "daemon"], help="run only the per-size table or only the daemon runs"
    )
    args = ap.parse_args()
    shapes = [(1, 2, 7), (1, 8, 7), (2, 8, 7), (4, 8, 7), (8, 8, 7)]
    if args.quick:
        shapes = [(1, 2, 7), (2, 8, 7)]
        args.soak_seconds = min(args.soak_seconds, 30)
    rounds = 20 if args.quick else 50
    rows = []
    print(
        f"machine: {os.cpu_count()} cores, {os.uname().release}; python {sys.version.split()[0]}", flush=True
    )
    for agents, ranks, workers in shapes:
        tree = Tree(agents, ranks, workers)
        try:
            watched = tree.expected
            pids = bench_pids()
            tw_us, tw_best, tw_ms, seen = sampler_cost(watched, rounds)
            p50, p99, size = metrics_latency(agents * ranks)
            pe_us = process_exporter(watched, 10 if args.quick else 20)
            ps_us, ps_best = naive_psutil(pids, rounds)
            fl_us, fl_best = floor_statm_stat(pids, rounds)
        finally:
            tree.close()
        row = {
            "processes": watched,
            "seen": seen,
            "trainwatch_us_per_process": tw_us,
            "trainwatch_us_per_process_min": tw_best,
            "round_ms": tw_ms,
            "metrics_p50_ms": p50,
            "metrics_p99_ms": p99,
            "metrics_bytes": size,
            "process_exporter_us_per_process": pe_us,
            "psutil_us_per_process": ps_us,
            "psutil_us_per_process_min": ps_best,
            "statm_stat_floor_us_per_process": fl_us,
            "statm_stat_floor_us_per_process_min": fl_best,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.only == "table":
        cpu_pct, rss_1h, soak_start, soak_end, soak_rounds = float("nan"), float("nan"), 0.0, 0.0, 0
    else:
        cpu_pct, rss_1h = daemon_at_1hz(10 if args.quick else 60)
        soak_start, soak_end, soak_rounds = soak_rss(args.soak_seconds)
    print()
    print(
        "| watched processes | trainwatch CPU/process/round, median (min) | round wall time | "
        "/metrics p50 / p99 | process-exporter CPU/process/scrape | naive psutil, median (min) | "
        "statm+stat floor, median (min) |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        pe = (
            "n/a"
            if r["process_exporter_us_per_process"] is None
            else f"{r['process_exporter_us_per_process']:.0f} µs"
        )
        print(
            f"| {r['processes']} | {r['trainwatch_us_per_process']:.1f} ({r['trainwatch_us_per_process_min']:.1f}) µs"
            f" | {r['round_ms']:.1f} ms | {r['metrics_p50_ms']:.2f} / {r['metrics_p99_ms']:.2f} ms | {pe} | "
            f"{r['psutil_us_per_process']:.1f} ({r['psutil_us_per_process_min']:.1f}) µs | "
            f"{r['statm_stat_floor_us_per_process']:.1f} ({r['statm_stat_floor_us_per_process_min']:.1f}) µs |"
        )
    print()
    print(
        f"daemon at 1 Hz, 8 ranks x 8 workers (72 processes): {cpu_pct:.2f}% of one core, RSS {rss_1h:.1f} MiB"
    )
    print(
        f"daemon RSS over {soak_rounds} rounds (10 Hz, ring of 600 as at 1 Hz/600 s): "
        f"{soak_start:.1f} MiB -> {soak_end:.1f} MiB"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "rows": rows,
                    "daemon_1hz_cpu_percent": cpu_pct,
                    "soak": [soak_start, soak_end, soak_rounds],
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
