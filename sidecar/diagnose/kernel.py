"""The kernel's records in the logs, for ``trainwatch diagnose``: its OOM records (any
timestamp style, wrapped lines joined, folded by pid), its task table (each rank's RSS),
``N pages RAM``, Mem-Info, NVRM Xids, and the page size the report was counted in."""

from __future__ import annotations

import re

from sidecar.autopsy.logrecords import KernelRecords
from sidecar.autopsy.oom import OomFold
from sidecar.parse.kernel import OomKill, OomMemcgLimit, OomSummary, parse_oom_line, parse_xid_line
from sidecar.parse.logs import KernelLine, parse_task_row

__all__ = ["PAGE_SIZES", "infer_page_size", "kernel_records"]

_PARTIAL = re.compile(r"oom-kill:constraint=(CONSTRAINT_[A-Z]+)")
# mem_cgroup_print_oom_meminfo(): a memory cgroup's counters, which the kernel prints only in
# the report of an OOM inside that cgroup ("memory: usage 102400kB, limit 102400kB, failcnt
# 31"; v1 adds "memory+swap:" and "kmem:", v2 "swap:")
_MEMCG_METER = re.compile(r"(?:^|\] )(?:memory|memory\+swap|swap|kmem): usage \d{1,20}kB, limit \d{1,20}kB")


_PAGES_RAM = re.compile(r"^(\d+) pages RAM$")


# Mem-Info: the machine's counters in pages, then each NUMA node's in kB
_MEMINFO_PAGES = re.compile(r"^active_anon:(\d{1,20}) inactive_anon:(\d{1,20}) ")


_MEMINFO_NODE_KB = re.compile(r"^Node \d{1,5} active_anon:(\d{1,20})kB inactive_anon:(\d{1,20})kB ")


PAGE_SIZES = (4096, 8192, 16384, 65536)  # x86, sparc, arm64 16K, arm64/ppc64 64K


def infer_page_size(observations: list[tuple[int, int]]) -> int | None:
    """The page size an OOM report was counted in, from what it printed twice: once in
    pages and once in kB (``[(bytes, pages), ...]``). The task table's ``rss`` is pages,
    the kill line's anon-rss + file-rss + shmem-rss of the same pid is kB; Mem-Info's
    ``active_anon:N`` is pages, its ``Node 0 active_anon:NkB`` kB. The report's host may
    not be this one (a log from an arm64 host with 64 KiB pages): None when nothing pairs,
    or the pairs do not agree on one size."""
    sizes = set()
    for size_bytes, pages in observations:
        if pages < 16 or size_bytes <= 0:  # too few pages to tell 4 KiB from 8 KiB
            continue
        ratio = size_bytes / pages
        near = min(PAGE_SIZES, key=lambda page: abs(ratio / page - 1))
        if abs(ratio / near - 1) > 0.2:
            return None
        sizes.add(near)
    return sizes.pop() if len(sizes) == 1 else None


def kernel_records(lines: list[KernelLine]) -> KernelRecords:
    k = KernelRecords([], [], {}, [], None)
    fold = OomFold()  # every line at time 0: the records of one pid are one kill
    pages_ram: int | None = None
    meminfo_pages: int | None = None
    node_kb = 0
    for line in lines:
        parsed = parse_oom_line(line.text)
        if isinstance(parsed, (OomMemcgLimit, OomSummary, OomKill)):
            merged = fold.feed(parsed, line.text, 0)
            if merged is not None and line.at is not None:
                k.oom_at.setdefault(merged.pid, line.at)
            continue
        m = _PARTIAL.search(line.text)
        if m:
            k.partial.append((m[1], line))
            continue
        row = parse_task_row(line.text)
        if row is not None:
            k.tasks[row.pid] = (row.rss_pages, row.comm)
            continue
        xid = parse_xid_line(line.text) if "NVRM" in line.text else None
        if xid is not None:
            k.xids.append((line, xid))
            continue
        text = line.text.strip()
        m = _PAGES_RAM.match(text)
        if m:
            pages_ram = int(m[1])
            continue
        m = _MEMINFO_PAGES.match(text)
        if m and meminfo_pages is None:
            meminfo_pages = int(m[1]) + int(m[2])
            continue
        m = _MEMINFO_NODE_KB.match(text)
        if m and meminfo_pages is not None:
            node_kb += int(m[1]) + int(m[2])
    k.ooms = list(fold.kills)
    if not k.ooms and not k.partial:  # a memcg OOM's report, cut off before its kill lines
        meter = next((line for line in lines if _MEMCG_METER.search(line.text)), None)
        if meter is not None:
            k.partial.append(("CONSTRAINT_MEMCG", meter))
    pairs = [(o.rss_bytes, k.tasks[o.pid][0]) for o in k.ooms if o.rss_bytes is not None and o.pid in k.tasks]
    if meminfo_pages is not None and node_kb:
        pairs.append((node_kb * 1024, meminfo_pages))
    k.page_size = infer_page_size(pairs)
    if pages_ram is not None and k.page_size is not None:
        k.host_total = pages_ram * k.page_size
    return k
