"""Memory cgroups on v1, v2 and hybrid hosts, on fixture trees laid out per the kernel docs."""

from __future__ import annotations

import os

import pytest

from sidecar.errors import NoSuchProcess, ParseError
from sidecar.front.demo import memory_cgroup
from sidecar.probes.cgroup import (
    CgroupReader,
    parse_flat_keyed,
    parse_limit,
    parse_mountinfo,
    parse_proc_cgroup,
)
from tests.conftest import PROC_TORCHRUN, RANK0
from tests.support import cgtrees
from tests.support.cgtrees import MIB, MOUNTINFO_HYBRID, MOUNTINFO_V1_CONTAINER, MOUNTINFO_V2
from tests.support.paths import FIXTURES
from tests.support.skips import requires, skip


def test_mountinfo_of_this_hybrid_machine():
    mounts = parse_mountinfo(MOUNTINFO_HYBRID)
    v1 = [m for m in mounts if m.version == 1]
    v2 = [m for m in mounts if m.version == 2]
    assert any("memory" in m.controllers and m.mount_point == "/sys/fs/cgroup/memory" for m in v1)
    assert [m.mount_point for m in v2] == ["/sys/fs/cgroup/unified"]


def test_mountinfo_escapes_and_ignores_other_filesystems():
    text = "1 0 0:1 / /sys/fs/my\\040cg rw - cgroup2 cgroup2 rw\n2 0 0:2 / /proc rw - proc proc rw\n"
    assert [m.mount_point for m in parse_mountinfo(text)] == ["/sys/fs/my cg"]


def test_proc_cgroup_forms():
    hybrid = (PROC_TORCHRUN / str(RANK0) / "cgroup").read_bytes()
    table = parse_proc_cgroup(hybrid)
    assert table["memory"].startswith("/process_api/") and table[""] == "/"
    assert parse_proc_cgroup(b"0::/kubepods.slice/x.scope\n") == {"": "/kubepods.slice/x.scope"}
    assert parse_proc_cgroup(b"4:cpu,cpuacct:/a\n")["cpuacct"] == "/a"
    with pytest.raises(ParseError):
        parse_proc_cgroup(b"garbage\n")


def test_limits_and_keyed_files():
    assert parse_limit("max\n") is None
    assert parse_limit(cgtrees.V1_UNLIMITED) is None
    assert parse_limit("104857600\n") == 104857600
    with pytest.raises(ParseError):
        parse_limit("lots")
    assert parse_flat_keyed("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n")["oom_kill"] == 3
    assert parse_flat_keyed("low 0\nhigh 5\nmax 2\noom 1\noom_kill 1\noom_group_kill 0\nbad line here\n") == {
        "low": 0,
        "high": 5,
        "max": 2,
        "oom": 1,
        "oom_kill": 1,
        "oom_group_kill": 0,
    }


def test_v1_slurm_tree_names_the_tightest_ancestor(tmp_path):
    cgtrees.slurm_v1(tmp_path)
    reader = CgroupReader(MOUNTINFO_HYBRID, fs_prefix=str(tmp_path))
    ref = reader.resolve(b"9:name=systemd:/\n4:memory:/slurm/uid_1000/job_42/step_0\n0::/\n")
    assert ref is not None and ref.version == 1
    s = reader.sample(ref)
    assert s.path == "/slurm/uid_1000/job_42/step_0"
    assert s.limit_bytes == 16_384 * MIB and s.usage_bytes == 7_900 * MIB and s.peak_bytes == 8_100 * MIB
    assert s.oom_kills == 1
    assert [a.path for a in s.ancestors] == ["/slurm/uid_1000/job_42", "/slurm/uid_1000", "/slurm", "/"]
    assert s.ancestors[0].limit_bytes == 8_192 * MIB and s.ancestors[-1].limit_bytes is None
    assert s.limited_by == "/slurm/uid_1000/job_42" and s.effective_limit_bytes == 8_192 * MIB
    job = reader.sample_level(ref, "/slurm/uid_1000/job_42")
    assert job.usage_bytes == 8_000 * MIB and job.limit_bytes == 8_192 * MIB


def test_limit_hits_are_the_cgroup_s_and_its_limiting_level_s(tmp_path):
    """A cgroup's oom_kill counts kills by any OOM killer; what says its own limit was reached
    is v1's failcnt (each level its own: the job's limit binds the step, so the job's count)
    and v2's memory.events oom (the pod's limit binds the container)."""
    mem = cgtrees.slurm_v1(tmp_path / "v1")
    reader = CgroupReader(MOUNTINFO_HYBRID, fs_prefix=str(tmp_path / "v1"))
    step = reader.sample(reader.resolve(b"4:memory:/slurm/uid_1000/job_42/step_0\n"))
    assert step.limited_by == "/slurm/uid_1000/job_42" and step.limit_hits == 5
    (mem / "slurm/uid_1000/job_42/step_0/memory.memsw.failcnt").write_text("2\n")  # swap accounted
    # (a boot option: a reader learns once that a directory has no memsw files)
    assert reader.limit_hits(step.path, 1, step.limited_by) == 5
    fresh = CgroupReader(MOUNTINFO_HYBRID, fs_prefix=str(tmp_path / "v1"))
    assert fresh.limit_hits(step.path, 1, step.limited_by) == 7
    assert reader.limit_hits("/slurm", 1) == 0  # unlimited: its count never moves
    assert reader.limit_hits("/gone", 1) is None
    cgtrees.kubepods_v2(tmp_path / "v2")
    reader2 = CgroupReader(MOUNTINFO_V2, fs_prefix=str(tmp_path / "v2"))
    c1 = reader2.sample(reader2.resolve(b"0::/kubepods.slice/kubepods-pod1.slice/cri-containerd-c1.scope\n"))
    assert c1.oom_kills == 2 and c1.limit_hits == 2  # the pod's oom events, none of its own
    assert reader2.limit_hits("/", 2) is None  # v2's root has no memory.events


def test_v1_unlimited_everywhere(tmp_path):
    cgtrees.slurm_v1(tmp_path)
    reader = CgroupReader(MOUNTINFO_HYBRID, fs_prefix=str(tmp_path))
    s = reader.sample(reader.resolve(b"4:memory:/slurm\n"))
    assert s.limit_bytes is None and s.limited_by is None and s.effective_limit_bytes is None


def test_v1_container_mount_root(tmp_path):
    mem = tmp_path / "sys/fs/cgroup/memory"
    cgtrees.write(mem, "/", cgtrees.v1_level(str(2048 * MIB), 100 * MIB, 200 * MIB))
    reader = CgroupReader(MOUNTINFO_V1_CONTAINER, fs_prefix=str(tmp_path))
    ref = reader.resolve(b"4:memory:/docker/abc123\n")
    assert ref is not None and ref.directory == str(mem)
    s = reader.sample(ref)
    assert s.limit_bytes == 2048 * MIB and s.ancestors == ()
    # below the mount root: a child of the container's cgroup, under it
    child = reader.resolve(b"4:memory:/docker/abc123/job\n")
    assert child is not None and child.directory == str(mem / "job")
    # a sibling whose name only starts like the root is not under it (nor is it visible here)
    other = reader.resolve(b"4:memory:/docker/abc1234/job\n")
    assert other is not None and other.directory != str(mem / "4/job")
    assert other.directory == str(mem / "docker/abc1234/job")


def test_v2_kubepods_tree(tmp_path):
    cgtrees.kubepods_v2(tmp_path)
    reader = CgroupReader(MOUNTINFO_V2, fs_prefix=str(tmp_path))
    ref = reader.resolve(b"0::/kubepods.slice/kubepods-pod1.slice/cri-containerd-c1.scope\n")
    assert ref is not None and ref.version == 2
    s = reader.sample(ref)
    assert s.usage_bytes == 3_990 * MIB and s.limit_bytes is None
    assert s.peak_bytes is None  # memory.peak only since 5.19
    assert s.oom_kills == 2 and s.oom_events == 0
    assert s.limited_by == "/kubepods.slice/kubepods-pod1.slice" and s.effective_limit_bytes == 4_096 * MIB
    assert [a.path for a in s.ancestors] == ["/kubepods.slice/kubepods-pod1.slice", "/kubepods.slice", "/"]
    pod = reader.sample_level(ref, "/kubepods.slice/kubepods-pod1.slice")
    assert pod.oom_events == 2 and pod.peak_bytes == 4_096 * MIB


def test_the_charge_split_and_memory_events_of_a_v2_pod(tmp_path):
    """memory.stat (a real capture) is read once per sample into the split; memory.events
    keeps the five events the metric exports; memory.pressure gives the cgroup's own
    stall; a cgroup without those files has none of them."""
    cg = cgtrees.kubepods_v2(tmp_path)
    pod = cg / "kubepods.slice/kubepods-pod1.slice"
    real = FIXTURES / "cgroup-v2-memory"
    (pod / "memory.stat").write_text((real / "memory.stat").read_text())
    (pod / "memory.pressure").write_text(
        "some avg10=1.50 avg60=0.40 avg300=0.10 total=2500000\n"
        "full avg10=0.50 avg60=0.10 avg300=0.02 total=900000\n"
    )
    reader = CgroupReader(MOUNTINFO_V2, fs_prefix=str(tmp_path))
    ref = reader.resolve(b"0::/kubepods.slice/kubepods-pod1.slice/cri-containerd-c1.scope\n")
    assert ref is not None
    assert reader.sample(ref).charge is None  # the container level has no memory.stat here
    s = reader.sample_level(ref, "/kubepods.slice/kubepods-pod1.slice")
    assert s.charge is not None
    assert s.charge.shmem_bytes == 48 * MIB and s.charge.anon_bytes >= 96 * MIB
    assert s.charge.working_set_bytes == 4_000 * MIB - 64 * MIB  # current - inactive_file
    assert s.events == {"low": 0, "high": 0, "max": 37, "oom": 2, "oom_kill": 2}
    assert s.pressure_ratio == (0.015, 0.005) and s.pressure_stall_seconds == (2.5, 0.9)
    assert reader.sample(ref).pressure_ratio is None  # no memory.pressure there: none, not zero


def test_v1_charge_with_kernel_memory(tmp_path):
    mem = cgtrees.slurm_v1(tmp_path)
    real = FIXTURES / "cgroup-v1-memory"
    job = mem / "slurm/uid_1000/job_42"
    (job / "memory.stat").write_text((real / "memory.stat").read_text())
    (job / "memory.kmem.usage_in_bytes").write_text("2207744\n")
    reader = CgroupReader(MOUNTINFO_HYBRID, fs_prefix=str(tmp_path))
    ref = reader.resolve(b"4:memory:/slurm/uid_1000/job_42/step_0\n")
    assert ref is not None
    s = reader.sample_level(ref, "/slurm/uid_1000/job_42")
    assert s.charge is not None and s.charge.kernel_bytes == 2207744 and s.charge.shmem_bytes == 48 * MIB
    assert s.events == {}  # v1 has no memory.events


def test_v2_root_cgroup_has_no_memory_files(tmp_path):
    cgtrees.kubepods_v2(tmp_path)
    reader = CgroupReader(MOUNTINFO_V2, fs_prefix=str(tmp_path))
    s = reader.sample(reader.resolve(b"0::/\n"))
    assert s.path == "/" and s.usage_bytes is None and s.limit_bytes is None


def test_v2_without_memory_controller_is_not_a_memory_cgroup(tmp_path):
    cg = tmp_path / "sys/fs/cgroup"
    cgtrees.write(cg, "/", {"cgroup.subtree_control": "pids\n"})
    cgtrees.write(cg, "/user.slice", {"cgroup.procs": ""})
    reader = CgroupReader(MOUNTINFO_V2, fs_prefix=str(tmp_path))
    assert reader.resolve(b"0::/user.slice\n") is None


def test_hybrid_prefers_v1_memory(tmp_path):
    cgtrees.slurm_v1(tmp_path)
    reader = CgroupReader(MOUNTINFO_HYBRID, fs_prefix=str(tmp_path))
    assert reader.resolve(b"4:memory:/slurm\n0::/\n").version == 1


def test_gone_cgroup_raises_no_such_process(tmp_path):
    cgtrees.slurm_v1(tmp_path)
    reader = CgroupReader(MOUNTINFO_HYBRID, fs_prefix=str(tmp_path))
    with pytest.raises(NoSuchProcess):
        reader.sample(reader.resolve(b"4:memory:/slurm/gone\n"))


def test_no_cgroup_mounts():
    reader = CgroupReader("")
    assert not reader.available and reader.resolve(b"0::/\n") is None


def test_this_machines_own_cgroup(tmp_path):
    """The real hierarchy of this machine, whichever version it is (v1 on the development
    machine, v2 on the GPU machine): our own cgroup resolves and reads."""
    reader = CgroupReader.for_host()
    with open("/proc/self/cgroup", "rb") as f:
        ref = reader.resolve(f.read())
    if ref is None:
        skip("memcg", "no memory cgroup holds this process")
    s = reader.sample(ref)
    assert s.usage_bytes is None or s.usage_bytes > 0


def test_ancestor_limits_are_reread_after_their_ttl(tmp_path):
    mem = cgtrees.slurm_v1(tmp_path)
    now = [0.0]
    reader = CgroupReader(MOUNTINFO_HYBRID, fs_prefix=str(tmp_path), clock=lambda: now[0])
    ref = reader.resolve(b"4:memory:/slurm/uid_1000/job_42/step_0\n")
    assert reader.sample(ref).effective_limit_bytes == 8_192 * MIB
    (mem / "slurm/uid_1000/job_42/memory.limit_in_bytes").write_text(str(4_096 * MIB))
    now[0] = 5.0
    assert reader.sample(ref).effective_limit_bytes == 8_192 * MIB  # cached
    now[0] = 10.5
    assert reader.sample(ref).effective_limit_bytes == 4_096 * MIB
    # the cgroup's own limit is read every round
    (mem / "slurm/uid_1000/job_42/step_0/memory.limit_in_bytes").write_text(str(1_024 * MIB))
    assert reader.sample(ref).effective_limit_bytes == 1_024 * MIB


@pytest.mark.root
@requires("memcg", "cgroup-xattrs")
def test_oomd_marks_on_a_real_cgroup_and_its_ancestors():
    reader = CgroupReader.for_host()
    with memory_cgroup(1 << 30, "trainwatch-xattr") as (version, parent, child):
        root = parent.parent
        path = "/" + str(child.relative_to(root))
        before = reader.oomd_marks(path, version)
        assert not any(parent.name in k for k in before)
        os.setxattr(child, "user.oomd_ooms", b"2")
        os.setxattr(parent, "trusted.oomd_kill", b"5")
        marks = reader.oomd_marks(path, version)
        assert marks[f"user.oomd_ooms {path}"] == 2
        assert marks[f"trusted.oomd_kill /{parent.name}"] == 5
