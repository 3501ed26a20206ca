"""Hangs caught while they can still be seen: real torchrun jobs (gloo, CPU) whose rank 1
stops joining collectives, watched by the real daemon.

- Under `trainwatch run` with a 60 s collective timeout and ``--stall-after 10``: the
  stall is flagged at about 10 s with every rank's py-spy stack, and the postmortem written
  after the timeout carries that snapshot (the missing rank's stack, taken at the stall).
- The missing rank busy on its CPU (a loop that never reaches the collective) while its
  peer waits: the waiting rank is stalled and the busy one named; SIGKILLed afterwards, its
  stack is still in the postmortem.
- A rank whose GPU is busy (as an NCCL collective's spinning kernel keeps it) while its
  peer's GPU runs nothing: flagged stalled though busy. This machine has no GPU: NVML is the
  stand-in built from tests/workloads/nvml_shim.c, loaded by the real bindings in the real
  daemon; the real NCCL run is the GPU machine's (tests/unit/stalls/test_tracker_device.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request

import pytest

from tests.support.e2e import (
    REPO,
    TORCHRUN,
    WORKLOAD,
    DaemonProc,
    TorchrunJob,
    free_port,
    job_postmortem,
    nvml_stand_in,
    parse_metrics,
    value,
    wait_for,
)
from tests.support.skips import requires


def _stall_of(ranks_doc: dict, agent_pid: int | None = None) -> dict | None:
    """The job's stall snapshot once it has every rank's stack."""
    for job in ranks_doc["jobs"]:
        if agent_pid is not None and job["agent_pid"] != agent_pid:
            continue
        stall = job.get("stall")
        if job["stalled"] and stall and all(r["stack"] for r in stall["ranks"]):
            return job
    return None


@requires("py-spy")
def test_a_hang_is_caught_at_the_stall_and_its_stacks_outlive_the_timeout(tmp_path):
    """gloo all_reduce with a 60 s timeout (the stall is due at about 10 s, its stacks
    within seconds after: a margin for a loaded machine); rank 1 sleeps outside every
    collective."""
    port = free_port()
    cmd = [
        sys.executable, "-m", "sidecar", "run", "--port", str(port), "--postmortem-dir", str(tmp_path / "pm"),
        "--interval", "0.5", "--stall-after", "10", "--",
        TORCHRUN, "--standalone", "--nproc-per-node=2", "--monitor-interval=0.1", str(WORKLOAD),
        "--hold-mb=30", "--workers=0", "--hang-rank=1", "--hang-after=2", "--pg-timeout=60",
        "--duration=600",
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env
    ) as proc:

        def stalled() -> dict | None:
            # the job is stalled once its longest-stalled rank is: rank 0 ran its step a
            # little longer than rank 1 (a loaded machine: a second), so wait for both
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ranks", timeout=2) as r:
                    job = _stall_of(json.loads(r.read()))
            except OSError:
                return None
            return job if job and all(r["stalled"] for r in job["ranks"]) else None

        job = wait_for(stalled, 60, "every rank seen stalled, with its stack", 0.5)
        assert job["stalled_seconds"] >= 10
        by_rank = {r["label"]: r for r in job["ranks"]}
        assert by_rank["0"]["stall_reason"] == "idle"
        assert by_rank["1"]["stall_reason"] == "idle" and by_rank["1"]["cpu_busy"] is False
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            m = parse_metrics(r.read().decode())
        assert (value(m, "trainwatch_job_stalled_seconds", job=job["job"]) or 0) >= 10
        assert value(m, "trainwatch_rank_stalled", job=job["job"], rank="0") == 1
        assert value(m, "trainwatch_rank_stalled", job=job["job"], rank="1") == 1
        # both idle: the stacks tell who the other waits for
        stall = job["stall"]
        assert stall["suspected_missing"] == ["1"] and stall["suspected_by"] == "stacks", stall
        assert job["suspected_missing"] == []  # activity alone could not tell
        _out, err = proc.communicate(timeout=200)
    assert proc.returncode == 1, err[-3000:]
    assert "stalled for 1" in err and "no CPU and no GPU use" in err
    files = sorted((tmp_path / "pm").glob("*.json"))
    assert len(files) == 1, files
    doc = json.loads(files[0].read_text())
    assert doc["killer"]["kind"] == "collective_timeout", doc["killer"]
    assert "within 60 s" in doc["killer"]["summary"], doc["killer"]
    stall = doc["stall"]
    assert stall is not None and stall["detected_at"] < doc["victim"]["died_at"], stall
    ranks = {r["label"]: r for r in stall["ranks"]}
    assert ranks["0"]["in_collective"] and "all_reduce" in ranks["0"]["stack"], ranks["0"]
    # the missing rank's stack, taken at the stall: where it was instead
    assert ranks["1"]["in_collective"] is False and "stray (rank.py" in ranks["1"]["stack"], ranks["1"]
    assert stall["suspected_missing"] == ["1"]


@pytest.mark.root
@requires("py-spy", "tracefs")
def test_a_rank_busy_elsewhere_is_named_and_its_stack_outlives_its_sigkill(tmp_path):
    """Rank 1 spins its CPU in a loop and never reaches the collective rank 0 waits in:
    the job is stalled though a rank works, rank 1 is the suspect; the user then kills it."""
    with (
        TorchrunJob(tmp_path, "stray", hold_mb=30, workers=0, hang_rank=1, hang_after=2, hang_spin=1) as job,
        DaemonProc(tmp_path, "--stall-after", "4", interval=0.5) as daemon,
    ):
        pids = job.ready()
        daemon.wait_sampled(job, pids)
        got = wait_for(
            lambda: _stall_of(daemon.ranks(), job.agent_pid), 60, "the stall with both stacks", 0.5
        )
        by_rank = {r["label"]: r for r in got["ranks"]}
        assert by_rank["0"]["stall_reason"] == "idle" and by_rank["0"]["stalled"]
        assert by_rank["1"]["stall_reason"] is None and by_rank["1"]["cpu_busy"] is True
        assert got["suspected_missing"] == ["1"]
        stall = got["stall"]
        assert stall["suspected_missing"] == ["1"] and stall["suspected_by"] == "stacks", stall
        m = daemon.metrics()
        assert value(m, "trainwatch_rank_stalled", job=got["job"], rank="0") == 1
        assert value(m, "trainwatch_rank_stalled", job=got["job"], rank="1") == 0
        os.kill(pids[1][0], signal.SIGKILL)
        doc = job_postmortem(daemon, victim_rank=1, want_fates=2, job=job)
        assert doc["killer"]["kind"] == "external_signal", doc["killer"]
        ranks = {r["label"]: r for r in doc["stall"]["ranks"]}
        assert "stray (rank.py" in ranks["1"]["stack"] and ranks["1"]["cpu_busy"] is True, ranks["1"]
        assert ranks["0"]["in_collective"] is True
        assert daemon.stop() == 0


@pytest.mark.root
@requires("cc", "tracefs")
def test_a_gpu_busy_in_a_collective_is_stalled_while_its_peer_is_silent(tmp_path, monkeypatch):
    """Both ranks on the stand-in GPU. While the job works both GPUs are busy (their SM and
    memory activity come through nvmlDeviceGetProcessUtilization): no stall. Then rank 1
    stops joining collectives and its GPU goes silent, while rank 0's stays busy as an NCCL
    kernel spinning for a peer keeps it: rank 0 is stalled ("waiting"), rank 1 the suspect."""
    on_gpu, busy, go = tmp_path / "gpu-pids", tmp_path / "gpu-busy", tmp_path / "hang"
    nvml_stand_in(tmp_path, monkeypatch, pids=on_gpu, busy=busy)
    with (
        TorchrunJob(
            tmp_path, "gpu-wait", hold_mb=30, workers=0, hang_rank=1, hang_after=3600, hang_file=go
        ) as job,
        DaemonProc(tmp_path, "--stall-after", "4", "--no-py-spy", interval=0.5) as daemon,
    ):
        pids = job.ready()
        daemon.wait_sampled(job, pids)
        r0, r1 = pids[0][0], pids[1][0]
        on_gpu.write_text(f"{r0}\n{r1}\n")
        busy.write_text(f"{r0} 97 41\n{r1} 95 38\n")

        def gpu(label: str) -> dict | None:
            for j in daemon.ranks()["jobs"]:
                for r in j["ranks"]:
                    if j["agent_pid"] == job.agent_pid and r["label"] == label:
                        return r
            return None

        wait_for(lambda: (gpu("1") or {}).get("gpu_busy") is True, 30, "both GPUs seen busy")
        daemon.wait_rounds(12)  # 6 s of work with busy GPUs, past --stall-after
        working = next(j for j in daemon.ranks()["jobs"] if j["agent_pid"] == job.agent_pid)
        assert not working["stalled"] and working["stalled_seconds"] == 0.0, working
        assert gpu("0")["gpu_sm_percent"] == 97.0 and gpu("0")["gpu_memory_percent"] == 41.0
        # rank 1 leaves the collectives; its GPU goes silent, rank 0's spins
        busy.write_text(f"{r0} 100 0\n")
        go.touch()

        def waiting() -> dict | None:
            for j in daemon.ranks()["jobs"]:
                if j["agent_pid"] == job.agent_pid and j["stalled"]:
                    return j
            return None

        got = wait_for(waiting, 30, "rank 0 stalled while its GPU is busy")
        by_rank = {r["label"]: r for r in got["ranks"]}
        assert by_rank["0"]["stall_reason"] == "waiting" and by_rank["0"]["gpu_busy"] is True, by_rank["0"]
        assert by_rank["1"]["stall_reason"] == "idle" and by_rank["1"]["gpu_busy"] is False, by_rank["1"]
        assert got["suspected_missing"] == ["1"]
        assert value(daemon.metrics(), "trainwatch_rank_stalled", job=got["job"], rank="0") == 1
        snap = wait_for(lambda: (waiting() or {}).get("stall"), 30, "the snapshot")
        assert snap["suspected_by"] == "activity" and snap["suspected_missing"] == ["1"]
        r0_snap = next(r for r in snap["ranks"] if r["label"] == "0")
        assert r0_snap["gpu_busy"] is True and r0_snap["gpu_sm_percent"] == 100.0
        assert r0_snap["stack"] is None and r0_snap["stack_error"] == "turned off (--no-py-spy)"
        assert "Traceback" not in daemon.log()
        job.stop()
        assert daemon.stop() == 0
