"""Files read through held descriptors (``probes/held.py``): the host's files on the real
/proc, and a real memory cgroup that is removed and made again under the same name."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import time

import pytest

from sidecar.errors import NoSuchProcess, ProbeError, read_bytes
from sidecar.front.demo import join_cgroup, memory_cgroup
from sidecar.probes.cgroup import CgroupReader
from sidecar.probes.held import HeldFiles
from sidecar.probes.host import HostReader, parse_vmstat_oom_kill
from tests.support.e2e import wait_for
from tests.support.skips import left_out, met, requires

MIB = 1 << 20
HOG = "b = bytearray(64 << 20); print(1, flush=True); input()"  # 64 MiB charged, then waits


def _keys(data: bytes) -> list[bytes]:
    return [line.split()[0] for line in data.splitlines() if line]


def _readable(path: str) -> bytes | None:
    """The file's content, None where this kernel has no such file or refuses its read (PSI
    compiled in but booted off reads EOPNOTSUPP; gVisor has no /proc/vmstat)."""
    try:
        return read_bytes(path)
    except ProbeError:
        return None


def test_a_many_record_file_is_read_whole_through_a_held_descriptor():
    """A seq_file of the kernel (here /proc/self/maps) may hand out a page's worth of
    records per read, so a short read is not its end. The file is made longer than this
    machine's page rather than assumed so (/proc/vmstat is under a page on some kernels):
    three pages' worth of one-page mappings of alternating protection (a line of about 50
    bytes each; the kernel cannot merge them). Read twice through the same descriptor, it
    has every record each time."""
    page = os.sysconf("SC_PAGE_SIZE")
    regions = [
        mmap.mmap(-1, page, prot=mmap.PROT_READ | (mmap.PROT_WRITE * (i % 2)))
        for i in range(3 * page // 40 + 100)
    ]
    try:
        held = HeldFiles()
        first = held.read("/proc/self/maps", records=True)
        again = held.read("/proc/self/maps", records=True)
        assert len(held) == 1
        assert len(first) > 2 * page
        whole = read_bytes("/proc/self/maps")
        assert first.count(b"\n") == again.count(b"\n") == whole.count(b"\n")
        if met("vmstat"):  # the kernel's many-record file the sampler reads this way
            vmstat = held.read("/proc/vmstat", records=True)
            whole = read_bytes("/proc/vmstat")
            assert _keys(vmstat) == _keys(whole)
            # oom_kill since Linux 4.13: there when this kernel's own file has it
            assert (parse_vmstat_oom_kill(vmstat) is None) == (parse_vmstat_oom_kill(whole) is None)
        else:
            left_out("vmstat", "/proc/vmstat read whole through a held descriptor")
        held.close()
        assert len(held) == 0
    finally:
        for region in regions:
            region.close()


def test_host_files_are_held_on_the_real_proc_only(tmp_path):
    """Each of the host's files this kernel has is held: meminfo always; vmstat (none in
    gVisor) with its oom_kill counter since 4.13; memory PSI where the kernel has it on."""
    vmstat, psi = _readable("/proc/vmstat"), _readable("/proc/pressure/memory")
    real = HostReader("/proc")
    sample = real.sample()
    assert sample.total_bytes > 0
    assert (sample.oom_kills is None) == (vmstat is None or parse_vmstat_oom_kill(vmstat) is None)
    assert (sample.psi_some_avg10_ratio is None) == (psi is None)
    assert len(real._held) == 1 + (vmstat is not None) + (psi is not None)
    (tmp_path / "meminfo").write_bytes(b"MemTotal: 100 kB\nMemFree: 1 kB\nMemAvailable: 50 kB\n")
    copy = HostReader(str(tmp_path), shm_path=str(tmp_path))
    assert copy.sample().available_bytes == 50 * 1024
    (tmp_path / "new").write_bytes(b"MemTotal: 100 kB\nMemFree: 1 kB\nMemAvailable: 70 kB\n")
    (tmp_path / "new").replace(tmp_path / "meminfo")  # a fixture replaced: read afresh
    assert copy.sample().available_bytes == 70 * 1024
    assert len(copy._held) == 0


@pytest.mark.root
@requires("memcg")
def test_a_removed_cgroup_reads_gone_and_its_namesake_reads_its_own_usage():
    reader = CgroupReader.for_host()
    with memory_cgroup(1 << 30, "trainwatch-held") as (_version, _parent, child):
        hog = subprocess.Popen(
            [*join_cgroup(child), sys.executable, "-c", HOG],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        try:
            assert hog.stdout is not None and hog.stdout.readline().strip() == b"1"
            ref = wait_for(
                lambda: reader.resolve(read_bytes(f"/proc/{hog.pid}/cgroup")), 10, "the hog in its cgroup"
            )
            assert ref is not None and ref.directory == str(child)
            sample = reader.sample(ref)
            assert sample.usage_bytes is not None and sample.usage_bytes >= 64 * MIB
            assert reader.usage(ref) >= 64 * MIB
            reader.end_round()
            # usage, limit, peak, the OOM counters, memory.stat, v1's kernel memory and limit
            # hits (with swap accounting, memsw's too) and v2's PSI: each that this kernel has
            # (memory.peak since 5.19, PSI where it is on)
            names = (
                ("memory.usage_in_bytes", "memory.limit_in_bytes", "memory.max_usage_in_bytes",
                 "memory.oom_control", "memory.stat", "memory.kmem.usage_in_bytes",
                 "memory.failcnt", "memory.memsw.failcnt")
                if ref.version == 1
                else ("memory.current", "memory.max", "memory.peak", "memory.events", "memory.stat",
                      "memory.pressure")
            )  # fmt: skip
            present = {name for name in names if _readable(f"{child}/{name}") is not None}
            assert {os.path.basename(path) for path in reader._held._fds} == present
        finally:
            hog.kill()
            hog.communicate()  # reaped, its pipes closed
        deadline = time.monotonic() + 30
        while True:  # the exiting task leaves the cgroup a moment after its parent reaped it
            try:
                child.rmdir()
                break
            except OSError:
                assert time.monotonic() < deadline, "the cgroup never emptied"
                time.sleep(0.05)
        with pytest.raises(NoSuchProcess):
            reader.usage(ref)
        child.mkdir()  # the same name, another cgroup: nothing of the old one is read
        assert reader.usage(ref) < 4 * MIB
        assert reader.sample(ref).usage_bytes < 4 * MIB
        reader.end_round()
        assert len(reader._held) >= 1
        reader.end_round()  # a round that read no cgroup closes every descriptor
        assert len(reader._held) == 0
