"""Other processes' output files, found through /proc/PID/fd and read from where they were."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from sidecar.probes.outputs import read_output, regular_outputs, run_spool


def test_regular_outputs_and_reading_what_was_written_since(tmp_path):
    log = tmp_path / "agent.log"
    log.write_text("an earlier run: failed (exitcode: -9) local_rank: 0 (pid: 1)\n")
    with open(log, "a") as out:
        p = subprocess.Popen(
            [sys.executable, "-c", "import sys, time; input(); print('now', flush=True); time.sleep(30)"],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.PIPE,
            text=True,
        )
    try:
        found = regular_outputs("/proc", p.pid)  # Popen returned: the child's fds are in place
        assert len(found) == 1 and found[0].path == str(log)  # one file for stdout and stderr
        assert found[0].offset == log.stat().st_size
        assert p.stdin is not None
        p.stdin.write("\n")
        p.stdin.flush()
        deadline = time.monotonic() + 5
        while "now" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert read_output("/proc", found[0]) == "now\n"
        assert read_output("/proc", found[0], since_offset=False).startswith("an earlier run")
        with subprocess.Popen(["sleep", "30"], stdout=subprocess.PIPE, stderr=subprocess.PIPE) as piped:
            assert regular_outputs("/proc", piped.pid) == []  # pipes cannot be read back
            piped.kill()
    finally:
        p.kill()
        p.wait()
        assert p.stdin is not None
        p.stdin.close()
    # the process is gone: the file is read by its path, and a replaced file is not read
    assert read_output("/proc", found[0]) == "now\n"
    (tmp_path / "new.log").write_text("another file\n")
    os.replace(tmp_path / "new.log", log)  # logrotate's way: another file under the name
    assert read_output("/proc", found[0]) == ""


def test_a_run_spool_is_found_only_where_an_ancestor_holds_it(tmp_path):
    """`trainwatch run` (here: this test process) holds the spool open and starts the agent
    (a child that waits). The spool is found through this process's descriptor; a path the
    job names that no ancestor holds, or a symlink to the spool, is not opened."""
    spool = tmp_path / "run-1.out"
    fd = os.open(spool, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.write(fd, b"[rank0]: RuntimeError: ...\n")
    other = tmp_path / "secret"
    other.write_text("not the job's output\n")
    (tmp_path / "link").symlink_to(spool)
    agent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        found = run_spool("/proc", agent.pid, str(spool), os.getuid())
        assert found is not None and found.pid == os.getpid() and found.fd == fd and found.offset == 0
        assert read_output("/proc", found) == "[rank0]: RuntimeError: ...\n"
        assert run_spool("/proc", agent.pid, str(other), os.getuid()) is None  # named, held by nobody
        assert run_spool("/proc", agent.pid, str(tmp_path / "link"), os.getuid()) is None
        assert run_spool("/proc", agent.pid, str(spool), os.getuid() + 1) is None  # another user's job
    finally:
        agent.kill()
        agent.wait()
        os.close(fd)
