"""Kernel log records: kmsg framing and the OOM report of every kernel generation, on
captured and public text."""

from __future__ import annotations

import json

from sidecar.parse.kernel import (
    OomHeader,
    OomKill,
    OomMemcgLimit,
    OomMemcgUsage,
    OomSummary,
    parse_kmsg_record,
    parse_oom_line,
)
from tests.support.paths import PUBLIC_CASES as PUBLIC


def test_kmsg_records():
    r = parse_kmsg_record(b"3,568,663845901,-;Memory cgroup out of memory: Killed process 8366 (python3)\n")
    assert (r.priority, r.sequence, r.timestamp_us, r.from_kernel) == (3, 568, 663845901, True)
    r = parse_kmsg_record(b"4,450,408549355,-;Mem-Info:\\x0a active_anon:386\n SUBSYSTEM=x\n")
    assert r.text == "Mem-Info:\n active_anon:386"
    assert not parse_kmsg_record(b"14,569,1,-;probe: clock check 0\n").from_kernel  # user space wrote it
    assert parse_kmsg_record(b"6,1,2,-,newfield;x").text == "x"
    assert parse_kmsg_record(b"garbage") is None and parse_kmsg_record(b"a,b,c;x") is None


def test_oom_records_of_6_18_memcg():
    s = parse_oom_line(
        "oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,mems_allowed=0,"
        "oom_memcg=/probe_oom,task_memcg=/probe_oom,task=python3,pid=8366,uid=0"
    )
    assert s == OomSummary("CONSTRAINT_MEMCG", False, "/probe_oom", "/probe_oom", "python3", 8366, 0)
    k = parse_oom_line(
        "Memory cgroup out of memory: Killed process 8366 (python3) total-vm:119004kB, "
        "anon-rss:102016kB, file-rss:6600kB, shmem-rss:0kB, UID:0 pgtables:268kB oom_score_adj:0"
    )
    assert isinstance(k, OomKill) and k.scope == "memcg" and k.pid == 8366 and k.oom_score_adj == 0
    assert k.rss_bytes == (102016 + 6600) * 1024
    assert parse_oom_line("memory: usage 102400kB, limit 102400kB, failcnt 0") == OomMemcgUsage(
        104857600, 104857600
    )


def test_oom_records_of_other_generations():
    g = parse_oom_line(
        "oom-kill:constraint=CONSTRAINT_NONE,nodemask=(null),cpuset=/,mems_allowed=0,global_oom,"
        "task_memcg=/user.slice,task=python3,pid=5863,uid=0"
    )
    assert isinstance(g, OomSummary) and g.global_oom and g.oom_memcg is None
    k54 = parse_oom_line(
        "Memory cgroup out of memory: Killed process 63214 (uwsgi) total-vm:3149468kB, "
        "anon-rss:164992kB, file-rss:52176kB, shmem-rss:92kB, UID:0 pgtables:1372kB oom_score_adj:986"
    )
    assert isinstance(k54, OomKill) and k54.pid == 63214 and k54.oom_score_adj == 986
    k4 = parse_oom_line("[8.123] Killed process 4242 (python) total-vm:1000kB, anon-rss:500kB, file-rss:4kB")
    assert isinstance(k4, OomKill) and k4.scope is None and k4.shmem_rss_bytes is None
    assert parse_oom_line("Task in /docker/abc killed as a result of limit of /docker") == OomMemcgLimit(
        "/docker/abc", "/docker"
    )
    h = parse_oom_line("python3 invoked oom-killer: gfp_mask=0xcc0(GFP_KERNEL), order=0, oom_score_adj=1000")
    assert h == OomHeader("python3", 0, 1000)
    # a summary cut off mid-line (as posted in a public issue) yields nothing rather than a guess
    assert (
        parse_oom_line("oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=38e6,mems_allowed=0-7,o")
        is None
    )


def test_public_kernel_logs():
    cases = {c["id"]: c for c in map(json.loads, PUBLIC.read_text().splitlines())}
    text = next(
        e["text"] for e in cases["tranx-41-dmesg-global-oom"]["evidence"] if e["kind"] == "kernel_log"
    )
    events = [e for e in map(parse_oom_line, text.splitlines()) if e is not None]
    kills = [e for e in events if isinstance(e, OomKill)]
    assert kills and kills[0].scope == "global" and kills[0].pid == 25315


def test_the_pre_4_19_choice_line_is_read_when_a_paste_cut_it_after_the_comm():
    line = "Memory cgroup out of memory: Kill process 17811 (python3)"
    whole, cut = parse_oom_line(line + " score 1000 or sacrifice child"), parse_oom_line(line)
    assert isinstance(whole, OomKill) and isinstance(cut, OomKill)
    assert (cut.scope, cut.pid, cut.comm) == (whole.scope, whole.pid, whole.comm)
    assert (cut.scope, cut.pid, cut.comm) == ("memcg", 17811, "python3")
    # cut inside the words that follow, it is not that line (nor anything else the kernel writes)
    assert parse_oom_line("Memory cgroup out of memory: Kill process 17811 (python3) sco") is None
