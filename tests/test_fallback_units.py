"""The fallbacks' parts on real text and real processes: the torchrun agent's lines (the
device captures, the public logs), userspace OOM daemons' lines (a real earlyoom's
output), pidfds on real processes, other processes' output files, cgroup xattrs, the
autopsy's userspace-OOM rules, and --disable."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from sidecar.autopsy import Evidence, RankState, UserspaceKill, autopsy
from sidecar.cli import parse_args
from sidecar.demo import memory_cgroup
from sidecar.errors import ConfigError
from sidecar.model import wait_status_from_returncode
from sidecar.parse.oomd import parse_userspace_oom_line
from sidecar.parse.torchrun import (
    ClosingSignal,
    DeathSignal,
    Escalation,
    FailureEntry,
    WorkerFailed,
    exit_codes_by_pid,
    parse_agent_text,
)
from sidecar.probes.cgroup import CgroupReader
from sidecar.probes.outputs import read_output, regular_outputs
from sidecar.watch.exits import ExitEvent
from sidecar.watch.pidfds import PidfdWatcher, pidfd_exit_status
from tests.paths import CAPTURES
from tests.paths import PUBLIC_CASES as PUBLIC
from tests.skips import requires

S = 10**9

# -- the agent's lines -------------------------------------------------------------


def test_agent_output_of_torch_2_11_gives_every_ranks_exit_code():
    """Capture A (H200, torch 2.11): rank 2 SIGKILLed itself; rank 0 ignored SIGTERM and was
    SIGKILLed 30 s later; rank 1 died of SIGTERM; rank 3 exited 143 from a handler."""
    capture = json.loads((CAPTURES / "torchrun-A.json").read_text())
    text = "\n".join(re.sub(r"^\d+\.\d+ ", "", line) for line in capture["agent_output"])
    records = parse_agent_text(text)
    assert [r.pid for r in records if isinstance(r, ClosingSignal)] == [576, 577, 579]
    assert all(r.signal == signal.SIGTERM for r in records if isinstance(r, ClosingSignal))
    assert [(r.pid, r.from_signal, r.to_signal) for r in records if isinstance(r, Escalation)] == [
        (576, 15, 9)
    ]
    failed = [r for r in records if isinstance(r, WorkerFailed)]
    assert [(r.exitcode, r.local_rank, r.pid) for r in failed] == [(-9, 2, 578)]
    entries = {r.pid: r for r in records if isinstance(r, FailureEntry)}
    assert {pid: (e.rank, e.exitcode) for pid, e in entries.items()} == {
        576: (0, -9),
        577: (1, -15),
        579: (3, 143),
        578: (2, -9),
    }
    assert [pid for pid, e in entries.items() if e.root_cause] == [578]
    assert entries[576].traceback == "Signal 9 (SIGKILL) received by PID 576"
    assert entries[576].error_file == "<N/A>" and entries[578].time == "2026-12-02_11:52:51"
    codes = exit_codes_by_pid(records)
    assert {pid: rc for pid, (rc, _) in codes.items()} == {578: -9, 576: -9, 577: -15, 579: 143}
    assert "failed (exitcode: -9) local_rank: 2 (pid: 578)" in codes[578][1]


def test_agent_lines_of_older_torch_and_glued_tables():
    cases = {c["id"]: c for c in map(json.loads, PUBLIC.read_text().splitlines())}

    def agent_text(case_id: str) -> str:
        return "\n".join(e["text"] for e in cases[case_id]["evidence"] if e["kind"] == "torchrun_log")

    old = parse_agent_text(agent_text("colossalai-3514-rank0-agent-sigterm"))  # 1.x logger prefix
    assert [r.pid for r in old if isinstance(r, ClosingSignal)] == [812914, 812915, 812916]
    assert [(r.exitcode, r.local_rank, r.pid) for r in old if isinstance(r, WorkerFailed)] == [
        (-9, 3, 812917)
    ]
    glued = parse_agent_text(agent_text("amvur-2-rank2-sigkill-growing-ram"))  # lines run together
    entry = next(r for r in glued if isinstance(r, FailureEntry))
    assert (entry.rank, entry.local_rank, entry.exitcode, entry.pid, entry.root_cause) == (
        2,
        2,
        -9,
        36071,
        True,
    )
    hup = parse_agent_text(agent_text("msswift-5884-sighup-torch25"))  # 2.5 glog style
    assert [r.signal for r in hup if isinstance(r, ClosingSignal)] == [signal.SIGHUP, signal.SIGHUP]
    assert any(isinstance(r, DeathSignal) for r in hup)


def test_torchrun_exitcodes_become_wait_statuses():
    for rc, status in ((-9, 9), (-15, 15), (-6, 6), (143, 143 << 8), (1, 256), (0, 0)):
        assert wait_status_from_returncode(rc) == status
        assert ExitEvent(1, status, 0, 0).returncode == rc


# -- userspace OOM daemons' lines ---------------------------------------------------

# printed by the real earlyoom 1.7 binary here (--dryrun); the newer form as earlyoom 1.8
# writes it (oom_score, cmdline)
EARLYOOM_17 = 'sending SIGTERM to process 1137 uid 0 "bash": badness 666, VmRSS 4 MiB'
EARLYOOM_18 = (
    'sending SIGKILL to process 4242 uid 1000 "python": oom_score 1000, VmRSS 20480 MiB, '
    'cmdline "/usr/bin/python train.py --lr 1e-4"'
)
SYSTEMD_OOMD = (
    "Killed /user.slice/user-1000.slice/user@1000.service/app.slice/train.scope due to memory "
    "pressure for /user.slice/user-1000.slice/user@1000.service being 52.34% > 50.00% for > 20s "
    "with reclaim activity"
)
OOMD = (
    "oomd kill: 81.28 80.05 42.78 workload.slice/train.service 1000 ruleset:[protect host] detector:pressure"
)


def test_userspace_oom_lines():
    a = parse_userspace_oom_line(EARLYOOM_17)
    assert a is not None and (a.daemon, a.pid, a.signal, a.comm, a.rss_bytes) == (
        "earlyoom",
        1137,
        signal.SIGTERM,
        "bash",
        4 << 20,
    )
    b = parse_userspace_oom_line(EARLYOOM_18)
    assert b is not None and (b.pid, b.signal, b.rss_bytes) == (4242, signal.SIGKILL, 20480 << 20)
    c = parse_userspace_oom_line(SYSTEMD_OOMD)
    assert c is not None and c.daemon == "systemd-oomd" and c.pid is None
    assert c.cgroup == "/user.slice/user-1000.slice/user@1000.service/app.slice/train.scope"
    d = parse_userspace_oom_line(OOMD)
    assert d is not None and (d.daemon, d.cgroup) == ("oomd", "/workload.slice/train.service")
    for other in ("low memory! at or below SIGTERM limits: mem 10.00%", "oomd: running", ""):
        assert parse_userspace_oom_line(other) is None


def _rank(label: str, pid: int, code: int | None, died: int | None, cgroup: str = "/job") -> RankState:
    return RankState(label, int(label), int(label), pid, (), code, died, cgroup, None, "connector")


def test_autopsy_userspace_records():
    r0, r1 = _rank("0", 100, 9, 10 * S + 5), _rank("1", 101, 9, 10 * S)
    by_pid = UserspaceKill("earlyoom", 101, None, 9, None, EARLYOOM_18, "log")
    v = autopsy(Evidence((r0, r1), userspace=(by_pid,)))
    assert v is not None and (v.kind, v.confidence, v.victim.pid) == ("userspace_oom", "certain", 101)
    assert v.fates == {"1": "root_cause", "0": "terminated_by_agent"}  # the line names 101 only
    by_cgroup = UserspaceKill("systemd-oomd", None, "/", 9, None, SYSTEMD_OOMD, "xattr")
    v = autopsy(Evidence((r0, r1), userspace=(by_cgroup,)))
    assert v is not None and (v.kind, v.confidence) == ("userspace_oom", "likely")
    assert v.fates == {"1": "root_cause", "0": "same_cause"}
    elsewhere = UserspaceKill("systemd-oomd", None, "/other", 9, None, SYSTEMD_OOMD, "xattr")
    other_pid = UserspaceKill("earlyoom", 555, None, 9, None, EARLYOOM_18, "log")
    v = autopsy(Evidence((r0, r1), userspace=(elsewhere, other_pid)))
    assert v is not None and v.kind == "external_signal"  # never a guess from another's record
    # a SIGSEGV is not what OOM daemons send, even when a record names the cgroup
    v = autopsy(Evidence((_rank("0", 100, 11, S),), userspace=(by_cgroup,)))
    assert v is not None and v.kind == "segfault"
    # the exit's source is told in the first evidence item
    told = autopsy(Evidence((RankState("0", 0, 0, 7, (), 9, S, None, None, "agent-log"),)))
    assert told is not None and told.evidence[0].source == "agent-log"
    assert "from the agent's log" in told.evidence[0].detail


def test_without_first_hand_times_the_agents_teardown_decides_the_root_cause():
    """Both deaths noticed in one sampler round, rank 0 "first": the agent's log says it
    sent rank 0 its closing SIGTERM, so rank 1 is the root cause."""
    r0 = RankState("0", 0, 0, 100, (), 15, 10 * S, "/job", None, "agent-log")
    r1 = RankState("1", 1, 1, 101, (), 9, 10 * S + 1, "/job", None, "agent-log")
    v = autopsy(Evidence((r0, r1), agent_teardown=frozenset({100})))
    assert v is not None and v.victim.pid == 101 and v.kind == "external_signal"
    assert v.fates == {"0": "terminated_by_agent", "1": "root_cause"}
    v = autopsy(Evidence((r0, r1)))
    assert v is not None and v.victim.pid == 100  # without it, the noticed order decides


# -- pidfds --------------------------------------------------------------------------


def _kernel() -> tuple[int, int]:
    major, minor = re.match(r"(\d+)\.(\d+)", os.uname().release).groups()  # type: ignore[union-attr]
    return int(major), int(minor)


def _start_ticks(pid: int) -> int:
    data = Path(f"/proc/{pid}/stat").read_bytes()
    return int(data[data.rindex(b")") + 2 :].split()[19])


class _Collect:
    def __init__(self) -> None:
        self.exits: list[ExitEvent] = []
        self.unknown: list[int] = []
        self.done = threading.Event()

    def on_exit(self, e: ExitEvent) -> None:
        self.exits.append(e)
        self.done.set()

    def on_unknown(self, pid: int, ns: int) -> None:
        self.unknown.append(pid)
        self.done.set()


@pytest.mark.parametrize("reap_at_once", [False, True])
def test_pidfd_watcher_tells_a_kill_with_its_status(reap_at_once):
    """A real process SIGKILLed: the status comes from the zombie, or (reaped at once,
    before the watcher looks) from PIDFD_GET_INFO on 6.15+; otherwise it is unknown."""
    got = _Collect()
    watcher = PidfdWatcher(got.on_exit, got.on_unknown)
    watcher.start()
    try:
        p = subprocess.Popen(["sleep", "60"])
        watcher.track(p.pid, _start_ticks(p.pid))
        assert watcher.watched == 1
        os.kill(p.pid, signal.SIGKILL)
        if reap_at_once:
            p.wait()
        assert got.done.wait(5)
        if not reap_at_once:
            p.wait()
        if got.exits:
            e = got.exits[0]
            assert (e.pid, e.exit_code, e.source, e.signal) == (p.pid, 9, "pidfd", 9)
        else:
            assert got.unknown == [p.pid] and _kernel() < (6, 15)
        assert watcher.watched == 0
    finally:
        watcher.stop()


def test_pidfd_watcher_ignores_a_reused_pid_and_reports_clean_exits():
    got = _Collect()
    watcher = PidfdWatcher(got.on_exit, got.on_unknown)
    watcher.start()
    try:
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
        watcher.track(p.pid, _start_ticks(p.pid) + 1)  # not the process we meant
        assert watcher.watched == 0
        watcher.track(p.pid, _start_ticks(p.pid))
        watcher.track(p.pid, _start_ticks(p.pid))  # idempotent
        assert watcher.watched == 1
        assert got.done.wait(5)
        p.wait()
        assert got.exits and got.exits[0].exit_code == 0 and got.exits[0].returncode == 0
    finally:
        watcher.stop()


def test_pidfd_exit_status_after_the_reap():
    p = subprocess.Popen(["sh", "-c", "exit 3"])
    fd = os.pidfd_open(p.pid)
    try:
        p.wait()
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        assert poller.poll(2000)
        code = pidfd_exit_status(fd)
        assert code == (3 << 8 if _kernel() >= (6, 15) else None)
    finally:
        os.close(fd)


# -- other processes' output files ---------------------------------------------------


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


# -- cgroup xattrs ---------------------------------------------------------------------


@pytest.mark.root
@requires("memcg")
def test_oomd_marks_on_a_real_cgroup_and_its_ancestors():
    reader = CgroupReader.for_host()
    with memory_cgroup(1 << 30, "trainwatch-xattr") as (version, parent, child):
        root = parent.parent
        path = "/" + str(child.relative_to(root))
        before = reader.oomd_marks(path, version)
        assert not any(parent.name in k for k in before)
        os.setxattr(child, "user.oomd_ooms", b"2")
        os.setxattr(parent, "trusted.oomd_kill", b"5")
        marks = reader.oomd_marks(path, version)
        assert marks[f"user.oomd_ooms {path}"] == 2
        assert marks[f"trusted.oomd_kill /{parent.name}"] == 5


# -- --disable ---------------------------------------------------------------------------


def test_disable_flag_and_variable():
    s = parse_args(["--attach-torchrun", "--disable", "connector", "--disable", "kmsg,tracepoint"], {})
    assert s.disabled == {"connector", "kmsg", "tracepoint"}
    assert parse_args(["--attach-torchrun"], {"TRAINWATCH_DISABLE": "pidfd,outputs"}).disabled == {
        "pidfd",
        "outputs",
    }
    assert parse_args(["--attach-torchrun"], {}).disabled == frozenset()
    with pytest.raises(ConfigError, match=r"--disable: expected one of connector, .*got 'ebpf'"):
        parse_args(["--attach-torchrun", "--disable", "ebpf"], {})
    with pytest.raises(ConfigError, match="TRAINWATCH_DISABLE"):
        parse_args(["--attach-torchrun"], {"TRAINWATCH_DISABLE": "kmsg,nope"})


def test_torchelastic_error_files_of_every_writer():
    from sidecar.parse.torchrun import parse_error_file

    rec = parse_error_file(
        '{"message": {"message": "ValueError: bad batch", "extraInfo": {"py_callstack": '
        '"Traceback (most recent call last):\\n  File \\"t.py\\", line 3, in main\\n'
        'ValueError: bad batch\\n", '
        '"timestamp": "1796235841"}}}'
    )
    assert (rec.message, rec.timestamp) == ("ValueError: bad batch", 1796235841)
    assert rec.traceback is not None and rec.traceback.endswith("ValueError: bad batch\n")
    # older writers and the C++ signal handler: a plain string
    assert parse_error_file('{"message": "Signal 11 (SIGSEGV) received"}').message.startswith("Signal 11")
    for bad, why in (("{not json", "not JSON"), ("[]", "no 'message'"), ('{"message": 3}', "neither")):
        with pytest.raises(ValueError, match=why):
            parse_error_file(bad)
