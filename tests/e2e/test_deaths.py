"""Real deaths, produced here, through the real daemon: the opening story (every rank loads
its own copy into a memory cgroup), a rank killed with kill -9 from outside or by its agent,
a global OOM, cgroup and global OOMs told without the kernel log, the demo, a userspace OOM
daemon. A cgroup OOM told with the kernel log, each view of it, is
tests/e2e/scenarios/test_cgroup_oom.py."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

from sidecar.front.demo import join_cgroup, memory_cgroup, memory_hierarchy
from tests.support.e2e import DaemonProc, TorchrunJob, job_postmortem, less_host_memory, survivor_fate_right
from tests.support.skips import left_out, met, requires

GIB = 1 << 30


@pytest.mark.quiet  # four ranks fill 6 GiB: not beside the whole suite
@pytest.mark.root
@requires("memcg", "kmsg")
def test_the_opening_story_every_rank_loads_its_own_copy(tmp_path):
    """DEVELOPERS.md's opening story, scaled to this machine: four ranks each load the same
    2 GiB 'model' into host memory, a 64 MiB shard every 0.8 s (80 MB/s a rank, as from a
    network file system), inside a 6 GiB cgroup limit. trainwatch warns before the kernel
    kills one; the postmortem names the limit, the rank and its pid with certainty, the
    others as torn down by the agent (or same_cause, when the kernel killed one of them
    too before the agent's SIGTERM, or its collective failed first), lists the warning,
    and says every rank held its own full copy."""
    with memory_cgroup(6 * GIB, "trainwatch-story") as (_version, parent, child):
        with (
            DaemonProc(tmp_path) as daemon,
            TorchrunJob(
                tmp_path,
                "story",
                nproc=4,
                wrap=join_cgroup(child),
                hold_mb=50,
                workers=0,
                load_mb=2048,
                load_interval=0.8,
            ) as job,
        ):
            pids = {rank: p[0] for rank, p in job.ready().items()}
            doc = job_postmortem(daemon, victim_rank=None, want_fates=4, job=job, timeout=120)
            job.proc.wait(60)
            text = daemon.get(f"/postmortems/{doc['id']}?format=text")[1]
        k = doc["killer"]
        assert (k["kind"], k["confidence"]) == ("cgroup_oom", "certain"), k
        assert f"/{parent.name}" in k["summary"]
        victim = doc["victim"]
        assert pids[victim["rank"]] == victim["pid"] and victim["exit_code"] == -9
        assert any(e["source"] == "kmsg" and f"pid={victim['pid']}" in e["detail"] for e in k["evidence"])
        # Every rank grows at once: before the agent's SIGTERMs land, the kernel may kill a
        # second one (same_cause, by SIGKILL, with its own record); the rest are torn down.
        ranks = {r["rank"]: r for r in doc["ranks"]}
        assert set(ranks) == {0, 1, 2, 3} and ranks[victim["rank"]]["fate"] == "root_cause"
        dmesg = subprocess.run(["dmesg"], capture_output=True, text=True, check=True).stdout
        # this test's cgroup names its kills (pids wrap at 32768 here: old records reuse them)
        kills = [line for line in dmesg.splitlines() if "oom-kill:" in line and parent.name in line]
        others = [r for n, r in ranks.items() if n != victim["rank"]]
        for r in others:
            killed = any(f"pid={r['pid']}," in line for line in kills) and r["exit_code"] == -9
            # killed too: the same cause; else the agent's SIGTERM, or gloo's report first
            assert r["fate"] == "same_cause" if killed else survivor_fate_right(r, job.output()), r
        # foresight: warned before the kill, against this limit
        assert doc["warnings"], "no warning before the kill"
        died = datetime.fromisoformat(victim["died_at"]).timestamp()
        first = doc["warnings"][0]
        assert datetime.fromisoformat(first["at"]).timestamp() < died - 1, (first, victim["died_at"])
        assert first["limit"]["kind"] == "cgroup" and first["limit"]["path"].endswith(parent.name)
        assert "warned before the death:" in text and "predicted at T-" in text, text
        (tip,) = [a for a in doc["advice"] if "each process loads its own full copy" in a]
        assert tip.startswith("Every rank grew alike and held about the same host memory"), tip
        held = [float(x) for x in re.findall(r"(\d+\.\d) GiB", tip)[:2]]
        assert 1.5 <= held[0] <= held[1] <= 2.6, tip  # each held its own ~2 GiB copy
        (tmp_path / "story.txt").write_text(text)  # the closing note shows it
        assert any(f"/{parent.name} is 6.0 GiB" in a for a in doc["advice"]), doc["advice"]


def test_kill_9_from_outside_is_an_external_signal_not_an_oom(tmp_path):
    with (
        DaemonProc(tmp_path) as daemon,
        TorchrunJob(tmp_path, "kill", hold_mb=50, workers=1) as job,
        TorchrunJob(tmp_path, "bystander", hold_mb=50, workers=0) as other,
    ):
        pids = job.ready()
        other_pids = other.ready()
        daemon.wait_sampled(job, pids)
        daemon.wait_sampled(other, other_pids)
        killer_proc = subprocess.run(
            ["sh", "-c", f"kill -9 {pids[1][0]}; echo $$"], capture_output=True, text=True
        )
        doc = job_postmortem(daemon, victim_rank=1, want_fates=2, job=job)
        job.proc.wait(60)
        if not met("tracefs"):
            left_out("tracefs", "the sender named by the signal tracepoint, certain")
        else:  # the tracepoint names the sender: first-hand, so certain
            assert doc["killer"]["confidence"] == "certain", doc["killer"]
            assert f"pid {killer_proc.stdout.strip()} (sh)" in doc["killer"]["summary"], doc["killer"]
            assert any(e["source"] == "tracepoint" for e in doc["killer"]["evidence"])
        # the other job is untouched and not mentioned
        assert other.proc.poll() is None
        assert not {r["pid"] for r in doc["ranks"]} & {p[0] for p in other_pids.values()}
        assert doc["job"]["agent_pid"] == job.agent_pid
        for entry in json.loads(daemon.get("/postmortems")[1]):
            other_doc = json.loads(daemon.get(f"/postmortems/{entry['id']}")[1])
            assert other_doc["job"]["agent_pid"] != other.agent_pid
        killer = doc["killer"]
        assert killer["kind"] == "external_signal", killer
        assert killer["confidence"] in ("certain", "likely", "possible") and "SIGKILL" in killer["summary"]
        assert doc["victim"]["pid"] == pids[1][0]
        rows = {r["rank"]: r for r in doc["ranks"]}
        assert rows[1]["fate"] == "root_cause" and survivor_fate_right(rows[0], job.output()), rows
        m = daemon.metrics()
        killers = {
            labels["killer"]: v
            for labels, v in m["trainwatch_rank_deaths_total"]
            if labels["job"] == doc["job"]["key"]
        }
        # each death counted once, under its fate's killer (the survivor's, the agent's or the same)
        if rows[0]["fate"] == "terminated_by_agent":
            assert killers == {"external_signal": 1, "agent_teardown": 1}, killers
        else:
            assert killers == {"external_signal": 2}, killers
        assert daemon.stop() == 0


def test_the_agents_sigkill_after_an_ignored_sigterm_is_teardown(tmp_path):
    """Rank 0 ignores SIGTERM; torchrun SIGKILLs it 30 s after the SIGTERM: a -9 that is
    not an OOM and not the root cause."""
    with (
        DaemonProc(tmp_path) as daemon,
        TorchrunJob(tmp_path, "stubborn", hold_mb=50, workers=0, ignore_sigterm_rank=0) as job,
    ):
        pids = job.ready()
        daemon.wait_sampled(job, pids)
        os.kill(pids[1][0], signal.SIGKILL)
        job.proc.wait(90)
        doc = job_postmortem(daemon, victim_rank=1, want_fates=2, job=job)
        r0 = next(r for r in doc["ranks"] if r["rank"] == 0)
        assert r0["signal"] == "SIGKILL" and r0["fate"] == "terminated_by_agent", r0
        assert doc["killer"]["kind"] == "external_signal" and doc["victim"]["rank"] == 1
        assert daemon.stop() == 0


@pytest.mark.isolated  # run alone: the whole machine runs out of memory
@pytest.mark.root
@requires("global-oom", "kmsg")
def test_global_oom_is_kernel_oom(tmp_path):
    """The whole machine runs out of memory; the growing rank has oom_score_adj=1000, so
    the kernel's OOM killer takes it and nothing else. All but 3 GiB of the available
    memory is held back in the huge page pool first (less_host_memory), so the rank
    fills 3 GiB rather than the whole machine."""
    with (
        less_host_memory(3 * GIB),
        DaemonProc(tmp_path) as daemon,
        TorchrunJob(
            tmp_path, "global", hold_mb=50, workers=0, grow_rank=1, grow_after=2, duration=600
        ) as job,
    ):
        pids = job.ready()
        doc = job_postmortem(daemon, victim_rank=1, want_fates=2, job=job, timeout=240)
        job.proc.wait(60)
        killer = doc["killer"]
        assert killer["kind"] == "kernel_oom" and killer["confidence"] == "certain", killer
        assert doc["victim"]["pid"] == pids[1][0]
        rows = {r["rank"]: r for r in doc["ranks"]}
        assert rows[1]["fate"] == "root_cause" and survivor_fate_right(rows[0], job.output()), rows
        assert any("global_oom" in e["detail"] or "Out of memory" in e["detail"] for e in killer["evidence"])
        assert daemon.stop() == 0
    # The same death after the fact, from the torchrun log and the kernel log alone.
    dmesg = subprocess.run(["dmesg", "-T"], capture_output=True, text=True, check=True).stdout
    r = subprocess.run(
        [sys.executable, "-m", "sidecar", "diagnose", "--format", "json", str(job.dir / "torchrun.log"), "-"],
        input=dmesg,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    diag = json.loads(r.stdout)
    assert (diag["killer"]["kind"], diag["killer"]["confidence"]) == ("kernel_oom", "certain"), diag["killer"]
    assert diag["victim"]["pid"] == pids[1][0]
    assert survivor_fate_right({row["pid"]: row for row in diag["ranks"]}[pids[0][0]], job.output())


@pytest.mark.root
@requires("memcg")
def test_without_the_kernel_log_a_cgroup_oom_is_told_by_its_counters(tmp_path):
    """No kernel log and no tracepoint (a container without CAP_SYSLOG): a rank over a real
    cgroup limit is named by the counters alone, at likely: the cgroup's oom_kill moved and
    its limit was reached (v1 failcnt, v2 memory.events oom)."""
    with memory_cgroup(int(1.5 * GIB), "trainwatch-blind") as (_version, parent, child):
        with (
            DaemonProc(tmp_path, "--disable", "kmsg", "--disable", "tracepoint") as daemon,
            TorchrunJob(
                tmp_path, "blind", wrap=join_cgroup(child), hold_mb=50, workers=0, grow_rank=1, grow_after=2
            ) as job,
        ):
            pids = job.ready()
            doc = job_postmortem(daemon, victim_rank=1, want_fates=2, job=job)
            job.proc.wait(60)
        killer = doc["killer"]
        assert (killer["kind"], killer["confidence"]) == ("cgroup_oom", "likely"), killer
        assert f"/{parent.name}" in killer["summary"] and "reached its limit" in killer["summary"], killer
        assert doc["victim"]["pid"] == pids[1][0] and doc["victim"]["exit_code"] == -9
        assert any("limit reached" in e["detail"] for e in killer["evidence"]), killer["evidence"]
        assert not any(e["source"] == "kmsg" for e in killer["evidence"])


@pytest.mark.isolated  # run alone: the whole machine runs out of memory
@pytest.mark.root
@pytest.mark.parametrize("limit", [None, 64 * GIB], ids=["unlimited", "limit-never-reached"])
@requires("global-oom", "memcg")
def test_without_the_kernel_log_a_global_oom_is_no_cgroup_oom(tmp_path, limit):
    """The global OOM killer's kill of a rank moves its cgroup's oom_kill counter too (the
    counter counts kills by any OOM killer). Read from the counters alone (no kernel log, no
    tracepoint), the kill is never the cgroup's own OOM: its limit was never reached. With no
    limit above the rank only the global killer can have killed it (likely); under a limit it
    did not reach, a wider limit above could have too (possible)."""
    with (
        memory_cgroup(limit, "trainwatch-global") as (_version, _parent, child),
        less_host_memory(3 * GIB),
        DaemonProc(tmp_path, "--disable", "kmsg", "--disable", "tracepoint") as daemon,
        TorchrunJob(
            tmp_path,
            "global",
            wrap=join_cgroup(child),
            hold_mb=50,
            workers=0,
            grow_rank=1,
            grow_after=2,
            duration=600,
        ) as job,
    ):
        pids = job.ready()
        doc = job_postmortem(daemon, victim_rank=1, want_fates=2, job=job, timeout=240)
        job.proc.wait(60)
        assert daemon.stop() == 0
    killer = doc["killer"]
    want = ("kernel_oom", "likely" if limit is None else "possible")
    assert (killer["kind"], killer["confidence"]) == want, killer
    assert doc["victim"]["pid"] == pids[1][0] and doc["victim"]["exit_code"] == -9
    if limit is not None:
        assert "never reached its limit" in killer["summary"], killer


def test_demo_ends_with_a_postmortem(tmp_path):
    """`trainwatch demo`, the README's first command: a real job, a real limit (or a kill
    from outside without root), the postmortem printed, the HTML view written."""
    out = subprocess.run(
        [sys.executable, "-m", "sidecar", "demo"], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stdout + out.stderr
    expected = "killer: cgroup_oom (certain)" if memory_hierarchy() else "killer: external_signal"
    assert expected in out.stdout, out.stdout
    # the survivor's fate as it really ended: torn down by torchrun, or its own exit or the
    # OOM killer's next kill first (same_cause), as the postmortem the demo printed says
    printed = re.search(r"trainwatch postmortem (\S+\.json)", out.stdout)
    assert printed, out.stdout
    saved = Path(printed[1])
    rows = {r["rank"]: r for r in json.loads(saved.read_text())["ranks"]}
    assert rows[1]["fate"] == "root_cause", rows
    assert survivor_fate_right(rows[0], (saved.parents[1] / "torchrun.log").read_text()), rows[0]
    assert rows[0]["fate"] in out.stdout and "root_cause" in out.stdout
    html = next(line.split("file://", 1)[1] for line in out.stdout.splitlines() if "file://" in line)
    assert Path(html).read_text().startswith("<!doctype html>")


@requires("tracefs")
def test_a_userspace_oom_daemon_is_named_by_the_tracepoint(tmp_path):
    """A stand-in for earlyoom (a process whose comm is earlyoom) SIGKILLs a rank."""
    daemon_script = tmp_path / "earlyoom"
    daemon_script.write_text('#!/bin/sh\nkill -9 "$1"\n')
    daemon_script.chmod(0o755)
    with DaemonProc(tmp_path) as daemon, TorchrunJob(tmp_path, "eo", hold_mb=50, workers=0) as job:
        pids = job.ready()
        daemon.wait_sampled(job, pids)
        subprocess.run([str(daemon_script), str(pids[1][0])], check=True)
        doc = job_postmortem(daemon, victim_rank=1, want_fates=2, job=job)
        job.proc.wait(60)
        killer = doc["killer"]
        assert killer["kind"] == "userspace_oom" and killer["confidence"] == "certain", killer
        assert "earlyoom" in killer["summary"]
        assert daemon.stop() == 0
