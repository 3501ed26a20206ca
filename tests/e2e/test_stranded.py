"""Stranded survivors, for real: a rank killed while a rank of the same job, under another
agent, waits for it in the job's store (a pipeline's hand-off: its agent never hears of the
death, nothing ends it until the store's timeout). Watched by the node's daemon, and the job
run under ``trainwatch run --end-stranded-after``; beside it, a job whose every rank pauses
for 40 s with no death, which is never stranded.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import uuid

import pytest

from tests.support.e2e import (
    REPO,
    TORCHRUN,
    WORKLOAD,
    DaemonProc,
    TorchrunJob,
    free_port,
    nvml_stand_in,
    wait_for,
)


def _agent(run_id: str, endpoint: str, host: bool, ready: str) -> list[str]:
    """One agent ("node") of a two-agent job on this machine, one rank each."""
    return [
        TORCHRUN, "--nnodes=2", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}",
        f"--rdzv-conf=is_host={int(host)}", "--local-addr=127.0.0.1", "--nproc-per-node=1",
        "--max-restarts=0",
        "--monitor-interval=0.1", str(WORKLOAD), f"--ready-dir={ready}", "--handoff=1", "--workers=1",
        "--hold-mb=30", "--duration=300",
    ]  # fmt: skip


def _job(ranks: dict, key_of_pid: int) -> dict | None:
    for job in ranks["jobs"]:
        if any(r["pid"] == key_of_pid for r in job["ranks"]):
            return job
    return None


def _ready(folder, n: int) -> list | None:
    files = sorted(folder.glob("rank*.r0"))
    return files if len(files) == n else None


def _stranded_metric(daemon: DaemonProc, job: str) -> float:
    return {labels["job"]: v for labels, v in daemon.metrics()["trainwatch_job_stranded_ranks"]}[job]


def test_a_survivor_waiting_for_a_dead_rank_is_stranded_and_run_ends_the_job(tmp_path):
    """Rank 1 (under agent B) is SIGKILLed; rank 0 (under agent A) waits for its next hand-off
    in the store. The node's daemon reports rank 0 stranded within 30 s (``/ranks``, the
    metrics); ``trainwatch run --end-stranded-after 15s`` then ends the job and exits 124. The
    paused job beside it (every rank idle, no death) is stalled all along, never stranded."""
    ready = tmp_path / "ready"
    ready.mkdir()
    run_id = uuid.uuid4().hex[:12]
    endpoint = f"127.0.0.1:{free_port()}"
    both = " & ".join(shlex.join(_agent(run_id, endpoint, host, str(ready))) for host in (True, False))
    run_cmd = [
        sys.executable, "-m", "sidecar", "run", "--port", "0", "--postmortem-dir", str(tmp_path / "pm"),
        "--end-stranded-after", "15s", "--", "sh", "-c", f"{both} & wait",
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with (
        DaemonProc(tmp_path / "node") as daemon,
        TorchrunJob(tmp_path, "paused", hold_mb=30, workers=0, pause_after=0, pause_for=120) as paused,
    ):
        run = subprocess.Popen(
            run_cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        pids: dict[int, list[int]] = {}
        try:
            files = wait_for(lambda: _ready(ready, 2), 120, "both ranks")
            pids.update({int(f.name[4]): [int(p) for p in f.read_text().split()] for f in files})
            paused_pids = paused.ready()
            daemon.wait_sampled(paused, paused_pids)
            wait_for(lambda: _job(daemon.ranks(), pids[0][0]), 30, "rank 0 watched")
            os.kill(pids[1][0], signal.SIGKILL)
            killed = time.monotonic()
            try:
                job = wait_for(
                    lambda: (j := _job(daemon.ranks(), pids[0][0])) and j["stranded"] and j,
                    40,
                    "rank 0 stranded",
                )
            except AssertionError as exc:
                seen = json.dumps(_job(daemon.ranks(), pids[0][0]))[:3000]
                raise AssertionError(f"{exc}\n{seen}\n{daemon.log()[-5000:]}") from None
            took = time.monotonic() - killed
            assert took <= 30, took
            stranded = job["stranded"]
            assert stranded["ranks"] == ["0"] and stranded["gpu_memory_bytes"] == 0, stranded
            assert stranded["dead_ranks"][0].startswith("1 (job "), stranded  # under the other agent
            assert _stranded_metric(daemon, job["job"]) == 1
            # the paused job: idle the whole time (its stall counts from its last progress), no death
            seen = wait_for(
                lambda: (j := _job(daemon.ranks(), paused_pids[0][0])) and j["stalled_seconds"] >= 30 and j,
                90,
                "the paused job idle 40 s",
            )
            assert seen["stranded"] is None and _stranded_metric(daemon, seen["job"]) == 0, seen
            _out, err = run.communicate(timeout=60)
        finally:
            if run.poll() is None:
                run.kill()
                for pid in pids.get(0, []):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
    assert run.returncode == 124, err[-3000:]
    print(f"death -> stranded reported: {took:.1f} s")
    assert "stranded for" in err and "ending the job (--end-stranded-after)" in err, err[-3000:]
    with pytest.raises(ProcessLookupError):
        os.kill(pids[0][0], 0)  # the survivor was ended
    docs = [json.loads(p.read_text()) for p in (tmp_path / "pm").glob("*.json")]
    first = next(d for d in docs if d["victim"]["pid"] == pids[1][0])
    assert first["killer"]["kind"] == "external_signal", first["killer"]


def test_a_survivor_whose_gpu_spins_for_a_dead_rank_is_stranded(tmp_path, monkeypatch):
    """The survivor of an NCCL job does not idle: its GPU holds the collective's kernel,
    polling for the dead rank's data, at 100 % and without memory traffic in every sample
    (as measured on an H200), which no idleness rule sees. The two agents' ranks on the NVML
    stand-in: both working (SM and memory busy), then rank 1 SIGKILLed and rank 0's GPU
    spinning: rank 0 is stranded, never stalled for it."""
    on_gpu, busy = tmp_path / "gpu-pids", tmp_path / "gpu-busy"
    nvml_stand_in(tmp_path, monkeypatch, pids=on_gpu, busy=busy)
    ready = tmp_path / "ready"
    ready.mkdir()
    run_id, endpoint = uuid.uuid4().hex[:12], f"127.0.0.1:{free_port()}"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    agents = [
        subprocess.Popen(_agent(run_id, endpoint, host, str(ready)), cwd=REPO, env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        for host in (True, False)
    ]  # fmt: skip
    try:
        with DaemonProc(tmp_path / "node", interval=0.5) as daemon:
            files = wait_for(lambda: _ready(ready, 2), 120, "both ranks")
            pids = {int(f.name[4]): [int(p) for p in f.read_text().split()] for f in files}
            r0, r1 = pids[0][0], pids[1][0]
            on_gpu.write_text(f"{r0}\n{r1}\n")
            busy.write_text(f"{r0} 97 41\n{r1} 95 38\n")
            wait_for(
                lambda: (j := _job(daemon.ranks(), r0)) and j["ranks"][0]["gpu_busy"] is True,
                30,
                "rank 0's GPU seen busy",
            )
            daemon.wait_rounds(12)  # a window of work, judged
            busy.write_text(f"{r0} 100 0\n")
            os.kill(r1, signal.SIGKILL)
            killed = time.monotonic()
            job = wait_for(
                lambda: (j := _job(daemon.ranks(), r0)) and j["stranded"] and j, 40, "rank 0 stranded"
            )
            took = time.monotonic() - killed
            assert took <= 30, took
            assert job["stranded"]["ranks"] == ["0"], job["stranded"]
            row = job["ranks"][0]
            assert row["gpu_busy"] is True and row["stall_reason"] is None and not job["stalled"], row
            print(f"death -> stranded reported, GPU spinning: {took:.1f} s")
    finally:
        for agent in agents:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(agent.pid, signal.SIGKILL)
            agent.wait(30)
