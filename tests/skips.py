"""Why a test may not run, in one table, and what the suite may leave out.

Every skip in the suite names one of the keys below (``requires(key)`` as a mark,
``skip(key)`` inside a test), and every check that a passing test leaves out for a missing
tool calls ``left_out(key, what)`` instead of passing silently. At the end of the session
the conftest lists all of them. Under ``TRAINWATCH_STRICT_SKIPS=1`` (``.ci/run`` sets it) a
skip or a left-out check whose key is not in ``tests/allowed-skips.txt`` fails the run: a
precondition missing on CI is a broken CI machine or setup, never a silent pass.
"""

from __future__ import annotations

import functools
import os
import platform
import shutil
import sys
from pathlib import Path

import pytest

from sidecar.demo import memory_hierarchy

GIB = 1 << 30
ALLOWED_FILE = Path(__file__).resolve().parent / "allowed-skips.txt"


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
        lambda: memory_hierarchy() is not None,
        lambda: "needs root and a writable memory cgroup hierarchy",
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
        lambda: (Path(__file__).resolve().parents[1] / ".cache/earlyoom/usr/bin/earlyoom").exists(),
        lambda: "needs earlyoom's binary (scripts/dev-setup unpacks it into .cache/earlyoom)",
    ),
    "py-spy": (
        lambda: bool(shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))),
        lambda: "needs py-spy (a test extra)",
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
    from tests.e2e import python_for_user

    return python_for_user(65534)
