"""Why a test may not run, in one table, and what the suite may leave out.

Every skip in the suite names one of the keys below (``requires(key)`` as a mark,
``skip(key)`` inside a test), and every check that a passing test leaves out for a missing
tool calls ``left_out(key, what)`` instead of passing silently. At the end of the session
the conftest lists all of them. Under ``TRAINWATCH_STRICT_SKIPS=1`` (``.ci/run`` sets it) a
skip or a left-out check whose key is not in ``tests/allowed-skips.txt`` fails the run: a
precondition missing on CI is a broken CI machine or setup, never a silent pass.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import importlib.util
import os
import platform
import select
import shutil
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sidecar.front.demo import memory_cgroup, memory_hierarchy
from tests.support import slurm

GIB = 1 << 30
ALLOWED_FILE = Path(__file__).resolve().parents[1] / "allowed-skips.txt"


def _meminfo() -> dict[str, int]:
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        name, _, rest = line.partition(":")
        out[name] = int(rest.split()[0]) * 1024
    return out


def _root() -> bool:
    return os.geteuid() == 0


def _tracefs() -> bool:
    return _root() and os.path.isdir("/sys/kernel/tracing/events/signal/signal_generate")


def _kmsg() -> bool:
    """/dev/kmsg readable by this process (a container may not expose it; gVisor has none;
    kernel.dmesg_restrict=1 keeps it from a user without CAP_SYSLOG)."""
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        os.read(fd, 16384)
        return True
    except BlockingIOError:  # nothing logged yet
        return True
    except OSError as exc:
        return exc.errno == errno.EPIPE  # a record overwritten before this read: readable
    finally:
        os.close(fd)


@functools.lru_cache(maxsize=1)
def _mount() -> bool:
    """Mounting a tmpfs, as the tests that make a full or read-only directory or a small
    /dev/shm do: root with CAP_SYS_ADMIN (a container's root often lacks it), tried in a
    mount namespace of its own (unshare makes its mounts private: the machine's stay)."""
    if not _root() or shutil.which("unshare") is None:
        return False
    cmd = ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"]
    try:
        return subprocess.run(cmd, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@functools.lru_cache(maxsize=1)
def _memcg() -> bool:
    """A memory cgroup this process may make, with the kernel's own memory interface: the
    charge split (memory.stat) and the OOM counter (v1 memory.oom_control, v2
    memory.events). gVisor's cgroupfs makes groups but has neither, and never enforces
    their limits. Made and removed here (no process is put in it)."""
    if memory_hierarchy() is None:
        return False
    try:
        with memory_cgroup(1 << 30, "trainwatch-probe") as (version, _parent, child):
            oom = "memory.oom_control" if version == 1 else "memory.events"
            return (child / "memory.stat").exists() and (child / oom).exists()
    except OSError:
        return False


@functools.lru_cache(maxsize=1)
def _cgroup_xattrs() -> bool:
    """Extended attributes on a cgroup's directory, as systemd-oomd sets them: user.* (kernfs
    has them since Linux 5.7) and trusted.* (CAP_SYS_ADMIN)."""
    if not _memcg():
        return False
    try:
        with memory_cgroup(1 << 30, "trainwatch-probe") as (_version, _parent, child):
            os.setxattr(child, "user.trainwatch_probe", b"1")
            os.setxattr(child, "trusted.trainwatch_probe", b"1")
            return True
    except OSError:
        return False


def _cn_proc_op(op: int, nonce: int) -> bytes:
    """A netlink message to the process connector (CN_IDX_PROC, CN_VAL_PROC) carrying one
    proc_cn_mcast_op (1 listen, 2 ignore: include/uapi/linux/cn_proc.h); the kernel's ACK
    carries ``nonce + 1`` in its cn_msg ack field."""
    cn_msg = struct.pack("=IIIIHH", 1, 1, 0, nonce, 4, 0) + struct.pack("=I", op)
    return struct.pack("=IHHII", 16 + len(cn_msg), 3, 0, 0, 0) + cn_msg  # NLMSG_DONE


@functools.lru_cache(maxsize=1)
def _connector() -> bool:
    """Whether the kernel's process connector takes a subscription from this process: root
    in the initial user, PID and network namespaces of a kernel with CONFIG_PROC_EVENTS
    (gVisor has no NETLINK_CONNECTOR; a container's own namespaces are ignored). Asked of
    the kernel directly, not through sidecar.watch.exits, whose tests this decides: its ACK
    (PROC_EVENT_NONE answering our nonce) carries the error, 0 when subscribed."""
    if not _root():
        return False
    nonce = os.getpid() & 0x7FFFFFFF
    try:
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, 11)  # NETLINK_CONNECTOR
    except OSError:
        return False
    with sock:
        try:
            sock.bind((0, 1))  # the CN_IDX_PROC multicast group
            sock.send(_cn_proc_op(1, nonce))
            deadline = time.monotonic() + 1.0  # other listeners' events may arrive meanwhile
            while select.select([sock], [], [], max(0.0, deadline - time.monotonic()))[0]:
                data = sock.recv(65536)
                # nlmsghdr (16), cn_msg (20: ack at 12), proc_event (what at 0, ack.err at 16)
                if len(data) >= 56 and struct.unpack_from("=I", data, 28)[0] == nonce + 1:
                    what, err = struct.unpack_from("=I", data, 36)[0], struct.unpack_from("=I", data, 52)[0]
                    if what == 0:
                        return err == 0
            return False
        except OSError:
            return False
        finally:
            with contextlib.suppress(OSError):
                sock.send(_cn_proc_op(2, nonce))


def _pidfd() -> bool:
    """pidfd_open (Linux 5.3+, Python 3.9+; a seccomp profile may refuse it)."""
    try:
        os.close(os.pidfd_open(os.getpid()))
        return True
    except (OSError, AttributeError):
        return False


@functools.lru_cache(maxsize=1)
def _openat2() -> bool:
    """The openat2 system call (Linux 5.6+; gVisor has none): the same number on every
    architecture, asked with ctypes as sidecar/saferead.py does, not through it."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    how = ctypes.create_string_buffer(struct.pack("=QQQ", os.O_PATH | os.O_CLOEXEC, 0, 0), 24)
    fd = libc.syscall(437, ctypes.c_int(-100), b"/", how, ctypes.c_size_t(24))  # AT_FDCWD
    if fd < 0:
        return False
    os.close(fd)
    return True


@functools.lru_cache(maxsize=1)
def _zombie_exit_code() -> bool:
    """Whether /proc/PID/stat shows a zombie's wait status (field 52, Linux 3.5+). gVisor
    writes 0 there whatever the status: a child that exits 3 is seen as a zombie here."""
    child = subprocess.Popen(["sh", "-c", "exit 3"])
    try:
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
        data = Path(f"/proc/{child.pid}/stat").read_bytes()
        fields = data[data.rindex(b")") + 2 :].split()
        return len(fields) > 49 and fields[0] == b"Z" and int(fields[49]) == 3 << 8
    except (OSError, ValueError):
        return False
    finally:
        child.wait()


def global_oom_allowed() -> tuple[bool, str]:
    """Whether this machine may be driven into a real global OOM: root (the victim sets
    oom_score_adj=1000, so the kernel takes it and nothing else), no swap (with swap the fill
    pages out for minutes instead of ending in an OOM), at most 64 GiB of RAM (filling more
    takes too long for a test), and nobody said TRAINWATCH_E2E_GLOBAL_OOM=0."""
    if os.environ.get("TRAINWATCH_E2E_GLOBAL_OOM") == "0":
        return False, "TRAINWATCH_E2E_GLOBAL_OOM=0 turned it off"
    if not _root():
        return False, "needs root"
    info = _meminfo()
    if info.get("SwapTotal", 0) > 0:
        return False, "the machine has swap: filling memory would page out for minutes"
    if info["MemTotal"] > 64 * GIB:
        return False, f"{info['MemTotal'] / GIB:.0f} GiB of RAM is too much to fill in a test"
    return True, ""


def _why_global_oom() -> str:
    return global_oom_allowed()[1]


# key -> (is the precondition met here?, what is missing when it is not)
REQUIREMENTS = {
    "root": (_root, lambda: "needs root"),
    "memcg": (
        _memcg,
        lambda: (
            "needs root and a writable memory cgroup hierarchy with the kernel's memory.stat and OOM "
            "counter (gVisor's has neither and does not enforce limits)"
        ),
    ),
    "cgroup-xattrs": (
        _cgroup_xattrs,
        lambda: "needs user.* and trusted.* extended attributes on a memory cgroup (Linux 5.7+, root)",
    ),
    "connector": (
        _connector,
        lambda: (
            "needs the process connector: root in the initial user, PID and network namespaces "
            "(gVisor has none)"
        ),
    ),
    "pidfd": (_pidfd, lambda: "needs pidfd_open (Linux 5.3+, not refused by seccomp)"),
    "openat2": (_openat2, lambda: "needs the openat2 system call (Linux 5.6+; gVisor has none)"),
    "zombie-exit-code": (
        _zombie_exit_code,
        lambda: "needs a zombie's wait status in /proc/PID/stat (field 52; gVisor writes 0 there)",
    ),
    "vmstat": (
        lambda: os.path.exists("/proc/vmstat"),
        lambda: "needs /proc/vmstat (gVisor has none)",
    ),
    "tracefs": (_tracefs, lambda: "needs root and tracefs mounted at /sys/kernel/tracing"),
    "global-oom": (lambda: global_oom_allowed()[0], _why_global_oom),
    "promtool": (
        lambda: shutil.which("promtool") is not None,
        lambda: "needs promtool (Debian's prometheus; scripts/dev-setup installs it)",
    ),
    "prometheus": (
        lambda: shutil.which("prometheus") is not None,
        lambda: "needs Debian's prometheus (scripts/dev-setup installs it)",
    ),
    "chromium": (
        lambda: bool(shutil.which("chromium") or shutil.which("chromium-browser")),
        lambda: "needs chromium (scripts/dev-setup installs it)",
    ),
    "earlyoom": (
        lambda: (Path(__file__).resolve().parents[2] / ".cache/earlyoom/usr/bin/earlyoom").exists(),
        lambda: "needs earlyoom's binary (scripts/dev-setup unpacks it into .cache/earlyoom)",
    ),
    "py-spy": (
        lambda: bool(shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))),
        lambda: "needs py-spy (a test extra)",
    ),
    "deepspeed": (
        lambda: (Path(sys.executable).parent / "deepspeed").exists(),
        lambda: "needs DeepSpeed's launcher (the test group of pyproject.toml installs it)",
    ),
    "openmpi": (
        lambda: shutil.which("mpirun.openmpi") is not None,
        lambda: "needs Open MPI's mpirun.openmpi (scripts/dev-setup installs Debian's openmpi-bin)",
    ),
    "mpich": (
        lambda: shutil.which("mpiexec.mpich") is not None,
        lambda: "needs MPICH's mpiexec.mpich (scripts/dev-setup installs Debian's mpich)",
    ),
    "slurm": (
        lambda: slurm.available(),
        lambda: "needs root and Debian's slurmctld, slurmd, slurm-client and munge (scripts/dev-setup)",
    ),
    "accelerate": (
        lambda: (Path(sys.executable).parent / "accelerate").exists(),
        lambda: "needs Hugging Face accelerate (the test group of pyproject.toml installs it)",
    ),
    "lightning": (
        lambda: importlib.util.find_spec("lightning") is not None,
        lambda: "needs Lightning (the test group of pyproject.toml installs it)",
    ),
    "systemd-analyze": (
        lambda: shutil.which("systemd-analyze") is not None,
        lambda: "needs systemd-analyze",
    ),
    "setpriv": (lambda: shutil.which("setpriv") is not None, lambda: "needs setpriv (util-linux)"),
    "cc": (lambda: shutil.which("cc") is not None, lambda: "needs a C compiler (cc) to build the NVML shim"),
    "other-user": (
        lambda: os.geteuid() == 0 and shutil.which("setpriv") is not None and _nobody_python() is not None,
        lambda: "needs root, setpriv and a python3 of this version that user nobody may run with torch",
    ),
    "glibc": (
        lambda: platform.libc_ver()[0] == "glibc",
        lambda: "needs the GNU C library (its malloc names a double free before it aborts)",
    ),
    "exception-trace": (
        lambda: (
            Path("/proc/sys/debug/exception-trace").exists()
            and Path("/proc/sys/debug/exception-trace").read_text().strip() != "0"
        ),
        lambda: "needs the kernel to log unhandled faults (sysctl debug.exception-trace=1)",
    ),
    "mount": (_mount, lambda: "needs root with CAP_SYS_ADMIN to mount a tmpfs (and unshare(1))"),
    "kmsg": (_kmsg, lambda: "needs /dev/kmsg readable (the kernel's OOM records)"),
    "kmsg-write": (lambda: os.access("/dev/kmsg", os.W_OK), lambda: "needs write access to /dev/kmsg"),
    "free-memory": (
        lambda: _meminfo()["MemAvailable"] >= 6 * GIB,
        lambda: "needs 6 GiB of available memory",
    ),
    "gpu": (
        lambda: any(Path("/dev").glob("nvidia[0-9]*")),
        lambda: "needs an NVIDIA GPU (this machine has none)",
    ),
}


def met(key: str) -> bool:
    return bool(REQUIREMENTS[key][0]())


def reason(key: str) -> str:
    return f"[{key}] {REQUIREMENTS[key][1]()}"


def requires(*keys: str) -> pytest.MarkDecorator:
    """A mark: skip the test unless every key's precondition holds here."""
    missing = [k for k in keys if not met(k)]
    return pytest.mark.skipif(bool(missing), reason="; ".join(reason(k) for k in missing) or "met")


def skip(key: str, detail: str = "") -> None:
    """Skip from inside a test, for a precondition found missing only at run time."""
    pytest.skip(reason(key) + (f": {detail}" if detail else ""))


# Checks that a passing test left out: (key, test id, what was not checked).
LEFT_OUT: list[tuple[str, str, str]] = []


def left_out(key: str, what: str) -> None:
    """Record that a check inside a passing test did not run here, for want of ``key``."""
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]
    LEFT_OUT.append((key, test, what))


def allowed() -> dict[str, str]:
    """tests/allowed-skips.txt: ``key  why CI may lack it``, one a line, # comments."""
    out = {}
    for line in ALLOWED_FILE.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            key, _, why = line.partition(" ")
            out[key] = why.strip()
    return out


@functools.lru_cache(maxsize=1)
def _nobody_python() -> tuple[str, str] | None:
    from tests.support.e2e import python_for_user

    return python_for_user(65534)
