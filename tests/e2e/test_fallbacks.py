"""Real deaths told by the fallbacks: exits through pidfds when the process connector is
off, exit codes from the agent's own log when neither is there, and userspace OOM
daemons named by their own records (a real earlyoom's log, systemd-oomd's cgroup xattrs,
oomd's kernel-log line) when the signal tracepoint is off."""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from sidecar.front.demo import join_cgroup, memory_cgroup
from tests.support.e2e import REPO, DaemonProc, TorchrunJob, job_postmortem, survivor_fate_right, wait_for
from tests.support.skips import met, requires, skip

GIB = 1 << 30
EARLYOOM = REPO / ".cache" / "earlyoom" / "usr" / "bin" / "earlyoom"


def _fates(doc: dict) -> dict[int, str]:
    return {r["rank"]: r["fate"] for r in doc["ranks"]}


def test_without_the_connector_pidfds_tell_the_exit(tmp_path):
    with (
        DaemonProc(tmp_path, "--disable", "connector", "--disable", "tracepoint") as daemon,
        TorchrunJob(tmp_path, "pidfd", hold_mb=50, workers=0) as job,
    ):
        pids = job.ready()
        daemon.wait_sampled(job, pids)
        os.kill(pids[1][0], 9)
        doc = job_postmortem(daemon, victim_rank=1, want_fates=2, job=job)
        job.proc.wait(60)
        assert "exits: watching each rank through a pidfd" in daemon.log()
        assert "process connector subscribed" not in daemon.log()
        victim = next(r for r in doc["ranks"] if r["rank"] == 1)
        assert victim["exit_code"] == -9 and victim["exit_source"] == "pidfd", victim
        assert doc["killer"]["evidence"][0]["source"] == "pidfd"
        assert doc["killer"]["kind"] == "external_signal", doc["killer"]
        rows = {r["rank"]: r for r in doc["ranks"]}
        assert rows[1]["fate"] == "root_cause" and survivor_fate_right(rows[0], job.output()), rows
        assert rows[0]["exit_source"] == "pidfd", rows[0]
        assert daemon.stop() == 0


def test_with_neither_connector_nor_pidfd_the_agents_log_gives_the_codes(tmp_path):
    """The agent's stderr is a regular file (torchrun.log): its "failed (exitcode: -9)"
    line and failure table give the statuses the sampler could not see (the agent reaps
    within 0.1 s; the sampler looks every 2 s)."""
    with (
        DaemonProc(
            tmp_path, "--disable", "connector", "--disable", "pidfd", "--disable", "tracepoint", interval=2.0
        ) as daemon,
        TorchrunJob(tmp_path, "agentlog", hold_mb=50, workers=0) as job,
    ):
        pids = job.ready()
        daemon.wait_sampled(job, pids)
        os.kill(pids[1][0], 9)
        job.proc.wait(60)

        def coded():
            doc = job_postmortem(daemon, victim_rank=1, want_fates=1, job=job)
            ranks = {r["rank"]: r for r in doc["ranks"]}
            return doc if ranks[1]["exit_code"] == -9 and ranks[0]["exit_code"] is not None else None

        doc = wait_for(coded, 60, "the exit codes from the agent's log", 0.5)
        ranks = {r["rank"]: r for r in doc["ranks"]}
        sources = {ranks[0]["exit_source"], ranks[1]["exit_source"]}
        assert sources <= {"agent-log", "proc"} and "agent-log" in sources, ranks
        assert doc["killer"]["kind"] == "external_signal", doc["killer"]
        assert ranks[1]["fate"] == "root_cause" and survivor_fate_right(ranks[0], job.output()), ranks
        assert daemon.stop() == 0


def test_a_clean_end_without_exit_statuses_writes_no_postmortem(tmp_path):
    """The other side of the same fallback: when training simply ends, every rank
    vanishes with no status known; the agent's log names no failure, so no incident."""
    with (
        DaemonProc(tmp_path, "--disable", "connector", "--disable", "pidfd", interval=0.5) as daemon,
        TorchrunJob(tmp_path, "clean", hold_mb=50, workers=0) as job,
    ):
        pids = job.ready()
        daemon.wait_sampled(job, pids)
        assert job.stop() == 0
        # Either a rank's clean exit was seen as a zombie (status 0: nothing to judge) or it
        # vanished with its status unknown and the agent's clean exit and log cleared it.
        # Wait for the daemon to let go of the agent, and for its decision on any death it saw.

        def decided() -> str | None:
            log = daemon.log()
            if f"agent pid {job.agent_pid} exited, detached" not in log:
                return None
            opened = any(f"(pid {p[0]}) died" in log for p in pids.values())
            written = re.search(r"job \S+: postmortem \S+: ", log)
            return log if not opened or "clean end: no postmortem" in log or written else None

        log = wait_for(decided, 30, "the daemon to detach the agent and decide on the ranks' ends")
        opened = any(f"(pid {p[0]}) died" in log for p in pids.values())
        assert not opened or "clean end: no postmortem" in log, log[-3000:]
        for entry in json.loads(daemon.get("/postmortems")[1]):
            doc = json.loads(daemon.get(f"/postmortems/{entry['id']}")[1])
            assert doc["job"]["agent_pid"] != job.agent_pid, doc["killer"]
        assert daemon.stop() == 0


def test_the_ranks_error_file_gives_the_exception_when_no_output_is_read(tmp_path):
    """An entrypoint under @record writes its exception to TORCHELASTIC_ERROR_FILE (torchrun
    points each rank at its own). With no output read (--disable outputs: as when the ranks
    write to a terminal or a pipe), that record still names the exception, first-hand."""
    with (
        DaemonProc(tmp_path, "--disable", "outputs") as daemon,
        TorchrunJob(
            tmp_path, "errfile", hold_mb=50, workers=0, raise_rank=1, raise_after=1.0, record=1
        ) as job,
    ):
        job.ready()
        doc = job_postmortem(daemon, victim_rank=1, want_fates=2, job=job)
        job.proc.wait(60)
    killer = doc["killer"]
    assert (killer["kind"], killer["confidence"]) == ("python_exception", "certain"), killer
    assert "ValueError: rank 1: a bad batch on purpose (shape mismatch)" in killer["summary"]
    cited = [e for e in killer["evidence"] if e["source"] == "error_file"]
    assert cited and cited[0]["detail"].endswith(
        "error.json: ValueError: rank 1: a bad batch on purpose (shape mismatch)"
    )
    rows = {r["rank"]: r for r in doc["ranks"]}
    assert rows[1]["fate"] == "root_cause" and survivor_fate_right(rows[0], job.output()), rows
    assert not any("could not be read" in a for a in doc["advice"])
    # the same death without @record: nothing first-hand, so only "possible", and the advice
    # says how to make the ranks' words readable next time
    (tmp_path / "b").mkdir()
    with (
        DaemonProc(tmp_path / "b", "--disable", "outputs") as daemon,
        TorchrunJob(tmp_path, "noerrfile", hold_mb=50, workers=0, raise_rank=1, raise_after=1.0) as job,
    ):
        job.ready()
        doc = job_postmortem(daemon, victim_rank=1, want_fates=2, job=job)
        job.proc.wait(60)
    assert (doc["killer"]["kind"], doc["killer"]["confidence"]) == ("python_exception", "possible")
    assert any("could not be read" in a and "TORCHELASTIC_ERROR_FILE" in a for a in doc["advice"])


def test_per_rank_log_files_of_torchrun_redirects_are_read(tmp_path):
    """torchrun --log-dir DIR --redirects 3: each rank's stdout and stderr are files of their
    own, and the agent's output holds none of the ranks' words. The daemon finds those files
    through /proc/PID/fd/1 and /2 and reads the exception there."""
    logs = tmp_path / "rank-logs"
    with (
        DaemonProc(tmp_path) as daemon,
        TorchrunJob(
            tmp_path,
            "redirects",
            launcher_args=(f"--log-dir={logs}", "--redirects=3"),
            hold_mb=50,
            workers=0,
            raise_rank=1,
            raise_after=1.0,
        ) as job,
    ):
        job.ready()
        doc = job_postmortem(daemon, victim_rank=1, want_fates=2, job=job)
        job.proc.wait(60)
    agent_out = (job.dir / "torchrun.log").read_text()
    assert "a bad batch on purpose" not in agent_out  # the words are only in the rank's own file
    stderr_files = [p for p in logs.rglob("stderr.log") if "a bad batch on purpose" in p.read_text()]
    assert stderr_files, sorted(str(p) for p in logs.rglob("*"))
    killer = doc["killer"]
    assert (killer["kind"], killer["confidence"]) == ("python_exception", "certain"), killer
    assert "ValueError: rank 1: a bad batch on purpose (shape mismatch)" in killer["summary"]
    # rank 0 is SIGTERMed by the agent, or fails first in gloo for its peer's exit (a race):
    # its words are in its own stderr file, never in the agent's output
    rows = {r["rank"]: r for r in doc["ranks"]}
    own = "".join(p.read_text(errors="replace") for p in logs.rglob("stderr.log"))
    assert rows[1]["fate"] == "root_cause" and survivor_fate_right(rows[0], own), rows


def _mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no MemAvailable")


@pytest.mark.isolated  # run alone: earlyoom's threshold is the machine's free memory
@requires("earlyoom", "free-memory")
@pytest.mark.parametrize("tracepoint", [False, True], ids=["by-its-log", "by-the-tracepoint"])
def test_a_real_earlyoom_is_named(tmp_path, tracepoint):
    """A real earlyoom, told to act 1.5 GiB below the memory available now, SIGTERMs the
    growing rank (oom_score_adj=1000: its first choice). With the tracepoint off the verdict
    comes from earlyoom's own log line naming the pid; with it on, from the signal's sender,
    which the catalogue knows as earlyoom."""
    if tracepoint and not met("tracefs"):
        skip("tracefs", "the tracepoint's view of a real earlyoom")
    threshold_kib = (_mem_available() - int(1.5 * GIB)) // 1024
    log_path = tmp_path / "earlyoom.log"
    with (
        DaemonProc(tmp_path, *(() if tracepoint else ("--disable", "tracepoint"))) as daemon,
        TorchrunJob(tmp_path, "eo", hold_mb=50, workers=0, grow_rank=1, grow_after=3, grow_mb=16) as job,
    ):
        pids = job.ready()
        with open(log_path, "w") as out:
            earlyoom = subprocess.Popen(
                [str(EARLYOOM), "-M", f"{threshold_kib},{threshold_kib - (1 << 20)}", "-s", "100", "-r", "0"],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        try:
            doc = job_postmortem(daemon, victim_rank=1, want_fates=2, job=job)
        finally:
            earlyoom.terminate()
            earlyoom.wait(10)
        job.proc.wait(60)
        text = log_path.read_text()
        assert f"sending SIGTERM to process {pids[1][0]}" in text, text
        killer = doc["killer"]
        assert killer["kind"] == "userspace_oom" and killer["confidence"] == "certain", killer
        assert "earlyoom" in killer["summary"]
        if tracepoint:
            sender = killer["sender"]
            assert (sender["tool"], sender["pid"], sender["comm"]) == (
                "earlyoom",
                earlyoom.pid,
                "earlyoom",
            ), sender
            assert sender["exe"] == os.path.realpath(EARLYOOM), sender  # the kernel reports it resolved
        else:
            assert any(e["source"] == "log" and str(pids[1][0]) in e["detail"] for e in killer["evidence"]), (
                killer
            )
        assert doc["victim"]["signal"] == "SIGTERM"
        rows = {r["rank"]: r for r in doc["ranks"]}
        assert rows[1]["fate"] == "root_cause", json.dumps(doc["ranks"])
        # memory can stay below earlyoom's threshold for a moment after its first kill: where
        # its own log says it SIGTERMed rank 0 too, rank 0 died of the same cause, else the
        # agent ended it (a race on a loaded machine; each outcome has its word)
        if f"sending SIGTERM to process {pids[0][0]}" in text:
            assert rows[0]["fate"] == "same_cause", json.dumps(doc["ranks"])
        else:
            assert survivor_fate_right(rows[0]), json.dumps(doc["ranks"])
        assert daemon.stop() == 0


def _kill_cgroup(tmp: Path, name: str, cgroup: Path, script: str) -> Path:
    """A stand-in for a userspace OOM daemon (its comm is ``name``) that does what the
    daemon does to the cgroup it picks: ``script`` marks it, then every process in it
    gets SIGKILL."""
    (tmp / "bin").mkdir(exist_ok=True)
    exe = tmp / "bin" / name
    exe.write_text(
        f'#!/bin/sh\n{script}\nfor p in $(cat {cgroup}/cgroup.procs); do kill -9 "$p" 2>/dev/null; done\n'
    )
    exe.chmod(0o755)
    return exe


def _cgroup_wide_kill(tmp: Path, name: str, mark: Callable[[Path], str]) -> tuple[dict, str]:
    """A job in its own memory cgroup, killed whole by the stand-in ``name`` after it ran
    ``mark(cgroup)``; the tracepoint is off, so only the daemon's own record can tell.
    Returns the postmortem (checked for a userspace_oom, likely, that took both ranks)
    and the cgroup's path."""
    with memory_cgroup(8 * GIB, f"trainwatch-{name}") as (_version, parent, child):
        stand_in = _kill_cgroup(tmp, name, child, mark(child))
        with (
            DaemonProc(tmp, "--disable", "tracepoint") as daemon,
            TorchrunJob(tmp, name, wrap=join_cgroup(child), hold_mb=50, workers=0) as job,
        ):
            daemon.wait_sampled(job, job.ready())
            subprocess.run([str(stand_in)], check=True)
            doc = job_postmortem(daemon, victim_rank=None, want_fates=2, job=job)
            killer = doc["killer"]
            assert killer["kind"] == "userspace_oom" and killer["confidence"] == "likely", killer
            assert sorted(_fates(doc).values()) == ["root_cause", "same_cause"], doc["ranks"]
            assert daemon.stop() == 0
        return doc, "/" + str(child.relative_to(parent.parent))


CGROUPS_AS_ROOT = requires("memcg")


@pytest.mark.root
@CGROUPS_AS_ROOT
def test_systemd_oomd_is_named_by_its_cgroup_xattrs(tmp_path):
    """systemd-oomd marks the cgroup it kills (user.oomd_ooms, then user.oomd_kill) and
    SIGKILLs every process in it. The record names the cgroup, not the pid: likely."""
    doc, _ = _cgroup_wide_kill(
        tmp_path,
        "systemd-oomd",
        lambda cg: f"python3 -c \"import os; os.setxattr('{cg}', 'user.oomd_ooms', b'1')\"",
    )
    killer = doc["killer"]
    assert "systemd-oomd" in killer["summary"]
    marks = [e["detail"] for e in killer["evidence"] if e["source"] == "xattr"]
    assert marks and "user.oomd_ooms 0 -> 1" in marks[0], killer


@pytest.mark.root
@CGROUPS_AS_ROOT
@requires("kmsg-write")
def test_oomd_is_named_by_its_kernel_log_line(tmp_path):
    """Meta's oomd writes "oomd kill: <pressures> <cgroup> ..." into the kernel log, then
    kills the cgroup."""

    def line(cg: Path) -> str:
        rel = cg.relative_to(cg.parent.parent)
        return f"echo 'oomd kill: 81.28 80.05 42.78 {rel} 1000 ruleset:[trainwatch test]' > /dev/kmsg"

    doc, path = _cgroup_wide_kill(tmp_path, "oomd", line)
    killer = doc["killer"]
    lines = [e["detail"] for e in killer["evidence"] if e["source"] == "kmsg"]
    assert lines and "oomd kill:" in lines[0], killer
    assert path in killer["summary"] and "oomd" in killer["summary"]
