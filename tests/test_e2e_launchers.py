"""Real jobs under launchers other than torchrun, watched by the real daemon, and real deaths:
a rank SIGKILLed from outside, a rank at its memory cgroup's limit. Each asserts the victim,
the killer and every other rank's fate as that launcher's teardown makes it.

- DeepSpeed's launcher (``deepspeed --num_gpus 2 script``, CPU): the runner starts the
  per-node launcher ``python -u -m deepspeed.launcher.launch``, which starts each rank with
  RANK and LOCAL_RANK in its environment, and SIGTERMs every other rank's tree when one
  exits non-zero (``deepspeed/launcher/launch.py``).
"""

from __future__ import annotations

import os
import signal

import pytest

from sidecar.demo import join_cgroup, memory_cgroup
from tests.e2e import DaemonProc, DeepSpeedJob, job_postmortem
from tests.skips import requires

pytestmark = [pytest.mark.slow]

GIB = 1 << 30


def _torn_down_or_failed_with_it(row: dict) -> bool:
    """A survivor's fate under a launcher that polls its ranks (DeepSpeed's: every second):
    SIGTERMed by the launcher (terminated_by_agent), or, when its collective failed first
    for the peer that died (gloo: the connection closed), an exit of its own that its
    output ties to that death (same_cause). Which comes first is a race; each has its word."""
    if row["signal"] in ("SIGTERM", "SIGKILL"):
        return row["fate"] == "terminated_by_agent"
    return row["exit_code"] not in (0, None) and row["fate"] == "same_cause"


@requires("deepspeed")
def test_a_deepspeed_rank_killed_from_outside_is_named_and_the_launcher_s_teardown_is_told(tmp_path):
    """The ranks are found below DeepSpeed's launcher, numbered by their RANK, their forked
    workers in their trees and never ranks; rank 1 is then SIGKILLed from outside."""
    with (
        DaemonProc(tmp_path) as daemon,
        DeepSpeedJob(tmp_path, "ds-kill", hold_mb=50, workers=1) as job,
    ):
        pids = job.ready()
        seen = daemon.wait_sampled(job, pids)
        assert seen["launcher"] == "deepspeed" and seen["job"] == str(job.agent_pid), seen
        ranks = {r["rank"]: r for r in seen["ranks"]}
        assert sorted(ranks) == [0, 1]  # the workers (one each) are no ranks
        for rank, rank_pids in pids.items():
            assert ranks[rank]["pid"] == rank_pids[0] and ranks[rank]["rank_source"] == "RANK", ranks[rank]
            assert ranks[rank]["tree_processes"] == len(rank_pids), ranks[rank]
        m = daemon.metrics()
        info = {
            labels["rank"]: labels for labels, _ in m["trainwatch_rank_info"] if labels["job"] == seen["job"]
        }
        assert {r: labels["launcher"] for r, labels in info.items()} == {"0": "deepspeed", "1": "deepspeed"}
        os.kill(pids[1][0], signal.SIGKILL)
        doc = job_postmortem(daemon, victim_rank=1, want_fates=2, job=job)
        job.proc.wait(60)
    killer = doc["killer"]
    assert killer["kind"] == "external_signal", killer
    assert doc["victim"]["pid"] == pids[1][0] and doc["victim"]["signal"] == "SIGKILL", doc["victim"]
    rows = {r["rank"]: r for r in doc["ranks"]}
    assert rows[1]["fate"] == "root_cause" and _torn_down_or_failed_with_it(rows[0]), doc["ranks"]
    assert doc["job"]["launcher"] == "deepspeed" and {r["launcher"] for r in doc["ranks"]} == {"deepspeed"}
    assert {r["rank_source"] for r in doc["ranks"]} == {"RANK"}


@pytest.mark.root
@requires("deepspeed", "memcg", "kmsg")
def test_a_deepspeed_rank_at_its_cgroup_limit_is_named_with_certainty(tmp_path):
    """The whole launch in a 1.5 GiB memory cgroup; rank 1 grows until the kernel kills it."""
    with memory_cgroup(int(1.5 * GIB), "trainwatch-ds-oom") as (_version, parent, child):
        wrap = join_cgroup(child)  # the runner, its launcher and the ranks
        with (
            DaemonProc(tmp_path) as daemon,
            DeepSpeedJob(
                tmp_path,
                "ds-oom",
                wrap=wrap,
                hold_mb=50,
                workers=0,
                grow_rank=1,
                grow_after=2,
                grow_interval=0.1,
            ) as job,
        ):
            pids = job.ready()
            doc = job_postmortem(daemon, victim_rank=1, want_fates=2, job=job)
            job.proc.wait(60)
    killer = doc["killer"]
    assert killer["kind"] == "cgroup_oom" and killer["confidence"] == "certain", killer
    assert f"/{parent.name}" in killer["summary"], killer
    assert doc["victim"]["pid"] == pids[1][0] and doc["victim"]["signal"] == "SIGKILL", doc["victim"]
    rows = {r["rank"]: r for r in doc["ranks"]}
    assert rows[1]["fate"] == "root_cause" and _torn_down_or_failed_with_it(rows[0]), doc["ranks"]
    assert doc["job"]["launcher"] == "deepspeed"
