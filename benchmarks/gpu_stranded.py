"""On the GPU machine: is a survivor left spinning in an NCCL collective by a rank's death
reported stranded, and is a survivor that works on left alone?

    python benchmarks/gpu_stranded.py OUT_DIR [killed|killed-other ...]
    python benchmarks/gpu_stranded.py --results OUT_DIR/gpu-stranded.json   # into benchmarks/results/

Starts the real daemon (``--attach-torchrun --interval 0.5``) and, per scenario, a job of
tests/workloads/gpu_hang.py on GPU 0 whose every rank runs under its own torchrun agent
(``--nnodes=N``, one c10d rendezvous on loopback): no agent ends another's rank, as on N
nodes. 10 s of large matmuls with an all_reduce a step, 10 s of a small MLP's steps, then
the death: ``killed``, rank 1 SIGKILLs itself while rank 0 enters an all_reduce with it;
``killed-other`` (3 ranks), rank 1 SIGKILLs itself, rank 0 enters an all_reduce of [0, 2]
that rank 2 never joins (it runs matmuls of its own). No flight-recorder FIFO is set: the
GPU's activity alone must tell. Beside the daemon, NVML's per-process utilisation is read
every 0.5 s, raw. Each scenario ends 45 s after the death, or when every rank is gone.

Writes OUT_DIR/gpu-stranded.json (machine, per scenario: the phases, the daemon's
judgement of every rank over time, when the stranding was reported, the raw samples) and
the logs.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.gpu_common import phases as _phases  # noqa: E402
from benchmarks.gpu_common import start_nvml_sampler  # noqa: E402
from benchmarks.results import machine, write  # noqa: E402

BIG_S, SMALL_S, AFTER_S = 10.0, 10.0, 45.0
WORLD = {"killed": 2, "killed-other": 3}


def _get(base: str, path: str) -> Any:
    with urllib.request.urlopen(base + path, timeout=5) as r:
        return json.loads(r.read().decode())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"


def scenario(mode: str, base: str, out: Path, dev: Any) -> dict[str, Any]:
    world = WORLD[mode]
    work = Path(tempfile.mkdtemp(prefix=f"tw-gpu-stranded-{mode}-"))
    env = dict(os.environ, NCCL_SOCKET_IFNAME="lo", NCCL_IB_DISABLE="1", NCCL_NVLS_ENABLE="0")
    for var in ("TORCH_NCCL_DEBUG_INFO_PIPE_FILE", "TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        env.pop(var, None)
    torchrun = str(Path(sys.executable).parent / "torchrun")
    with socket.socket() as sock:  # a free port for the rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    run_id = uuid.uuid4().hex[:12]
    agents = []
    for node in range(world):
        log = open(out / f"agent-{mode}-{node}.log", "w")  # noqa: SIM115
        agents.append(
            subprocess.Popen(
                [
                    torchrun,
                    f"--nnodes={world}",
                    "--nproc-per-node=1",
                    "--rdzv-backend=c10d",
                    f"--rdzv-endpoint=127.0.0.1:{port}",
                    f"--rdzv-id={run_id}",
                    f"--rdzv-conf=is_host={int(node == 0)}",
                    "--local-addr=127.0.0.1",
                    "--max-restarts=0",
                    "--monitor-interval=0.1",
                    "tests/workloads/gpu_hang.py",
                    str(work),
                    str(BIG_S),
                    str(SMALL_S),
                    mode,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO,
                env=env,
                start_new_session=True,
            )
        )
    samples: list[dict[str, Any]] = []
    judged: list[dict[str, Any]] = []
    stop = threading.Event()

    sampler = start_nvml_sampler(dev, samples, stop)
    died_at = stranded_at = None
    victim = None
    deadline = time.time() + BIG_S + SMALL_S + 240
    while time.time() < deadline:
        phases = _phases(work)
        if victim is None and 1 in phases and any(n == "hang" for n, _, _ in phases[1]):
            victim = phases[1][0][2]
        if victim is not None and died_at is None and not _alive(victim):
            died_at = time.time()
        try:
            doc = _get(base, "/ranks")
        except OSError:
            doc = {"jobs": []}
        ours = [j for j in doc["jobs"] if j.get("run_id") == run_id]
        row: dict[str, Any] = {"at": time.time(), "jobs": []}
        for j in ours:
            row["jobs"].append(
                {
                    "job": j["job"],
                    "stranded": j["stranded"],
                    "stalled": j["stalled"],
                    "ranks": {
                        r["label"]: {k: r[k] for k in ("pid", "stall_reason", "cpu_busy", "gpu_busy",
                                                       "gpu_sm_percent", "gpu_memory_percent")}
                        for r in j["ranks"]
                    },
                }
            )  # fmt: skip
            if j["stranded"] and stranded_at is None:
                stranded_at = time.time()
        judged.append(row)
        if died_at is not None and time.time() - died_at > AFTER_S:
            break
        if all(a.poll() is not None for a in agents):
            break
        time.sleep(0.5)
    survivors = {
        str(rank): {"pid": rows[0][2], "alive_at_end": _alive(rows[0][2])}
        for rank, rows in _phases(work).items()
        if rank != 1
    }
    for a in agents:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(a.pid, signal.SIGKILL)
        a.wait(60)
    stop.set()
    sampler.join()
    last = judged[-1]["jobs"] if judged else []
    return {
        "mode": mode,
        "world": world,
        "phases": {str(k): v for k, v in _phases(work).items()},
        "victim_pid": victim,
        "died_at": died_at,
        "stranded_at": stranded_at,
        "death_to_stranded_s": None
        if died_at is None or stranded_at is None
        else round(stranded_at - died_at, 3),
        "stranded_last": [j["stranded"] for j in last],
        "survivors": survivors,
        "judged": judged,
        "nvml_samples": samples,
    }


def summarise(result: dict[str, Any]) -> dict[str, Any]:
    """Per scenario: the survivors' fates and what the GPU showed of each after the death."""
    out: dict[str, Any] = {}
    for sc in result["scenarios"]:
        died = sc["died_at"]
        per: dict[str, Any] = {}
        for rank, info in sc["survivors"].items():
            pid = str(info["pid"])
            before = [
                u
                for s in sc["nvml_samples"]
                if died and s["at"] < died
                for u in s.get("util", {}).get(pid, [])
            ]
            after = [
                u
                for s in sc["nvml_samples"]
                if died and s["at"] > died + 3
                for u in s.get("util", {}).get(pid, [])
            ]

            def shape(us: list[list[int]]) -> dict[str, Any]:
                if not us:
                    return {"samples": 0}
                sms = [u[0] for u in us]
                return {
                    "samples": len(us),
                    "sm_min": min(sms),
                    "sm_mean": round(sum(sms) / len(sms), 1),
                    "memory_max": max(u[1] for u in us),
                }

            per[rank] = {
                "alive_at_end": info["alive_at_end"],
                "before_death": shape(before),
                "after_death": shape(after),
            }
        stranded = [s for s in sc["stranded_last"] if s]
        out[sc["mode"]] = {
            "world": sc["world"],
            "death_to_stranded_s": sc["death_to_stranded_s"],
            "stranded_ranks": sorted({r for s in stranded for r in s["ranks"]}),
            "survivors": per,
        }
    return out


def main() -> int:
    if sys.argv[1:2] == ["--results"]:
        kept = json.loads(Path(sys.argv[2]).read_text())
        gpu = "h200" if "H200" in json.dumps(kept["machine"]) else "h100"
        write(f"gpu-stranded-{gpu}", summarise(kept), machine_info=kept["machine"])
        return 0
    out = Path(sys.argv[1])
    modes = sys.argv[2:] or list(WORLD)
    out.mkdir(parents=True, exist_ok=True)
    import pynvml

    pynvml.nvmlInit()
    dev = pynvml.nvmlDeviceGetHandleByIndex(0)
    log = out / "daemon.log"
    pm = Path(tempfile.mkdtemp(prefix="tw-gpu-stranded-pm-"))
    daemon = subprocess.Popen(
        [sys.executable, "-m", "sidecar", "--attach-torchrun", "--port", "0", "--interval", "0.5",
         "--postmortem-dir", str(pm)],
        stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=REPO,  # noqa: SIM115
    )  # fmt: skip
    base = None
    for _ in range(300):
        m = re.search(r"serving https?://([0-9.]+):(\d+)", log.read_text())
        if m:
            base = f"http://{m.group(1)}:{m.group(2)}"
            break
        time.sleep(0.1)
    assert base, log.read_text()
    result: dict[str, Any] = {"machine": machine(), "scenarios": []}
    try:
        for mode in modes:
            result["scenarios"].append(scenario(mode, base, out, dev))
            print(json.dumps(summarise(result)[mode]), flush=True)
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=30)
        result["postmortems"] = [json.loads(f.read_text()) for f in sorted(pm.glob("*.json"))]
        (out / "gpu-stranded.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
