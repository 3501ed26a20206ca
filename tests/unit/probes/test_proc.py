"""Parsers of /proc/PID files, on text captured from a real torchrun job."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from sidecar.errors import AccessDenied, NoSuchProcess, ParseError, read_bytes
from sidecar.probes.proc import (
    ProcReader,
    entrypoint_of,
    parse_cmdline,
    parse_environ,
    parse_rank_env,
    parse_stat,
    parse_status,
)
from tests.conftest import AGENT, KTHREADD, PROC_TORCHRUN, RANK0, RANK1, RUN_ID
from tests.support.skips import skip


def raw(pid: int, name: str) -> bytes:
    return (PROC_TORCHRUN / str(pid) / name).read_bytes()


def test_stat_of_the_agent_names_pt_elastic():
    st = parse_stat(raw(AGENT, "stat"), page_size=4096, ticks=100)
    assert st.pid == AGENT and st.comm == "pt_elastic" and st.state == "S"
    assert st.ppid == 1
    assert st.threads == 4
    assert st.start_ticks == 63935
    assert st.rss_bytes == 54377 * 4096
    assert st.cpu_seconds == pytest.approx((212 + 22) / 100)
    assert st.exit_code == 0


def test_stat_comm_with_spaces_and_parentheses():
    line = raw(RANK0, "stat").replace(b"(python3)", b"(py (evil) x)")
    st = parse_stat(line)
    assert st.comm == "py (evil) x" and st.ppid == AGENT


def test_stat_of_a_zombie_carries_its_exit_code():
    fields = raw(RANK1, "stat").decode().split()
    fields[2] = "Z"
    fields[-1] = "9"  # SIGKILL, wait-status encoding
    st = parse_stat(" ".join(fields).encode())
    assert st.state == "Z" and st.exit_code == 9


@pytest.mark.parametrize("bad", [b"", b"123", b"123 (x) S", b"abc (x) S 1 2"])
def test_stat_malformed_raises_parse_error(bad):
    with pytest.raises(ParseError):
        parse_stat(bad)


def test_status_of_a_rank():
    st = parse_status(raw(RANK0, "status"))
    assert st.name == "python3" and st.ppid == AGENT and st.uid == 0
    assert st.rss_bytes == 283560 * 1024 and st.peak_rss_bytes == 283560 * 1024
    assert st.ns_pids == (RANK0,)


def test_status_of_a_kernel_thread_has_no_memory():
    st = parse_status(raw(KTHREADD, "status"))
    assert st.name == "kthreadd" and st.rss_bytes is None and st.peak_rss_bytes is None


def test_status_nested_namespaces():
    text = raw(RANK0, "status").replace(f"NSpid:\t{RANK0}".encode(), b"NSpid:\t48213\t17")
    assert parse_status(text).ns_pids == (48213, 17)


def test_status_without_name_is_malformed():
    with pytest.raises(ParseError):
        parse_status(b"VmRSS:\t 1 kB\n")


def test_rank_environment():
    env = parse_rank_env(parse_environ(raw(RANK1, "environ")))
    assert env.rank == 1 and env.local_rank == 1 and env.world_size == 2
    assert env.local_world_size == 2 and env.group_rank == 0 and env.role == "default"
    assert env.run_id == RUN_ID and env.restart_count == 0 and env.max_restarts == 0
    assert env.error_file and env.error_file.endswith("/attempt_0/1/error.json")
    assert env.is_worker


def test_agent_environment_is_not_a_worker():
    env = parse_rank_env(parse_environ(raw(AGENT, "environ")))
    assert not env.is_worker


def test_environ_survives_garbage():
    env = parse_environ(b"A=1\0garbage\0=x\0B=2=3\0\xff\xfe=4\0")
    assert env["A"] == "1" and env["B"] == "2=3" and "garbage" not in env


def test_cmdline_and_entrypoint():
    argv = parse_cmdline(raw(RANK0, "cmdline"))
    assert argv[1:3] == ("-u", "tests/workloads/rank.py")
    assert entrypoint_of(argv) == "tests/workloads/rank.py"
    assert entrypoint_of(("/usr/bin/python3.11", "-u", "-m", "pkg.train", "--lr", "1")) == "-m pkg.train"
    assert entrypoint_of(("/usr/bin/python", "-X", "dev", "train.py")) == "train.py"
    assert entrypoint_of(("./train_binary", "--x")) == "./train_binary"
    assert parse_cmdline(b"") == ()


def test_reader_on_the_fixture_tree():
    reader = ProcReader(str(PROC_TORCHRUN))
    assert set(reader.pids()) >= {AGENT, RANK0, RANK1}
    assert reader.stat(RANK0).ppid == AGENT
    with pytest.raises(NoSuchProcess):
        reader.stat(999999)


def _uid_of(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Uid:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def test_access_denied_is_not_absent():
    """Another user's environ is AccessDenied, not NoSuchProcess: checked in a forked
    child that drops to nobody and reads this (root's) process's environ, or, not root,
    reads a process of another user (pid 1 is the container's own user's in some)."""
    import warnings

    if os.geteuid() == 0:
        target = os.getpid()
    else:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
        others = [p for p in pids if _uid_of(p) not in (None, os.getuid())]
        if not others:
            skip("root", "no process of another user to be refused")
        target = min(others)
    with warnings.catch_warnings():
        # Python 3.12 warns of a fork in a process with threads (pytest's may have some): the
        # child only drops its ids, reads one file through os calls and exits
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        code = 3
        try:
            if os.geteuid() == 0:
                os.setgroups([])
                os.setgid(65534)
                os.setuid(65534)
            read_bytes(f"/proc/{target}/environ")
            code = 1
        except AccessDenied:
            code = 0
        except BaseException:
            code = 2
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_other_read_errors_are_not_absent(tmp_path):
    from sidecar.errors import ProbeError

    with pytest.raises(ProbeError) as info:
        read_bytes(str(tmp_path))  # EISDIR
    assert not isinstance(info.value, (NoSuchProcess, AccessDenied))


def test_a_read_keeps_no_byte_past_its_limit(tmp_path):
    """The limit bounds the read, not the first chunk past it (a chunk is 64 KiB)."""
    big = tmp_path / "big"
    big.write_bytes(b"x" * 200_000)
    for limit in (1, 100, 8192, 65536, 65537, 200_000, 300_000):
        assert read_bytes(str(big), limit) == b"x" * min(limit, 200_000)


def test_the_flight_recorder_settings_in_real_processes_environments(tmp_path):
    import subprocess
    import sys

    env = dict(os.environ, TORCH_NCCL_TRACE_BUFFER_SIZE="2000", TORCH_NCCL_DEBUG_INFO_TEMP_FILE="/x/trace_")
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"], env=env) as p:
        try:
            deadline = time.monotonic() + 10  # until it has exec'd (before, environ is ours)
            while (
                b"time.sleep" not in Path(f"/proc/{p.pid}/cmdline").read_bytes()
                and time.monotonic() < deadline
            ):
                time.sleep(0.01)
            env = parse_rank_env(ProcReader("/proc").environ(p.pid))
            assert env.flight_recorder == (2000, "/x/trace_")  # the older names
        finally:
            p.kill()
    with subprocess.Popen(["sleep", "5"], env={"PATH": os.environ["PATH"]}) as p:
        try:
            while Path(f"/proc/{p.pid}/cmdline").read_bytes()[:5] != b"sleep":
                time.sleep(0.01)
            env = parse_rank_env(ProcReader("/proc").environ(p.pid))
            assert env.flight_recorder == (0, "/tmp/nccl_trace_rank_")
        finally:
            p.kill()
    new = parse_rank_env(
        {
            "TORCH_FR_BUFFER_SIZE": "500",
            "TORCH_NCCL_TRACE_BUFFER_SIZE": "9",
            "TORCH_FR_DUMP_TEMP_FILE": "/d/r_",
        }
    )
    assert new.flight_recorder == (500, "/d/r_")  # the new names win


def test_kept_descriptors_follow_their_process_and_close():
    """The sampler's reads through held descriptors (real /proc): a zombie still reads, a
    reaped process is gone for good (its descriptor never reads another process), and
    descriptors of processes no longer watched are closed."""
    import subprocess

    from sidecar.errors import NoSuchProcess
    from sidecar.probes.proc import ProcReader

    reader = ProcReader("/proc")
    child = subprocess.Popen(["sleep", "60"])
    try:
        alive = reader.stat_kept(child.pid)  # just exec'd: S, R or D (paging in), never Z
        assert alive.comm == "sleep" and alive.state not in ("Z", "X")
        assert reader.status_kept(child.pid).rss_bytes
        fds = set(reader._kept.values())
        assert len(fds) == 2
        child.kill()
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # a zombie, not reaped
        assert reader.stat_kept(child.pid).state == "Z"
        assert reader.stat_brief_kept(child.pid)[0] == "Z"
        child.wait()
        with pytest.raises(NoSuchProcess):
            reader.stat_kept(child.pid)
        assert (child.pid, "stat") not in reader._kept
        reader.keep_only(set())
        assert reader._kept == {}
        for fd in fds:
            with pytest.raises(OSError):
                os.fstat(fd)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        reader.close()


def test_rss_summed_through_held_descriptors_counts_the_live_and_names_the_gone():
    """The 10 Hz hot path (a rank's workers' statm in one loop, real /proc): live processes
    are summed, a zombie is not counted, a reaped one and one that fails the identity check
    are gone, and a pid is checked only before its descriptor is first opened."""
    import subprocess

    from sidecar.probes.proc import PAGE_SIZE, ProcReader
    from tests.support.e2e import wait_for

    reader = ProcReader("/proc")
    kids = [subprocess.Popen(["sleep", "60"]) for _ in range(3)]
    asked: list[int] = []

    def verify(pid: int) -> bool:
        asked.append(pid)
        return pid != kids[2].pid  # the third "is another process" already

    def statm_rss(pid: int) -> int:
        with open(f"/proc/{pid}/statm", "rb") as f:
            return int(f.read().split()[1]) * PAGE_SIZE

    def asleep(pid: int) -> bool:
        """In its nanosleep: its pages are in, its RSS holds still. The state S (the one
        interruptible sleep of sleep(1)), and the kernel function where the kernel names it:
        /proc/PID/wchan is "0" without kallsyms or to a reader it hides it from, and absent
        in gVisor."""
        with open(f"/proc/{pid}/stat", "rb") as f:
            if f.read().rsplit(b")", 1)[1].split()[0] != b"S":
                return False
        try:
            with open(f"/proc/{pid}/wchan", "rb") as f:
                wchan = f.read().strip()
        except FileNotFoundError:
            return True
        return wchan in (b"", b"0") or b"nanosleep" in wchan

    try:
        pids = [k.pid for k in kids]
        wait_for(lambda: all(asleep(p) for p in pids), 10, "the sleeps to sleep")
        expected = statm_rss(pids[0]) + statm_rss(pids[1])
        total, members, gone = reader.rss_kept_sum(pids, verify)
        assert (members, gone) == (2, [pids[2]]) and abs(total - expected) <= 8 * PAGE_SIZE
        assert sorted(asked) == sorted(pids)
        asked.clear()
        kids[0].kill()
        os.waitid(os.P_PID, pids[0], os.WEXITED | os.WNOWAIT)  # a zombie: reads zeros
        total, members, gone = reader.rss_kept_sum(pids[:2], verify)
        assert members == 1 and gone == [] and asked == []  # held: not checked again
        kids[0].wait()
        total, members, gone = reader.rss_kept_sum(pids[:2], verify)
        assert members == 1 and gone == [pids[0]]
    finally:
        for k in kids:
            k.kill()
            k.wait()
        reader.close()


def test_a_zombie_s_status_is_trusted_only_where_the_kernel_gives_it(tmp_path, monkeypatch):
    """The daemon asks the kernel once whether /proc shows a zombie's wait status (gVisor
    writes 0 there): the answer agrees with the suite's own check of this machine, and where
    it is no, a zombie's status is unknown (None), never 0, a clean exit. A /proc that is not
    this machine's teaches nothing."""
    from sidecar.probes import zombies as proc_mod
    from sidecar.probes.proc import parse_stat
    from sidecar.probes.zombies import ask_zombie_status, zombie_status
    from tests.support.skips import met

    monkeypatch.setattr(proc_mod, "_zombie_status_told", True)
    assert ask_zombie_status(str(tmp_path)) is True  # an empty tree: nothing learned
    assert ask_zombie_status() is met("zombie-exit-code")
    head = "Z 9 10 10 0 -1 0 0 0 0 0 1 1 0 0 20 0 1 0 500 0 0"
    fields = head.split(" ")
    fields += ["0"] * (49 - len(fields)) + ["9"]  # field 52 of the line: the wait status
    zombie = parse_stat(f"10 (python) {' '.join(fields)}\n".encode())
    assert zombie.exit_code == 9
    monkeypatch.setattr(proc_mod, "_zombie_status_told", True)
    assert zombie_status(zombie) == 9
    monkeypatch.setattr(proc_mod, "_zombie_status_told", False)
    assert zombie_status(zombie) is None


def test_alive_says_what_an_unreadable_stat_means_only_when_asked():
    """One meaning of "alive" for the sampler and the death flow: gone is dead, a reused pid
    is dead, a zombie is dead; an unreadable stat is no death, and each caller states what
    it answers then (the death flow: alive), or gets the error."""
    from sidecar.model import ProcKey
    from sidecar.probes.proc import ProcStat, still_alive

    def stat(state: str, start: int):
        return lambda pid: ProcStat(pid, "python", state, 1, 0.0, 1, start, 0, 0)

    def fails(exc: Exception):
        def read(pid: int) -> ProcStat:
            raise exc

        return read

    key = ProcKey(10, 100)
    assert still_alive(stat("S", 100), key, if_unreadable=None)
    assert not still_alive(stat("S", 101), key, if_unreadable=True)  # the pid names another process
    assert not still_alive(stat("Z", 100), key, if_unreadable=True)
    assert not still_alive(fails(NoSuchProcess("gone")), key, if_unreadable=True)
    assert still_alive(fails(AccessDenied("hidepid")), key, if_unreadable=True)
    assert not still_alive(fails(AccessDenied("hidepid")), key, if_unreadable=False)
    with pytest.raises(AccessDenied):
        still_alive(fails(AccessDenied("hidepid")), key, if_unreadable=None)
