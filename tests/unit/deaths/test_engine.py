"""The death watch on fed snapshots and exits: lost events, generations, one OOM told twice,
resync, lost GPUs, death times, the memory curve's window."""

from __future__ import annotations

import time
from datetime import datetime
from unittest.mock import ANY

import pytest

from sidecar.deaths.gather import Gatherer
from sidecar.model.events import ExitEvent
from sidecar.parse.kernel import (
    parse_kmsg_record,
)
from sidecar.postmortem import PostmortemStore
from tests.support.e2e import wait_for
from tests.support.snapshots import make_job, make_snapshot


def _vanished_while_events_were_lost(tmp_path):
    """A DeathWatch that knew one rank (pid 10, not this process's) and, after a loss of
    exit events, finds it gone: its exit status is unknown."""
    from sidecar.deaths.engine import DeathWatch
    from sidecar.sampling.timeline import Timeline

    store = PostmortemStore(str(tmp_path))
    watch = DeathWatch(store, Timeline(60, 1), Gatherer(), hostname="h")
    watch.start()
    watch.observe(make_snapshot(1, (make_job("a", 100),)))
    assert PostmortemStore(str(tmp_path)).newest() is None  # nothing on disk before the resync
    watch.resync(proc_root=str(tmp_path / "no-proc"))
    return watch, store


def test_lost_exit_events_give_an_unknown_verdict(tmp_path):
    """After ENOBUFS the rank that vanished is dead with an unknown exit status: once the
    wait for the agent's exit or log (a clean end?) has passed with neither, the
    postmortem says 'unknown', never a guess."""
    watch, store = _vanished_while_events_were_lost(tmp_path)
    try:
        doc = wait_for(store.newest, 60, "the postmortem of the rank that vanished")
    finally:
        watch.stop()
    assert doc["killer"]["kind"] == "unknown" and doc["victim"]["exit_code"] is None, doc["killer"]


def test_a_death_still_undecided_when_the_daemon_stops_is_written(tmp_path):
    """The daemon stopped while such a death still waited for the agent (a node drained
    right after a rank vanished): its postmortem is written then, with what is known. It
    used to be due again at once round after round, a core spun until the stop gave up
    on the thread, and the postmortem was lost."""
    watch, store = _vanished_while_events_were_lost(tmp_path)
    worker = watch.autopsies.thread
    watch.stop()
    assert worker is not None and not worker.is_alive()  # it ended; the stop did not give up on it
    doc = store.newest()
    assert doc is not None, "no postmortem after the stop"
    assert doc["killer"]["kind"] == "unknown" and doc["victim"]["exit_code"] is None, doc["killer"]


def test_each_worker_generation_gets_its_own_postmortem(tmp_path):
    """After an elastic restart the new generation's death is a new incident."""
    from dataclasses import replace

    from sidecar.deaths.engine import DeathWatch
    from sidecar.model import ProcKey
    from sidecar.sampling.timeline import Timeline

    store = PostmortemStore(str(tmp_path))
    watch = DeathWatch(store, Timeline(60, 1), Gatherer(), hostname="h")
    watch.start()
    gen0 = make_job("a", 100)
    gen1 = replace(gen0, restart_count=1, ranks=(replace(gen0.ranks[0], key=ProcKey(11, 2), restart=1),))

    def wait(n: int) -> None:
        deadline = time.monotonic() + 5
        while len(store.listing()) < n and time.monotonic() < deadline:
            time.sleep(0.02)

    try:
        watch.observe(make_snapshot(1, (gen0,)))
        watch.on_exit(ExitEvent(10, 9, 9, time.monotonic_ns()))
        wait(1)
        watch.observe(make_snapshot(2, (gen1,)))
        watch.on_exit(ExitEvent(11, 256, 9, time.monotonic_ns()))
        wait(2)
    finally:
        watch.stop()
    kinds = sorted(d["killer"]["kind"] for d in store.listing())
    assert kinds == ["external_signal", "python_exception"]
    assert any(d["id"].endswith("-r0-a1") for d in store.listing())


def test_the_summary_and_the_kill_line_are_one_oom(tmp_path):
    from sidecar.deaths.engine import DeathWatch
    from sidecar.sampling.timeline import Timeline

    watch = DeathWatch(PostmortemStore(str(tmp_path)), Timeline(60, 1), Gatherer(), hostname="h")
    for raw in (
        b"6,567,663845864,-;oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,mems_allowed=0,"
        b"oom_memcg=/probe_oom,task_memcg=/probe_oom,task=python3,pid=8366,uid=0",
        b"3,568,663845901,-;Memory cgroup out of memory: Killed process 8366 (python3) total-vm:119004kB, "
        b"anon-rss:102016kB, file-rss:6600kB, shmem-rss:0kB, UID:0 pgtables:268kB oom_score_adj:0",
        b"14,569,663845999,-;Killed process 8366 (python3) written by user space, ignored",
    ):
        watch.on_kmsg(parse_kmsg_record(raw))
    (oom,) = watch.state.records.ooms.kills
    assert (oom.pid, oom.scope, oom.oom_memcg, oom.rss_bytes) == (
        8366,
        "memcg",
        "/probe_oom",
        (102016 + 6600) * 1024,
    )
    assert oom.at_ns == 663845864 * 1000 and len(oom.lines) == 2


def test_resync_leaves_ranks_whose_exit_was_told_alone(tmp_path, caplog):
    """A rank whose exit the connector told before the overrun (here a clean one) ended
    then, whatever the rounds saw since: the resync leaves it alone."""
    from sidecar.deaths.engine import DeathWatch
    from sidecar.sampling.timeline import Timeline

    store = PostmortemStore(str(tmp_path))
    watch = DeathWatch(store, Timeline(60, 1), Gatherer(), hostname="h")
    watch.start()
    try:
        watch.observe(make_snapshot(1, (make_job("a", 100),)))
        watch.on_exit(ExitEvent(10, 0, 9, time.monotonic_ns()))  # the job ended normally before the overrun
        watch.observe(make_snapshot(2, ()))
        watch.resync(proc_root=str(tmp_path / "no-proc"))  # decides at once, under its lock
        assert "vanished" not in caplog.text and "died" not in caplog.text, caplog.text
    finally:
        watch.stop()  # finishes any postmortem in flight
    assert store.newest() is None


def test_resync_after_a_round_that_already_saw_the_rank_gone(tmp_path, caplog):
    """After a stall both the sampler and the connector's reader wake: a round may see the
    rank gone before the reader gets ENOBUFS. The rank's exit was lost all the same: the
    resync still records it, exit status unknown (it once looked only at the ranks the last
    round saw, and the death was lost; the e2e overrun test caught it, where the agent's log
    then gives the status)."""
    from sidecar.deaths.engine import DeathWatch
    from sidecar.sampling.timeline import Timeline

    store = PostmortemStore(str(tmp_path))
    watch = DeathWatch(store, Timeline(60, 1), Gatherer(), hostname="h")
    watch.start()
    try:
        watch.observe(make_snapshot(1, (make_job("a", 100),)))
        watch.observe(make_snapshot(2, ()))  # the round after the stall: pid 10 is gone
        watch.resync(proc_root=str(tmp_path / "no-proc"))
        assert "rank 0 (pid 10) vanished while exit events were lost" in caplog.text
        assert [inc.deaths for inc in watch.state.incidents.values()] == [{10: (None, ANY, None)}]
        watch.state.incidents.clear()  # the incident closed (a minute later), the rank still known
        caplog.clear()
        watch.resync(proc_root=str(tmp_path / "no-proc"))  # a second overrun
        assert "vanished" not in caplog.text and not watch.state.incidents, "an old death told twice"
    finally:
        watch.stop()


def test_a_gpu_nvml_reports_lost_is_a_gpu_error(tmp_path):
    """A GPU that falls off the bus lists no processes any more: the rank's GPU is the one
    NVML gave it memory on before; its loss names gpu_error (likely), another rank's does not."""
    from dataclasses import replace

    from sidecar.deaths.engine import DeathWatch
    from sidecar.model import GpuDeviceSample, GpuProcessSample
    from sidecar.sampling.timeline import Timeline

    def run(used_gpu: int) -> dict:
        store = PostmortemStore(str(tmp_path / str(used_gpu)))
        watch = DeathWatch(store, Timeline(60, 1), Gatherer(read_outputs=False), hostname="h")
        job = make_job("a", 100)
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
            watch.observe(replace(make_snapshot(1, (on_gpu,)), gpus=healthy))
            watch.observe(
                replace(make_snapshot(2, (job,)), gpus=lost)
            )  # the rank's memory is no longer listed
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


def test_the_ledger_counts_each_death_and_keeps_the_newest_times():
    """A count makes a new ledger (the scrape reads the old one meanwhile): the job's total
    for the killer up by one, the death's time the newest, a key counted again moved to the
    end, the oldest times dropped past the cap."""
    from sidecar.model.ledger import DeathLedger

    ledger = DeathLedger()
    for i in range(5):
        ledger = ledger.counted(("j", str(i), 0), "cgroup_oom", float(i), keep=3)
    assert list(ledger.times) == [("j", "2", 0), ("j", "3", 0), ("j", "4", 0)]
    assert dict(ledger.totals) == {("j", "cgroup_oom"): 5}
    again = ledger.counted(("j", "2", 0), "agent_teardown", 9.0, keep=3)
    assert list(again.times) == [("j", "3", 0), ("j", "4", 0), ("j", "2", 0)]
    assert again.times[("j", "2", 0)] == ("agent_teardown", 9.0)
    assert ledger.times[("j", "2", 0)] == ("cgroup_oom", 2.0)  # the old ledger is untouched
    assert dict(again.totals) == {("j", "cgroup_oom"): 5, ("j", "agent_teardown"): 1}
    with pytest.raises(TypeError):
        again.times[("j", "9", 0)] = ("x", 0.0)  # type: ignore[index]


def test_the_postmortem_curve_spans_its_window_after_the_sampler_sped_up(tmp_path):
    """300 s at 1 Hz, then 120 s at 10 Hz before the death: the postmortem's memory curve
    still covers the 5 minutes before it (a ring sized history/interval kept one minute)."""
    from sidecar.deaths.engine import TIMELINE_WINDOW_S, DeathWatch
    from sidecar.sampling.timeline import Timeline

    store = PostmortemStore(str(tmp_path))
    timeline = Timeline(600, 1)
    now = time.time()
    offsets = [float(s) for s in range(300)] + [300 + k / 10 for k in range(1200)]
    start = now - offsets[-1] - 0.5
    snaps = [make_snapshot(i, (make_job("a", 100 + i),), at=start + off) for i, off in enumerate(offsets)]
    for s in snaps:
        timeline.record(s)
    watch = DeathWatch(store, timeline, Gatherer(), hostname="h")
    watch.start()
    try:
        watch.observe(snaps[-1])
        watch.on_exit(ExitEvent(10, 9, 9, time.monotonic_ns()))
        doc = wait_for(store.newest, 5, "the postmortem", 0.02)
    finally:
        watch.stop()
    died = datetime.fromisoformat(doc["victim"]["died_at"]).timestamp()
    first = datetime.fromisoformat(doc["timeline"][0]["at"]).timestamp()
    last = datetime.fromisoformat(doc["timeline"][-1]["at"]).timestamp()
    assert first - (died - TIMELINE_WINDOW_S) < 1.5, (first, died)  # the whole window, not a minute
    # ... up to the newest sample before the death (how long building 1,500 samples took on
    # a loaded machine moves the death, not the curve's end)
    assert abs(last - (start + offsets[-1])) < 0.01, (last, start + offsets[-1])


def test_only_signals_that_end_a_process_have_their_sender_described(tmp_path, monkeypatch):
    """A rank's children send it SIGCHLD as they exit, by the thousand for a rank that runs
    subprocesses: those are not kept at all (they would crowd the kills out of the bounded
    record) and their senders never read from /proc; a SIGKILL's sender is, a self-sent
    SIGABRT is kept as it came."""
    import signal

    from sidecar.deaths.engine import DeathWatch
    from sidecar.model.events import SignalEvent
    from sidecar.sampling.timeline import Timeline

    described: list[int] = []
    monkeypatch.setattr(Gatherer, "sender", lambda self, pid, comm: described.append(pid))
    watch = DeathWatch(PostmortemStore(str(tmp_path)), Timeline(60, 1), Gatherer(), hostname="h")
    watch.observe(make_snapshot(1, (make_job("a", 100),)))  # rank pid 10
    for i in range(100):
        watch.on_signal(
            SignalEvent("python", 5000 + i, "python", 10, signal.SIGCHLD, 1, 0, time.monotonic_ns())
        )
    watch.on_signal(SignalEvent("python", 10, "python", 10, signal.SIGABRT, -6, 0, time.monotonic_ns()))
    watch.on_signal(SignalEvent("kill", 777, "python", 10, signal.SIGKILL, 0, 0, time.monotonic_ns()))
    watch.on_signal(
        SignalEvent("kill", 778, "python", 99, signal.SIGKILL, 0, 0, time.monotonic_ns())
    )  # not a rank
    assert described == [777]
    assert [e.signal for e in watch.state.records.signals] == [signal.SIGABRT, signal.SIGKILL]


def test_an_event_keeps_its_wall_time_when_the_document_is_rebuilt(tmp_path):
    """The wall time of a monotonic instant is read against the clocks' offset, which two
    reads of the two clocks give a few microseconds apart each time: kept between calls, a
    death rebuilt into a later version of its postmortem has the same time to the
    millisecond; a stepped wall clock (NTP) is followed."""
    from sidecar.deaths.engine import DeathWatch
    from sidecar.sampling.timeline import Timeline

    mono = [5_000_000_000]
    jitter = [0.0]
    watch = DeathWatch(
        PostmortemStore(str(tmp_path)),
        Timeline(300, 1),
        Gatherer(
            proc_root=str(tmp_path),
            clock_ns=lambda: mono[0],
            wall=lambda: 1_700_000_000.0 + mono[0] / 1e9 + jitter[0],
        ),
        hostname="h",
        clock_ns=lambda: mono[0],
        wall=lambda: 1_700_000_000.0 + mono[0] / 1e9 + jitter[0],
    )
    event = 4_999_999_500  # 0.5 us before "now"
    first = watch.autopsies.wall_of(event)
    mono[0] += 250_000_000
    jitter[0] = 0.0007  # the two clocks read 0.7 ms apart this time
    assert watch.autopsies.wall_of(event) == first
    assert f"{first:.3f}" == f"{watch.autopsies.wall_of(event):.3f}"
    jitter[0] = 2.0  # the wall clock was stepped by two seconds
    assert abs(watch.autopsies.wall_of(event) - (first + 2.0)) < 1e-6


def test_an_agent_s_outputs_outlive_its_last_round_for_a_while(tmp_path):
    """A round can see a job gone before the connector's reader tells its ranks' exits
    (after a stall, or lost events): the agent's output files, which give the exit codes,
    are kept 30 s after its last round, then let go."""
    from sidecar.deaths.engine import DeathWatch
    from sidecar.sampling.timeline import Timeline

    clock = [10**9]
    watch = DeathWatch(
        PostmortemStore(str(tmp_path)),
        Timeline(60, 1),
        Gatherer(proc_root=str(tmp_path / "no-proc"), clock_ns=lambda: clock[0]),
        hostname="h",
        clock_ns=lambda: clock[0],
    )
    watch.observe(make_snapshot(1, (make_job("a", 100),)))
    assert 9 in watch.state.agent_outputs
    clock[0] += 2 * 10**9
    watch.observe(make_snapshot(2, ()))  # the job gone from the rounds
    assert 9 in watch.state.agent_outputs
    clock[0] += 31 * 10**9
    watch.observe(make_snapshot(3, ()))
    assert 9 not in watch.state.agent_outputs


def test_a_job_gone_before_the_autopsy_keeps_the_dev_shm_the_sampler_last_read(tmp_path):
    """A bus error tears the job down in milliseconds; the autopsy then finds no process
    to read /dev/shm through. It uses the sampler's last read of the job's own /dev/shm and
    says how long before the death that was."""
    from dataclasses import replace

    from sidecar.deaths.incidents import Generation, Incident

    job = replace(make_job("a", 100), shm=(1 << 20, 3 << 18, 40.0))
    gen = Generation("a", 999_999_999, None, 1, 0, "t.py")
    inc = Incident(gen, {}, snapshot_before=make_snapshot(40, (job,)))
    inc.deaths[10] = (7, int(41.5e9), "connector")
    gather = Gatherer(
        proc_root=str(tmp_path / "no-proc"),
        read_outputs=False,
        job_output=None,
        read_host_oom_kills=lambda: None,
        read_cgroup_oom_kills=lambda p, v: None,
        read_oomd_marks=lambda p, v: {},
    )
    assert gather._shm(inc) == (1 << 20, 3 << 18, 1.5)
    inc.shm = None
    assert Gatherer._shm(gather, Incident(gen, {})) is None  # nothing sampled, nothing read: unknown


def test_the_sampler_reads_each_job_s_dev_shm_in_its_own_namespace():
    """Read through the job's process (here, this one) as the job sees it."""
    import os
    from typing import ClassVar

    from sidecar.model import ProcKey
    from sidecar.sampling.sampler import Sampler
    from sidecar.settings import Settings

    class _Job:
        key = "me"
        agent = ProcKey(os.getpid(), 1)
        ranks: ClassVar[dict[int, object]] = {}

    sampler = Sampler(Settings(proc_root="/proc", self_protection=False, oom_score_adj=None))
    sampler._read_shm([_Job()])  # type: ignore[list-item]
    size, used, _at = sampler._shm["me"]
    st = os.statvfs("/dev/shm")
    assert size == st.f_blocks * st.f_frsize and 0 <= used <= size


def test_only_a_process_that_is_gone_reads_as_dead(tmp_path, monkeypatch):
    """resync and restore judge a rank that reads as dead: one whose stat cannot be read
    (permission denied under hidepid, a stat that is not a file) is not taken for a death;
    one that is gone, or whose pid names another process or a zombie, is."""
    from sidecar.deaths import gather as gather_mod
    from sidecar.deaths.gather import Gatherer
    from sidecar.errors import AccessDenied
    from sidecar.model import ProcKey

    proc = tmp_path / "proc"
    (proc / "10").mkdir(parents=True)
    (proc / "10" / "stat").write_text("10 (python) S 9 10 10 0 -1 0 0 0 0 0 1 1 0 0 20 0 1 0 500 0 0\n")
    (proc / "11" / "stat").mkdir(parents=True)  # reading it fails (EISDIR): not "gone"
    gather = Gatherer(
        proc_root=str(proc),
        read_outputs=False,
        job_output=None,
        read_host_oom_kills=lambda: None,
        read_cgroup_oom_kills=lambda p, v: None,
        read_oomd_marks=lambda p, v: {},
    )
    assert gather.alive(ProcKey(10, 500))
    assert not gather.alive(ProcKey(10, 499))  # the pid names another process now
    assert not gather.alive(ProcKey(12, 500))  # gone
    assert gather.alive(ProcKey(11, 500))  # unreadable: cannot be told dead
    (proc / "10" / "stat").write_text("10 (python) Z 9 10 10 0 -1 0 0 0 0 0 1 1 0 0 20 0 1 0 500 0 0\n")
    assert not gather.alive(ProcKey(10, 500))  # a zombie has died

    def denied(root: str, pid: int) -> object:
        raise AccessDenied(f"{root}/{pid}/stat: permission denied")

    monkeypatch.setattr(gather_mod, "read_stat", denied)
    assert gather.alive(ProcKey(10, 500))  # hidepid: a living rank is not a death


def test_a_survivor_found_stranded_gets_that_fate_in_the_death_s_postmortem(tmp_path):
    """The death's postmortem is written at once (the survivor 'running'); when the sampler
    finds the survivor stranded, the document is rewritten with its fate 'stranded' and since
    when. A stranded rank that later dies has its death's fate."""
    from dataclasses import replace

    from sidecar.deaths.engine import DeathWatch
    from sidecar.model import ProcKey
    from sidecar.sampling.timeline import Timeline

    store = PostmortemStore(str(tmp_path))
    watch = DeathWatch(store, Timeline(60, 1), Gatherer(), hostname="h")
    job = make_job("a", 100)
    survivor = replace(job.ranks[0], rank=1, rank_label="1", local_rank=1, key=ProcKey(11, 1))
    job = replace(job, world_size=2, ranks=(job.ranks[0], survivor))
    watch.start()
    try:
        watch.observe(make_snapshot(1, (job,)))
        watch.on_exit(ExitEvent(10, 9, 9, time.monotonic_ns()))  # rank 0 SIGKILLed
        doc = wait_for(store.newest, 10, "the postmortem")
        assert {r["rank"]: r["fate"] for r in doc["ranks"]} == {0: "root_cause", 1: "running"}
        watch.on_stranded("a", 0, {11: 1234.5})
        doc = wait_for(
            lambda: (d := store.newest()) and d["ranks"][1]["fate"] == "stranded" and d, 10, "rewrite"
        )
        assert doc["ranks"][1]["stranded_since"] == "1970-01-01T00:20:34.500+00:00"
        watch.on_stranded("a", 1, {11: 99.0})  # another generation's: not this incident's
        watch.on_exit(ExitEvent(11, 15, 9, time.monotonic_ns()))  # then SIGTERMed
        doc = wait_for(lambda: (d := store.newest()) and d["ranks"][1]["signal"] and d, 10, "its death")
    finally:
        watch.stop()
    assert doc["ranks"][1]["fate"] != "stranded" and "stranded_since" not in doc["ranks"][1], doc["ranks"]


def test_oom_counters_before_a_death_come_from_a_round_before_the_kill(tmp_path):
    """The kernel counts an OOM kill before its victim exits, and a round can still list a
    victim that is exiting: the last round that saw it may hold the kill in its counters.
    The counters "before" come from the newest round at least a second before that one,
    each cgroup's lowest read since; an older round's are not taken."""
    from dataclasses import replace

    from sidecar.deaths.engine import DeathWatch
    from sidecar.model import CgroupSample, HostSample
    from sidecar.sampling.timeline import Timeline

    clock = [0]
    watch = DeathWatch(
        PostmortemStore(str(tmp_path)),
        Timeline(60, 1),
        Gatherer(clock_ns=lambda: clock[0]),
        hostname="h",
        clock_ns=lambda: clock[0],
    )
    host = HostSample(100, 50, 0, None, None, None, None, None, None)
    cg = CgroupSample("/job", 1, 80, 100, None, 0, None, "/job", 100)

    def round_at(seconds: float, host_kills: int, cg_kills: int, hits: int, cgroups: bool = True) -> None:
        clock[0] = int(seconds * 1e9)
        snap = replace(
            make_snapshot(int(seconds * 10), (make_job("a", 100),)),
            host=replace(host, oom_kills=host_kills),
            cgroups=(replace(cg, oom_kills=cg_kills, limit_hits=hits),) if cgroups else (),
        )
        watch.observe(snap)

    round_at(0.0, 3, 0, 1)  # too old: a second and more before the round it stands for
    round_at(1.0, 4, 0, 2, cgroups=False)  # the cgroup not read this round
    round_at(1.5, 4, 0, 2)
    round_at(2.0, 5, 1, 3)  # lists the victim, its kill already counted
    clock[0] = int(2.2e9)
    watch.on_exit(ExitEvent(10, 9, 9, clock[0]))
    (inc,) = watch.state.incidents.values()
    assert inc.snapshot_before is not None and inc.snapshot_before.host is not None
    assert inc.snapshot_before.host.oom_kills == 5  # the memory at death: the last round that saw it
    assert (inc.host_oom_before, inc.cgroup_oom_before, inc.cgroup_hits_before) == (
        4,
        {"/job": 0},
        {"/job": 2},
    )
