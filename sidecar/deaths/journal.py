"""What the death watch knows, kept on disk, so that a restarted daemon can explain the
deaths that happened while it was down.

A daemon can be SIGKILLed, OOM-killed or restarted by its supervisor in the middle of an
incident. The kernel keeps its log (the OOM records naming the victim's pid) and the agent
keeps its log file; what the new process lacks is which processes were ranks, of which
job, in which cgroup, printing where. Every ``SAVE_EVERY_S`` while jobs are watched (and at
once when the set of ranks or an incident changes) the death watch writes that here:
the ranks as last sampled, their jobs' output files, the cgroups' counters, the incidents
with their postmortem ids and the deaths recorded, and a thinned memory curve per job.

At start, a state of the same boot (``/proc/sys/kernel/random/boot_id``) is read back:
ranks that are gone and whose death no postmortem holds are judged again from the kernel
log's history and the agent's log, and the postmortem says it was *reconstructed*. A state
of another boot is dropped (its pids mean nothing now). The file is the daemon's own
(written atomically, mode 0600, in the postmortem directory); a malformed one is ignored
with a warning. What a state holds, and its encoding, is ``saved.py``'s.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import threading

from sidecar import lognames
from sidecar.deaths.saved import SavedState, decode, encode

__all__ = ["SAVE_EVERY_S", "STATE_NAME", "Journal", "read_boot_id"]

log = logging.getLogger(lognames.JOURNAL)

STATE_NAME = "trainwatch.state"  # in the postmortem directory (the store reads only *.json)
SECOND_SLOT = ".b"  # trainwatch.state.b: the slot written in turn with it
SAVE_EVERY_S = 5.0
MAX_BYTES = 8 << 20  # a state this large is not the daemon's


def read_boot_id(proc_root: str = "/proc") -> str | None:
    try:
        with open(f"{proc_root}/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read(64).strip() or None
    except (OSError, UnicodeDecodeError):
        return None


class Journal:
    """The state, in two files written in turn (``save`` from any thread, one write at a
    time; ``load`` at start reads the newer one of this boot).

    Each save overwrites the older slot in place (open, one ``pwrite`` of the JSON padded
    with spaces to the slot's length, close: no truncate, no rename, no new directory
    entry; each rename cost an ext4 journal transaction, every 5 s). Nothing is held open
    between saves, so the file system can still be remounted read-only or unmounted. A
    write cut short (the daemon SIGKILLed in the middle of one) spoils only its own slot:
    the other holds the state of one save before. Each slot is a file this process made
    (whatever was at its path, a planted link too, is unlinked first and the file created
    exclusively, mode 0600), and it is written only while its path still names that file
    (same inode, one link): else a new one is made."""

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, STATE_NAME)
        self.paths = (self.path, self.path + SECOND_SLOT)
        self._lock = threading.Lock()
        self._failed: str | None = None  # the last write error, logged once
        self._made: list[tuple[int, int] | None] = [None, None]  # (device, inode) of each slot made
        self._sizes = [0, 0]
        self._next = 0

    def _open_slot(self, i: int) -> int:
        path = self.paths[i]
        made = self._made[i]
        if made is not None:
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
            except FileNotFoundError:
                fd = -1
            if fd >= 0:
                st = os.fstat(fd)
                if (st.st_dev, st.st_ino) == made and st.st_nlink == 1:
                    return fd
                os.close(fd)  # not the file this process made any more
        os.makedirs(os.path.dirname(path), mode=0o750, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # whatever is there (a planted link) goes; a new file is made
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        st = os.fstat(fd)
        self._made[i], self._sizes[i] = (st.st_dev, st.st_ino), 0
        return fd

    def save(self, state: SavedState) -> None:
        data = json.dumps(encode(state), separators=(",", ":")).encode()
        with self._lock:
            i = self._next
            try:
                fd = self._open_slot(i)
                try:
                    padded = data + b" " * (self._sizes[i] - len(data))  # JSON allows trailing blanks
                    if os.pwrite(fd, padded, 0) != len(padded):
                        raise OSError(errno.EIO, "short write")
                finally:
                    os.close(fd)
                self._sizes[i] = max(self._sizes[i], len(data))
                self._next = 1 - i
            except OSError as exc:
                self._made[i] = None  # made afresh next time
                if self._failed != str(exc):
                    log.warning(
                        "journal: %s not written (%s): a restart will not know the jobs", self.paths[i], exc
                    )
                    self._failed = str(exc)
                return
            if self._failed is not None:
                log.info("journal: %s written again", self.paths[i])
                self._failed = None

    def load(self, boot_id: str | None) -> SavedState | None:
        """The newer saved state of this boot, else None (and why, in the log)."""
        states = [s for s in (self._load(path, boot_id) for path in self.paths) if s is not None]
        return max(states, key=lambda s: s.saved_ns) if states else None

    @staticmethod
    def _load(path: str, boot_id: str | None) -> SavedState | None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("journal: %s not read: %s", path, exc)
            return None
        try:
            st = os.fstat(fd)
            if st.st_uid != os.geteuid() or st.st_size > MAX_BYTES:
                log.warning("journal: %s is not this daemon's (owner or size); ignored", path)
                return None
            raw = os.read(fd, MAX_BYTES + 1)
        finally:
            os.close(fd)
        try:
            state = decode(json.loads(raw))
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:
            log.warning("journal: %s is malformed (%s); ignored", path, exc)
            return None
        if boot_id is None or state.boot_id != boot_id:
            log.info("journal: %s is of another boot; its processes are gone", path)
            return None
        return state
