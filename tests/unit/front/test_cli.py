"""Argument parsing is pure: argv + environment in, Settings or a one-line ConfigError out."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from sidecar.errors import ConfigError
from sidecar.front.cli import parse_args
from sidecar.settings import Settings, default_postmortem_dir


def test_defaults():
    s = parse_args(["--attach-torchrun"], {})
    assert s == Settings(postmortem_dir=default_postmortem_dir())
    assert (s.interval_seconds, s.host, s.port, s.history_seconds, s.log_level) == (
        1.0,
        "127.0.0.1",
        9864,
        600.0,
        "INFO",
    )


def test_every_flag(tmp_path):
    s = parse_args(
        [
            "--attach-torchrun",
            "--pid",
            "12",
            "--pid",
            "13",
            "--interval",
            "0.1",
            "--host",
            "0.0.0.0",
            "--port",
            "0",
            "--postmortem-dir",
            str(tmp_path),
            "--history",
            "120",
            "--log-level",
            "debug",
        ],
        {},
    )
    assert s.pids == (12, 13) and s.interval_seconds == 0.1 and s.host == "0.0.0.0" and s.port == 0
    assert s.postmortem_dir == str(tmp_path) and s.history_seconds == 120 and s.log_level == "DEBUG"


def test_environment_equivalents_and_flags_win(tmp_path):
    env = {
        "TRAINWATCH_ATTACH_TORCHRUN": "1",
        "TRAINWATCH_PID": "5,6 7",
        "TRAINWATCH_INTERVAL": "0.5",
        "TRAINWATCH_HOST": "::1",
        "TRAINWATCH_PORT": "9000",
        "TRAINWATCH_POSTMORTEM_DIR": str(tmp_path),
        "TRAINWATCH_HISTORY": "60",
        "TRAINWATCH_LOG_LEVEL": "warning",
    }
    s = parse_args([], env)
    assert s.pids == (5, 6, 7) and s.interval_seconds == 0.5 and s.host == "::1" and s.port == 9000
    assert s.postmortem_dir == str(tmp_path) and s.history_seconds == 60 and s.log_level == "WARNING"
    assert parse_args(["--port", "9001"], env).port == 9001


@pytest.mark.parametrize(
    "argv, env, names",
    [
        (["--attach-torchrun", "--interval", "0.05"], {}, "--interval"),
        (["--attach-torchrun", "--interval", "fast"], {}, "--interval"),
        (["--attach-torchrun"], {"TRAINWATCH_INTERVAL": "-1"}, "TRAINWATCH_INTERVAL"),
        (["--attach-torchrun", "--port", "70000"], {}, "--port"),
        (["--attach-torchrun"], {"TRAINWATCH_PORT": "http"}, "TRAINWATCH_PORT"),
        (["--attach-torchrun", "--pid", "abc"], {}, "--pid"),
        (["--attach-torchrun"], {"TRAINWATCH_PID": "1,x"}, "TRAINWATCH_PID"),
        (["--attach-torchrun", "--history", "0.5", "--interval", "1"], {}, "--history"),
        (["--attach-torchrun", "--log-level", "LOUD"], {}, "--log-level"),
        (["--attach-torchrun", "--host", ""], {}, "--host"),
        (["--attach-torchrun", "--bogus"], {}, "--bogus"),
        ([], {"TRAINWATCH_ATTACH_TORCHRUN": "maybe"}, "TRAINWATCH_ATTACH_TORCHRUN"),
        ([], {}, "--attach-torchrun"),
    ],
)
def test_bad_values_name_the_flag(argv, env, names):
    with pytest.raises(ConfigError) as info:
        parse_args(argv, env)
    assert names in str(info.value)


def test_postmortem_dir_that_is_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ConfigError, match="--postmortem-dir"):
        parse_args(["--attach-torchrun", "--postmortem-dir", str(f)], {})


def test_bad_flag_is_one_line_and_exit_2():
    out = subprocess.run(
        [sys.executable, "-m", "sidecar", "--attach-torchrun", "--interval", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and out.stderr.startswith("trainwatch: error: --interval")
    assert "Traceback" not in out.stderr


def test_port_in_use_is_one_line():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = subprocess.run(
            [sys.executable, "-m", "sidecar", "--attach-torchrun", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert out.returncode == 2 and "--port" in out.stderr and "Traceback" not in out.stderr


def test_help_lists_every_flag():
    out = subprocess.run(
        [sys.executable, "-m", "sidecar", "--help"], capture_output=True, text=True, timeout=60
    )
    for flag in (
        "--attach-torchrun",
        "--pid",
        "--interval",
        "--host",
        "--port",
        "--postmortem-dir",
        "--history",
        "--log-level",
    ):
        assert flag in out.stdout


def test_pid_that_does_not_exist_is_one_line():
    out = subprocess.run(
        [sys.executable, "-m", "sidecar", "--attach-torchrun", "--pid", "999999999"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and out.stderr.startswith(
        "trainwatch: error: --pid 999999999: no such process"
    )


def test_doctor_names_every_source():
    out = subprocess.run(
        [sys.executable, "-m", "sidecar", "doctor"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    for source in (
        "host PID namespace",
        "other users' /proc",
        "process connector",
        "pidfd",
        "kernel log",
        "signal tracepoint",
        "memory cgroups",
        "NVML",
        "memory PSI",
        "user namespace",
    ):
        assert source in out.stdout


def test_doctor_names_what_disable_turned_off():
    """A source the options turn off is 'off', neither ok nor missing: doctor --strict does not
    fail for it, and its machine check is not run as if it were needed."""
    from sidecar.front.doctor import checks, missing, render

    results = checks(Settings(disabled=frozenset({"kmsg", "smaps"})), connector=False)
    kernel_log = [c for c in results if c.name == "kernel log"]
    assert len(kernel_log) == 1 and kernel_log[0].off and "--disable kmsg" in kernel_log[0].detail
    smaps = [c for c in results if c.name == "smaps"]
    assert len(smaps) == 1 and smaps[0].off and "smaps_rollup" in smaps[0].detail
    assert not any(c.off for c in missing(results))
    assert "off      kernel log" in render(results)


def test_doctor_says_what_is_lost_and_the_fix():
    from sidecar.front.doctor import Check, render, summary_line

    text = render(
        [
            Check("kernel log", False, "/dev/kmsg: Permission denied", "certain OOM verdicts", "run as root"),
            Check("NVML", True, "1 GPU(s)"),
        ]
    )
    lines = text.splitlines()
    i = next(n for n, line in enumerate(lines) if "MISSING  kernel log" in line)
    assert "loses: certain OOM verdicts" in lines[i + 1] and "fix:   run as root" in lines[i + 2]
    assert "ok       NVML" in text and lines[-1] == "1 missing: kernel log"
    assert summary_line([Check("NVML", True, "x")]) == "evidence sources: NVML ok"


def test_stall_after_and_py_spy():
    s = parse_args(["--attach-torchrun", "--stall-after", "5", "--py-spy"], {})
    assert (s.stall_after_seconds, s.py_spy) == (5.0, True)
    s = parse_args(["--attach-torchrun"], {"TRAINWATCH_STALL_AFTER": "90", "TRAINWATCH_PY_SPY": "1"})
    assert (s.stall_after_seconds, s.py_spy) == (90.0, True)
    assert parse_args(["--attach-torchrun"], {}).stall_after_seconds == 60.0
    with pytest.raises(ConfigError, match="--stall-after: must be between"):
        parse_args(["--attach-torchrun", "--stall-after", "0"], {})
    with pytest.raises(ConfigError, match="TRAINWATCH_PY_SPY"):
        parse_args(["--attach-torchrun"], {"TRAINWATCH_PY_SPY": "maybe"})


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


def test_self_protection_flags():
    s = parse_args(["--attach-torchrun"], {})
    assert s.oom_score_adj == -1000 and s.self_protection is True
    assert parse_args(["--attach-torchrun", "--oom-score-adj", "keep"], {}).oom_score_adj is None
    assert parse_args(["--attach-torchrun"], {"TRAINWATCH_OOM_SCORE_ADJ": "-500"}).oom_score_adj == -500
    assert parse_args(["--attach-torchrun", "--no-self-protection"], {}).self_protection is False
    assert parse_args(["--attach-torchrun"], {"TRAINWATCH_SELF_PROTECTION": "0"}).self_protection is False
    for bad in ("-1001", "1001", "low"):
        with pytest.raises(ConfigError, match="--oom-score-adj: expected a number from -1000 to 1000"):
            parse_args(["--attach-torchrun", "--oom-score-adj", bad], {})


# SYS_tgkill where the C library has no tgkill() (glibc before 2.30): the number differs
# between architectures (the unified table's 131 serves arm64, riscv64 and loongarch64)
TGKILL = {"x86_64": 234, "i686": 270, "aarch64": 131, "riscv64": 131, "loongarch64": 131, "ppc64le": 250,
          "s390x": 241, "armv7l": 268}  # fmt: skip


def _tgkill(pid: int, tid: int, signal: int) -> int:
    """Send ``signal`` to the thread ``tid`` of process ``pid``."""
    import ctypes
    import platform

    libc = ctypes.CDLL(None, use_errno=True)
    if hasattr(libc, "tgkill"):
        return int(libc.tgkill(pid, tid, int(signal)))
    number = TGKILL.get(platform.machine())
    assert number is not None, f"no tgkill() in the C library, nor its number for {platform.machine()}"
    return int(libc.syscall(number, pid, tid, int(signal)))


def _catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (its SigCgt mask, in hex)."""
    with open(f"/proc/{pid}/status") as f:
        mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    return bool(mask >> (signum - 1) & 1)


@pytest.mark.parametrize("which", ["main", "another"])
def test_sigterm_stops_the_daemon_whichever_thread_receives_it(tmp_path, which):
    """A process-directed signal goes to any thread that does not block it; Python runs the
    handler on the main thread only, so the main thread must wake for a signal another
    thread received (it waits without a timeout: a tick would cost an idle daemon). The
    signal is sent here to one thread with tgkill, as the kernel may pick it."""
    import signal as sig

    from tests.support.e2e import DaemonProc, wait_for

    with DaemonProc(tmp_path) as daemon:
        pid = daemon.proc.pid
        # its handler installed (serve() does so once the service has started): a SIGTERM
        # before that would end it by the default action, which is not under test here
        wait_for(lambda: _catches(pid, sig.SIGTERM), 30, "the daemon to catch SIGTERM")
        tids = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
        tid = pid if which == "main" else next(t for t in tids if t != pid)
        assert _tgkill(pid, tid, sig.SIGTERM) == 0
        wait_for(
            lambda: daemon.proc.poll() is not None, 15, f"the daemon to stop after SIGTERM to task {tid}"
        )
        assert daemon.proc.returncode == 0
        assert "received SIGTERM, shutting down" in daemon.log() and "stopped" in daemon.log()


def test_run_takes_a_free_port_when_the_default_is_taken_at_its_bind(monkeypatch):
    """Two `trainwatch run` starting at once both find the default port free; the second's
    bind then fails. It must watch on a free port, not leave its job unwatched (seen on the
    parallel CI: no postmortem). A port that was asked for is an error, as before."""
    import sidecar.front.run as run
    import sidecar.front.service as service

    tried: list[int] = []

    def start(self: service.Service) -> None:
        tried.append(self.settings.port)
        if self.settings.port != 0:
            raise ConfigError(
                f"--port: cannot listen on 127.0.0.1:{self.settings.port}: Address already in use"
            )

    monkeypatch.setattr(service.Service, "start", start)
    got = run._start_watching(Settings(), explicit_port=False, job_output=lambda pid: "")
    assert got is not None and tried == [9864, 0] and got.settings.pids == (os.getpid(),)
    tried.clear()
    assert run._start_watching(Settings(), explicit_port=True, job_output=lambda pid: "") is None
    assert tried == [9864]
