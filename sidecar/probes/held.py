"""Files read every round through descriptors held open: the host's and the watched
cgroups' counters.

A file of a pseudo-filesystem (procfs, cgroupfs) is generated at each read, so one
``pread`` at offset 0 through a descriptor kept from the last round reads it afresh:
one system call instead of open, read, read-to-EOF, close. A descriptor of a removed
cgroup reads ENODEV (kernfs deactivated the file), never the file of a cgroup made
later under the same name: the read is retried once through a fresh ``open``, which
says whether the path is gone (NoSuchProcess) or names a new cgroup.

Only for files whose content is regenerated: a regular file replaced by rename would be
read old through its descriptor, so callers that read fixture trees (tests, a copied
/proc) read each time (``HeldFiles(enabled=False)``). Owned by one thread (the
sampler's); the death path's readers open their own.
"""

from __future__ import annotations

import os

from sidecar.errors import read_bytes, translate_os_error

__all__ = ["HeldFiles"]

_CHUNK = 65536


class HeldFiles:
    """``read(path)``: the file's content, through a descriptor kept between calls.

    ``records=True`` for seq files of many records (``/proc/vmstat``): the kernel fills
    at most a page per read there, so a short read is not the end and the file is read
    until an empty read. A single-record file (meminfo, PSI, every cgroup file) is
    whole in one short read. At most ``most`` descriptors are held; past that, files are
    read the one-shot way."""

    def __init__(self, *, enabled: bool = True, most: int = 256) -> None:
        self.enabled = enabled
        self.most = most
        self._fds: dict[str, int] = {}
        self._kept_under: set[str] | None = None  # keep_under's last set
        self._opened = self._opened_then = 0  # descriptors opened so far, and at its last look

    def __len__(self) -> int:
        return len(self._fds)

    def read(self, path: str, *, records: bool = False, limit: int = 1 << 20) -> bytes:
        if not self.enabled:
            return read_bytes(path, limit)
        fd = self._fds.get(path)
        if fd is None:
            if len(self._fds) >= self.most:
                return read_bytes(path, limit)
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError as exc:
                raise translate_os_error(exc, path) from None
            self._fds[path] = fd
            self._opened += 1
        try:
            data = os.pread(fd, _CHUNK, 0)
            if len(data) < _CHUNK and not records:
                return data
            chunks = [data]
            size = len(data)
            while data and size < limit:
                data = os.pread(fd, _CHUNK, size)
                chunks.append(data)
                size += len(data)
            return b"".join(chunks)
        except OSError:
            # removed (ENODEV) or otherwise unreadable through this descriptor: the path
            # says what is there now
            self.drop(path)
            return read_bytes(path, limit)

    def drop(self, path: str) -> None:
        fd = self._fds.pop(path, None)
        if fd is not None:
            os.close(fd)

    def keep_under(self, directories: set[str]) -> None:
        """Close the descriptors of files outside ``directories`` (cgroups no longer
        watched); nothing to look at when no descriptor was opened since a call with the
        same set."""
        if directories == self._kept_under and self._opened == self._opened_then:
            return
        for path in [p for p in self._fds if p.rsplit("/", 1)[0] not in directories]:
            self.drop(path)
        self._kept_under, self._opened_then = directories, self._opened

    def close(self) -> None:
        for path in list(self._fds):
            self.drop(path)
