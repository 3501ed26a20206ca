"""Faults around a real death, each made for real: the postmortem directory full (a tiny
tmpfs) or read-only when a rank dies, and two daemons on one node."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from sidecar.front.demo import join_cgroup, memory_cgroup
from tests.support.e2e import (
    DaemonProc,
    TorchrunJob,
    job_postmortem,
    nvml_stand_in,
    survivor_fate_right,
    value,
    wait_for,
)
from tests.support.skips import requires

GIB = 1 << 30


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0750", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _files(d: Path) -> list[str]:
    return sorted(p.name for p in d.glob("*.json"))


@pytest.mark.root
@requires("mount")  # a tmpfs that fills or turns read-only
@pytest.mark.parametrize("fault", ["full", "read-only"])
def test_a_postmortem_directory_that_takes_nothing_loses_nothing(tmp_path, fault):
    """The rank dies while the directory takes no file: the postmortem is served from
    memory at once, and written as soon as the directory takes it again."""
    with tmpfs(tmp_path / "pm", "64k") as pm:
        filler = pm / "filler"
        if fault == "full":
            with contextlib.suppress(OSError), open(filler, "wb") as f:
                while True:
                    f.write(b"\0" * 4096)
        with (
            DaemonProc(tmp_path, "--postmortem-dir", str(pm)) as daemon,
            TorchrunJob(tmp_path, f"pm-{fault}", hold_mb=30, workers=0) as job,
        ):
            pids = job.ready()
            daemon.wait_sampled(job, pids)
            if fault == "read-only":
                subprocess.run(["mount", "-o", "remount,ro", str(pm)], check=True)
            os.kill(pids[1][0], signal.SIGKILL)
            doc = job_postmortem(daemon, victim_rank=1, want_fates=2, job=job)
            job.proc.wait(60)
            assert doc["killer"]["kind"] == "external_signal"
            wait_for(lambda: "cannot write postmortem" in daemon.log(), 30, "the write error in the log")
            assert _files(pm) == [], "nothing could be written"
            status, body = daemon.get(f"/postmortems/{doc['id']}")
            assert status == 200 and json.loads(body)["id"] == doc["id"]  # served from memory
            if fault == "full":
                filler.unlink()
            else:
                subprocess.run(["mount", "-o", "remount,rw", str(pm)], check=True)
            wait_for(
                lambda: f"{doc['id']}.json" in _files(pm), 30, "the postmortem written once there is room"
            )
            written = json.loads((pm / f"{doc['id']}.json").read_text())
            assert written["id"] == doc["id"] and written["killer"] == json.loads(body)["killer"]
            assert "is writable again" in daemon.log()
            assert daemon.stop() == 0


@pytest.mark.root
@requires("root", "tracefs")
def test_two_daemons_on_one_node_both_explain_the_death(tmp_path):
    """Each has its own tracefs instance and its own store: neither blinds the other."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with (
        DaemonProc(tmp_path / "a") as first,
        DaemonProc(tmp_path / "b") as second,
        TorchrunJob(tmp_path, "two", hold_mb=30, workers=0) as job,
    ):
        pids = job.ready()
        first.wait_sampled(job, pids)
        second.wait_sampled(job, pids)
        killer = subprocess.run(
            ["sh", "-c", f"kill -9 {pids[1][0]}; echo $$"], capture_output=True, text=True
        )
        docs = [job_postmortem(d, victim_rank=1, want_fates=2, job=job) for d in (first, second)]
        job.proc.wait(60)
        for d, doc in zip((first, second), docs, strict=True):
            k = doc["killer"]
            assert (k["kind"], k["confidence"]) == ("external_signal", "certain"), k
            assert f"pid {killer.stdout.strip()} (sh)" in k["summary"], k  # each one's tracepoint
            assert "Traceback" not in d.log()
        tracing = Path("/sys/kernel/tracing/instances")
        mine = [tracing / f"trainwatch-{d.proc.pid}" for d in (first, second)]
        assert all(p.is_dir() for p in mine), mine  # one tracefs instance each
        # the same death (the wall time of it each converts from the monotonic clock itself)
        same = [{k: v for k, v in doc["victim"].items() if k != "died_at"} for doc in docs]
        assert same[0] == same[1], same
        assert first.stop() == 0 and second.stop() == 0
        assert not any(p.exists() for p in mine)  # each removed its own, and only its own


def _growing_on_cue(tmp_path: Path, name: str, cgroup: Path, cue: Path) -> TorchrunJob:
    """A job in ``cgroup`` whose rank 1 grows until the limit kills it, once ``cue`` exists."""
    return TorchrunJob(
        tmp_path,
        name,
        wrap=join_cgroup(cgroup),
        hold_mb=50,
        workers=0,
        grow_rank=1,
        grow_after=0,
        grow_file=cue,
    )


@pytest.mark.root
@requires("memcg", "kmsg")
def test_a_death_while_the_daemon_was_down_is_explained_on_restart(tmp_path):
    """The daemon is SIGKILLed while it watches a job; a rank then exceeds its cgroup's limit
    and the agent tears the job down. A new daemon on the same directory finds the death in
    the kernel log's history and the agent's log, and says the postmortem is reconstructed."""
    grow = tmp_path / "grow"
    state = tmp_path / "postmortems" / "trainwatch.state"
    with (
        memory_cgroup(int(1.5 * GIB), "trainwatch-down") as (_version, parent, child),
        _growing_on_cue(tmp_path, "down", child, grow) as job,
    ):
        pids = job.ready()
        with DaemonProc(tmp_path) as first:
            first.wait_sampled(job, pids)
            victim = pids[1][0]
            wait_for(
                lambda: state.exists() and f'"pid":{victim},' in state.read_text(),
                30,
                "the journal to hold the ranks",
            )
            first.proc.kill()
            first.proc.wait()
        grow.touch()  # rank 1 grows until the limit stops it, with no daemon watching
        assert job.proc.wait(120) != 0
        with DaemonProc(tmp_path) as second:
            doc = job_postmortem(second, victim_rank=1, want_fates=2, job=job)
            k = doc["killer"]
            assert (k["kind"], k["confidence"]) == ("cgroup_oom", "certain"), k
            assert f"/{parent.name}" in k["summary"]
            assert doc["victim"]["pid"] == victim
            assert any(e["source"] == "kmsg" and f"pid={victim}" in e["detail"] for e in k["evidence"]), k
            assert any(
                e["source"] == "trainwatch" and e["detail"].startswith("reconstructed") for e in k["evidence"]
            ), k
            assert set(doc["reconstructed"]) == {"down_since", "restarted_at"}
            rows = {r["rank"]: r for r in doc["ranks"]}
            assert rows[1]["fate"] == "root_cause" and survivor_fate_right(rows[0], job.output()), rows
            died = {r["rank"]: r["died_at"] for r in doc["ranks"]}
            assert died[0] is None, "nothing timed rank 0's end: no time is made up"
            assert died[1] == doc["victim"]["died_at"]  # the kernel record's time
            details = [e["detail"] for e in k["evidence"]]
            assert len(details) == len(set(details)), details
            assert doc["memory"]["cgroup"]["limit_bytes"] == int(1.5 * GIB)
            assert doc["timeline"], "the memory curve kept across the restart"
            assert "died while trainwatch was down" in second.log()
            assert second.stop() == 0


def _kmsg_ring_bytes() -> int:
    import ctypes

    size = ctypes.CDLL(None, use_errno=True).klogctl(10, None, 0)  # SYSLOG_ACTION_SIZE_BUFFER
    assert size > 0, "klogctl(SIZE_BUFFER) failed"
    return int(size)


def _flood_kmsg(total: int) -> None:
    """Write ``total`` bytes of records into the kernel log, 10 per open (/dev/kmsg's
    per-writer rate limit lets 10 through before it drops)."""
    line = b"<7>trainwatch-test: filling the kernel log ring " + b"." * 150 + b"\n"
    written = 0
    while written < total:
        fd = os.open("/dev/kmsg", os.O_WRONLY)
        try:
            for _ in range(10):
                os.write(fd, line)
                written += len(line)
        finally:
            os.close(fd)


@pytest.mark.isolated  # run alone: it floods the kernel log every daemon reads
@pytest.mark.root
@requires("memcg", "kmsg", "kmsg-write")
def test_a_kernel_log_overrun_mid_incident_is_said_and_never_certain(tmp_path):
    """The daemon is stopped (SIGSTOP: starved) while a rank exceeds its cgroup's limit, and
    the kernel log is then flooded past its ring: the OOM records are gone when the daemon
    runs again. It reads on past the overrun, counts the loss, and names the cgroup OOM from
    the cgroup's counter, as likely, never certain, saying records were lost."""
    grow = tmp_path / "grow"
    with (
        memory_cgroup(int(1.5 * GIB), "trainwatch-overrun") as (_version, parent, child),
        _growing_on_cue(tmp_path, "overrun", child, grow) as job,
        DaemonProc(tmp_path) as daemon,
    ):
        pids = job.ready()
        daemon.wait_sampled(job, pids)
        victim = pids[1][0]
        daemon.proc.send_signal(signal.SIGSTOP)
        try:
            grow.touch()
            assert job.proc.wait(120) != 0
            _flood_kmsg(3 * _kmsg_ring_bytes())
            dmesg = subprocess.run(["dmesg"], capture_output=True, text=True).stdout
            assert f"pid={victim}," not in dmesg, "the flood did not overwrite the OOM records"
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
        doc = job_postmortem(daemon, victim_rank=1, want_fates=2, job=job)
        k = doc["killer"]
        assert (k["kind"], k["confidence"]) == ("cgroup_oom", "likely"), k
        assert f"/{parent.name}" in k["summary"] and "overwritten unread" in k["summary"], k
        assert any(
            e["source"] == "kmsg" and "overwritten before trainwatch read them" in e["detail"]
            for e in k["evidence"]
        ), k
        assert any(e["source"] == "cgroup" and "oom_kill 0 -> 1" in e["detail"] for e in k["evidence"]), k
        assert "records were overwritten before trainwatch read them" in daemon.log()
        lost = value(daemon.metrics(), "trainwatch_lost_events_total", source="kmsg")
        assert lost is not None and lost > 0
        assert daemon.stop() == 0


@pytest.mark.root
@requires("root", "tracefs")
def test_a_connector_overrun_mid_incident_loses_no_death(tmp_path, monkeypatch):
    """The daemon is stopped while a flood of events fills its (small) connector buffer,
    and a rank is killed behind the flood: its exit event is dropped. Woken, the daemon gets
    ENOBUFS, finds the rank gone from /proc, takes its status from the agent's log, and the
    signal tracepoint (a buffer of its own) still names who sent the SIGKILL. The flood comes
    from inside the job (rank 0 forks 500 children that fail): the socket filter drops the
    node's other processes' events in the kernel, so only a watched tree can flood it."""
    monkeypatch.setenv("TRAINWATCH_CONNECTOR_BUFFER", "4096")
    flood = tmp_path / "flood"
    with (
        TorchrunJob(tmp_path, "enobufs", hold_mb=30, workers=0, flood_rank=0, flood_file=flood) as job,
        DaemonProc(tmp_path) as daemon,
    ):
        pids = job.ready()
        daemon.wait_sampled(job, pids)
        victim = pids[1][0]
        daemon.proc.send_signal(signal.SIGSTOP)
        try:
            # 500 forks and non-zero exits: far more events than 4 KiB (8 KiB as the kernel counts) hold
            flood.touch()
            wait_for(lambda: (tmp_path / "flood.done").exists(), 60, "rank 0's flood of children")
            os.kill(victim, signal.SIGKILL)
            assert job.proc.wait(60) != 0
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
        doc = job_postmortem(daemon, victim_rank=1, want_fates=2, job=job)
        assert "process connector overrun (ENOBUFS)" in daemon.log()
        lost = value(daemon.metrics(), "trainwatch_lost_events_total", source="connector")
        assert lost is not None and lost >= 1
        victim_row = next(r for r in doc["ranks"] if r["rank"] == 1)
        assert victim_row["exit_source"] == "agent-log" and victim_row["exit_code"] == -9, victim_row
        k = doc["killer"]  # the tracepoint's record (its own buffer) names this process as the sender
        assert (k["kind"], k["confidence"]) == ("external_signal", "certain"), k
        assert f"pid {os.getpid()} " in k["summary"], k
        assert daemon.stop() == 0


@pytest.mark.root
@requires("cc", "tracefs")
def test_nvml_reports_the_gpu_lost_mid_run(tmp_path, monkeypatch):
    """NVML loses the GPU while a job runs (an NVML stand-in built here, tests/workloads/
    nvml_shim.c, loaded by the real bindings in the real daemon: this machine has no GPU).
    The daemon keeps sampling and serving, exports the loss, and when the rank on that GPU
    then aborts, names the lost GPU, not a plain abort."""
    on_gpu, lost, abort = tmp_path / "gpu-pids", tmp_path / "gpu-lost", tmp_path / "abort"
    nvml_stand_in(tmp_path, monkeypatch, pids=on_gpu, lost=lost)
    with (
        TorchrunJob(tmp_path, "nvml-lost", hold_mb=30, workers=0, abort_rank=1, abort_file=abort) as job,
        DaemonProc(tmp_path) as daemon,
    ):
        pids = job.ready()
        daemon.wait_sampled(job, pids)
        on_gpu.write_text(f"{pids[1][0]}\n")

        def gpu_of_rank1() -> float | None:
            return value(daemon.metrics(), "trainwatch_rank_gpu_memory_bytes", rank="1", gpu="0")

        wait_for(lambda: gpu_of_rank1() == 1 << 30, 30, "rank 1's GiB on GPU 0 through NVML")
        lost.touch()
        wait_for(lambda: value(daemon.metrics(), "trainwatch_gpu_lost", gpu="0") == 1, 30, "the GPU lost")
        assert value(daemon.metrics(), "trainwatch_probe_success", probe="gpu") == 0
        assert daemon.get("/healthz")[0] == 200  # the sampler goes on without the GPU
        daemon.wait_rounds(2)
        abort.touch()
        doc = job_postmortem(daemon, victim_rank=1, want_fates=2, job=job)
        k = doc["killer"]
        assert (k["kind"], k["confidence"]) == ("gpu_error", "likely"), k
        assert "GPU 0 (trainwatch shim GPU) was lost" in k["summary"], k
        assert any(e["source"] == "nvml" and "GPU_IS_LOST" in e["detail"] for e in k["evidence"]), k
        assert doc["victim"]["signal"] == "SIGABRT"
        assert "Traceback" not in daemon.log()
        assert daemon.stop() == 0
