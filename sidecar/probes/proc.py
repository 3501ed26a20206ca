"""Per-process files: /proc/PID/{stat,status,environ,cmdline}.

``stat`` is the cheap, always-read file (state, parent, CPU time, threads, start time,
RSS: about 4 µs); ``status`` adds VmHWM (peak RSS) and NSpid and is read for ranks only;
``environ`` and ``cmdline`` are read once per process. Parsers are pure; ``ProcReader``
does the I/O against a root that defaults to ``/proc``.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Callable
from dataclasses import dataclass

from sidecar.errors import NoSuchProcess, ParseError, ProbeError, read_bytes, translate_os_error
from sidecar.model import ProcKey, RankEnv

__all__ = [
    "PAGE_SIZE",
    "TICKS_PER_SECOND",
    "ProcReader",
    "ProcStat",
    "ProcStatus",
    "entrypoint_of",
    "parse_cmdline",
    "parse_environ",
    "parse_rank_env",
    "parse_smaps_rollup",
    "parse_stat",
    "parse_stat_brief",
    "parse_status",
    "still_alive",
]

TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK")
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True, slots=True)
class ProcStat:
    """The fields of /proc/PID/stat trainwatch uses, in base units.

    ``exit_code`` (field 52, kernel 3.5+) is the wait status of a zombie, 0 otherwise.
    """

    pid: int
    comm: str
    state: str
    ppid: int
    cpu_seconds: float
    threads: int
    start_ticks: int
    rss_bytes: int
    exit_code: int | None

    @property
    def key(self) -> ProcKey:
        return ProcKey(self.pid, self.start_ticks)


@dataclass(frozen=True, slots=True)
class ProcStatus:
    """The fields of /proc/PID/status trainwatch uses (kB in the file, bytes here).

    ``ns_pids`` is NSpid: the pid in each PID namespace from the reader's outward view
    inwards. Kernel threads have no Vm* lines, so those fields may be None.
    """

    name: str
    ppid: int
    uid: int | None
    threads: int | None
    rss_bytes: int | None
    peak_rss_bytes: int | None
    ns_pids: tuple[int, ...]
    anon_shmem_bytes: int | None = None  # RssAnon + RssShmem: what reclaim cannot take back


def parse_stat(data: bytes, page_size: int = PAGE_SIZE, ticks: int = TICKS_PER_SECOND) -> ProcStat:
    """Parse /proc/PID/stat. The comm (field 2) may hold spaces and parentheses, so the
    fields are split after the *last* ')'. Raises ParseError on anything else."""
    try:
        open_paren = data.index(b"(")
        close_paren = data.rindex(b")")
        pid = int(data[:open_paren])
        comm = data[open_paren + 1 : close_paren].decode("utf-8", "replace")
        rest = data[close_paren + 2 :].split()
        # rest[0] is field 3 (state); field N is rest[N - 3].
        utime, stime = int(rest[11]), int(rest[12])
        exit_code = int(rest[49]) if len(rest) > 49 else None
        return ProcStat(
            pid=pid,
            comm=comm,
            state=rest[0].decode(),
            ppid=int(rest[1]),
            cpu_seconds=(utime + stime) / ticks,
            threads=int(rest[17]),
            start_ticks=int(rest[19]),
            rss_bytes=int(rest[21]) * page_size,
            exit_code=exit_code,
        )
    except (ValueError, IndexError) as exc:
        raise ParseError(f"malformed stat: {data[:80]!r}") from exc


def parse_stat_brief(data: bytes, page_size: int = PAGE_SIZE) -> tuple[str, int, int, int]:
    """The hot path for a rank's descendants: (state, ppid, start_ticks, rss_bytes) of a
    /proc/PID/stat text, without building a ProcStat. Raises ParseError."""
    try:
        rest = data[data.rindex(b")") + 2 :].split(None, 22)
        return rest[0].decode(), int(rest[1]), int(rest[19]), int(rest[21]) * page_size
    except (ValueError, IndexError) as exc:
        raise ParseError(f"malformed stat: {data[:80]!r}") from exc


_STATUS_KEYS = (
    b"\nPPid:",
    b"\nUid:",
    b"\nThreads:",
    b"\nVmRSS:",
    b"\nVmHWM:",
    b"\nNSpid:",
    b"\nRssAnon:",
    b"\nRssShmem:",
)


def _field(data: bytes, key: bytes) -> bytes | None:
    start = data.find(key)
    if start < 0:
        return None
    start += len(key)
    end = data.find(b"\n", start)
    return data[start : end if end >= 0 else len(data)]


def parse_smaps_rollup(data: bytes) -> tuple[int, int]:
    """(PSS, USS) bytes from /proc/PID/smaps_rollup: the process's proportional share of
    the pages it maps, and the pages only it maps (Private_Clean + Private_Dirty +
    Private_Hugetlb). Raises ParseError without a Pss line (a kernel thread, or an exited
    process, whose rollup is empty)."""
    pss = uss = 0
    seen = False
    for line in data.splitlines():
        key, _, rest = line.partition(b":")
        if key not in (b"Pss", b"Private_Clean", b"Private_Dirty", b"Private_Hugetlb"):
            continue
        fields = rest.split()
        if not fields or not fields[0].isdigit() or len(fields[0]) > 20:
            raise ParseError(f"smaps_rollup: bad {key.decode()} line")
        value = int(fields[0]) * 1024
        if key == b"Pss":
            pss, seen = value, True
        else:
            uss += value
    if not seen:
        raise ParseError("smaps_rollup: no Pss line")
    return pss, uss


def parse_status(data: bytes) -> ProcStatus:
    """Parse /proc/PID/status (``Key:\\tvalue`` lines, kB for sizes). Each wanted key is
    found directly rather than by splitting all ~55 lines (this runs for every rank in
    every round). Raises ParseError when the always-present lines (Name, PPid) are
    missing or a value is not a number."""
    if not data.startswith(b"Name:"):
        raise ParseError("status without Name")
    name_end = data.find(b"\n")
    name = data[5 : name_end if name_end >= 0 else len(data)].strip().decode("utf-8", "replace")
    ppid_s, uid_s, threads_s, rss_s, hwm_s, nspid_s, anon_s, shmem_s = (_field(data, k) for k in _STATUS_KEYS)
    if ppid_s is None:
        raise ParseError("status without PPid")
    try:
        return ProcStatus(
            name=name,
            ppid=int(ppid_s),
            uid=int(uid_s.split()[0]) if uid_s else None,
            threads=int(threads_s) if threads_s else None,
            rss_bytes=int(rss_s.split()[0]) * 1024 if rss_s else None,
            peak_rss_bytes=int(hwm_s.split()[0]) * 1024 if hwm_s else None,
            ns_pids=tuple(int(p) for p in nspid_s.split()) if nspid_s else (),
            anon_shmem_bytes=(int(anon_s.split()[0]) + int(shmem_s.split()[0])) * 1024
            if anon_s and shmem_s
            else None,
        )
    except (ValueError, IndexError) as exc:
        raise ParseError(f"malformed status: {data[:80]!r}") from exc


def parse_environ(data: bytes) -> dict[str, str]:
    """Parse /proc/PID/environ (NUL-separated ``KEY=value``). Entries without '=' are
    skipped: a process may have rewritten its environment block."""
    env: dict[str, str] = {}
    for item in data.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep and key:
            env[key.decode("utf-8", "replace")] = value.decode("utf-8", "replace")
    return env


def _int_or_none(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        return None


def parse_rank_env(env: dict[str, str]) -> RankEnv:
    """Extract a torchrun worker's identity (RANK, LOCAL_RANK, TORCHELASTIC_* ...)."""
    return RankEnv(
        rank=_int_or_none(env.get("RANK")),
        local_rank=_int_or_none(env.get("LOCAL_RANK")),
        world_size=_int_or_none(env.get("WORLD_SIZE")),
        local_world_size=_int_or_none(env.get("LOCAL_WORLD_SIZE")),
        group_rank=_int_or_none(env.get("GROUP_RANK")),
        role=env.get("ROLE_NAME"),
        run_id=env.get("TORCHELASTIC_RUN_ID"),
        restart_count=_int_or_none(env.get("TORCHELASTIC_RESTART_COUNT")) or 0,
        max_restarts=_int_or_none(env.get("TORCHELASTIC_MAX_RESTARTS")),
        error_file=env.get("TORCHELASTIC_ERROR_FILE"),
        flight_recorder=(
            _int_or_none(env.get("TORCH_FR_BUFFER_SIZE") or env.get("TORCH_NCCL_TRACE_BUFFER_SIZE")) or 0,
            env.get("TORCH_FR_DUMP_TEMP_FILE")
            or env.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
            or "/tmp/nccl_trace_rank_",
        ),
        run_output=env.get("TRAINWATCH_RUN_OUTPUT") or None,
        flight_pipe=env.get("TORCH_NCCL_DEBUG_INFO_PIPE_FILE") or None,
        slurm_times=_slurm_times(env),
        node_rank=_int_or_none(env.get("NODE_RANK")),
    )


def _slurm_times(env: dict[str, str]) -> tuple[int, int] | None:
    start = _int_or_none(env.get("SLURM_JOB_START_TIME"))
    end = _int_or_none(env.get("SLURM_JOB_END_TIME"))
    return (start, end) if start is not None and end is not None and 0 < start <= end else None


def parse_cmdline(data: bytes) -> tuple[str, ...]:
    """Parse /proc/PID/cmdline (NUL-separated argv). A process that rewrote its title
    with spaces instead of NULs yields one element; kernel threads yield ()."""
    if not data:
        return ()
    return tuple(a.decode("utf-8", "replace") for a in data.rstrip(b"\0").split(b"\0"))


_INTERPRETER_FLAGS_WITH_VALUE = {"-W", "-X", "-Q", "-c"}


def entrypoint_of(argv: tuple[str, ...]) -> str | None:
    """The training entry point of a worker's argv: ``python -u train.py ...`` gives
    ``train.py``, ``python -m pkg.train`` gives ``-m pkg.train``. Paths are kept as
    given; None when nothing looks like an entry point."""
    if not argv:
        return None
    args = list(argv[1:]) if os.path.basename(argv[0]).startswith("python") else list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "-m" and i + 1 < len(args):
            return f"-m {args[i + 1]}"
        if arg in _INTERPRETER_FLAGS_WITH_VALUE:
            i += 2
            continue
        if arg.startswith("-"):
            i += 1
            continue
        return arg
    return None


def still_alive(read: Callable[[int], ProcStat], key: ProcKey, *, if_unreadable: bool | None) -> bool:
    """True while ``key`` still names a live process: its pid's stat, from ``read``, has the
    key's start time and is no zombie. False once it is gone. A stat that cannot be read
    (permission denied under a ``hidepid`` mount, an I/O error) tells neither: the caller
    says what that means (``if_unreadable``; the death flow answers True, since a death is
    never made up from an unreadable file), or with None the ``ProbeError`` is raised."""
    try:
        st = read(key.pid)
    except NoSuchProcess:
        return False
    except ProbeError:
        if if_unreadable is None:
            raise
        return if_unreadable
    return st.start_ticks == key.start_ticks and st.state not in ("Z", "X")


def read_stat(root: str, pid: int) -> ProcStat:
    """``/proc/PID/stat`` of one process, for the occasional reader (a death, a resync) that
    holds no ProcReader. Raises NoSuchProcess, AccessDenied, ParseError."""
    return parse_stat(read_bytes(f"{root}/{pid}/stat"))


def _kept_limit() -> int:
    """How many /proc files the sampler may hold open: a quarter of the open-file limit
    (raised to its hard ceiling first, as far as 16384), at most 4096."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = 16384 if hard == resource.RLIM_INFINITY else min(hard, 16384)
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        return min(4096, soft // 4) if soft != resource.RLIM_INFINITY else 4096
    except (OSError, ValueError):
        return 0


class ProcReader:
    """Reads per-process files below ``root`` (``/proc`` unless a test says otherwise).

    The watched processes' ``stat`` and ``status`` are read through descriptors held
    open (``*_kept``, one ``pread`` a round instead of open, read, close). A descriptor
    names the process it was opened for: once that process is reaped it reads ESRCH (as
    NoSuchProcess), even when its pid names another process by then. Only procfs works
    so (a file of a copied tree read through an old descriptor is the old file): a root
    other than /proc reads each time."""

    def __init__(self, root: str = "/proc") -> None:
        self.root = root
        self._dir_fd: int | None = None
        self._kept: dict[tuple[int, str], int] = {}
        self._kept_for: set[int] | None = None  # keep_only's last set
        self._opened = self._opened_then = 0  # descriptors opened so far, and at keep_only's last look
        self._kept_limit: int | None = None if os.path.realpath(root) == "/proc" else 0

    def _open(self, pid: int, name: str) -> int:
        """A descriptor of ``pid``'s file, relative to a directory fd held open on the root."""
        rel = f"{pid}/{name}"
        try:
            if self._dir_fd is None:
                self._dir_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            return os.open(rel, os.O_RDONLY | os.O_CLOEXEC, dir_fd=self._dir_fd)
        except OSError as exc:
            raise translate_os_error(exc, f"{self.root}/{rel}") from None

    def _read_one_shot(self, pid: int, name: str) -> bytes:
        """The sampling path's read of a single_open file (stat, status): one read, no
        Python-level buffering. Falls back to a full read for the rare file over 8 KiB (a
        status with a huge Groups)."""
        rel = f"{pid}/{name}"
        fd = self._open(pid, name)
        try:
            data = os.read(fd, 8192)
        except OSError as exc:
            raise translate_os_error(exc, f"{self.root}/{rel}") from None
        finally:
            os.close(fd)
        if len(data) == 8192:
            return read_bytes(f"{self.root}/{rel}")
        return data

    def _read_kept(self, pid: int, name: str) -> bytes:
        fd = self._kept.get((pid, name))
        if fd is None:
            if self._kept_limit is None:
                self._kept_limit = _kept_limit()
            if len(self._kept) >= self._kept_limit:
                return self._read_one_shot(pid, name)
            fd = self._kept[(pid, name)] = self._open(pid, name)
            self._opened += 1
        try:
            data = os.pread(fd, 8192, 0)
        except OSError as exc:
            self._drop(pid, name)
            raise translate_os_error(exc, f"{self.root}/{pid}/{name}") from None
        if not data:
            self._drop(pid, name)
            raise NoSuchProcess(f"{self.root}/{pid}/{name}: empty")
        if len(data) == 8192:
            return read_bytes(f"{self.root}/{pid}/{name}")
        return data

    def _drop(self, pid: int, name: str) -> None:
        fd = self._kept.pop((pid, name), None)
        if fd is not None:
            os.close(fd)

    @property
    def keeps(self) -> bool:
        """Whether descriptors are held (a real procfs, and the open-file limit allows)."""
        return self._kept_limit != 0

    def keep_only(self, pids: set[int]) -> None:
        """Close the held descriptors of processes no longer watched (nothing to look at
        when the watched set is the last call's and no descriptor was opened since)."""
        if pids == self._kept_for and self._opened == self._opened_then:
            return
        for pid, name in [k for k in self._kept if k[0] not in pids]:
            self._drop(pid, name)
        self._kept_for, self._opened_then = pids, self._opened

    def stat_kept(self, pid: int) -> ProcStat:
        return parse_stat(self._read_kept(pid, "stat"))

    def stat_brief_kept(self, pid: int) -> tuple[str, int, int, int]:
        return parse_stat_brief(self._read_kept(pid, "stat"))

    def rss_kept_sum(self, pids: list[int], verify: Callable[[int], bool]) -> tuple[int, int, list[int]]:
        """The statm RSS of ``pids`` summed through held descriptors, in one loop (the hot
        path at 10 Hz: a rank's DataLoader workers): (bytes, processes with an address
        space, pids gone). ``verify(pid)`` is asked before a pid's descriptor is first
        opened (is it still the process discovery saw?); False counts it gone. A zombie
        reads zeros and is not counted; an unreadable or malformed file is skipped."""
        total = members = 0
        gone: list[int] = []
        kept = self._kept
        for pid in pids:
            try:
                if (pid, "statm") not in kept and not verify(pid):
                    gone.append(pid)
                    continue
                rss = int(self._read_kept(pid, "statm").split(None, 2)[1]) * PAGE_SIZE
            except NoSuchProcess:
                gone.append(pid)
                continue
            except (ProbeError, ValueError, IndexError):
                continue
            if rss:
                total += rss
                members += 1
        return total, members, gone

    def status_kept(self, pid: int) -> ProcStatus:
        return parse_status(self._read_kept(pid, "status"))

    def close(self) -> None:
        for pid, name in list(self._kept):
            self._drop(pid, name)
        if self._dir_fd is not None:
            os.close(self._dir_fd)
            self._dir_fd = None

    def pids(self) -> list[int]:
        """Every numeric entry of the root: the processes (thread-group leaders)."""
        return [int(name) for name in os.listdir(self.root) if name.isdigit()]

    def stat(self, pid: int) -> ProcStat:
        return parse_stat(self._read_one_shot(pid, "stat"))

    def stat_brief(self, pid: int) -> tuple[str, int, int, int]:
        """(state, ppid, start_ticks, rss_bytes): what a rank's descendants need."""
        return parse_stat_brief(self._read_one_shot(pid, "stat"))

    def status(self, pid: int) -> ProcStatus:
        return parse_status(self._read_one_shot(pid, "status"))

    def smaps_rollup(self, pid: int) -> tuple[int, int]:
        """(PSS, USS) bytes. The kernel walks every mapping to sum them (under the
        process's mmap lock, for reading): not for every round (``probes/pss.py``)."""
        return parse_smaps_rollup(read_bytes(f"{self.root}/{pid}/smaps_rollup", limit=8 << 10))

    def environ(self, pid: int) -> dict[str, str]:
        """Raises AccessDenied for another user's process without CAP_SYS_PTRACE."""
        return parse_environ(read_bytes(f"{self.root}/{pid}/environ", limit=4 << 20))

    def cmdline(self, pid: int) -> tuple[str, ...]:
        return parse_cmdline(read_bytes(f"{self.root}/{pid}/cmdline", limit=256 << 10))

    def thread_names(self, pid: int, limit: int = 512) -> list[str]:
        """The names (``comm``) of the process's threads, at most ``limit`` of them (a
        process with thousands of threads costs no more than that)."""
        task = f"{self.root}/{pid}/task"
        try:
            tids = [t for t in os.listdir(task) if t.isdigit()][:limit]
        except OSError as exc:
            raise translate_os_error(exc, task) from None
        names = []
        for tid in tids:
            try:
                comm = read_bytes(f"{task}/{tid}/comm", limit=64)
                names.append(comm.decode("utf-8", "replace").rstrip("\n"))
            except NoSuchProcess:
                continue  # that thread ended
        return names

    def cgroup(self, pid: int) -> bytes:
        return read_bytes(f"{self.root}/{pid}/cgroup")

    def alive(self, key: ProcKey) -> bool:
        """True while ``key`` still names a live (non-zombie) process; an unreadable stat
        raises (``still_alive``)."""
        return still_alive(self.stat, key, if_unreadable=None)
