"""`trainwatch run -- torchrun ...` for real: the job's output passes through unchanged and
is kept as evidence; the exit status is the command's; signals sent to trainwatch reach
the command; the ranks' own words name collective timeouts and exceptions."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from sidecar.front.demo import join_cgroup, memory_cgroup
from tests.support.e2e import REPO, TORCHRUN, WORKLOAD, DaemonProc, survivor_fate_right, wait_for
from tests.support.runs import fates, only_postmortem, trainwatch_run
from tests.support.skips import requires

GIB = 1 << 30


def test_a_rank_that_stops_joining_collectives_is_a_gloo_collective_timeout(tmp_path):
    code, _out, err = trainwatch_run(tmp_path, "--hang-rank=1", "--hang-after=2", "--pg-timeout=5")
    assert code == 1, err[-3000:]  # torchrun's exit status
    # the job's own output reached the terminal unchanged, and trainwatch's lines come last
    assert "[rank0]: RuntimeError:" in err and "Timed out waiting 5000ms" in err
    assert "ChildFailedError" in err
    assert err.rstrip().splitlines()[-1].startswith("trainwatch: postmortem: trainwatch postmortem ")
    doc = only_postmortem(tmp_path)
    killer = doc["killer"]
    assert killer["kind"] == "collective_timeout" and killer["confidence"] == "certain", killer
    assert "gloo all_reduce" in killer["summary"] and "within 5 s" in killer["summary"], killer
    assert "rank 1 never arrived" in killer["summary"], killer
    assert doc["victim"]["rank"] == 0
    assert fates(doc) == {0: "root_cause", 1: "terminated_by_agent"}
    assert any("Timed out waiting 5000ms" in e["detail"] for e in killer["evidence"])
    assert any("TORCH_" in a or "flight recorder" in a for a in doc["advice"]), doc["advice"]
    assert "collective_timeout (certain)" in err


def test_a_python_exception_is_named_by_its_own_line(tmp_path):
    code, _out, err = trainwatch_run(tmp_path, "--raise-rank=1", "--raise-after=2")
    assert code == 1, err[-3000:]
    doc = only_postmortem(tmp_path)
    killer = doc["killer"]
    assert killer["kind"] == "python_exception" and killer["confidence"] == "certain", killer
    assert "ValueError: rank 1: a bad batch on purpose (shape mismatch)" in killer["summary"], killer
    assert doc["victim"]["rank"] == 1
    # rank 0 either died of its peer's closed connection or was torn down by the agent
    assert survivor_fate_right(next(r for r in doc["ranks"] if r["rank"] == 0), err), doc["ranks"]


def test_a_coloured_traceback_behind_a_progress_bar_is_still_the_rank_s_own_words(tmp_path):
    """Rank 1 draws a progress bar with carriage returns and prints its traceback in ANSI
    colours, as a pretty terminal library does: the daemon reads its output through the
    paste reader, so the exception line is found as if it were plain."""
    code, _out, err = trainwatch_run(tmp_path, "--raise-rank=1", "--raise-after=2", "--colour")
    assert code == 1, err[-3000:]
    assert "\x1b[1;31m" in err and "training 3/4" in err  # it really printed colours and a bar
    killer = only_postmortem(tmp_path)["killer"]
    assert killer["kind"] == "python_exception" and killer["confidence"] == "certain", killer
    assert "ValueError: rank 1: a bad batch on purpose (shape mismatch)" in killer["summary"], killer
    assert "\x1b" not in killer["summary"], killer


@pytest.mark.root
@requires("memcg")
def test_an_oom_stays_the_root_cause_when_its_peer_then_fails(tmp_path):
    """Rank 1 is killed by a cgroup limit; rank 0's all_reduce then fails (the peer closed
    its connection, or the timeout): the OOM is the root cause, the cascade is told."""
    with memory_cgroup(int(1.5 * GIB), "trainwatch-cascade") as (_version, _parent, child):
        code, _out, err = trainwatch_run(
            tmp_path,
            "--grow-rank=1",
            "--grow-after=2",
            "--pg-timeout=5",
            wrap=join_cgroup(child),
        )
    assert code == 1, err[-3000:]
    doc = only_postmortem(tmp_path)
    assert doc["killer"]["kind"] == "cgroup_oom" and doc["victim"]["rank"] == 1, doc["killer"]
    assert survivor_fate_right(next(r for r in doc["ranks"] if r["rank"] == 0), err), doc["ranks"]


def test_exit_status_and_usage():
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "sidecar", "run", "--port", "0", *args],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=REPO,
        )

    assert run("--", "sh", "-c", "echo out; echo err >&2; exit 7").returncode == 7
    done = run("--", "sh", "-c", "echo out; echo err >&2; exit 7")
    assert done.stdout == "out\n" and done.stderr == "err\n"  # passed through, nothing added
    assert run("--", "sh", "-c", "kill -TERM $$").returncode == 128 + signal.SIGTERM
    helped = run("--help")
    assert helped.returncode == 0 and helped.stdout.startswith("usage: trainwatch run [options] -- COMMAND")
    bad = run("sh", "-c", "true")
    assert bad.returncode == 2 and bad.stderr.startswith("trainwatch: error: run: give the command after --")
    missing = run("--", "/nonexistent/torchrun")
    assert missing.returncode == 2 and "cannot start /nonexistent/torchrun" in missing.stderr


def test_a_signal_sent_to_trainwatch_reaches_the_command(tmp_path):
    marker = tmp_path / "got"
    ready = tmp_path / "ready"
    script = f"trap 'echo TERM > {marker}; exit 5' TERM; touch {ready}; while :; do sleep 0.1; done"
    proc = subprocess.Popen(
        [sys.executable, "-m", "sidecar", "run", "--port", "0", "--", "sh", "-c", script],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=REPO,
    )
    try:
        # trainwatch blocks the signals it forwards before it starts the command, so once
        # the command has set its trap a SIGTERM to trainwatch must reach it
        wait_for(ready.exists, 30, "the command to set its trap")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 5
        assert marker.read_text() == "TERM\n"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def test_the_node_daemon_and_trainwatch_run_give_one_verdict(tmp_path):
    """A node runs the daemon and a user starts a gloo job under `trainwatch run`; rank 1
    stops joining collectives and rank 0 times out. `run` holds the job's pipes; it keeps a
    copy of the output in a spool the node daemon finds through run's own descriptor. Both
    postmortems name the same killer, confidence and fates, and the daemon's advice does not
    tell the user to run under `trainwatch run`."""
    with DaemonProc(tmp_path) as daemon:
        code, _out, err = trainwatch_run(tmp_path, "--hang-rank=1", "--hang-after=2", "--pg-timeout=5")
        assert code == 1, err[-3000:]
        mine = only_postmortem(tmp_path)
        agent = mine["job"]["agent_pid"]

        def theirs() -> dict | None:
            for entry in json.loads(daemon.get("/postmortems")[1]):
                doc = json.loads(daemon.get(f"/postmortems/{entry['id']}")[1])
                if doc["job"]["agent_pid"] == agent and len(doc["ranks"]) == 2:
                    decided = [r for r in doc["ranks"] if r["fate"] not in ("running", "unknown")]
                    return doc if len(decided) == 2 else None
            return None

        node = wait_for(theirs, 60, "the node daemon's postmortem of the same death")
        log = daemon.log()
    assert "runs under trainwatch run: reading its output from" in log, log[-3000:]
    for doc in (mine, node):
        assert (doc["killer"]["kind"], doc["killer"]["confidence"]) == ("collective_timeout", "certain"), doc[
            "killer"
        ]
    assert node["killer"]["summary"] == mine["killer"]["summary"]
    for name, doc in (("trainwatch run", mine), ("node daemon", node)):  # shown with pytest -s
        print(f"{name}: {doc['id']}: {doc['killer']['kind']} ({doc['killer']['confidence']}): "
              f"{doc['killer']['summary']} fates {fates(doc)}")  # fmt: skip
    assert fates(node) == fates(mine) == {0: "root_cause", 1: "terminated_by_agent"}
    assert not any("trainwatch run" in a for a in node["advice"]), node["advice"]


@pytest.mark.parametrize("traced", [True, False], ids=["tracepoint", "agent-log-only"])
def test_an_agent_signalled_from_outside_is_the_job_s_killer_not_its_teardown(tmp_path, traced):
    """SIGTERM sent to the torchrun agent (as a scheduler or a person does): it tears its
    ranks down. The ranks were ended by the agent, but the job's killer is the signal to
    the agent: seen by the tracepoint (certain, its sender named: this test), or, without
    it, read from the agent's own log through the catalog ("Received 15 death signal"):
    possible, for that word names no sender and an OOM daemon's SIGTERM reads the same."""
    from tests.support.e2e import descendants

    cmd = [
        sys.executable, "-m", "sidecar", "run", "--postmortem-dir", str(tmp_path / "pm"), "--interval", "0.5",
        "--port", "0", "--log-level", "INFO",
        *([] if traced else ["--disable", "tracepoint"]),
        "--", TORCHRUN, "--standalone", "--nproc-per-node=2", "--monitor-interval=0.1", str(WORKLOAD),
        "--hold-mb=30", "--workers=0", "--duration=120", f"--ready-dir={tmp_path}",
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    err_path = tmp_path / "run.err"
    with open(err_path, "w") as err_file:
        job = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=err_file)
    try:

        def agent() -> int | None:
            for pid in descendants(job.pid):
                try:
                    if b"torchrun" in Path(f"/proc/{pid}/cmdline").read_bytes():
                        return pid
                except OSError:
                    continue
            return None

        agent_pid = wait_for(agent, 60, "the torchrun agent")
        wait_for(lambda: len(list(tmp_path.glob("rank*.r0"))) == 2, 60, "both ranks in their loop")
        # and run's daemon sees both (on a loaded machine it may attach after the ranks are ready)
        base = wait_for(
            lambda: re.search(r"serving (http://[\d.]+:\d+)/metrics", err_path.read_text()),
            60,
            "run's server",
        ).group(1)

        def sampled() -> bool:
            with urllib.request.urlopen(base + "/ranks", timeout=10) as r:
                jobs = json.loads(r.read())["jobs"]
            return any(
                j["agent_pid"] == agent_pid and sum(1 for x in j["ranks"] if x["rss_bytes"]) == 2
                for j in jobs
            )

        wait_for(sampled, 60, "run's daemon to sample both ranks")
        os.kill(agent_pid, signal.SIGTERM)
        job.wait(timeout=120)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    err = err_path.read_text()
    doc = only_postmortem(tmp_path)
    killer = doc["killer"]
    assert killer["kind"] == "external_signal", killer
    assert f"agent (pid {agent_pid})" in killer["summary"], killer
    if traced:
        assert killer["confidence"] == "certain", killer
        assert f"by pid {os.getpid()}" in killer["summary"], killer
        assert killer["sender"]["pid"] == os.getpid(), killer["sender"]
    else:  # the agent's word that SIGTERM came names no sender (an OOM daemon's reads the same)
        assert killer["confidence"] == "possible", killer
        assert any(
            "death signal" in e["detail"] or "SignalException" in e["detail"] for e in killer["evidence"]
        )
    assert "terminated_by_agent" in fates(doc).values(), doc["ranks"]
    assert re.search(r"^trainwatch: rank \S+ \(pid \d+\): external_signal", err, re.M), err[-3000:]
