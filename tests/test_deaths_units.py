"""Exit events, kernel OOM records, the autopsy rules and the postmortem store, on real
captured bytes and text (EVIDENCE.md, the public logs) and on real processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from datetime import datetime
from pathlib import Path

import pytest

from sidecar.autopsy import Evidence, KernelOom, RankState, autopsy
from sidecar.parse.kernel import (
    OomHeader,
    OomKill,
    OomMemcgLimit,
    OomMemcgUsage,
    OomSummary,
    parse_kmsg_record,
    parse_oom_line,
)
from sidecar.postmortem import PostmortemStore, make_id
from sidecar.watch.exits import (
    ExitEvent,
    ProcConnector,
    decode_wait_status,
    parse_messages,
    subscribe_message,
)
from tests.paths import CAPTURES
from tests.paths import PUBLIC_CASES as PUBLIC
from tests.skips import requires

S = 10**9

# -- the process connector -------------------------------------------------------------

# EVIDENCE.md §2.1: the EXIT datagram of a kill -9'd orphaned sleep, captured on 6.18
EXIT_DATAGRAM = bytes.fromhex(
    "4c000000030000000600000000000000"
    "0100000001000000060000000000000028000000"
    "0000008000000000e8105f325c000000"
    "d1180000d11800000900000011000000"
    "0100000001000000"
)


def test_exit_datagram_captured_on_6_18():
    exits, acks = parse_messages(EXIT_DATAGRAM)
    assert exits == [ExitEvent(pid=6353, exit_code=9, parent_pid=1, monotonic_ns=0x5C325F10E8)]
    assert exits[0].signal == 9 and exits[0].returncode == -9 and acks == []


def test_non_leader_threads_are_not_process_exits():
    thread = bytearray(EXIT_DATAGRAM)
    thread[52:56] = (6354).to_bytes(4, "little")  # tid != tgid
    assert parse_messages(bytes(thread)) == ([], [])


@pytest.mark.parametrize(
    "code, expected",
    [
        (9, (None, 9)),
        (15, (None, 15)),
        (768, (3, None)),
        (36608, (143, None)),
        (6, (None, 6)),
        (134, (None, 6)),
        (0, (0, None)),
    ],
)
def test_wait_status_decoding(code, expected):
    assert decode_wait_status(code) == expected


def test_subscription_message_layout():
    msg = subscribe_message(1, filtered=False)
    assert len(msg) == 16 + 20 + 4 and int.from_bytes(msg[:4], "little") == len(msg)
    assert msg[16:24] == (1).to_bytes(4, "little") * 2  # CN_IDX_PROC, CN_VAL_PROC
    filtered = subscribe_message(1, filtered=True)
    assert filtered[-4:] == (0x20000000).to_bytes(4, "little")  # PROC_EVENT_NONZERO_EXIT


@requires("root")  # the connector is certain to work as root in the host namespaces
def test_real_connector_sees_a_sigkill():
    got: list[ExitEvent] = []
    connector = ProcConnector(got.append)
    connector.start()
    try:
        child = subprocess.Popen(["sleep", "30"])
        child.kill()
        child.wait()
        ok = subprocess.Popen(["sh", "-c", "exit 3"])
        ok.wait()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not {child.pid, ok.pid} <= {e.pid for e in got}:
            time.sleep(0.02)
    finally:
        connector.stop()
    by_pid = {e.pid: e for e in got}
    assert by_pid[child.pid].signal == signal.SIGKILL
    assert by_pid[ok.pid].status == 3 and by_pid[child.pid].parent_pid == os.getpid()


# -- kernel log records ---------------------------------------------------------------


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


# -- the autopsy ----------------------------------------------------------------------


def _r(
    label: str, pid: int, code: int | None = None, at: float | None = None, cg: str = "/job", by: str = "/job"
):
    return RankState(
        label, int(label), int(label), pid, (), code, None if at is None else int(at * S), cg, by
    )


def test_cgroup_oom_is_certain_when_the_kernel_names_the_pid():
    oom = KernelOom(
        102, int(10.001 * S), "memcg", "/pod", "/pod/c", "python3", 5 << 30, ("oom-kill:...pid=102",)
    )
    v = autopsy(Evidence((_r("0", 101, 15, 10.05), _r("1", 102, 9, 10.0), _r("2", 103)), kernel=(oom,)))
    assert (
        v.kind == "cgroup_oom" and v.confidence == "certain" and v.victim.pid == 102 and "/pod" in v.summary
    )
    assert v.fates == {"0": "terminated_by_agent", "1": "root_cause", "2": "running"}


def test_global_oom_is_kernel_oom():
    oom = KernelOom(102, int(10 * S), "global", None, "/user.slice", "python3", 20 << 30, ())
    v = autopsy(Evidence((_r("0", 101, 15, 10.1), _r("1", 102, 9, 10.0)), kernel=(oom,)))
    assert v.kind == "kernel_oom" and v.confidence == "certain"


def test_root_cause_is_the_first_death_not_the_lowest_rank():
    v = autopsy(Evidence((_r("0", 101, 9, 10.2), _r("3", 104, 9, 10.0))))
    assert v.victim.label == "3" and v.fates["0"] == "terminated_by_agent"


def test_sigkill_without_record_or_counter_is_external_never_oom():
    v = autopsy(
        Evidence(
            (_r("0", 101, 15, 10.1), _r("1", 102, 9, 10.0)),
            host_oom_kills_before=7,
            host_oom_kills_after=7,
            cgroup_oom_kills_before={"/job": 0},
            cgroup_oom_kills_after={"/job": 0},
        )
    )
    assert v.kind == "external_signal" and v.confidence == "likely"
    blind = autopsy(Evidence((_r("1", 102, 9, 10.0),), kernel_log_readable=False))
    assert blind.kind == "external_signal" and blind.confidence == "possible"


def test_counters_without_a_record_are_likely_not_certain():
    v = autopsy(
        Evidence(
            (_r("1", 102, 9, 10.0),),
            host_oom_kills_before=7,
            host_oom_kills_after=8,
            cgroup_oom_kills_before={"/job": 0},
            cgroup_oom_kills_after={"/job": 1},
            kernel_log_readable=False,
        )
    )
    assert v.kind == "cgroup_oom" and v.confidence == "likely"


def test_the_agents_sigkill_30_s_later_is_teardown_not_oom():
    oom = KernelOom(102, int(10 * S), "memcg", "/job", "/job", "python3", None, ())
    v = autopsy(
        Evidence((_r("0", 101, 9, 40.1), _r("1", 102, 9, 10.0), _r("2", 103, 36608, 10.5)), kernel=(oom,))
    )
    assert v.fates == {"0": "terminated_by_agent", "1": "root_cause", "2": "terminated_by_agent"}


def test_two_ranks_killed_by_one_oom_are_same_cause():
    ooms = (
        KernelOom(102, int(10 * S), "global", None, None, "p", None, ()),
        KernelOom(101, int(10.01 * S), "global", None, None, "p", None, ()),
    )
    v = autopsy(Evidence((_r("0", 101, 9, 10.02), _r("1", 102, 9, 10.0)), kernel=ooms))
    assert v.fates == {"0": "same_cause", "1": "root_cause"}


def test_exit_status_and_unknowns():
    assert autopsy(Evidence((_r("1", 102, 256, 10.0),))).kind == "python_exception"
    assert autopsy(Evidence((_r("1", 102, 11, 10.0),))).kind == "segfault"
    assert autopsy(Evidence((_r("1", 102, None, 10.0),))).kind == "unknown"
    assert autopsy(Evidence((_r("1", 102),))) is None


# -- the store ------------------------------------------------------------------------


def _doc(ident: str) -> dict:
    return {
        "schema": "trainwatch.postmortem/v1",
        "id": ident,
        "created_at": "2026-12-02T11:40:16.000+00:00",
        "victim": {"rank": 1},
        "killer": {"kind": "cgroup_oom", "summary": "s"},
    }


def test_store_is_atomic_private_and_survives_a_restart(tmp_path):
    ident = make_id(1796212414.0, 4356, "1", "node-17")
    assert ident == "20261202T115334Z-node-17-4356-r1"
    store = PostmortemStore(str(tmp_path / "pm"))
    store.put(_doc(ident), first=True)
    path = tmp_path / "pm" / f"{ident}.json"
    assert oct(path.stat().st_mode & 0o777) == "0o640" and not list((tmp_path / "pm").glob("*.tmp"))
    again = PostmortemStore(str(tmp_path / "pm"))
    assert again.get(ident)["id"] == ident and again.newest()["id"] == ident
    assert again.listing()[0]["killer"]["kind"] == "cgroup_oom"


def test_store_rejects_bad_ids_and_skips_junk(tmp_path):
    (tmp_path / "20261202T114014Z-h-1-r1.json").write_text("{not json")
    store = PostmortemStore(str(tmp_path))
    for bad in ("../../etc/passwd", "x", "20261202T114014Z-h-1-r1/../../x", ""):
        assert store.get(bad) is None
    assert store.newest() is None


def test_unwritable_directory_keeps_the_postmortem_in_memory(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    store = PostmortemStore(str(blocker / "pm"))
    ident = make_id(1796212414.0, 1, "0", "h")
    store.put(_doc(ident), first=True)
    store.put(_doc(ident), first=False)
    assert store.get(ident) is not None and store.written_total == 1
    assert sum("kept in memory" in r.getMessage() for r in caplog.records) == 1


def test_text_view_and_cli(tmp_path):
    import sys

    from sidecar.postmortem import render_text

    doc = _doc(make_id(1796212414.0, 4356, "1", "node-17"))
    doc.update(
        {
            "victim": {
                "rank": 1,
                "pid": 4387,
                "exit_code": -9,
                "signal": "SIGKILL",
                "died_at": "2026-12-02T11:53:34+00:00",
            },
            "killer": {
                "kind": "cgroup_oom",
                "confidence": "certain",
                "summary": "rank 1 hit /pod's limit",
                "evidence": [{"source": "kmsg", "at": None, "detail": "oom-kill:...pid=4387"}],
            },
            "ranks": [
                {
                    "rank": 0,
                    "pid": 4386,
                    "fate": "terminated_by_agent",
                    "exit_code": -15,
                    "rss_bytes": 3 << 30,
                },
                {"rank": 1, "pid": 4387, "fate": "root_cause", "exit_code": -9, "rss_bytes": 5 << 30},
            ],
            "memory": {
                "host": {"total_bytes": 64 << 30},
                "cgroup": {"path": "/pod", "version": 2, "limit_bytes": 8 << 30},
            },
            "timeline": [{"rss_bytes": {"1": n << 30}} for n in (1, 2, 4, 5)],
            "advice": ["raise the limit"],
        }
    )
    text = render_text(doc)
    for needle in (
        "killer: cgroup_oom (certain)",
        "[kmsg]",
        "terminated_by_agent",
        "5.0 GiB",
        "/pod (v2)",
        "- raise the limit",
        "▂▃▆█",
    ):
        assert needle in text, needle
    store = PostmortemStore(str(tmp_path))
    store.put(doc, first=True)
    out = subprocess.run(
        [sys.executable, "-m", "sidecar", "postmortem", "--postmortem-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0 and out.stdout == text
    bad = subprocess.run(
        [sys.executable, "-m", "sidecar", "postmortem", str(tmp_path / "missing.json")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr


def test_html_view_is_self_contained_and_escaped():
    from sidecar.postmortem_html import render_html

    doc = _doc(make_id(1796212414.0, 1, "1", "h"))
    doc.update(
        {
            "killer": {
                "kind": "cgroup_oom",
                "confidence": "certain",
                "summary": "<script>alert(1)</script>",
                "evidence": [{"source": "kmsg", "at": None, "detail": "a & b"}],
            },
            "ranks": [
                {
                    "rank": 1,
                    "pid": 2,
                    "fate": "root_cause",
                    "died_at": "2026-12-02T11:53:40+00:00",
                    "rss_bytes": 5 << 30,
                }
            ],
            "memory": {"cgroup": {"path": "/pod", "version": 2, "limit_bytes": 8 << 30}},
            "timeline": [
                {
                    "at": f"2026-12-02T11:53:3{i}+00:00",
                    "rss_bytes": {"1": i << 30},
                    "tree_rss_bytes": {"1": i << 30},
                    "host_available_bytes": 50 << 30,
                    "cgroup_usage_bytes": i << 30,
                }
                for i in range(10)
            ],
        }
    )
    page = render_html(doc)
    assert "<script>" not in page and "&lt;script&gt;" in page and "a &amp; b" in page
    assert page.count("<polyline") >= 3 and "cgroup limit 8.0 GiB" in page and "✕ rank 1" in page
    assert "default-src 'none'" in page
    assert "https://" not in page and "http://" not in page.replace("http://www.w3.org/2000/svg", "")


@pytest.mark.parametrize(
    "name, victim, kind",
    [
        # A: rank 2 SIGKILLs itself (no OOM record, as a kill from outside leaves); rank 0
        # ignores SIGTERM and gets torchrun's SIGKILL 30 s later; rank 1 dies of SIGTERM;
        # rank 3 exits 143 from its handler.
        ("torchrun-A", 2, "external_signal"),
        # B: rank 1 raises an exception (exit 1); the others die of the agent's SIGTERM.
        ("torchrun-B", 1, "python_exception"),
    ],
)
def test_autopsy_on_real_exit_events_captured_on_the_gpu_machine(name, victim, kind):
    capture = json.loads((CAPTURES / f"{name}.json").read_text())
    pid_rank = {v["pid"]: int(v["RANK"]) for v in capture["env_files"].values() if "RANK" in v}
    exits = {e["pid"]: e for e in capture["cn_proc_exits_workers"]}
    ranks = tuple(
        RankState(str(r), r, r, pid, (), exits[pid]["exit_code"], int(exits[pid]["ts_mono"] * S))
        for pid, r in sorted(pid_rank.items(), key=lambda kv: kv[1])
    )
    v = autopsy(Evidence(ranks, host_oom_kills_before=3, host_oom_kills_after=3))
    assert v.victim.rank == victim and v.kind == kind
    assert v.fates == {
        str(r.rank): "root_cause" if r.rank == victim else "terminated_by_agent" for r in ranks
    }
    if name == "torchrun-A":
        r0 = next(r for r in ranks if r.rank == 0)
        assert (
            r0.signal == signal.SIGKILL and (r0.died_ns - v.victim.died_ns) / S > 29
        )  # the -9 that is no OOM


def test_secrets_are_redacted():
    from sidecar.redact import REDACTED, redact_argv, redact_env

    argv = [
        "torchrun",
        "train.py",
        "--hf_token=hf_abc",
        "--password",
        "hunter2",
        "--lr",
        "1e-4",
        "WANDB_API_KEY=x",
        "--output-dir",
        "/ckpt",
    ]
    assert redact_argv(argv) == [
        "torchrun",
        "train.py",
        f"--hf_token={REDACTED}",
        "--password",
        REDACTED,
        "--lr",
        "1e-4",
        f"WANDB_API_KEY={REDACTED}",
        "--output-dir",
        "/ckpt",
    ]
    assert redact_env({"HF_TOKEN": "a", "AWS_SECRET_ACCESS_KEY": "b", "RANK": "0"}) == {
        "HF_TOKEN": REDACTED,
        "AWS_SECRET_ACCESS_KEY": REDACTED,
        "RANK": "0",
    }


def test_the_agent_log_line_is_redacted(proc_tree, caplog):
    import logging

    from sidecar.discovery import Discovery
    from sidecar.probes.proc import ProcReader
    from tests.conftest import AGENT

    cmdline = proc_tree / str(AGENT) / "cmdline"
    cmdline.write_bytes(cmdline.read_bytes() + b"--hf_token=hf_SECRETVALUE\0")
    with caplog.at_level(logging.INFO):
        Discovery(ProcReader(str(proc_tree))).tick()
    found = [r.getMessage() for r in caplog.records if "found torchrun agent" in r.getMessage()]
    assert found and "hf_SECRETVALUE" not in found[0] and "--hf_token=<redacted>" in found[0]


def test_lost_exit_events_give_an_unknown_verdict(tmp_path):
    """After ENOBUFS the rank that vanished is dead with an unknown exit status: the
    postmortem says 'unknown', never a guess."""
    from sidecar.deaths import DeathWatch
    from sidecar.timeline import Timeline
    from tests.test_daemon_loop import _job, _snapshot

    store = PostmortemStore(str(tmp_path))
    watch = DeathWatch(store, Timeline(60, 1), hostname="h")
    watch.start()
    try:
        watch.observe(_snapshot(1, (_job("a", 100),)))  # a rank whose pid (10) is not this one's
        live = PostmortemStore(str(tmp_path))
        watch.resync(proc_root=str(tmp_path / "no-proc"))
        deadline = time.monotonic() + 5
        while store.newest() is None and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        watch.stop()
    doc = store.newest()
    assert doc is not None and doc["killer"]["kind"] == "unknown" and doc["victim"]["exit_code"] is None
    assert live.newest() is None  # nothing was on disk before the resync


def test_trace_lines_of_signal_generate():
    from sidecar.watch.signals import parse_trace_line

    # captured on the development machine (EVIDENCE.md §2.3), trace_clock=mono
    e = parse_trace_line(
        "kill-8787           [001] d..1. 721.695636: signal_generate: sig=9  errno=0 code=0 "
        "comm=sleep pid=8784 grp=1 res=0".replace("sig=9  ", "sig=9 ")
    )
    assert (e.sender_comm, e.sender_pid, e.target_pid, e.signal, e.code) == ("kill", 8787, 8784, 9, 0)
    assert e.monotonic_ns == 721_695_636_000
    oom = parse_trace_line(
        "python3-8740 [000] d..2. 710.978684: signal_generate: sig=9 errno=0 code=128 "
        "comm=python3 pid=8740 grp=1 res=0"
    )
    assert oom.from_kernel and oom.sender_pid == oom.target_pid == 8740
    spaced = parse_trace_line(
        "   pt_main thread-17 (  17) [003] ..... 5.000001: signal_generate: sig=15 errno=0 "
        "code=0 comm=python pid=20 grp=1 res=0"
    )
    assert spaced.sender_comm == "pt_main thread" and spaced.signal == 15
    assert parse_trace_line("# tracer: nop") is None


def test_the_tracepoint_names_the_sender():
    from sidecar.autopsy import SignalSent

    victim = _r("1", 102, 9, 10.0)
    by_kill = SignalSent("kill", 4242, 102, 9, 0, int(9.999 * S))
    v = autopsy(Evidence((_r("0", 101, 15, 10.05), victim), signals=(by_kill,)))
    assert (
        v.kind == "external_signal"
        and v.confidence == "certain"
        and "pid 4242 (kill) sent SIGKILL" in v.summary
    )
    by_earlyoom = SignalSent("earlyoom", 900, 102, 9, 0, int(9.999 * S))
    assert autopsy(Evidence((victim,), signals=(by_earlyoom,))).kind == "userspace_oom"
    by_agent = SignalSent("pt_elastic", 77, 102, 9, 0, int(9.999 * S))
    assert autopsy(Evidence((victim,), signals=(by_agent,), agent_pid=77)).kind == "agent_teardown"
    # an old signal to the same pid is not this death's
    stale = SignalSent("kill", 4242, 102, 9, 0, int(1 * S))
    assert autopsy(Evidence((victim,), signals=(stale,))).confidence != "certain"
    # the kernel's own SIGKILL (si_code 128) is the OOM killer's business, not a sender's
    kernel = SignalSent("python3", 102, 102, 9, 128, int(9.999 * S))
    oom = KernelOom(102, int(10 * S), "memcg", "/job", "/job", "python3", None, ())
    assert autopsy(Evidence((victim,), kernel=(oom,), signals=(kernel,))).kind == "cgroup_oom"


def test_each_worker_generation_gets_its_own_postmortem(tmp_path):
    """After an elastic restart the new generation's death is a new incident."""
    from dataclasses import replace

    from sidecar.deaths import DeathWatch
    from sidecar.model import ProcKey
    from sidecar.timeline import Timeline
    from tests.test_daemon_loop import _job, _snapshot

    store = PostmortemStore(str(tmp_path))
    watch = DeathWatch(store, Timeline(60, 1), hostname="h")
    watch.start()
    gen0 = _job("a", 100)
    gen1 = replace(gen0, restart_count=1, ranks=(replace(gen0.ranks[0], key=ProcKey(11, 2), restart=1),))

    def wait(n: int) -> None:
        deadline = time.monotonic() + 5
        while len(store.listing()) < n and time.monotonic() < deadline:
            time.sleep(0.02)

    try:
        watch.observe(_snapshot(1, (gen0,)))
        watch.on_exit(ExitEvent(10, 9, 9, time.monotonic_ns()))
        wait(1)
        watch.observe(_snapshot(2, (gen1,)))
        watch.on_exit(ExitEvent(11, 256, 9, time.monotonic_ns()))
        wait(2)
    finally:
        watch.stop()
    kinds = sorted(d["killer"]["kind"] for d in store.listing())
    assert kinds == ["external_signal", "python_exception"]
    assert any(d["id"].endswith("-r0-a1") for d in store.listing())


def test_a_running_oom_daemon_makes_an_unexplained_kill_only_possible():
    v = autopsy(Evidence((_r("1", 102, 9, 10.0),), oom_daemons=(("earlyoom", 812),)))
    assert v.kind == "external_signal" and v.confidence == "possible"  # never guessed as an OOM
    assert "earlyoom (pid 812)" in v.summary and any(e.source == "proc" for e in v.evidence)


def test_the_summary_and_the_kill_line_are_one_oom(tmp_path):
    from sidecar.deaths import DeathWatch
    from sidecar.timeline import Timeline

    watch = DeathWatch(PostmortemStore(str(tmp_path)), Timeline(60, 1), hostname="h")
    for raw in (
        b"6,567,663845864,-;oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,mems_allowed=0,"
        b"oom_memcg=/probe_oom,task_memcg=/probe_oom,task=python3,pid=8366,uid=0",
        b"3,568,663845901,-;Memory cgroup out of memory: Killed process 8366 (python3) total-vm:119004kB, "
        b"anon-rss:102016kB, file-rss:6600kB, shmem-rss:0kB, UID:0 pgtables:268kB oom_score_adj:0",
        b"14,569,663845999,-;Killed process 8366 (python3) written by user space, ignored",
    ):
        watch.on_kmsg(parse_kmsg_record(raw))
    (oom,) = watch._kernel
    assert (oom.pid, oom.scope, oom.oom_memcg, oom.rss_bytes) == (
        8366,
        "memcg",
        "/probe_oom",
        (102016 + 6600) * 1024,
    )
    assert oom.at_ns == 663845864 * 1000 and len(oom.lines) == 2


def test_resync_leaves_ranks_that_ended_before_the_last_round_alone(tmp_path, caplog):
    from sidecar.deaths import DeathWatch
    from sidecar.timeline import Timeline
    from tests.test_daemon_loop import _job, _snapshot

    store = PostmortemStore(str(tmp_path))
    watch = DeathWatch(store, Timeline(60, 1), hostname="h")
    watch.start()
    try:
        watch.observe(_snapshot(1, (_job("a", 100),)))
        watch.observe(_snapshot(2, ()))  # the job ended normally before the overrun
        watch.resync(proc_root=str(tmp_path / "no-proc"))  # decides at once, under its lock
        assert "vanished" not in caplog.text and "died" not in caplog.text, caplog.text
    finally:
        watch.stop()  # finishes any postmortem in flight
    assert store.newest() is None


@requires("tracefs")
def test_a_killed_daemons_tracefs_instance_is_cleaned_up():
    from sidecar.watch.signals import SignalWatcher

    stale = Path("/sys/kernel/tracing/instances/trainwatch-999999999")  # above any pid_max: never alive
    stale.mkdir()
    watcher = SignalWatcher(lambda e: None)
    try:
        watcher.start()
        assert not stale.exists()
        assert Path(watcher.instance, "buffer_size_kb").read_text().strip() != "1410"
    finally:
        watcher.stop()
        if stale.exists():
            stale.rmdir()
    assert not Path(watcher.instance).exists()


def test_a_gpu_nvml_reports_lost_is_a_gpu_error(tmp_path):
    """A GPU that falls off the bus lists no processes any more: the rank's GPU is the one
    NVML gave it memory on before; its loss names gpu_error (likely), another rank's does not."""
    from dataclasses import replace

    from sidecar.deaths import DeathWatch
    from sidecar.model import GpuDeviceSample, GpuProcessSample
    from sidecar.timeline import Timeline
    from tests.test_daemon_loop import _job, _snapshot

    def run(used_gpu: int) -> dict:
        store = PostmortemStore(str(tmp_path / str(used_gpu)))
        watch = DeathWatch(store, Timeline(60, 1), hostname="h", read_outputs=False)
        job = _job("a", 100)
        on_gpu = replace(job, ranks=(replace(job.ranks[0], gpu_memory_bytes={used_gpu: 1 << 30}),))
        healthy = tuple(
            GpuDeviceSample(
                i, f"GPU-{i}", "NVIDIA H200", 1 << 30, 140 << 30, False, (GpuProcessSample(10, 1 << 30),)
            )
            for i in (0, 1)
        )
        lost = (GpuDeviceSample(0, "GPU-0", "NVIDIA H200", None, None, lost=True), healthy[1])
        watch.start()
        try:
            watch.observe(replace(_snapshot(1, (on_gpu,)), gpus=healthy))
            watch.observe(replace(_snapshot(2, (job,)), gpus=lost))  # the rank's memory is no longer listed
            watch.on_exit(ExitEvent(10, 6, 6, time.monotonic_ns()))  # SIGABRT
            deadline = time.monotonic() + 5
            while store.newest() is None and time.monotonic() < deadline:
                time.sleep(0.02)
        finally:
            watch.stop()
        doc = store.newest()
        assert doc is not None
        return doc

    doc = run(0)
    assert (doc["killer"]["kind"], doc["killer"]["confidence"]) == ("gpu_error", "likely"), doc["killer"]
    assert "GPU 0 (NVIDIA H200) was lost" in doc["killer"]["summary"]
    assert any(e["source"] == "nvml" and "GPU_IS_LOST" in e["detail"] for e in doc["killer"]["evidence"])
    assert any("Xid 79 and NVML's GPU_IS_LOST" in a for a in doc["advice"])
    doc = run(1)  # the rank was on GPU 1, which is fine: the lost GPU 0 is not its cause
    assert doc["killer"]["kind"] == "abort", doc["killer"]


def test_death_times_keep_the_newest_and_a_key_once():
    from sidecar.deaths import remember

    times: dict = {}
    for i in range(5):
        times = remember(times, ("j", str(i), 0), ("cgroup_oom", float(i)), cap=3)
    assert list(times) == [("j", "2", 0), ("j", "3", 0), ("j", "4", 0)]
    again = remember(times, ("j", "2", 0), ("agent_teardown", 9.0), cap=3)
    assert list(again) == [("j", "3", 0), ("j", "4", 0), ("j", "2", 0)]
    assert again[("j", "2", 0)] == ("agent_teardown", 9.0) and times[("j", "2", 0)] == ("cgroup_oom", 2.0)


def test_the_postmortem_curve_spans_its_window_after_the_sampler_sped_up(tmp_path):
    """300 s at 1 Hz, then 120 s at 10 Hz before the death: the postmortem's memory curve
    still covers the 5 minutes before it (a ring sized history/interval kept one minute)."""
    from sidecar.deaths import TIMELINE_WINDOW_S, DeathWatch
    from sidecar.timeline import Timeline
    from tests.test_daemon_loop import _job, _snapshot

    store = PostmortemStore(str(tmp_path))
    timeline = Timeline(600, 1)
    now = time.time()
    offsets = [float(s) for s in range(300)] + [300 + k / 10 for k in range(1200)]
    start = now - offsets[-1] - 0.5
    snaps = [_snapshot(i, (_job("a", 100 + i),), at=start + off) for i, off in enumerate(offsets)]
    for s in snaps:
        timeline.record(s)
    watch = DeathWatch(store, timeline, hostname="h")
    watch.start()
    try:
        watch.observe(snaps[-1])
        watch.on_exit(ExitEvent(10, 9, 9, time.monotonic_ns()))
        deadline = time.monotonic() + 5
        while store.newest() is None and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        watch.stop()
    doc = store.newest()
    assert doc is not None
    died = datetime.fromisoformat(doc["victim"]["died_at"]).timestamp()
    first = datetime.fromisoformat(doc["timeline"][0]["at"]).timestamp()
    last = datetime.fromisoformat(doc["timeline"][-1]["at"]).timestamp()
    assert first - (died - TIMELINE_WINDOW_S) < 1.5, (first, died)  # the whole window, not a minute
    assert died - last < 1.0
