"""``trainwatch doctor``: which evidence sources work on this machine for this user and for
the daemon that the given options describe, and for each missing one what is lost and what
brings it back; also whether the installation is whole (the emitter catalog), the postmortem
directory writable and the web config loadable. A source the options turn off is ``off``, not
missing. The daemon logs the same summary at start.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from sidecar.errors import ProbeError, read_bytes
from sidecar.probes.cgroup import CgroupReader
from sidecar.probes.gpu import GpuProbe
from sidecar.settings import EVIDENCE_SOURCES, Settings
from sidecar.watch.signals import TRACEFS_PLACES, find_tracefs

__all__ = ["Check", "checks", "missing", "render", "summary_line"]

# The inode numbers of the initial namespaces are fixed by the kernel (include/linux/proc_ns.h).
INIT_NS = {"pid": 0xEFFFFFFC, "user": 0xEFFFFFFD, "cgroup": 0xEFFFFFFB}


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    ok: bool
    detail: str
    lost: str = ""
    fix: str = ""
    off: bool = False  # turned off by the options: neither ok nor missing


# The check that each evidence source of --disable stands for.
SOURCE_CHECKS = {
    "connector": "process connector",
    "pidfd": "pidfd",
    "kmsg": "kernel log",
    "tracepoint": "signal tracepoint",
    "nvml": "NVML",
}


def _namespace(kind: str, proc_root: str) -> bool | None:
    try:
        return os.stat(f"{proc_root}/self/ns/{kind}").st_ino == INIT_NS[kind]
    except OSError:
        return None


def _has_capability(proc_root: str, bit: int) -> bool:
    try:
        for line in read_bytes(f"{proc_root}/self/status").decode().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> bit & 1)
    except (ProbeError, ValueError):
        pass
    return False


@dataclass(frozen=True, slots=True)
class _Node:
    """What every check of this node may need: the /proc it reads, and whether the daemon
    is in the host's PID, user and cgroup namespaces (None: unknown)."""

    root: str
    in_pid: bool | None
    in_user: bool | None
    in_cg: bool | None


def _pid_namespace(n: _Node) -> Check:
    return Check(
        "host PID namespace",
        n.in_pid is not False,
        "yes"
        if n.in_pid
        else ("unknown" if n.in_pid is None else "no: trainwatch is in a PID namespace of its own"),
        "jobs outside this namespace, and GPU memory per rank (NVML reports host pids)",
        "run in the host's PID namespace: docker --pid=host, Kubernetes hostPID: true",
    )


def _other_users(n: _Node) -> Check:
    if os.geteuid() == 0 or _has_capability(n.root, 19):  # CAP_SYS_PTRACE
        return Check(
            "other users' /proc",
            True,
            "root" if os.geteuid() == 0 else "CAP_SYS_PTRACE: other users' environments are readable",
        )
    return Check(
        "other users' /proc",
        False,
        "not root and no CAP_SYS_PTRACE",
        "RANK/LOCAL_RANK of other users' ranks (labelled local0, local1... by start order)",
        "run as root or as the job's user, or grant CAP_SYS_PTRACE",
    )


def _connector(n: _Node) -> Check:
    from sidecar.watch.exits import ProcConnector

    probe = ProcConnector(lambda event: None)
    try:
        probe.start(timeout=0.5)
        return Check(
            "process connector",
            True,
            "subscribed" + (" (non-zero exits only)" if probe.filtered else ""),
        )
    except OSError as exc:
        return Check(
            "process connector",
            False,
            exc.strerror or str(exc),
            "first-hand exit codes and death times (then pidfds tell them, see below)",
            "run as root in the host's PID, user and network namespaces (hostNetwork, hostPID, no "
            "user-namespace remapping); CAP_NET_ADMIN before Linux 6.6",
        )
    finally:
        probe.stop()


def _pidfd(n: _Node) -> Check:
    try:
        os.close(os.pidfd_open(os.getpid()))
        return Check("pidfd", True, "pidfd_open works: exits are caught even without the connector")
    except (OSError, AttributeError) as exc:
        return Check(
            "pidfd",
            False,
            getattr(exc, "strerror", None) or str(exc),
            "the exit-capture fallback: without the connector, statuses come only from zombies seen "
            "in /proc or the agent's log file",
            "Linux 5.3+ and Python 3.9+; no seccomp profile that blocks pidfd_open",
        )


def _kernel_log(n: _Node) -> Check:
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
        os.close(fd)
        return Check("kernel log", True, "/dev/kmsg readable")
    except OSError as exc:
        return Check(
            "kernel log",
            False,
            f"/dev/kmsg: {exc.strerror}",
            "kernel OOM records naming the victim: OOM verdicts drop from 'certain' to 'likely'",
            "run as root or with CAP_SYSLOG (kernel.dmesg_restrict=1); expose /dev/kmsg to the container",
        )


def _signal_tracepoint(n: _Node) -> Check:
    tracing = f"{find_tracefs()}/events/signal/signal_generate"
    if os.path.isdir(tracing):
        return Check(
            "signal tracepoint",
            os.access(tracing + "/enable", os.W_OK),
            "signal:signal_generate available"
            + ("" if os.access(tracing + "/enable", os.W_OK) else " but not writable"),
            "the sender of a SIGKILL/SIGTERM (so an outside kill is named, not only suspected)",
            "run as root",
        )
    return Check(
        "signal tracepoint",
        False,
        f"tracefs not mounted at {' or '.join(TRACEFS_PLACES)}",
        "the sender of a SIGKILL/SIGTERM (so an outside kill is named, not only suspected)",
        "mount -t tracefs nodev /sys/kernel/tracing (as root)",
    )


def _memory_cgroups(n: _Node) -> Check:
    reader = CgroupReader.for_host(n.root)
    if not reader.available:
        return Check(
            "memory cgroups",
            False,
            "no memory cgroup hierarchy mounted",
            "cgroup limits, usage and OOM counts",
            "mount the cgroup hierarchy at /sys/fs/cgroup",
        )
    try:
        ref = reader.resolve(read_bytes(f"{n.root}/self/cgroup"))
    except ProbeError:
        ref = None
    kinds = (
        ("v1 memory" if reader.v1_memory else "")
        + (" + " if reader.v1_memory and reader.v2 else "")
        + ("cgroup2" if reader.v2 else "")
    )
    readable = False
    if ref is not None:
        try:
            reader.sample(ref)
            readable = True
        except ProbeError:
            readable = False
    detail = f"{kinds} mounted; own memory cgroup {ref.path if ref else 'not found'}" + (
        ", readable" if readable else ""
    )
    if n.in_cg is False:
        detail += "; in a cgroup namespace of its own (other pods' paths are hidden)"
    return Check(
        "memory cgroups",
        readable,
        detail,
        "limits, usage, peaks and OOM counts of the ranks' cgroups",
        "mount /sys/fs/cgroup read-only into the container; use the host cgroup namespace (--cgroupns=host)",
    )


def _nvml(n: _Node) -> Check:
    gpu = GpuProbe()
    result = gpu.sample()
    gpu.close()
    return Check(
        "NVML",
        result.success,
        f"{len(result.devices)} GPU(s)" if result.success else (result.message or "unavailable"),
        "GPU memory per device and per rank",
        "install the NVIDIA driver and nvidia-ml-py; in a container, the NVIDIA container toolkit",
    )


def _memory_psi(n: _Node) -> Check:
    try:
        read_bytes(f"{n.root}/pressure/memory")
        return Check("memory PSI", True, "/proc/pressure/memory readable")
    except ProbeError as exc:
        return Check(
            "memory PSI",
            False,
            str(exc),
            "memory pressure (stall time) metrics",
            "a kernel with CONFIG_PSI=y booted with psi=1",
        )


def _user_namespace(n: _Node) -> Check:
    return Check(
        "user namespace",
        n.in_user is not False,
        "initial" if n.in_user else "remapped or unknown",
        "" if n.in_user else "the process connector (it ignores requests from other user namespaces)",
        "" if n.in_user else "run without user-namespace remapping",
    )


# The node's checks, in the order doctor prints them.
_NODE_CHECKS = (
    _pid_namespace,
    _other_users,
    _connector,
    _pidfd,
    _kernel_log,
    _signal_tracepoint,
    _memory_cgroups,
    _nvml,
    _memory_psi,
    _user_namespace,
)


def checks(settings: Settings, *, connector: bool = True, installation: bool = True) -> list[Check]:
    """Every check, for the daemon ``settings`` describe. ``connector``: subscribe to the
    process connector to see whether it works (the running daemon knows already);
    ``installation``: the catalog, postmortem directory and web config too."""
    root = settings.proc_root
    node = _Node(root, *(_namespace(k, root) for k in ("pid", "user", "cgroup")))
    out = [check(node) for check in _NODE_CHECKS if connector or check is not _connector]
    out += _self_protection(settings)
    if installation:
        out += _installation(settings)
    off = {SOURCE_CHECKS.get(source, source): source for source in settings.disabled}
    out = [
        Check(c.name, True, f"turned off (--disable {off[c.name]})", off=True) if c.name in off else c
        for c in out
    ]
    for source in sorted(settings.disabled):
        if source not in SOURCE_CHECKS:
            out.append(
                Check(source, True, f"turned off (--disable {source}): {EVIDENCE_SOURCES[source]}", off=True)
            )
    return out


def missing(results: list[Check]) -> list[Check]:
    """The checks that failed (a source turned off is not among them)."""
    return [c for c in results if not c.ok]


def _installation(settings: Settings) -> list[Check]:
    """The installation and the files the options name: the emitter catalog whole, the
    postmortem directory writable (or creatable), the web config loadable."""
    from sidecar.catalog import FILES, CatalogError, load, texts

    out = []
    try:
        n = len(load(texts()))
        out.append(Check("emitter catalog", True, f"{n} messages from {len(FILES)} emitter families"))
    except (CatalogError, OSError, UnicodeDecodeError) as exc:
        out.append(
            Check(
                "emitter catalog",
                False,
                str(exc),
                "the emitters' own words in ranks' output, agents' logs and diagnose: most verdicts",
                "reinstall trainwatchd from a wheel that carries sidecar/catalog/*.toml",
            )
        )
    path = settings.postmortem_dir
    near = path
    while not os.path.exists(near) and os.path.dirname(near) != near:
        near = os.path.dirname(near)
    ok = os.path.isdir(near) and os.access(near, os.W_OK | os.X_OK)
    out.append(
        Check(
            "postmortem dir",
            ok,
            f"{path} {'writable' if os.path.exists(path) else 'can be created'}"
            if ok
            else f"{path}: {near} is not writable",
            "postmortems and the journal that reconstructs a death after a restart",
            "give --postmortem-dir a directory this user can write",
        )
    )
    if settings.web_config is not None:
        from sidecar.errors import ConfigError
        from sidecar.web.config import load as load_web

        try:
            load_web(settings.web_config)
            out.append(Check("web config", True, f"{settings.web_config} loads"))
        except ConfigError as exc:
            out.append(
                Check("web config", False, str(exc), "the daemon does not start", "fix the file it names")
            )
    return out


CAP_IPC_LOCK, CAP_SYS_NICE, CAP_SYS_RESOURCE = 14, 23, 24


def _self_protection(settings: Settings) -> list[Check]:
    """What the daemon will be granted to survive the OOM it explains (protection.py)."""
    import resource

    root = settings.proc_root
    out = []
    if settings.oom_score_adj is not None and settings.oom_score_adj < 0:
        ok = _has_capability(root, CAP_SYS_RESOURCE)
        out.append(
            Check(
                "oom_score_adj",
                ok,
                f"{settings.oom_score_adj} will be set" if ok else "no CAP_SYS_RESOURCE: cannot go below 0",
                "the daemon may be the OOM killer's choice in the OOM it should explain",
                "run as root, or grant CAP_SYS_RESOURCE (systemd: OOMScoreAdjust=-1000)",
            )
        )
    if settings.self_protection:
        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        ok = _has_capability(root, CAP_IPC_LOCK) or soft == resource.RLIM_INFINITY
        out.append(
            Check(
                "memory lock",
                ok,
                "mlockall will lock the daemon's pages"
                if ok
                else f"no CAP_IPC_LOCK, RLIMIT_MEMLOCK {soft} bytes",
                "under memory pressure the death path may wait for its own pages",
                "grant CAP_IPC_LOCK or LimitMEMLOCK=infinity (docker --cap-add IPC_LOCK)",
            )
        )
        ok = _has_capability(root, CAP_SYS_NICE)
        out.append(
            Check(
                "priority",
                ok,
                "the daemon's threads will run at nice -10" if ok else "no CAP_SYS_NICE",
                "on busy cores a postmortem may wait for CPU",
                "grant CAP_SYS_NICE (docker --cap-add SYS_NICE)",
            )
        )
    return out


def render(results: list[Check]) -> str:
    lines = ["trainwatch doctor: evidence sources on this machine, for this user", ""]
    for c in results:
        state = "off    " if c.off else ("ok     " if c.ok else "MISSING")
        lines.append(f"  {state}  {c.name:<20} {c.detail}")
        if not c.ok and c.lost:
            lines.append(f"           {'':<20} loses: {c.lost}")
        if not c.ok and c.fix:
            lines.append(f"           {'':<20} fix:   {c.fix}")
    lost = [c.name for c in missing(results)]
    lines += ["", "everything is available" if not lost else f"{len(lost)} missing: {', '.join(lost)}"]
    return "\n".join(lines) + "\n"


def summary_line(results: list[Check]) -> str:
    return "evidence sources: " + ", ".join(
        f"{c.name} {'off' if c.off else ('ok' if c.ok else 'MISSING')}" for c in results
    )
