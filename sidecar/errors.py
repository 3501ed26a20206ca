"""The few errors trainwatch raises, produced in one place and handled by callers.

::

    TrainwatchError
    ├── ProbeError            reading a source of truth failed
    │   ├── NoSuchProcess     the process (or the file) is gone: normal, never logged as a problem
    │   ├── AccessDenied      the file exists but may not be read: never mistaken for "absent"
    │   └── ParseError        the file was read but its content is not what the kernel documents
    └── ConfigError           a bad setting (flag or TRAINWATCH_* variable): one line, exit status 2

``read_bytes`` is the one helper that turns ``OSError`` into these, so every probe shares
one vocabulary, as psutil does.
"""

from __future__ import annotations

import errno
import os

__all__ = [
    "AccessDenied",
    "ConfigError",
    "NoSuchProcess",
    "ParseError",
    "ProbeError",
    "TrainwatchError",
    "read_bytes",
    "read_text",
    "translate_os_error",
]


class TrainwatchError(Exception):
    """Base of every error trainwatch raises on purpose."""


class ProbeError(TrainwatchError):
    """Reading a file of /proc, /sys or a library failed."""

    def __init__(self, message: str, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


class NoSuchProcess(ProbeError):
    """The process exited (or the file vanished) while it was being read."""


class AccessDenied(ProbeError):
    """The file exists but this process may not read it (EACCES, EPERM)."""


class ParseError(ProbeError):
    """The content does not have the documented format."""


class ConfigError(TrainwatchError):
    """A setting has a bad value. The message names the flag or variable."""


_GONE = {errno.ENOENT, errno.ESRCH, errno.ENOTDIR}
_DENIED = {errno.EACCES, errno.EPERM}


def read_bytes(path: str, limit: int = 1 << 20) -> bytes:
    """Read a whole (small) file the way /proc wants it read: open, read until EOF, close.

    Raises NoSuchProcess when the file or its process is gone, AccessDenied on
    EACCES/EPERM, ProbeError on any other OSError. ``limit`` bounds what is read and kept
    (never a byte more), so a huge environ cannot balloon the daemon. (A short read is not
    taken as the end: for record-by-record files such as vmstat or mountinfo it is not.)
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise translate_os_error(exc, path) from None
    try:
        chunks: list[bytes] = []
        size = 0
        while size < limit:
            chunk = os.read(fd, min(65536, limit - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks)
    except OSError as exc:
        raise translate_os_error(exc, path) from None
    finally:
        os.close(fd)


def read_text(path: str, limit: int = 1 << 20) -> str:
    """``read_bytes`` decoded as UTF-8 (undecodable bytes replaced, never raised)."""
    return read_bytes(path, limit).decode("utf-8", "replace")


def translate_os_error(exc: OSError, path: str) -> ProbeError:
    """The typed error for an OSError met while reading ``path``."""
    if exc.errno in _GONE:
        return NoSuchProcess(f"{path}: gone", path)
    if exc.errno in _DENIED:
        return AccessDenied(f"{path}: permission denied", path)
    return ProbeError(f"{path}: {exc.strerror or exc}", path)
