"""The safe-read helper: the only way the daemon opens a file whose path a job chose.

The daemon runs as root on nodes shared by many users; a rank's environment names its
error file (``TORCHELASTIC_ERROR_FILE``) and its flight-recorder dump, and its stdout may
be any file. Such a path is

* resolved in the job's own mount namespace, through an ``O_PATH`` descriptor of
  ``/proc/PID/root`` taken while a process of the job lived (``JobRoot``), with symbolic
  links kept inside that root (``openat2`` ``RESOLVE_IN_ROOT``; where the kernel lacks it,
  a walk that follows no link at all), never in the daemon's;
* opened ``O_RDONLY|O_NOFOLLOW|O_NONBLOCK|O_CLOEXEC``: a final symbolic link is refused,
  a FIFO cannot block the open;
* read only when ``fstat`` says it is a regular file owned by the rank's user, and no
  bigger than the caller's cap (or only its tail, for logs);
* read on a reader thread with a deadline, so a hung file system (FUSE, NFS) costs one
  stuck thread, never the autopsy. Reader threads are started before any death
  (``prestart``) and reused: at the moment of an OOM there may be no memory for a new one.

Anything else raises ``Refused`` with a reason the postmortem shows as evidence.
"""

from __future__ import annotations

import ctypes
import errno
import operator
import os
import queue
import stat
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, SupportsIndex, TypeVar

__all__ = [
    "HOST_ROOT",
    "MAX_STUCK",
    "JobRoot",
    "Read",
    "Refused",
    "poke_job_fifo",
    "read_fd_file",
    "read_job_file",
    "statvfs_in_root",
]

T = TypeVar("T")

DEFAULT_DEADLINE_S = 0.3
MAX_STUCK = 4  # reads still hung on a file system before further reads are refused outright
_stuck = 0
_stuck_lock = threading.Lock()

_SYS_OPENAT2 = 437  # one number on every architecture (the unified syscall table, Linux 5.6+)
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_IN_ROOT = 0x10
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY


class Refused(Exception):
    """A job-named file that was not read, and why (one short phrase)."""


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_libc: ctypes.CDLL | None
try:
    _libc = ctypes.CDLL(None, use_errno=True)
    _libc.syscall.restype = ctypes.c_long
except (OSError, AttributeError):  # pragma: no cover - every glibc and musl has syscall()
    _libc = None
_openat2_works: bool | None = None


def _openat2(dir_fd: int, path: str, flags: int) -> int:
    """``openat2`` with the path resolved inside ``dir_fd``; raises OSError, and
    ``NotImplementedError`` where the kernel has no openat2."""
    global _openat2_works
    if _libc is None or _openat2_works is False:
        raise NotImplementedError
    how = _OpenHow(flags, 0, _RESOLVE_IN_ROOT | _RESOLVE_NO_MAGICLINKS)
    fd = _libc.syscall(_SYS_OPENAT2, dir_fd, os.fsencode(path), ctypes.byref(how), ctypes.sizeof(how))
    if fd < 0:
        err = ctypes.get_errno()
        if err in (errno.ENOSYS, errno.EPERM) and _openat2_works is None:  # EPERM: a seccomp filter
            _openat2_works = False
            raise NotImplementedError
        raise OSError(err, os.strerror(err), path)
    _openat2_works = True
    return int(fd)


def _walk(dir_fd: int, parts: list[str], flags: int) -> int:
    """Where openat2 is missing: one component at a time, following no symbolic link."""
    cur = os.dup(dir_fd)
    try:
        for part in parts[:-1]:
            try:
                nxt = os.open(part, os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=cur)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise Refused(f"a symbolic link or a non-directory in the path ({part})") from None
                raise
            os.close(cur)
            cur = nxt
        return os.open(parts[-1], flags, dir_fd=cur)
    finally:
        os.close(cur)


def _open_in(root_fd: int, path: str, flags: int = _READ_FLAGS) -> int:
    if not path.startswith("/") or "\0" in path or len(path) > 4096:
        raise Refused("not an absolute path")
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if not parts or ".." in parts:
        raise Refused("a path with '..'")
    try:
        try:
            return _openat2(root_fd, "/".join(parts), flags)
        except NotImplementedError:
            return _walk(root_fd, parts, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise Refused("a symbolic link (not followed)") from None
        if exc.errno == errno.EXDEV:
            raise Refused("it leaves the job's root") from None
        raise


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a directory"),
    ):
        if test(mode):
            return name
    return "not a regular file"


@dataclass(frozen=True, slots=True)
class Read:
    data: bytes
    size: int  # the file's size when read
    mtime: float


def _read_checked(
    fd: int, owner: int | None, cap: int, tail: bool, expect: tuple[int, int] | None, since: int = 0
) -> Read:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise Refused(f"{_kind(st.st_mode)}, not a regular file")
    if expect is not None and (st.st_dev, st.st_ino) != expect:
        raise Refused("another file now")
    if owner is not None and st.st_uid != owner:
        raise Refused(f"owned by uid {st.st_uid}, not by the rank's user (uid {owner})")
    if st.st_size > cap and not tail:
        raise Refused(f"{st.st_size} bytes, more than the {cap} read")
    start = max(since if since <= st.st_size else 0, st.st_size - cap) if tail else 0
    chunks, left = [], cap
    while left > 0:
        chunk = os.pread(fd, min(left, 1 << 20), start)
        if not chunk:
            break
        chunks.append(chunk)
        start += len(chunk)
        left -= len(chunk)
    return Read(b"".join(chunks), st.st_size, st.st_mtime)


class _Reader:
    """A reader thread, kept between reads: started before a death (``prestart``), so an
    OOM never has to find memory for a new thread at the moment a postmortem is due."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[tuple[Callable[[], Any], dict[str, Any], threading.Event]] = (
            queue.SimpleQueue()
        )
        self.thread = threading.Thread(target=self._loop, name="trainwatch-read", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        global _stuck
        while True:
            fn, box, done = self.jobs.get()
            try:
                box["value"] = fn()
            except BaseException as exc:  # handed to the caller
                box["error"] = exc
            with _stuck_lock:
                if box.get("late"):  # the caller gave up on it; it is free again
                    _stuck -= 1
                done.set()
                _idle.append(self)


_idle: list[_Reader] = []


def prestart(n: int = 2) -> None:
    """Start ``n`` reader threads now (the daemon does at start)."""
    with _stuck_lock:
        missing = max(0, n - len(_idle))
    for _ in range(missing):
        reader = _Reader()
        with _stuck_lock:
            _idle.append(reader)


def _with_deadline(fn: Callable[[], T], seconds: float) -> T:
    """``fn()`` on a reader thread; Refused when it has not returned in ``seconds`` (the
    thread is left to finish, and counted as stuck until it does)."""
    global _stuck
    with _stuck_lock:
        if _stuck >= MAX_STUCK:
            raise Refused(f"{_stuck} earlier reads are still hung on a file system")
        reader = _idle.pop() if _idle else None
    if reader is None:
        try:
            reader = _Reader()
        except RuntimeError as exc:  # no memory for another thread (the OOM this is explaining)
            raise Refused(f"no thread to read it with ({exc})") from None
    box: dict[str, Any] = {}
    done = threading.Event()
    reader.jobs.put((fn, box, done))
    if not done.wait(seconds):
        with _stuck_lock:
            if not done.is_set():
                box["late"] = True
                _stuck += 1
                raise Refused(f"the read did not finish within {seconds:g} s (a hung file system?)")
    if "error" in box:
        raise box["error"]
    return box["value"]  # type: ignore[no-any-return]


class _HostRoot:
    """The daemon's own root, opened on first use: for paths the daemon saw itself
    (``readlink`` of a process's descriptor), checked against the file they must be."""

    _fd = -1

    def __index__(self) -> int:
        if _HostRoot._fd < 0:
            _HostRoot._fd = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        return _HostRoot._fd


HOST_ROOT = _HostRoot()


class JobRoot:
    """A job's file-system root: an ``O_PATH`` descriptor of ``/proc/PID/root``, taken while
    a process of the job lives and kept until ``close``, so paths resolve in the job's mount
    namespace even after its processes are gone."""

    def __init__(self, proc_root: str, pid: int) -> None:
        self.pid = pid
        self.fd = os.open(f"{proc_root}/{pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __index__(self) -> int:  # passed as the root of read_job_file
        return self.fd


def read_job_file(
    root: SupportsIndex,
    path: str,
    *,
    owner: int | None,
    cap: int,
    tail: bool = False,
    expect: tuple[int, int] | None = None,
    since: int = 0,
    deadline_s: float = DEFAULT_DEADLINE_S,
) -> Read:
    """The file at ``path`` in ``root`` (a descriptor: a ``JobRoot``, ``HOST_ROOT``): all of
    it (at most ``cap`` bytes, else Refused) or, with ``tail``, what was written after byte
    ``since``, at most the last ``cap`` bytes. ``owner``: the uid that must own it (None:
    any). ``expect``: the (device, inode) it must be. Raises Refused, or OSError (ENOENT:
    it does not exist)."""

    def go() -> Read:
        fd = _open_in(operator.index(root), path)
        try:
            return _read_checked(fd, owner, cap, tail, expect, since)
        finally:
            os.close(fd)

    return _with_deadline(go, deadline_s)


def read_fd_file(
    proc_root: str,
    pid: int,
    fd_number: int,
    *,
    owner: int | None,
    cap: int,
    expect: tuple[int, int] | None,
    since: int = 0,
    deadline_s: float = DEFAULT_DEADLINE_S,
) -> Read:
    """What a live process wrote to the file it has open as ``fd_number`` after byte
    ``since`` (at most the last ``cap`` bytes), through ``/proc/PID/fd``: the process's own
    open file, so no path is resolved. The same checks."""

    def go() -> Read:
        fd = os.open(
            f"{proc_root}/{pid}/fd/{fd_number}", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
        )
        try:
            return _read_checked(fd, owner, cap, True, expect, since)
        finally:
            os.close(fd)

    return _with_deadline(go, deadline_s)


def poke_job_fifo(
    root: SupportsIndex, path: str, *, owner: int | None, deadline_s: float = DEFAULT_DEADLINE_S
) -> None:
    """Write one byte into the FIFO at ``path`` in ``root`` (a job's on-demand dump trigger).
    The path is resolved as for reads and opened ``O_PATH`` (which opens no device, so no
    driver sees an open); only a FIFO owned by ``owner`` is then reopened for writing,
    through its own descriptor (no second resolution), without blocking: a FIFO nobody reads
    is ``Refused``. Raises Refused or OSError (ENOENT: no such FIFO)."""

    def go() -> None:
        fd = _open_in(operator.index(root), path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if not stat.S_ISFIFO(st.st_mode):
                kind = "a regular file" if stat.S_ISREG(st.st_mode) else _kind(st.st_mode)
                raise Refused(f"not a FIFO ({kind})")
            if owner is not None and st.st_uid != owner:
                raise Refused(f"owned by uid {st.st_uid}, not the rank's user {owner}")
            try:
                wfd = os.open(f"/proc/self/fd/{fd}", os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
            except OSError as exc:
                if exc.errno == errno.ENXIO:
                    raise Refused("nobody reads the FIFO") from None
                raise
            try:
                os.write(wfd, b"1")
            except BlockingIOError:
                raise Refused("the FIFO is full (a request is already waiting)") from None
            finally:
                os.close(wfd)
        finally:
            os.close(fd)

    _with_deadline(go, deadline_s)


def statvfs_in_root(
    proc_root: str, pid: int, path: str, deadline_s: float = DEFAULT_DEADLINE_S
) -> os.statvfs_result:
    """``statvfs`` of a path in a live process's mount namespace, with a deadline."""
    return _with_deadline(lambda: os.statvfs(f"{proc_root}/{pid}/root{path}"), deadline_s)
