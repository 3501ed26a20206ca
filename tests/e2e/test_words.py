"""Each death a rank can die here for real is named the same way live and after the fact:
a real torchrun job (gloo, CPU) under `trainwatch run`, one rank dying of an abort by the C
library (a double free) or by Rust's allocation error handler, a plain traceback, or a
segfault the kernel itself logs; then `trainwatch diagnose` on that same job's output (what
the terminal showed: the agent's lines and the ranks' stderr) names the same kind of killer
for the same rank. A segfault under faulthandler and a bus error in a too-small /dev/shm,
with every other view of each, are tests/e2e/scenarios/test_segfault.py and
test_bus_error.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.e2e import REPO
from tests.support.runs import named_alike, run_and_diagnose
from tests.support.skips import requires


@requires("glibc")  # another C library detects a double free in its own words, or not at all
def test_an_abort_by_the_c_library_is_named_live_and_from_its_logs(tmp_path):
    """glibc finds a block freed twice, says so on the rank's stderr and calls abort()."""
    live, offline, output = run_and_diagnose(tmp_path, "--double-free-rank=1", "--raise-after=2")
    named_alike(live, offline, "abort", 1)
    assert "double free" in output, output[-3000:]
    for doc in (live, offline):  # the C library's own words are the evidence
        assert any("double free" in e["detail"] for e in doc["killer"]["evidence"]), doc["killer"]


def test_a_rust_extension_s_allocation_failure_is_named_live_and_from_its_logs(tmp_path):
    """A Rust extension in the rank (pydantic-core here; tokenizers and safetensors alike)
    cannot get host memory (an address-space cap): Rust's allocation error handler says so on
    the rank's stderr and aborts the process."""
    live, offline, output = run_and_diagnose(tmp_path, "--rust-alloc-rank=1", "--raise-after=2")
    named_alike(live, offline, "abort", 1)
    assert "memory allocation of" in output, output[-3000:]
    for doc in (live, offline):  # Rust's own words are the evidence
        assert any("memory allocation of" in e["detail"] for e in doc["killer"]["evidence"]), doc["killer"]


def test_a_plain_traceback_is_named_live_and_from_its_logs(tmp_path):
    live, offline, _ = run_and_diagnose(tmp_path, "--raise-rank=1", "--raise-after=2")
    named_alike(live, offline, "python_exception", 1)
    for doc in (live, offline):
        assert "ValueError" in doc["killer"]["summary"], doc["killer"]


@pytest.mark.root
@requires("root", "exception-trace")  # dmesg; the kernel logging unhandled faults
def test_the_kernels_own_segfault_record_names_the_rank(tmp_path):
    """With no handler of its own (faulthandler off), the rank's SIGSEGV is logged by the
    kernel as "python[PID]: segfault at ..."; the catalog reads that record on the live
    path (the kernel log) and in diagnose (the same record pasted beside the job's output),
    certain either way: the kernel names the pid."""
    live, _, _ = run_and_diagnose(tmp_path, "--segfault-rank=1", "--raise-after=2", "--segfault-unhandled=1")
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
    live, offline, output = run_and_diagnose(
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
