"""Memory cgroups: which one a process is in, its limit, usage, peak and OOM kills,
and the limits of every ancestor (the tightest level is the one that will OOM first).

Works on v1 (memory controller mounted as its own hierarchy), v2 (unified, memory
enabled) and hybrid hosts (v1 memory plus a cgroup2 mount without it: v1 wins, since
the memory controller can be bound to one hierarchy only). The path in /proc/PID/cgroup
is relative to the hierarchy's mount, found in /proc/self/mountinfo, never assumed to be
/sys/fs/cgroup/<path>. Cgroup paths are reported as the kernel writes them (the
hierarchy-relative path, the form also used by the kernel's OOM records).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from sidecar.errors import NoSuchProcess, ParseError, ProbeError, read_bytes
from sidecar.model import CgroupLevel, CgroupSample, MemoryCharge
from sidecar.parse.memstat import charge_of, parse_memory_stat
from sidecar.probes.held import HeldFiles
from sidecar.probes.host import Psi, parse_psi

__all__ = [
    "UNLIMITED_THRESHOLD",
    "CgroupMount",
    "CgroupReader",
    "MemoryCgroupRef",
    "parse_flat_keyed",
    "parse_limit",
    "parse_mountinfo",
    "parse_proc_cgroup",
]

# v1 reports "no limit" as PAGE_COUNTER_MAX * PAGE_SIZE (9223372036854771712 with 4 KiB
# pages); anything this large is not a limit a job can hit.
UNLIMITED_THRESHOLD = 1 << 62
V2_EVENTS = ("low", "high", "max", "oom", "oom_kill")  # memory.events, as exported


@dataclass(frozen=True, slots=True)
class CgroupMount:
    """A cgroup hierarchy's mount: ``root`` is the hierarchy path shown at ``mount_point``."""

    version: int
    mount_point: str
    root: str
    controllers: frozenset[str]


@dataclass(frozen=True, slots=True)
class MemoryCgroupRef:
    """Where a process's memory cgroup lives: its hierarchy path and its directory."""

    version: int
    path: str
    directory: str
    mount_directory: str


def parse_mountinfo(text: str) -> list[CgroupMount]:
    """The cgroup and cgroup2 mounts of a /proc/PID/mountinfo text.

    Line format: ``id parent major:minor root mount-point options [optional...] - fstype
    source super-options``. Mount points escape spaces as ``\\040``.
    """
    mounts: list[CgroupMount] = []
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields = left.split()
        tail = right.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        fstype = tail[0]
        if fstype not in ("cgroup", "cgroup2"):
            continue
        root = _unescape(fields[3])
        mount_point = _unescape(fields[4])
        if fstype == "cgroup2":
            mounts.append(CgroupMount(2, mount_point, root, frozenset()))
        else:
            opts = frozenset(tail[2].split(","))
            mounts.append(CgroupMount(1, mount_point, root, opts))
    return mounts


def _unescape(field: str) -> str:
    return field.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def parse_proc_cgroup(data: bytes) -> dict[str, str]:
    """Parse /proc/PID/cgroup (``id:controllers:path`` lines).

    Returns controller -> path, with the unified hierarchy's line under the key ``""``.
    A v1 line may list several controllers (``4:cpu,cpuacct:/x``).
    """
    result: dict[str, str] = {}
    for line in data.decode("utf-8", "replace").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            if line.strip():
                raise ParseError(f"malformed cgroup line: {line[:80]!r}")
            continue
        _, controllers, path = parts
        if controllers == "":
            result[""] = path
        else:
            for controller in controllers.split(","):
                result[controller] = path
    return result


def parse_limit(text: str) -> int | None:
    """A limit file's content: v2 ``max`` or a v1 near-2^63 value mean no limit (None)."""
    value = text.strip()
    if value == "max":
        return None
    try:
        number = int(value)
    except ValueError as exc:
        raise ParseError(f"malformed limit: {value[:40]!r}") from exc
    return None if number >= UNLIMITED_THRESHOLD else number


def parse_flat_keyed(text: str) -> dict[str, int]:
    """A flat-keyed file (v2 memory.events, v1 memory.oom_control): ``key value`` lines."""
    result: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2:
            try:
                result[parts[0]] = int(parts[1])
            except ValueError:
                continue
    return result


class CgroupReader:
    """Resolves a process's memory cgroup and reads its counters.

    ``proc_root`` is where /proc/PID/cgroup is read; ``mountinfo`` is the text of the
    daemon's own /proc/self/mountinfo (read by the caller, once); ``fs_prefix`` is put in
    front of every mount point, so tests can lay a cgroup tree under a temporary folder.
    """

    ANCESTOR_LIMITS_TTL_SECONDS = 10.0

    def __init__(
        self, mountinfo: str, fs_prefix: str = "", clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.fs_prefix = fs_prefix
        self.clock = clock
        # Ancestors' limits change rarely (a container resized, a Slurm step started);
        # re-read them every ANCESTOR_LIMITS_TTL_SECONDS, not every round.
        self._ancestors_cache: dict[str, tuple[float, tuple[CgroupLevel, ...]]] = {}
        # usage() and sample() read through descriptors kept open while a cgroup is read
        # each round (end_round closes the others); not a fixture tree's files, which a
        # test may replace. oom_kills() (any thread) opens its own.
        self._held = HeldFiles(enabled=not fs_prefix)
        self._no_memsw: set[str] = set()  # v1 directories without memory.memsw.* (no swap accounting)
        self._touched: set[str] = set()
        mounts = parse_mountinfo(mountinfo)
        self.v1_memory = next((m for m in mounts if m.version == 1 and "memory" in m.controllers), None)
        self.v2 = next((m for m in mounts if m.version == 2), None)

    @classmethod
    def for_host(cls, proc_root: str = "/proc") -> CgroupReader:
        try:
            text = read_bytes(f"{proc_root}/self/mountinfo").decode("utf-8", "replace")
        except ProbeError:
            text = ""
        return cls(text)

    @property
    def available(self) -> bool:
        return self.v1_memory is not None or self.v2 is not None

    def _directory(self, mount: CgroupMount, path: str) -> str:
        rel = path
        root = mount.root.rstrip("/")
        if root and (path == root or path.startswith(root + "/")):  # /docker/abc is not /docker/abc123's
            rel = path[len(root) :]
        # A cgroup namespace shows the mount root as "/.."; paths are then namespace-relative.
        rel = rel if rel.startswith("/") else "/" + rel
        base = self.fs_prefix + mount.mount_point
        return base if rel == "/" else base + rel

    def resolve(self, proc_cgroup: bytes) -> MemoryCgroupRef | None:
        """The memory cgroup named by a /proc/PID/cgroup content, or None when this host
        has no memory controller (v1) and the unified hierarchy does not offer one."""
        table = parse_proc_cgroup(proc_cgroup)
        if self.v1_memory is not None and "memory" in table:
            path = table["memory"]
            mount = self.v1_memory
            return MemoryCgroupRef(1, path, self._directory(mount, path), self.fs_prefix + mount.mount_point)
        if self.v2 is not None and "" in table:
            path = table[""]
            mount = self.v2
            directory = self._directory(mount, path)
            base = self.fs_prefix + mount.mount_point
            # memory is usable on v2 when it is enabled for this cgroup (listed in
            # cgroup.controllers), or the cgroup is the root (which has no memory.* files).
            if directory == base or _has_memory_controller(directory):
                return MemoryCgroupRef(2, path, directory, base)
        return None

    def oom_kills(self, path: str, version: int) -> int | None:
        """The oom_kill counter of the memory cgroup at hierarchy ``path`` right now (v1
        memory.oom_control, v2 memory.events), None when it cannot be read. Safe to call
        from any thread: it only reads one file."""
        mount = self.v1_memory if version == 1 else self.v2
        if mount is None:
            return None
        directory = self._directory(mount, path)
        keyed = _read_keyed(f"{directory}/{'memory.oom_control' if version == 1 else 'memory.events'}")
        return keyed.get("oom_kill") if keyed is not None else None

    def limit_hits(
        self,
        path: str,
        version: int,
        limited_by: str | None = None,
        read: Callable[..., bytes] = read_bytes,
        own: int | None = None,
    ) -> int | None:
        """How many times the memory cgroup at ``path``, or the level ``limited_by`` whose
        limit binds it, reached its limit (v2 memory.events ``oom``: usage at the limit and an
        allocation about to fail; v1 memory.failcnt and memory.memsw.failcnt, each level its
        own), summed over the two; None when none can be read. A cgroup's ``oom_kill`` counts
        its processes killed by *any* OOM killer, the global one's too: only this says its
        own limit was reached. ``own``: the count of ``path`` itself already read (sample()'s
        memory.events), ``read`` the reader to use (sample()'s held descriptors). Safe to call
        from any thread with the default reader: it only reads small files."""
        mount = self.v1_memory if version == 1 else self.v2
        if mount is None:
            return None
        total: int | None = None
        for level in dict.fromkeys((path, limited_by or path)):
            counts: list[int | None]
            if level == path and own is not None:
                counts = [own]
            else:
                counts = self._limit_counts(self._directory(mount, level), version, read)
            for count in counts:
                if count is not None:
                    total = (total or 0) + count
        return total

    def _limit_counts(self, directory: str, version: int, read: Callable[..., bytes]) -> list[int | None]:
        try:
            if version == 2:
                keyed = _read_keyed(f"{directory}/memory.events", read)  # v2's root has none: None
                return [keyed.get("oom") if keyed is not None else None]
            counts = [_read_int(f"{directory}/memory.failcnt", read)]
            if directory not in self._no_memsw:  # swap accounting off: no memsw files, learnt once
                memsw = _read_int(f"{directory}/memory.memsw.failcnt", read)
                if memsw is None:
                    if len(self._no_memsw) >= 1024:  # bounded over a long life of many jobs
                        self._no_memsw.clear()
                    self._no_memsw.add(directory)
                counts.append(memsw)
            return counts
        except (ProbeError, ParseError):
            return []

    OOMD_XATTRS = ("user.oomd_ooms", "trusted.oomd_ooms", "user.oomd_kill", "trusted.oomd_kill")

    def oomd_marks(self, path: str, version: int) -> dict[str, int]:
        """The userspace OOM daemons' marks on the memory cgroup at ``path`` and each of
        its ancestors: ``{"user.oomd_ooms /a/b": 2, ...}`` (systemd-oomd counts its kills
        of a cgroup in ``user.oomd_ooms``/``user.oomd_kill``; Meta's oomd uses the
        ``trusted.`` names too). {} where there are none or xattrs cannot be read. One
        getxattr per name and level; safe from any thread."""
        mount = self.v1_memory if version == 1 else self.v2
        if mount is None:
            return {}
        marks: dict[str, int] = {}
        level = path.rstrip("/") or "/"
        while True:
            directory = self._directory(mount, level)
            for name in self.OOMD_XATTRS:
                try:
                    raw = os.getxattr(directory, name)
                except OSError:
                    continue
                try:
                    marks[f"{name} {level}"] = int(raw.strip(b"\0 \n") or b"0")
                except ValueError:
                    continue
            if level == "/":
                return marks
            level = level.rsplit("/", 1)[0] or "/"

    def usage(self, ref: MemoryCgroupRef) -> int | None:
        """The cgroup's usage alone (the one counter read every round); None for v2's root,
        which has none. Raises NoSuchProcess when the cgroup is gone."""
        if ref.version == 2 and ref.directory == ref.mount_directory:
            return None
        name = "memory.usage_in_bytes" if ref.version == 1 else "memory.current"
        self._touched.add(ref.directory)
        usage = _read_int(f"{ref.directory}/{name}", self._held.read)
        if usage is None:
            raise NoSuchProcess(f"{ref.directory}: cgroup gone", ref.directory)
        return usage

    def sample(self, ref: MemoryCgroupRef) -> CgroupSample:
        """Read the cgroup's counters and its ancestors' limits. Raises NoSuchProcess when
        the cgroup directory is gone (the job's container or step ended)."""
        events: dict[str, int] | None = None
        charge = None
        psi: Psi | None = None
        read = self._held.read
        self._touched.add(ref.directory)
        if ref.version == 1:
            usage = _read_int(f"{ref.directory}/memory.usage_in_bytes", read)
            limit = _read_limit(f"{ref.directory}/memory.limit_in_bytes", read)
            peak = _read_int(f"{ref.directory}/memory.max_usage_in_bytes", read)
            oom = _read_keyed(f"{ref.directory}/memory.oom_control", read)
            oom_kills = oom.get("oom_kill") if oom is not None else None
            oom_events = None
            if usage is not None:
                charge = _charge(ref.directory, 1, usage, read)
        else:
            is_root = ref.directory == ref.mount_directory
            if is_root:
                usage = limit = peak = None
                oom_kills = oom_events = None
            else:
                usage = _read_int(f"{ref.directory}/memory.current", read)
                limit = _read_limit(f"{ref.directory}/memory.max", read)
                peak = _read_int(f"{ref.directory}/memory.peak", read)
                events = _read_keyed(f"{ref.directory}/memory.events", read)
                oom_kills = events.get("oom_kill") if events is not None else None
                oom_events = events.get("oom") if events is not None else None
                if usage is not None:
                    charge = _charge(ref.directory, 2, usage, read)
                    psi = _pressure(ref.directory, read)
        if usage is None and not (ref.version == 2 and ref.directory == ref.mount_directory):
            raise NoSuchProcess(f"{ref.directory}: cgroup gone", ref.directory)
        ancestors = self._cached_ancestors(ref)
        limited_by, effective = _tightest(CgroupLevel(ref.path, limit), ancestors)
        return CgroupSample(
            path=ref.path,
            version=ref.version,
            usage_bytes=usage,
            limit_bytes=limit,
            peak_bytes=peak,
            oom_kills=oom_kills,
            oom_events=oom_events,
            ancestors=ancestors,
            limited_by=limited_by,
            effective_limit_bytes=effective,
            charge=charge,
            events={k: events[k] for k in V2_EVENTS if k in events} if events else {},
            pressure_ratio=(psi.some_avg10_ratio, psi.full_avg10_ratio) if psi else None,
            pressure_stall_seconds=(psi.some_total_seconds, psi.full_total_seconds) if psi else None,
            limit_hits=self.limit_hits(ref.path, ref.version, limited_by, read, oom_events),
        )

    def end_round(self) -> None:
        """The sampler's round is over: descriptors of cgroups it did not read are closed."""
        self._held.keep_under(self._touched)
        self._touched = set()

    def sample_level(self, ref: MemoryCgroupRef, path: str) -> CgroupSample:
        """Sample an ancestor ``path`` of ``ref`` (same hierarchy)."""
        return self.sample(self.level_ref(ref, path))

    @staticmethod
    def level_ref(ref: MemoryCgroupRef, path: str) -> MemoryCgroupRef:
        """The ref of ``ref``'s ancestor ``path`` (same hierarchy)."""
        depth = ref.path.rstrip("/").count("/") - path.rstrip("/").count("/")
        directory = ref.directory
        for _ in range(depth):
            directory = os.path.dirname(directory)
        return MemoryCgroupRef(ref.version, path, directory, ref.mount_directory)

    def _cached_ancestors(self, ref: MemoryCgroupRef) -> tuple[CgroupLevel, ...]:
        now = self.clock()
        cached = self._ancestors_cache.get(ref.directory)
        if cached is not None and now - cached[0] < self.ANCESTOR_LIMITS_TTL_SECONDS:
            return cached[1]
        if len(self._ancestors_cache) > 1024:  # bounded: cgroups come and go with jobs
            self._ancestors_cache.clear()
        levels = tuple(self._ancestors(ref))
        self._ancestors_cache[ref.directory] = (now, levels)
        return levels

    def _ancestors(self, ref: MemoryCgroupRef) -> list[CgroupLevel]:
        levels: list[CgroupLevel] = []
        path = ref.path.rstrip("/")
        directory = ref.directory
        limit_file = "memory.limit_in_bytes" if ref.version == 1 else "memory.max"
        while path and directory != ref.mount_directory:
            path = os.path.dirname(path)
            directory = os.path.dirname(directory)
            if ref.version == 2 and directory == ref.mount_directory:
                levels.append(CgroupLevel(path or "/", None))
                break
            levels.append(CgroupLevel(path or "/", _read_limit(f"{directory}/{limit_file}")))
            if path in ("", "/"):
                break
        return levels


def _tightest(leaf: CgroupLevel, ancestors: tuple[CgroupLevel, ...]) -> tuple[str | None, int | None]:
    limited = [
        (level.limit_bytes, level.path) for level in (leaf, *ancestors) if level.limit_bytes is not None
    ]
    if not limited:
        return None, None
    limit, path = min(limited, key=lambda item: item[0])
    return path, limit


def _has_memory_controller(directory: str) -> bool:
    try:
        parent = os.path.dirname(directory)
        controllers = read_bytes(f"{parent}/cgroup.subtree_control").split()
        return b"memory" in controllers
    except ProbeError:
        return os.path.exists(f"{directory}/memory.current")


def _charge(
    directory: str, version: int, usage: int, read: Callable[..., bytes] = read_bytes
) -> MemoryCharge | None:
    """The charge split from memory.stat (one read), plus v1's kernel memory counter; None
    when it cannot be read (the split is an addition: the usage and limit still stand)."""
    try:
        stat = parse_memory_stat(read(f"{directory}/memory.stat", limit=64 << 10).decode("ascii", "replace"))
        kmem = None
        if version == 1:
            with contextlib.suppress(ProbeError, ValueError):
                kmem = int(read(f"{directory}/memory.kmem.usage_in_bytes").strip())
    except ProbeError:
        return None
    return charge_of(stat, version, usage, kmem)


def _pressure(directory: str, read: Callable[..., bytes] = read_bytes) -> Psi | None:
    """The cgroup's own memory.pressure (v2; absent where PSI is off): None when unreadable."""
    try:
        return parse_psi(read(f"{directory}/memory.pressure", limit=4096))
    except ProbeError:
        return None


def _read_int(path: str, read: Callable[..., bytes] = read_bytes) -> int | None:
    try:
        return int(read(path).strip())
    except NoSuchProcess:
        return None
    except ValueError as exc:
        raise ParseError(f"{path}: not a number") from exc


def _read_limit(path: str, read: Callable[..., bytes] = read_bytes) -> int | None:
    try:
        return parse_limit(read(path).decode())
    except NoSuchProcess:
        return None


def _read_keyed(path: str, read: Callable[..., bytes] = read_bytes) -> dict[str, int] | None:
    try:
        return parse_flat_keyed(read(path).decode())
    except NoSuchProcess:
        return None
