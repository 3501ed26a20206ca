"""What a memory cgroup's charge is made of: its ``memory.stat`` split into what can and
cannot be reclaimed.

Page cache and /dev/shm count toward a cgroup's limit like a process's heap does, which is
why "killed at 300 of 500 MiB RSS" happens. The split (kernel docs, cgroup-v1/memory.rst and
cgroup-v2.rst "memory.stat"):

- **anon**: anonymous memory (heaps, tensors in host memory). v2 ``anon``; v1 ``total_rss``.
- **shmem**: tmpfs and /dev/shm files, shared anonymous mappings. v2 ``shmem``; v1
  ``total_shmem``. Swap-backed: without swap, as unreclaimable as anon.
- **file**: the page cache *without* shmem (both versions count shmem inside their cache
  figure: v2 ``file - shmem``, v1 ``total_cache - total_shmem``). Reclaimable, mostly.
- **kernel**: slab, kernel stacks, page tables, socket buffers. v2 ``kernel`` (5.18+), else the
  sum of its parts; v1 ``memory.kmem.usage_in_bytes`` where the kernel keeps it.
- **working set**: usage - inactive_file, as kubelet computes it (what it evicts on).

v1 figures are the ``total_`` (hierarchical) ones: a parent's plain ``rss`` counts only
pages charged to it directly, not to its children, where the ranks usually are.
"""

from __future__ import annotations

from sidecar.model import MemoryCharge as Charge

__all__ = ["Charge", "charge_of", "parse_memory_stat"]

# v2 before 5.18 has no "kernel" line: its parts
_V2_KERNEL_PARTS = ("slab", "kernel_stack", "pagetables", "sec_pagetables", "percpu", "sock", "vmalloc")


def parse_memory_stat(text: str) -> dict[str, int]:
    """``memory.stat``'s "key value" lines; malformed lines are skipped."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        value = value.strip()
        if key and value.isdigit():
            out[key] = int(value)
    return out


def charge_of(
    stat: dict[str, int], version: int, usage: int | None, kmem: int | None = None
) -> Charge | None:
    """The split of one cgroup's charge, or None when ``stat`` lacks the lines it needs.
    ``usage``: memory.usage_in_bytes (v1) or memory.current (v2); ``kmem``: v1's
    memory.kmem.usage_in_bytes, where readable."""
    if version == 1:
        try:
            anon, cache, shmem = stat["total_rss"], stat["total_cache"], stat["total_shmem"]
            inactive = stat["total_inactive_file"]
        except KeyError:
            return None
        kernel = kmem
        file = cache - shmem
    else:
        try:
            anon, file_all, shmem, inactive = stat["anon"], stat["file"], stat["shmem"], stat["inactive_file"]
        except KeyError:
            return None
        file = file_all - shmem
        if "kernel" in stat:
            kernel = stat["kernel"]
        else:
            parts = [stat[k] for k in _V2_KERNEL_PARTS if k in stat]
            kernel = sum(parts) if parts else None
    working = None if usage is None else max(0, usage - inactive)
    return Charge(max(0, anon), max(0, file), max(0, shmem), kernel, working, max(0, inactive))
