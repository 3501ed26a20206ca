"""Real Slurm steps on the test Slurm (tests/support/slurm.py: Debian's slurmctld, slurmd and munge
on this machine, task/cgroup with ConstrainRAMSpace=yes), watched by the real daemon: the
step's slurmstepd is the launching process, its tasks the ranks (SLURM_PROCID), the job
``JOBID.STEPID``.

The ranks hand off through rank 0's store (``--handoff``): rank 0 waits for rank 1's next
key, so a death of rank 1 leaves rank 0 alive and waiting, in no collective that could fail.
With ``--kill-on-bad-exit=1`` Slurm then ends rank 0 itself (the launcher's teardown); without
it, nothing does, and rank 0 is stranded until the step is cancelled.

``trainwatch run -- srun ...``: the step's tasks are slurmd's, never below run; run's daemon
knows its own step by the marker its environment passes down (srun exports it), and no other.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.support import slurm
from tests.support.e2e import (
    REPO,
    TASK_JOB,
    DaemonProc,
    SlurmJob,
    free_port,
    job_postmortem,
    oom_killed,
    settled_postmortem,
    wait_for,
)
from tests.support.skips import requires

pytestmark = [pytest.mark.root]


def _ranks_job(daemon: DaemonProc, job: SlurmJob) -> dict | None:
    return next((j for j in daemon.ranks()["jobs"] if j["agent_pid"] == job.agent_pid), None)


@requires("slurm")
def test_a_slurm_task_killed_from_outside_is_named_and_slurm_ends_the_step(tmp_path):
    """``srun --kill-on-bad-exit=1``: rank 1 SIGKILLed from outside; Slurm then signals
    rank 0, which its postmortem row says (terminated_by_agent, the launcher slurm)."""
    with (
        DaemonProc(tmp_path, whole_machine=True) as daemon,
        SlurmJob(tmp_path, "sl-kill", hold_mb=50, workers=1, handoff=1, kill_on_bad_exit=True) as job,
    ):
        pids = job.ready()
        seen = daemon.wait_sampled(job, pids)
        assert job.agent_pid > 0  # read while the tasks run
        assert seen["launcher"] == "slurm" and seen["job"] == seen["run_id"] and seen["job"].endswith(".0"), (
            seen
        )
        ranks = {r["rank"]: r for r in seen["ranks"]}
        for rank, rank_pids in pids.items():
            assert ranks[rank]["pid"] == rank_pids[0] and ranks[rank]["rank_source"] == "SLURM_PROCID"
            assert ranks[rank]["tree_processes"] == len(rank_pids), ranks[rank]
        os.kill(pids[1][0], signal.SIGKILL)
        doc = job_postmortem(daemon, victim_rank=1, want_fates=2, job=job)
        assert job.proc.wait(60) != 0
        doc = settled_postmortem(daemon, doc, lambda d: d["ranks"][0]["fate"] not in ("stranded", "running"))
    assert doc["killer"]["kind"] == "external_signal", doc["killer"]
    assert doc["victim"]["pid"] == pids[1][0] and doc["victim"]["signal"] == "SIGKILL", doc["victim"]
    rows = {r["rank"]: r for r in doc["ranks"]}
    assert rows[0]["fate"] == "terminated_by_agent" and rows[0]["signal"] in ("SIGTERM", "SIGKILL"), rows[0]
    assert rows[0]["launcher"] == "slurm" and doc["job"]["launcher"] == "slurm"


@requires("slurm", "kmsg")
def test_a_slurm_task_past_its_step_s_mem_is_named_with_certainty(tmp_path):
    """``srun --mem=1536M``: Slurm's own step cgroup holds the limit; rank 1 grows past it."""
    with (
        DaemonProc(tmp_path, whole_machine=True) as daemon,
        SlurmJob(
            tmp_path, "sl-oom", hold_mb=50, workers=0, handoff=1, grow_rank=1, grow_after=2, grow_interval=0.1
        ) as job,
    ):
        pids = job.ready()
        assert job.agent_pid > 0  # read while the tasks run
        doc = job_postmortem(daemon, victim_rank=1, want_fates=2, job=job)
        job.proc.wait(60)
        # on a loaded machine Slurm may end rank 0 more than 10 s after the death: it is
        # stranded meanwhile (alive, idle), and its death's fate replaces that when it ends
        doc = settled_postmortem(daemon, doc, lambda d: d["ranks"][0]["fate"] not in ("stranded", "running"))
    killer = doc["killer"]
    assert killer["kind"] == "cgroup_oom" and killer["confidence"] == "certain", killer
    assert "/slurm" in killer["summary"] and "/job_" in killer["summary"], killer  # Slurm's cgroup
    assert doc["victim"]["pid"] == pids[1][0] and doc["victim"]["signal"] == "SIGKILL", doc["victim"]
    # rank 0: the kernel's OOM killer may take it next in the same step cgroup (the kernel's
    # own log says so: same_cause), else Slurm ends it (terminated_by_agent)
    fate = {r["rank"]: r["fate"] for r in doc["ranks"]}[0]
    assert fate == ("same_cause" if oom_killed(pids[0][0]) else "terminated_by_agent"), doc["ranks"]


@requires("slurm")
def test_a_slurm_task_left_waiting_without_kill_on_bad_exit_is_stranded(tmp_path):
    """``srun --kill-on-bad-exit=0``: rank 1 dies; rank 0 waits for it in the store, alive,
    until the step is cancelled. Reported stranded within 30 s: /ranks, the metric, and the
    fate ``stranded`` in the death's postmortem."""
    with (
        DaemonProc(tmp_path, whole_machine=True) as daemon,
        SlurmJob(tmp_path, "sl-strand", hold_mb=50, workers=0, handoff=1, kill_on_bad_exit=False) as job,
    ):
        pids = job.ready()
        daemon.wait_sampled(job, pids)
        assert job.agent_pid > 0  # read while the tasks run
        os.kill(pids[1][0], signal.SIGKILL)
        killed = time.monotonic()
        seen = wait_for(lambda: (j := _ranks_job(daemon, job)) and j["stranded"] and j, 40, "rank 0 stranded")
        took = time.monotonic() - killed
        assert took <= 30, took
        assert seen["stranded"]["ranks"] == ["0"] and seen["stranded"]["dead_ranks"] == ["1"], seen[
            "stranded"
        ]
        counts = {labels["job"]: v for labels, v in daemon.metrics()["trainwatch_job_stranded_ranks"]}
        assert counts[seen["job"]] == 1
        doc = job_postmortem(daemon, victim_rank=1, want_fates=1, job=job)
        doc = wait_for(
            lambda: (d := job_postmortem(daemon, 1, 1, job)) and d["ranks"][0]["fate"] == "stranded" and d,
            20,
            "the fate stranded in the postmortem",
        )
        assert doc["ranks"][0]["stranded_since"] and doc["ranks"][0]["died_at"] is None, doc["ranks"][0]
        assert doc["killer"]["kind"] == "external_signal", doc["killer"]
        print(f"death -> stranded reported under Slurm: {took:.1f} s")
        job.cancel()
        job.proc.wait(60)


@requires("slurm")
def test_trainwatch_run_names_the_death_of_its_own_slurm_step_and_no_other(tmp_path):
    """`trainwatch run -- srun ...` while another step fails beside it: run's postmortem is its
    own step's (rank 1's exception, relayed by srun), named on stderr; the other step's death
    is no business of run's daemon."""
    env = dict(slurm.cluster(), OMP_NUM_THREADS="1")
    cmd = [
        sys.executable, "-m", "sidecar", "run", "--postmortem-dir", str(tmp_path / "pm"), "--port", "0",
        "--interval", "0.5", "--", "srun", "--nodes=1", "--ntasks=2", "--mem=1536M", "--kill-on-bad-exit=1",
        sys.executable, str(TASK_JOB), f"--port={free_port()}", "--hold-mb=30", "--workers=0",
        "--duration=120", "--raise-rank=1", "--raise-after=3",
    ]  # fmt: skip
    with SlurmJob(tmp_path, "sl-other", hold_mb=30, workers=0, raise_rank=0, raise_after=3) as other:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=REPO, env=env)
        other.proc.wait(60)
    assert out.returncode != 0, out.stderr[-3000:]
    assert "rank 1: a bad batch on purpose" in out.stderr  # the task's own words, relayed by srun
    lines = out.stderr.rstrip().splitlines()
    assert lines[-1].startswith("trainwatch: postmortem: trainwatch postmortem "), lines[-5:]
    assert re.match(r"trainwatch: rank 1 \(pid \d+\): python_exception \(certain\)", lines[-2]), lines[-5:]
    (doc,) = [json.loads(p.read_text()) for p in (tmp_path / "pm").glob("*.json")]  # the other step's: none
    assert doc["job"]["launcher"] == "slurm" and doc["victim"]["rank"] == 1, doc["job"]
