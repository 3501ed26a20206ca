"""What a memory cgroup's charge is made of, from real memory.stat captures (v2 on the H200
machine, v1 here: tests/fixtures/README.md), each of a process holding 96 MiB of anonymous
memory, a 48 MiB /dev/shm file and 64 MiB of page cache."""

from __future__ import annotations

from sidecar.parse.memstat import charge_of, parse_memory_stat
from tests.support.paths import FIXTURES

MIB = 1 << 20


def _read(version: int, name: str) -> str:
    return (FIXTURES / f"cgroup-v{version}-memory" / name).read_text()


def test_v2_splits_the_charge_and_takes_shmem_out_of_the_page_cache():
    stat = parse_memory_stat(_read(2, "memory.stat"))
    usage = int(_read(2, "memory.current"))
    c = charge_of(stat, 2, usage)
    assert c is not None
    assert 96 * MIB <= c.anon_bytes < 100 * MIB  # the heap (and the interpreter's own)
    assert c.shmem_bytes == 48 * MIB
    assert 64 * MIB <= c.file_bytes < 66 * MIB  # the page cache, shmem taken out
    assert c.kernel_bytes == stat["kernel"]
    assert c.working_set_bytes == usage - stat["inactive_file"]
    assert c.unreclaimable_bytes == c.anon_bytes + c.shmem_bytes


def test_v2_before_5_18_adds_up_the_kernel_parts():
    stat = parse_memory_stat(_read(2, "memory.stat"))
    del stat["kernel"]
    c = charge_of(stat, 2, None)
    assert c is not None and c.working_set_bytes is None
    parts = ("slab", "kernel_stack", "pagetables", "sec_pagetables", "percpu", "sock", "vmalloc")
    assert c.kernel_bytes == sum(stat[k] for k in parts)


def test_lines_it_cannot_use_are_skipped_and_missing_ones_give_none():
    assert parse_memory_stat("anon 5\nbroken\nfile -3\nshmem x\n\n") == {"anon": 5}
    assert charge_of({"anon": 5}, 2, 10) is None
    assert charge_of({"rss": 5}, 1, 10) is None


def test_v1_reads_the_hierarchical_totals_of_the_limited_parent():
    """The limited parent's plain rss/cache are 0 (its pages are charged in the child where
    the process runs); the total_ figures hold them."""
    stat = parse_memory_stat(_read(1, "memory.stat"))
    assert stat["rss"] == 0 and stat["cache"] == 0
    usage = int(_read(1, "memory.usage_in_bytes"))
    kmem = int(_read(1, "memory.kmem.usage_in_bytes"))
    c = charge_of(stat, 1, usage, kmem)
    assert c is not None
    assert 96 * MIB <= c.anon_bytes < 100 * MIB
    assert c.shmem_bytes == 48 * MIB
    assert 64 * MIB <= c.file_bytes < 66 * MIB
    assert c.kernel_bytes == kmem
    assert c.working_set_bytes == usage - stat["total_inactive_file"]
    assert charge_of(stat, 1, usage).kernel_bytes is None  # no kmem file, no guess
