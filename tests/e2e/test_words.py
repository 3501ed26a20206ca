"""Each death a rank can die here for real is named the same way live and after the fact:
a real torchrun job (gloo, CPU) under `trainwatch run`, one rank dying of a segfault, a
bus error in a too-small /dev/shm, an abort by the C library (a double free), or a plain
traceback; then `trainwatch diagnose` on that same job's output (what the terminal showed:
the agent's lines and the ranks' stderr) names the same kind of killer for the same rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.e2e import REPO, TORCHRUN, WORKLOAD
from tests.support.skips import requires

PRIVATE_SHM = ["unshare", "-m", "sh", "-c", 'mount -t tmpfs -o size=1m tmpfs /dev/shm && exec "$@"', "sh"]


def _run_and_diagnose(tmp: Path, *workload: str, wrap: list[str] | None = None) -> tuple[dict, dict, str]:
    """(the live postmortem of `trainwatch run`, diagnose's document of the job's output,
    that output)."""
    cmd = [
        sys.executable, "-m", "sidecar", "run", "--postmortem-dir", str(tmp / "pm"), "--interval", "0.5",
        "--",
        *(wrap or []),
        TORCHRUN, "--standalone", "--nproc-per-node=2", "--monitor-interval=0.1", str(WORKLOAD),
        "--hold-mb=30", "--workers=0", "--duration=120", *workload,
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=REPO, env=env)
    assert out.returncode != 0, out.stderr[-3000:]
    files = sorted((tmp / "pm").glob("*.json"))
    assert len(files) == 1, files
    live = json.loads(files[0].read_text())
    # what the terminal showed of the job: trainwatch's own closing lines are not the job's
    job_output = "\n".join(line for line in out.stderr.splitlines() if not line.startswith("trainwatch: "))
    log = tmp / "job.log"
    log.write_text(job_output)
    diag = subprocess.run(
        [sys.executable, "-m", "sidecar", "diagnose", "--format", "json", str(log)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert diag.returncode == 0, diag.stderr
    return live, json.loads(diag.stdout), job_output


def _both(live: dict, offline: dict, kind: str, rank: int) -> None:
    for name, doc in (("live", live), ("diagnose", offline)):
        assert doc["killer"]["kind"] == kind, (name, doc["killer"])
        assert doc["victim"]["rank"] == rank, (name, doc["victim"], doc["killer"])
        assert doc["killer"]["confidence"] in ("certain", "likely"), (name, doc["killer"])


def test_a_segfault_is_named_live_and_from_its_logs(tmp_path):
    live, offline, _ = _run_and_diagnose(tmp_path, "--segfault-rank=1", "--raise-after=2")
    _both(live, offline, "segfault", 1)


@requires("glibc")  # another C library detects a double free in its own words, or not at all
def test_an_abort_by_the_c_library_is_named_live_and_from_its_logs(tmp_path):
    """glibc finds a block freed twice, says so on the rank's stderr and calls abort()."""
    live, offline, output = _run_and_diagnose(tmp_path, "--double-free-rank=1", "--raise-after=2")
    _both(live, offline, "abort", 1)
    assert "double free" in output, output[-3000:]
    for doc in (live, offline):  # the C library's own words are the evidence
        assert any("double free" in e["detail"] for e in doc["killer"]["evidence"]), doc["killer"]


def test_a_rust_extension_s_allocation_failure_is_named_live_and_from_its_logs(tmp_path):
    """A Rust extension in the rank (pydantic-core here; tokenizers and safetensors alike)
    cannot get host memory (an address-space cap): Rust's allocation error handler says so on
    the rank's stderr and aborts the process."""
    live, offline, output = _run_and_diagnose(tmp_path, "--rust-alloc-rank=1", "--raise-after=2")
    _both(live, offline, "abort", 1)
    assert "memory allocation of" in output, output[-3000:]
    for doc in (live, offline):  # Rust's own words are the evidence
        assert any("memory allocation of" in e["detail"] for e in doc["killer"]["evidence"]), doc["killer"]


def test_a_plain_traceback_is_named_live_and_from_its_logs(tmp_path):
    live, offline, _ = _run_and_diagnose(tmp_path, "--raise-rank=1", "--raise-after=2")
    _both(live, offline, "python_exception", 1)
    for doc in (live, offline):
        assert "ValueError" in doc["killer"]["summary"], doc["killer"]


@pytest.mark.root
@requires("mount")  # a private /dev/shm: unshare -m, mount
def test_a_bus_error_in_a_small_dev_shm_is_named_live_and_from_its_logs(tmp_path):
    live, offline, output = _run_and_diagnose(
        tmp_path, "--loader-rank=1", "--raise-after=2", wrap=PRIVATE_SHM
    )
    assert "Bus error" in output, output[-3000:]
    assert live["killer"]["kind"] == "bus_error" and live["killer"]["confidence"] == "certain", live["killer"]
    # the logs show the DataLoader's message but not /dev/shm's size: named, but not certain
    assert offline["killer"]["kind"] == "bus_error", offline["killer"]
    assert live["victim"]["rank"] == offline["victim"]["rank"] == 1


@pytest.mark.root
@requires("root", "exception-trace")  # dmesg; the kernel logging unhandled faults
def test_the_kernels_own_segfault_record_names_the_rank(tmp_path):
    """With no handler of its own (faulthandler off), the rank's SIGSEGV is logged by the
    kernel as "python[PID]: segfault at ..."; the catalog reads that record on the live
    path (the kernel log) and in diagnose (the same record pasted beside the job's output),
    certain either way: the kernel names the pid."""
    live, _, _ = _run_and_diagnose(tmp_path, "--segfault-rank=1", "--raise-after=2", "--segfault-unhandled=1")
    assert live["killer"]["kind"] == "segfault" and live["killer"]["confidence"] == "certain", live["killer"]
    pid = live["victim"]["pid"]
    records = [e["detail"] for e in live["killer"]["evidence"] if f"[{pid}]: segfault at" in e["detail"]]
    assert records, live["killer"]  # the kernel's record, read from /dev/kmsg, is the evidence
    kernel = subprocess.run(["dmesg"], capture_output=True, text=True, check=True).stdout
    mine = [line for line in kernel.splitlines() if f"[{pid}]: segfault at" in line]
    assert mine, "the kernel logged no segfault record for the rank"
    log = tmp_path / "job.log"
    offline = subprocess.run(
        [sys.executable, "-m", "sidecar", "diagnose", "--format", "json", str(log), "-"],
        input=mine[-1] + "\n",
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    doc = json.loads(offline.stdout)
    assert (doc["killer"]["kind"], doc["killer"]["confidence"]) == ("segfault", "certain"), doc["killer"]
    assert "the kernel's own record names the pid" in doc["killer"]["summary"]


def test_an_exception_that_left_a_peer_in_a_timeout_is_the_cause_live_and_from_its_logs(tmp_path):
    """Rank 1 raises, but a non-daemon thread keeps its process alive (its sockets open):
    rank 0 waits in its all_reduce until gloo's timeout (10 s), exits 1, and the agent, which
    saw rank 0 end first, tears rank 1 down with SIGTERM. The first failure is rank 1's
    exception; the timeout is its consequence (rank 1 never arrived because it had failed).
    Both were collective_timeout, certain, of rank 0."""
    live, offline, output = _run_and_diagnose(
        tmp_path, "--raise-rank=1", "--raise-after=2", "--raise-linger=120", "--pg-timeout=10"
    )
    assert "a bad batch on purpose" in output and "Timed out waiting" in output, output[-3000:]
    for name, doc in (("live", live), ("diagnose", offline)):
        assert doc["killer"]["kind"] == "python_exception", (name, doc["killer"])
        assert doc["victim"]["rank"] == 1, (name, doc["victim"], doc["killer"])
        assert doc["killer"]["confidence"] != "certain", (name, doc["killer"])  # ordered by words
        fates = {r["rank"]: r["fate"] for r in doc["ranks"]}
        assert fates == {0: "same_cause", 1: "root_cause"}, (name, doc["ranks"])
        details = " ".join(e["detail"] for e in doc["killer"]["evidence"])
        assert "timed out waiting for it" in details and "Timed out waiting 10000ms" in details, (
            name,
            details,
        )
