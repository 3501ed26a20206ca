"""Host memory: /proc/meminfo (MemTotal, MemAvailable), /proc/vmstat (oom_kill),
/proc/pressure/memory (PSI) and the /dev/shm file system (often what a container runs
out of when DataLoader workers pass tensors through shared memory).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from sidecar.errors import NoSuchProcess, ParseError, ProbeError, read_bytes
from sidecar.model import HostSample
from sidecar.probes.held import HeldFiles

__all__ = ["HostReader", "Meminfo", "Psi", "parse_meminfo", "parse_psi", "parse_vmstat_oom_kill"]


@dataclass(frozen=True, slots=True)
class Meminfo:
    total_bytes: int
    available_bytes: int


@dataclass(frozen=True, slots=True)
class Psi:
    """One PSI file: share of wall time stalled over the last 10 s (0..1) and the
    cumulative stall time, for ``some`` and ``full`` (``full`` is absent before 5.13 for
    the cpu file, always present for memory)."""

    some_avg10_ratio: float
    some_total_seconds: float
    full_avg10_ratio: float | None
    full_total_seconds: float | None


def _kb_field(data: bytes, key: bytes) -> int | None:
    """The kB value of the line ``key value kB`` (``key`` with its colon) in bytes, or None."""
    at = 0 if data.startswith(key) else data.find(b"\n" + key) + 1
    if at == 0 and not data.startswith(key):
        return None
    end = data.find(b"\n", at)
    line = data[at : end if end >= 0 else len(data)]
    try:
        return int(line.split()[1]) * 1024
    except (IndexError, ValueError) as exc:
        raise ParseError(f"malformed meminfo line {line[:80]!r}") from exc


def parse_meminfo(data: bytes) -> Meminfo:
    """Parse /proc/meminfo. MemAvailable exists since 3.14; older kernels are refused.
    The two lines are found directly (the file has some fifty)."""
    total = _kb_field(data, b"MemTotal:")
    available = _kb_field(data, b"MemAvailable:")
    if total is None or available is None:
        raise ParseError("meminfo without MemTotal/MemAvailable")
    return Meminfo(total, available)


def parse_vmstat_oom_kill(data: bytes) -> int | None:
    """The ``oom_kill`` counter of /proc/vmstat (kernel 4.13+), None when absent."""
    start = data.find(b"\noom_kill ")
    if start < 0:
        if data.startswith(b"oom_kill "):
            start = -1
        else:
            return None
    end = data.find(b"\n", start + 1)
    line = data[start + 1 : end if end >= 0 else len(data)]
    try:
        return int(line.split()[1])
    except (IndexError, ValueError) as exc:
        raise ParseError(f"malformed vmstat line {line!r}") from exc


def _psi_line(data: bytes, kind: bytes) -> tuple[float, float] | None:
    """(avg10 %, total us) of a PSI file's ``some`` or ``full`` line, None without it."""
    at = 0 if data.startswith(kind + b" ") else data.find(b"\n" + kind + b" ") + 1
    if at == 0 and not data.startswith(kind + b" "):
        return None
    end = data.find(b"\n", at)
    avg10 = total = None
    for part in data[at : end if end >= 0 else len(data)].split()[1:]:
        key, _, raw = part.partition(b"=")
        if key == b"avg10" or key == b"total":
            try:
                value = float(raw)
            except ValueError as exc:
                raise ParseError(f"malformed PSI field {part[:40]!r}") from exc
            if key == b"avg10":
                avg10 = value
            else:
                total = value
    if avg10 is None or total is None:
        return None
    return avg10, total


def parse_psi(data: bytes) -> Psi:
    """Parse a PSI file: ``some avg10=0.00 avg60=0.00 avg300=0.00 total=0`` and ``full ...``
    (only avg10 and total are used)."""
    some = _psi_line(data, b"some")
    if some is None:
        raise ParseError("PSI without a 'some' line")
    full = _psi_line(data, b"full")
    return Psi(
        some_avg10_ratio=some[0] / 100.0,
        some_total_seconds=some[1] / 1e6,
        full_avg10_ratio=full[0] / 100.0 if full else None,
        full_total_seconds=full[1] / 1e6 if full else None,
    )


class HostReader:
    """Reads the host files below ``proc_root``; ``shm_path`` is statvfs'ed for /dev/shm.

    MemTotal/MemAvailable are required (ProbeError when unreadable); the other sources
    are optional and come back as None when the kernel lacks them (no PSI, old vmstat).
    """

    def __init__(self, proc_root: str = "/proc", shm_path: str = "/dev/shm") -> None:
        self.proc_root = proc_root
        self.shm_path = shm_path
        # sample()'s three files, read through descriptors kept open (the real /proc only:
        # a fixture tree's file may be replaced); oom_kills() (any thread) opens its own
        self._held = HeldFiles(enabled=os.path.realpath(proc_root) == "/proc")

    def oom_kills(self) -> int | None:
        """/proc/vmstat oom_kill right now (None when unreadable or absent)."""
        try:
            return parse_vmstat_oom_kill(read_bytes(f"{self.proc_root}/vmstat"))
        except ProbeError:
            return None

    def sample(self) -> HostSample:
        read = self._held.read
        mem = parse_meminfo(read(f"{self.proc_root}/meminfo"))
        try:
            oom_kills = parse_vmstat_oom_kill(read(f"{self.proc_root}/vmstat", records=True))
        except NoSuchProcess:
            oom_kills = None
        psi: Psi | None
        try:
            psi = parse_psi(read(f"{self.proc_root}/pressure/memory"))
        except (NoSuchProcess, ParseError):
            psi = None
        except ProbeError:
            # EOPNOTSUPP when the kernel has CONFIG_PSI but was booted without psi=1.
            psi = None
        shm_total = shm_used = None
        try:
            st = os.statvfs(self.shm_path)
            shm_total = st.f_blocks * st.f_frsize
            shm_used = (st.f_blocks - st.f_bfree) * st.f_frsize
        except OSError:
            pass
        return HostSample(
            total_bytes=mem.total_bytes,
            available_bytes=mem.available_bytes,
            oom_kills=oom_kills,
            psi_some_avg10_ratio=psi.some_avg10_ratio if psi else None,
            psi_full_avg10_ratio=psi.full_avg10_ratio if psi else None,
            psi_some_total_seconds=psi.some_total_seconds if psi else None,
            psi_full_total_seconds=psi.full_total_seconds if psi else None,
            shm_total_bytes=shm_total,
            shm_used_bytes=shm_used,
        )


def ptrace_scope(proc_root: str = "/proc") -> int:
    """kernel.yama.ptrace_scope: 0 classic ptrace rules, 1 only descendants, 2 only with
    CAP_SYS_PTRACE, 3 never; 0 where Yama is not built in."""
    try:
        return int(read_bytes(f"{proc_root}/sys/kernel/yama/ptrace_scope").strip() or b"0")
    except (OSError, ProbeError, ValueError):
        return 0
