"""Builders of cgroup fixture trees laid out as the kernel documents them
(Documentation/admin-guide/cgroup-v1/memory.rst, cgroup-v2.rst), values in the
kernel's own formats. v1 values were checked against this machine's v1 hierarchy."""

from __future__ import annotations

from pathlib import Path

V1_UNLIMITED = "9223372036854771712"
MIB = 1 << 20

# Mount tables in /proc/self/mountinfo form.
MOUNTINFO_HYBRID = (
    Path(__file__).resolve().parents[1] / "fixtures" / "proc-torchrun" / "self" / "mountinfo"
).read_text()
MOUNTINFO_V2 = (
    "24 30 0:22 / /sys rw,nosuid,nodev,noexec,relatime shared:7 - sysfs sysfs rw\n"
    "28 24 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 cgroup2 "
    "rw,nsdelegate,memory_recursiveprot\n"
)
MOUNTINFO_V1_CONTAINER = (
    # docker without a cgroup namespace: the memory hierarchy is bind-mounted at the
    # container's own cgroup, so the mount root is that path.
    "700 690 0:40 /docker/abc123 /sys/fs/cgroup/memory ro,nosuid,nodev,noexec,relatime master:16 - "
    "cgroup cgroup rw,memory\n"
)


def write(root: Path, rel: str, files: dict[str, str]) -> Path:
    d = root / rel.lstrip("/")
    d.mkdir(parents=True, exist_ok=True)
    for name, value in files.items():
        (d / name).write_text(value)
    return d


def v1_level(limit: str, usage: int, peak: int, oom_kill: int = 0, failcnt: int = 0) -> dict[str, str]:
    return {
        "memory.limit_in_bytes": limit + "\n",
        "memory.failcnt": f"{failcnt}\n",
        "memory.usage_in_bytes": f"{usage}\n",
        "memory.max_usage_in_bytes": f"{peak}\n",
        "memory.oom_control": f"oom_kill_disable 0\nunder_oom 0\noom_kill {oom_kill}\n",
    }


def v2_level(
    maximum: str, current: int, peak: int | None, events: dict[str, int] | None = None
) -> dict[str, str]:
    ev = {"low": 0, "high": 0, "max": 0, "oom": 0, "oom_kill": 0, "oom_group_kill": 0}
    ev.update(events or {})
    files = {
        "memory.max": maximum + "\n",
        "memory.current": f"{current}\n",
        "memory.events": "".join(f"{k} {v}\n" for k, v in ev.items()),
        "cgroup.controllers": "cpu io memory pids\n",
        "cgroup.subtree_control": "memory pids\n",
    }
    if peak is not None:
        files["memory.peak"] = f"{peak}\n"
    return files


def slurm_v1(root: Path) -> Path:
    """A Slurm-like v1 hierarchy: the job level has the tightest limit, the step its own."""
    mem = root / "sys/fs/cgroup/memory"
    write(mem, "/", v1_level(V1_UNLIMITED, 20_000 * MIB, 21_000 * MIB))
    write(mem, "/slurm", v1_level(V1_UNLIMITED, 9_000 * MIB, 9_500 * MIB))
    write(mem, "/slurm/uid_1000", v1_level(V1_UNLIMITED, 9_000 * MIB, 9_500 * MIB))
    write(
        mem,
        "/slurm/uid_1000/job_42",
        v1_level(str(8_192 * MIB), 8_000 * MIB, 8_192 * MIB, oom_kill=1, failcnt=5),
    )
    write(
        mem,
        "/slurm/uid_1000/job_42/step_0",
        v1_level(str(16_384 * MIB), 7_900 * MIB, 8_100 * MIB, oom_kill=1),
    )
    return mem


def kubepods_v2(root: Path) -> Path:
    """A Kubernetes-like v2 hierarchy: the pod has the limit, the container none."""
    cg = root / "sys/fs/cgroup"
    write(
        cg,
        "/",
        {"cgroup.controllers": "cpu io memory pids\n", "cgroup.subtree_control": "cpu io memory pids\n"},
    )
    write(cg, "/kubepods.slice", v2_level("max", 30_000 * MIB, 31_000 * MIB))
    write(
        cg,
        "/kubepods.slice/kubepods-pod1.slice",
        v2_level(str(4_096 * MIB), 4_000 * MIB, 4_096 * MIB, {"max": 37, "oom": 2, "oom_kill": 2}),
    )
    write(
        cg,
        "/kubepods.slice/kubepods-pod1.slice/cri-containerd-c1.scope",
        v2_level("max", 3_990 * MIB, None, {"oom_kill": 2}),
    )
    return cg
