"""The sampler loop: fixed deadlines, overruns counted, a round that raises does not kill
the thread, and the history is kept in time (--history), bounded whatever the rate."""

from __future__ import annotations

import itertools
import os
import time

from sidecar.daemon import Daemon, Sampler
from sidecar.model import Snapshot
from sidecar.sampling.timeline import Timeline
from sidecar.settings import Settings
from tests.support.samplers import Clock, make_sampler
from tests.support.snapshots import make_job, make_snapshot


def _loop_settings(proc_tree, tmp_path) -> Settings:
    """An in-process daemon over a fixture tree at 10 Hz: the test runner itself is neither
    locked in memory nor reniced."""
    return Settings(
        interval_seconds=0.1,
        proc_root=str(proc_tree),
        postmortem_dir=str(tmp_path),
        self_protection=False,
        oom_score_adj=None,
    )


def test_timeline_keeps_its_history_in_time():
    tl = Timeline(history_seconds=10, interval_seconds=1)
    for i in range(500):
        tl.record(make_snapshot(i, (make_job("a", i),)))
    window = tl.window("a")
    assert [p.at for p in window] == [1000.0 + i for i in range(489, 500)]  # the last 10 s, ends included
    assert window[-1].rss_bytes == {"0": 499} and window[-1].tree_rss_bytes == {"0": 998}
    assert [p.at for p in tl.window("a", since=1000.0 + 495)] == [1495.0, 1496.0, 1497.0, 1498.0, 1499.0]


def test_timeline_keeps_its_history_when_the_sampler_speeds_up():
    """300 s at 1 Hz, then 120 s at 10 Hz (memory pressure): a ring sized history/interval
    kept about the last 60 s; kept in time, the 5-minute window before the end spans 5
    minutes, its last minute at the full 10 Hz, and the ring stays bounded."""
    tl = Timeline(history_seconds=600, interval_seconds=1)
    times = [float(s) for s in range(300)] + [300 + k / 10 for k in range(1200)]
    for i, at in enumerate(times):
        tl.record(make_snapshot(i, (make_job("a", i),), at=at))
        assert len(tl.window("a")) <= tl.capacity
    end = times[-1]
    window = tl.window("a", since=end - 300)
    assert window[0].at - (end - 300) < 1.0 and window[-1].at == end  # the whole 300 s
    assert sum(1 for p in window if p.at >= end - 59.95) == 600  # the last minute at 10 Hz
    gaps = [b.at - a.at for a, b in itertools.pairwise(window)]
    assert max(gaps) <= 1.0 + 1e-9  # older points thinned to the base rate, none dropped beyond it


def test_timeline_keeps_ended_jobs_for_a_while_but_not_forever():
    tl = Timeline(history_seconds=10, interval_seconds=1)
    for i in range(40):
        tl.record(make_snapshot(i, (make_job(f"job{i}", 1),)))
    assert "job39" in tl.jobs() and len(tl.jobs()) <= 17  # the live one plus at most 16 ended


def test_overruns_are_counted_and_the_loop_survives_errors(proc_tree, tmp_path):
    sampler = make_sampler(proc_tree, tmp_path)
    settings = _loop_settings(proc_tree, tmp_path)
    real = sampler.sample
    calls = {"n": 0}

    def flaky(plan):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("a probe blew up")
        if calls["n"] == 3:
            time.sleep(0.35)  # misses three deadlines
        return real(plan)

    sampler.sample = flaky  # type: ignore[method-assign]
    daemon = Daemon(settings, sampler, watch_deaths=False)
    daemon.start()
    try:
        deadline = time.monotonic() + 10
        while calls["n"] < 8 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        daemon.stop()
    assert calls["n"] >= 8
    assert daemon.overruns_total >= 3
    snap = daemon.snapshot
    assert snap is not None and snap.jobs and snap.overruns_total >= 3


def test_deadlines_do_not_drift(proc_tree, tmp_path):
    """Rounds start on a fixed grid whatever they take; a round that runs past the next
    deadlines counts them as overruns and the loop rejoins the grid. On a fake clock: the
    loop's waits advance it, each round takes the time given below."""

    clock = Clock()
    sampler = make_sampler(proc_tree, tmp_path, clock=clock)
    settings = _loop_settings(proc_tree, tmp_path)
    durations = [0.05] * 5 + [0.25] + [0.05] * 3
    starts: list[float] = []
    real = sampler.sample

    def timed(plan):
        starts.append(round(clock.now - 100.0, 6))
        clock.now += durations[len(starts) - 1]
        return real(plan)

    class Stop:  # the loop's Events: its wait is where time passes
        def is_set(self) -> bool:
            return len(starts) == len(durations)

        def wait(self, seconds: float) -> bool:
            clock.now += seconds
            return False

    sampler.sample = timed  # type: ignore[method-assign]
    daemon = Daemon(settings, sampler, watch_deaths=False)
    daemon._stop = daemon._wake = Stop()  # type: ignore[assignment]
    daemon._run()
    # A loop that slept a full interval after each round would start at 0, 0.15, 0.3...
    assert starts == [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.8, 0.9, 1.0], starts
    assert daemon.overruns_total == 2  # the 0.25 s round ran past the deadlines at 0.6 and 0.7


def test_pressure_means_a_rank_close_to_a_limit():
    from dataclasses import replace

    from sidecar.daemon import under_pressure
    from sidecar.model import CgroupSample, HostSample

    host = HostSample(
        total_bytes=100,
        available_bytes=50,
        oom_kills=0,
        psi_some_avg10_ratio=None,
        psi_full_avg10_ratio=None,
        psi_some_total_seconds=None,
        psi_full_total_seconds=None,
        shm_total_bytes=None,
        shm_used_bytes=None,
    )
    cg = CgroupSample(
        path="/job",
        version=1,
        usage_bytes=80,
        limit_bytes=None,
        peak_bytes=None,
        oom_kills=0,
        oom_events=None,
        limited_by="/",
        effective_limit_bytes=100,
    )
    snap = replace(make_snapshot(1, (make_job("a", 1),)), host=host, cgroups=(cg,))
    assert not under_pressure(snap)
    assert under_pressure(replace(snap, cgroups=(replace(cg, usage_bytes=95),)))
    assert under_pressure(replace(snap, host=replace(host, available_bytes=5)))
    assert not under_pressure(
        replace(snap, jobs=(), host=replace(host, available_bytes=5))
    )  # nothing to watch


def test_rounds_between_detailed_ones_carry_the_judgements(proc_tree, tmp_path):
    """Foresight and the stall tracker judge the detailed rounds only (once a second, every
    round near a limit); a round between two carries their last word for each rank, job
    and cgroup, and reads the figures that change fast afresh."""

    clock = Clock()
    sampler = make_sampler(proc_tree, tmp_path, clock=clock)
    daemon = Daemon(sampler.settings, sampler, watch_deaths=False)
    judged: list[bool] = []
    real_stalls = daemon.stalls.update
    daemon.stalls.update = lambda snap: judged.append(snap.detail) or real_stalls(snap)  # type: ignore[method-assign]
    first = daemon.sample_now()
    published = daemon.snapshot
    assert first.detail and judged == [True]
    clock.now += 0.1
    second = daemon.sample_now()
    assert not second.detail and judged == [True]  # not judged again
    now = daemon.snapshot
    assert now is not None and published is not None
    before = {r.key: r for j in published.jobs for r in j.ranks}
    for job in now.jobs:
        was = next(j for j in published.jobs if j.key == job.key)
        assert (job.stalled_seconds, job.suspected_missing) == (was.stalled_seconds, was.suspected_missing)
        for r in job.ranks:
            assert r.progress is not None and r.progress == before[r.key].progress
            assert (r.binding_limit, r.exhaustion_seconds) == (
                before[r.key].binding_limit,
                before[r.key].exhaustion_seconds,
            )
    assert now.monotonic > published.monotonic  # a new round all the same
    clock.now += 1.0
    assert daemon.sample_now().detail and judged == [True, True]
    daemon.pressure = True  # near a limit: every round is detailed and judged
    clock.now += 0.1
    assert daemon.sample_now().detail and judged == [True, True, True]


def test_between_detailed_rounds_a_rank_is_read_through_its_statm_alone(tmp_path):
    """Real processes (benchmarks/fake_job.py: an agent named pt_elastic, a rank, two
    workers), the connector's part played by an empty feed: between two detailed rounds a
    rank's own RSS comes from statm through its held descriptor (its stat, whose CPU time
    sums every thread, is not read), its CPU time is the detailed round's; a rank killed
    between two detailed rounds (a zombie: its statm reads zeros) is gone from the next."""
    import signal
    import subprocess
    import sys

    from sidecar.probes.proc import PAGE_SIZE
    from tests.support.e2e import wait_for
    from tests.support.paths import REPO

    job = subprocess.Popen(
        [sys.executable, str(REPO / "benchmarks" / "fake_job.py"), "--agents", "1", "--ranks", "1",
         "--workers", "2", "--hold-mb", "8"],
        stdin=subprocess.PIPE,
    )  # fmt: skip
    clock = Clock()
    settings = Settings(pids=(job.pid,), interval_seconds=0.1, postmortem_dir=str(tmp_path))
    sampler = Sampler(settings, clock=clock)
    sampler.discovery.listen(lambda: ([], False), lambda pids: None)
    try:

        def found() -> Snapshot | None:
            clock.now += 5.0  # discovery lists /proc every 5 s with the connector's feed
            snap = sampler.sample()
            ranks = [r for j in snap.jobs for r in j.ranks]
            return snap if ranks and ranks[0].tree_processes == 3 else None

        first = wait_for(found, 60, "the fake job's rank and its two workers")
        assert first.detail
        rank = first.jobs[0].ranks[0]
        stats: list[int] = []
        real_stat = sampler.proc.stat_kept
        sampler.proc.stat_kept = lambda pid: stats.append(pid) or real_stat(pid)  # type: ignore[method-assign]
        clock.now += 0.1
        light = sampler.sample()
        assert not light.detail and stats == []
        (now,) = light.jobs[0].ranks
        with open(f"/proc/{rank.key.pid}/statm", "rb") as f:
            resident = int(f.read().split()[1]) * PAGE_SIZE
        assert abs(now.rss_bytes - resident) <= 16 * PAGE_SIZE and now.rss_bytes >= 8 << 20
        assert now.cpu_seconds == rank.cpu_seconds and now.tree_processes == 3
        clock.now += 1.0
        assert sampler.sample().detail and stats == [rank.key.pid]  # a detailed round reads stat
        os.kill(rank.key.pid, signal.SIGKILL)

        def dead() -> bool:  # a zombie (the fake agent does not reap it) or gone
            try:
                with open(f"/proc/{rank.key.pid}/stat", "rb") as f:
                    return f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
            except FileNotFoundError:
                return True

        wait_for(dead, 30, "the rank dead")
        clock.now += 0.1
        gone = sampler.sample()
        assert not gone.detail and all(r.key != rank.key for j in gone.jobs for r in j.ranks)
    finally:
        job.terminate()
        job.communicate(timeout=60)
        sampler.proc.close()
