"""One real bus error, each view of it: a real torchrun job (gloo, CPU) under `trainwatch
run`, in a private mount namespace whose /dev/shm is a 1 MiB tmpfs; rank 1's DataLoader
workers write their batches through shared memory and die of SIGBUS. The job runs once,
for the module; each test reads one view of that death: the exit status and the agent's
words, the live postmortem (/dev/shm and its size named, the advice), and `trainwatch
diagnose` of the job's output naming the same killer for the same rank."""

from __future__ import annotations

import os

import pytest

from tests.support.runs import PRIVATE_SHM, Run, diagnose_job_output, only_postmortem, run_once
from tests.support.skips import requires

pytestmark = [
    pytest.mark.root,
    requires("mount"),  # a private /dev/shm: unshare -m, mount
]


@pytest.fixture(scope="module")
def bus_error(tmp_path_factory: pytest.TempPathFactory) -> Run:
    tmp = tmp_path_factory.mktemp("bus-error")
    return run_once(tmp, "--loader-rank=1", "--raise-after=2", wrap=PRIVATE_SHM)


def test_the_exit_status_is_the_job_s_and_the_agent_says_bus_error(bus_error: Run) -> None:
    assert bus_error.code == 1, bus_error.stderr[-3000:]
    assert "is killed by signal: Bus error" in bus_error.stderr


def test_the_postmortem_names_dev_shm_and_its_size(bus_error: Run) -> None:
    doc = only_postmortem(bus_error.tmp_path)
    killer = doc["killer"]
    assert killer["kind"] == "bus_error" and killer["confidence"] == "certain", killer
    assert "/dev/shm" in killer["summary"] and "of 1.0 MiB" in killer["summary"], killer
    assert doc["victim"]["rank"] == 1
    assert any("--shm-size" in a for a in doc["advice"]), doc["advice"]
    assert os.statvfs("/dev/shm").f_blocks * os.statvfs("/dev/shm").f_frsize > 1 << 20  # ours is untouched


def test_it_is_named_live_and_from_its_logs(bus_error: Run) -> None:
    assert bus_error.code != 0, bus_error.stderr[-3000:]
    live = only_postmortem(bus_error.tmp_path)
    offline, output = diagnose_job_output(bus_error.tmp_path, bus_error.stderr)
    assert "Bus error" in output, output[-3000:]
    assert live["killer"]["kind"] == "bus_error" and live["killer"]["confidence"] == "certain", live["killer"]
    # the logs show the DataLoader's message but not /dev/shm's size: named, but not certain
    assert offline["killer"]["kind"] == "bus_error", offline["killer"]
    assert live["victim"]["rank"] == offline["victim"]["rank"] == 1
