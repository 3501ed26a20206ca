"""On the GPU machine: does the stall detector see a rank stuck in an NCCL collective while
its GPU is busy, and does it keep quiet while the job works?

    python benchmarks/gpu_stall.py OUT_DIR [missing|crossed]
    python benchmarks/gpu_stall.py --results OUT_DIR/gpu-stall.json   # into benchmarks/results/

Starts the real daemon (``--attach-torchrun --stall-after 10 --interval 0.5``) and a
2-rank NCCL job on GPU 0 (tests/workloads/gpu_hang.py: 30 s of large matmuls with a
64 MiB all_reduce a step, 30 s of a small MLP's steps, then the hang: ``missing``, an
all_reduce rank 1 never joins; ``crossed``, each rank in an all_reduce of another process
group, both GPUs spinning; flight recorder on, with its on-demand FIFO). Beside the daemon, this script reads
NVML's per-process utilisation itself every 0.5 s, and each rank's CPU time, so the
signal the detector judges is kept raw. When the daemon has flagged the stall and taken
its snapshot, rank 1 is SIGKILLed (the user's kill) and the postmortem is kept.

Writes to OUT_DIR (names with ``-crossed`` for that mode): ``gpu-stall.json`` (machine,
per-phase activity of each rank, the daemon's judgement over time, the snapshot, the
postmortem), ``daemon.log``, ``torchrun.log``. The JSON is kept under
tests/fixtures/device-h200/ and benchmarks/results/.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.gpu_common import phases as _phases  # noqa: E402
from benchmarks.gpu_common import start_nvml_sampler  # noqa: E402
from benchmarks.results import machine, write  # noqa: E402

BIG_S, SMALL_S, STALL_AFTER = 30.0, 30.0, 10.0


def _get(base: str, path: str) -> Any:
    with urllib.request.urlopen(base + path, timeout=5) as r:
        body = r.read().decode()
    return json.loads(body) if path != "/metrics" else body


def _cpu(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    if sys.argv[1:2] == ["--results"]:  # a kept run (its gpu-stall.json) into benchmarks/results/
        kept = json.loads(Path(sys.argv[2]).read_text())
        mode = kept["settings"].get("mode", "missing")
        name = "gpu-stall-h200" if mode == "missing" else f"gpu-stall-{mode}-h200"
        write(name, {"settings": kept["settings"], **summarise(kept)}, machine_info=kept["machine"])
        return 0
    out = Path(sys.argv[1])
    mode = sys.argv[2] if len(sys.argv) > 2 else "missing"
    suffix = "" if mode == "missing" else f"-{mode}"
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="tw-gpu-stall-"))
    (work / "fr").mkdir()
    import pynvml

    pynvml.nvmlInit()
    dev = pynvml.nvmlDeviceGetHandleByIndex(0)
    py = sys.executable
    daemon_log = open(out / f"daemon{suffix}.log", "w")  # noqa: SIM115
    daemon = subprocess.Popen(
        [py, "-m", "sidecar", "--attach-torchrun", "--port", "0", "--interval", "0.5",
         "--stall-after", str(STALL_AFTER), "--postmortem-dir", str(work / "pm")],
        stdout=daemon_log, stderr=subprocess.STDOUT, cwd=REPO,
    )  # fmt: skip
    base = None
    for _ in range(200):
        m = re.search(r"serving (https?)://([0-9.]+):(\d+)", (out / f"daemon{suffix}.log").read_text())
        if m:
            base = f"http://{m.group(2)}:{m.group(3)}"
            break
        time.sleep(0.1)
    assert base, (out / f"daemon{suffix}.log").read_text()
    env = dict(
        os.environ,
        NCCL_SOCKET_IFNAME="lo",
        NCCL_IB_DISABLE="1",
        NCCL_NVLS_ENABLE="0",
        TORCH_FR_BUFFER_SIZE="2000",
        TORCH_NCCL_DUMP_ON_TIMEOUT="1",
        TORCH_FR_DUMP_TEMP_FILE=str(work / "fr" / "nccl_trace_rank_"),
        TORCH_NCCL_DEBUG_INFO_TEMP_FILE=str(work / "fr" / "nccl_trace_rank_"),
        TORCH_NCCL_DEBUG_INFO_PIPE_FILE=str(work / "fr" / "pipe_rank_"),
    )
    torchrun = str(Path(py).parent / "torchrun")
    job_log = open(out / f"torchrun{suffix}.log", "w")  # noqa: SIM115
    job = subprocess.Popen(
        [torchrun, "--standalone", "--nproc-per-node=2", "--monitor-interval=0.1",
         "tests/workloads/gpu_hang.py", str(work), str(BIG_S), str(SMALL_S), mode],
        stdout=job_log, stderr=subprocess.STDOUT, cwd=REPO, env=env,
    )  # fmt: skip
    samples: list[dict[str, Any]] = []
    judged: list[dict[str, Any]] = []
    stop = threading.Event()

    sampler = start_nvml_sampler(
        dev,
        samples,
        stop,
        lambda: {"cpu": {str(p): _cpu(p) for r in _phases(work).values() for _, _, p in r[:1]}},
    )
    result: dict[str, Any] = {"machine": machine(), "settings": {"big_s": BIG_S, "small_s": SMALL_S,
                              "stall_after": STALL_AFTER, "interval": 0.5, "mode": mode}}  # fmt: skip
    snapshot_job = None
    deadline = time.time() + BIG_S + SMALL_S + 150
    while time.time() < deadline and job.poll() is None:
        try:
            doc = _get(base, "/ranks")
        except OSError:
            time.sleep(0.5)
            continue
        for j in doc["jobs"]:
            judged.append(
                {
                    "at": time.time(),
                    "stalled": j["stalled"],
                    "stalled_seconds": j["stalled_seconds"],
                    "suspected_missing": j["suspected_missing"],
                    "ranks": {
                        r["label"]: [r["stall_reason"], r["cpu_busy"], r["gpu_busy"], r["gpu_sm_percent"],
                                     r["gpu_memory_percent"]]
                        for r in j["ranks"]
                    },
                }
            )  # fmt: skip
            if j["stalled"] and j.get("stall"):
                snapshot_job = j
        if snapshot_job is not None:
            break
        time.sleep(0.5)
    result["stall_seen"] = snapshot_job is not None
    if snapshot_job is not None:
        time.sleep(10)  # ten seconds more of the hang, for the raw signal
        result["ranks_at_stall"] = _get(base, "/ranks")
        result["metrics_at_stall"] = [
            ln for ln in _get(base, "/metrics").splitlines() if "stall" in ln or "gpu" in ln
        ]
        phases = _phases(work)
        victim = phases[1][0][2]
        result["killed"] = {"rank": 1, "pid": victim, "at": time.time()}
        os.kill(victim, signal.SIGKILL)
        for _ in range(240):
            try:
                pm = _get(base, "/postmortem")
            except OSError:
                pm = None
            if (
                pm
                and pm.get("victim", {}).get("rank") == 1
                and all(r["fate"] not in ("running", "unknown") for r in pm["ranks"])
            ):
                result["postmortem"] = pm
                break
            time.sleep(0.5)
    try:
        job.wait(timeout=120)
    except subprocess.TimeoutExpired:
        job.kill()
    stop.set()
    sampler.join()
    result["phases"] = {str(k): v for k, v in _phases(work).items()}
    result["nvml_samples"] = samples
    result["judged"] = judged
    result["flight_dumps"] = sorted(p.name for p in (work / "fr").iterdir())
    daemon.send_signal(signal.SIGTERM)
    daemon.wait(timeout=30)
    (out / f"gpu-stall{suffix}.json").write_text(json.dumps(result, indent=1))
    shutil.rmtree(work, ignore_errors=True)
    print(summary(result))
    return 0


def summarise(result: dict[str, Any]) -> dict[str, Any]:
    """Per phase and rank: NVML SM/memory percent (mean, min/max) and CPU cores; the
    daemon's stalled polls per phase; how long after the hang began it was flagged."""
    phases = result["phases"]
    start = {name: at for name, at, _ in phases.get("0", [])}
    pids = {rank: entries[0][2] for rank, entries in phases.items()}
    bounds = [("big", start.get("big"), start.get("small")), ("small", start.get("small"), start.get("hang")),
              ("hang", start.get("hang"), result.get("killed", {}).get("at"))]  # fmt: skip
    out: dict[str, Any] = {"phases": {}}
    for name, t0, t1 in bounds:
        if t0 is None or t1 is None:
            continue
        ranks: dict[str, Any] = {}
        for rank, pid in sorted(pids.items()):
            rows = [s for s in result["nvml_samples"] if t0 + 2 <= s["at"] <= t1 and "util" in s]
            mine = [s["util"].get(str(pid), [(0, 0)]) for s in rows]
            sm = [sum(v[0] for v in m) / len(m) for m in mine]
            mem = [sum(v[1] for v in m) / len(m) for m in mine]
            cpus = [(s["at"], s["cpu"].get(str(pid))) for s in rows if s["cpu"].get(str(pid)) is not None]
            cores = (cpus[-1][1] - cpus[0][1]) / (cpus[-1][0] - cpus[0][0]) if len(cpus) > 1 else None
            if sm:
                ranks[rank] = {
                    "sm_mean": round(sum(sm) / len(sm), 1),
                    "sm_min": round(min(sm), 1),
                    "memory_mean": round(sum(mem) / len(mem), 1),
                    "memory_max": round(max(mem), 1),
                    "cpu_cores": None if cores is None else round(cores, 2),
                }
        rounds = [j for j in result["judged"] if t0 <= j["at"] <= t1]
        out["phases"][name] = {
            "seconds": round(t1 - t0, 1),
            "ranks": ranks,
            "polls": len(rounds),
            "stalled_polls": sum(bool(j["stalled"]) for j in rounds),
        }
    hang = start.get("hang")
    flagged = next((j for j in result["judged"] if hang and j["at"] >= hang and j["stalled"]), None)
    if hang and flagged:
        out["flagged_after_seconds"] = round(flagged["at"] - hang, 1)
        out["flagged"] = {"ranks": flagged["ranks"], "suspected_missing": flagged["suspected_missing"]}
    return out


def summary(result: dict[str, Any]) -> str:
    s = summarise(result)
    lines = []
    for name, ph in s["phases"].items():
        for rank, r in ph["ranks"].items():
            lines.append(
                f"{name:5} rank {rank}: SM mean {r['sm_mean']:5.1f} min {r['sm_min']:5.1f} | memory mean "
                f"{r['memory_mean']:5.1f} max {r['memory_max']:5.1f} | CPU {r['cpu_cores']} cores"
            )
        lines.append(f"{name:5} daemon: {ph['stalled_polls']} of {ph['polls']} polls stalled")
    if "flagged_after_seconds" in s:
        lines.append(f"stall flagged {s['flagged_after_seconds']} s after the hang began")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
