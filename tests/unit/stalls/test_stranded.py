"""The stranding rule on synthetic rounds, judged by the real stall tracker with a fake clock
(the real strandings are in tests/e2e/test_stranded.py): a live rank is stranded once
another rank of its job and generation died and it has made no progress for 10 s since the
later of the death and its last progress; never without a death, never while it works."""

from __future__ import annotations

import dataclasses

from sidecar.model import JobSample, ProcKey, RankSample, Snapshot
from sidecar.stalls.stranded import STRANDED_AFTER_S, StrandTracker
from sidecar.stalls.tracker import StallTracker


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _rank(job: str, pid: int, cpu: float, gpu_bytes: int = 0) -> RankSample:
    return RankSample(
        job,
        pid,
        str(pid),
        pid,
        0,
        ProcKey(pid, 1),
        1,
        None,
        cpu,
        1,
        1,
        1,
        None,
        gpu_memory_bytes={0: gpu_bytes} if gpu_bytes else {},
    )


def _job(key: str, *ranks: RankSample, run_id: str | None = None, restart: int = 0) -> JobSample:
    return JobSample(key, ProcKey(9000 + len(key), 1), run_id, 2, restart, 0, None, 0.0, tuple(ranks))


def _snap(*jobs: JobSample) -> Snapshot:
    return Snapshot(0.0, 0.0, tuple(jobs), None, (), (), {}, 0, 0, 0.0, 0)


class Rounds:
    """Rounds every 0.5 s through the real stall tracker, then the stranding rule."""

    def __init__(self, deaths: dict) -> None:
        self.clock = Clock()
        self.deaths = deaths
        self.told: list[tuple[str, int, dict[int, float]]] = []
        self.stalls = StallTracker(60.0, py_spy=False, clock=self.clock, wall=self.clock)
        self.stranded = StrandTracker(
            lambda: self.deaths, lambda *a: self.told.append(a), wall=self.clock, window=self.stalls.window
        )

    def run(self, seconds: float, make: callable) -> list[Snapshot]:
        out = []
        end = self.clock.now + seconds
        while self.clock.now < end:
            self.clock.now += 0.5
            out.append(self.stranded.update(self.stalls.update(make(self.clock.now))))
        return out


def _busy(t: float) -> float:
    return t * 0.9  # 90 % of a core


def test_a_paused_job_is_never_stranded():
    """Every rank idle for minutes (a checkpoint written elsewhere, a pause): stalled, but no
    rank died, so nothing is stranded."""
    r = Rounds({})
    snaps = r.run(120, lambda t: _snap(_job("j", _rank("j", 1, 5.0), _rank("j", 2, 5.0))))
    assert snaps[-1].jobs[0].stalled_seconds > 100
    assert all(s.jobs[0].stranded is None for s in snaps) and not r.told


def test_an_idle_survivor_is_stranded_ten_seconds_after_the_death_and_its_last_progress():
    deaths: dict = {}
    r = Rounds(deaths)
    r.run(20, lambda t: _snap(_job("j", _rank("j", 1, _busy(t), gpu_bytes=3 << 30), _rank("j", 2, _busy(t)))))
    died_at = r.clock.now
    deaths[("j", "2", 0)] = ("external_signal", died_at)
    frozen = _busy(died_at)  # rank 1 blocks on the dead rank: no CPU from now on
    snaps = r.run(40, lambda t: _snap(_job("j", _rank("j", 1, frozen, gpu_bytes=3 << 30))))
    first = next(i for i, s in enumerate(snaps) if s.jobs[0].stranded is not None)
    flagged_at = died_at + (first + 1) * 0.5
    # idle is judged over the stall window (10 s), then 10 s more without progress
    assert STRANDED_AFTER_S <= flagged_at - died_at <= 30, flagged_at - died_at
    s = snaps[-1].jobs[0].stranded
    assert s is not None and s.ranks == ("1",) and s.dead_ranks == ("2",) and s.pids == (1,)
    assert s.gpu_memory_bytes == 3 << 30 and died_at <= s.since <= flagged_at - STRANDED_AFTER_S
    assert r.told == [("j", 0, {1: s.since})]  # told once


def test_a_survivor_that_keeps_working_after_the_death_is_not_stranded():
    """Fault-tolerant training that shrinks its world after a peer's death makes progress."""
    deaths = {("j", "2", 0): ("external_signal", 1000.0)}
    r = Rounds(deaths)
    snaps = r.run(60, lambda t: _snap(_job("j", _rank("j", 1, _busy(t)))))
    assert all(s.jobs[0].stranded is None for s in snaps) and not r.told


def test_a_survivor_that_was_already_idle_is_stranded_ten_seconds_after_the_death():
    """A rank that stalled before the death (waiting for the peer that later died) is
    stranded from the death on."""
    deaths: dict = {}
    r = Rounds(deaths)
    r.run(30, lambda t: _snap(_job("j", _rank("j", 1, 5.0), _rank("j", 2, _busy(t)))))
    died_at = r.clock.now
    deaths[("j", "2", 0)] = ("cgroup_oom", died_at)
    snaps = r.run(15, lambda t: _snap(_job("j", _rank("j", 1, 5.0))))
    first = next(i for i, s in enumerate(snaps) if s.jobs[0].stranded is not None)
    assert (first + 1) * 0.5 == STRANDED_AFTER_S
    assert snaps[-1].jobs[0].stranded.since == died_at


def test_a_death_of_another_generation_or_job_strands_nothing():
    """A death before an elastic restart is not the new workers' peer; another job's death
    is not this job's."""
    deaths = {("j", "2", 0): ("external_signal", 1000.0), ("k", "0", 1): ("external_signal", 1000.0)}
    r = Rounds(deaths)
    snaps = r.run(
        40, lambda t: _snap(_job("j", _rank("j", 1, 5.0), restart=1), _job("x", _rank("x", 3, 5.0)))
    )
    assert all(job.stranded is None for s in snaps for job in s.jobs)


def test_a_death_under_another_agent_of_the_same_job_strands_this_agent_s_ranks():
    """Two agents of one multi-node job on this node (one launcher id): a rank dead under one
    strands the blocked ranks of the other."""
    deaths: dict = {}
    r = Rounds(deaths)
    r.run(
        5,
        lambda t: _snap(
            _job("run-a", _rank("run-a", 1, 5.0), run_id="run"),
            _job("run-b", _rank("run-b", 2, _busy(t)), run_id="run"),
        ),
    )
    deaths[("run-b", "2", 0)] = ("external_signal", r.clock.now)
    snaps = r.run(30, lambda t: _snap(_job("run-a", _rank("run-a", 1, 5.0), run_id="run")))
    s = snaps[-1].jobs[0].stranded
    assert s is not None and s.dead_ranks == ("2 (job run-b)",) and s.ranks == ("1",)


def test_a_stranded_rank_that_works_again_is_no_longer_stranded():
    deaths: dict = {}
    r = Rounds(deaths)
    r.run(5, lambda t: _snap(_job("j", _rank("j", 1, 5.0))))
    deaths[("j", "2", 0)] = ("external_signal", r.clock.now)
    assert r.run(15, lambda t: _snap(_job("j", _rank("j", 1, 5.0))))[-1].jobs[0].stranded is not None
    snaps = r.run(15, lambda t: _snap(_job("j", _rank("j", 1, 5.0 + _busy(t)))))
    assert snaps[-1].jobs[0].stranded is None and len(r.told) == 1


def _gpu_rank(pid: int, t: float, sm: float, mem: float) -> RankSample:
    """A rank on a GPU, its CPU busy (a thread spinning in cudaStreamSynchronize, or work)."""
    return dataclasses.replace(_rank("j", pid, _busy(t)), gpu_sm_percent=sm, gpu_memory_percent=mem)


# The shapes measured per process on an H200 (benchmarks/results/gpu-stall-h200.json, NVML's
# per-process utilisation every 0.5 s): training steps with gaps to 0 % SM and some memory
# traffic; a kernel spinning in an all_reduce whose peer never came at 99-100 % SM and 0 %
# memory in every sample.
def _training(t: float) -> tuple[float, float]:
    return (0.0, 0.0) if int(t * 2) % 3 == 0 else (80.0, 3.0)


def _spinning(t: float) -> tuple[float, float]:
    return (99.0 + (int(t * 2) % 2), 0.0)


def test_a_survivor_spinning_its_gpu_for_a_dead_peer_is_stranded():
    """Busy CPU, busy GPU: the rule idle alone would call working; the GPU that holds a
    kernel in every sample and moves no memory is a polling loop: no progress."""
    deaths: dict = {}
    r = Rounds(deaths)
    r.run(20, lambda t: _snap(_job("j", _gpu_rank(1, t, *_training(t)), _gpu_rank(2, t, *_training(t)))))
    died_at = r.clock.now
    deaths[("j", "2", 0)] = ("external_signal", died_at)
    snaps = r.run(40, lambda t: _snap(_job("j", _gpu_rank(1, t, *_spinning(t)))))
    assert all(s.jobs[0].ranks[0].progress.reason is None for s in snaps)  # never a stall by itself
    first = next(i for i, s in enumerate(snaps) if s.jobs[0].stranded is not None)
    flagged_at = died_at + (first + 1) * 0.5
    assert STRANDED_AFTER_S <= flagged_at - died_at <= 30, flagged_at - died_at
    s = snaps[-1].jobs[0].stranded
    assert s is not None and s.ranks == ("1",) and died_at <= s.since <= flagged_at - STRANDED_AFTER_S


def test_a_survivor_training_on_its_gpu_after_the_death_is_not_stranded():
    """The same busy GPU with gaps between steps, or saturated but moving memory (a large
    model's steps), is work."""
    deaths = {("j", "2", 0): ("external_signal", 1000.0)}
    for shape in (_training, lambda t: (100.0, 25.0)):
        r = Rounds(deaths)
        snaps = r.run(60, lambda t, shape=shape: _snap(_job("j", _gpu_rank(1, t, *shape(t)))))
        assert all(s.jobs[0].stranded is None for s in snaps) and not r.told


def test_a_job_spinning_without_a_death_is_never_stranded_nor_stalled_for_it():
    r = Rounds({})
    snaps = r.run(
        60, lambda t: _snap(_job("j", _gpu_rank(1, t, *_spinning(t)), _gpu_rank(2, t, *_spinning(t))))
    )
    assert all(s.jobs[0].stranded is None and s.jobs[0].stalled_seconds == 0 for s in snaps)
    assert snaps[-1].jobs[0].ranks[0].progress.gpu_spinning_seconds >= 50


def test_a_spin_broken_by_one_gap_counts_again_from_the_gap():
    deaths = {("j", "2", 0): ("external_signal", 1000.0)}
    r = Rounds(deaths)
    r.run(30, lambda t: _snap(_job("j", _gpu_rank(1, t, *_spinning(t)))))
    gap = r.clock.now + 0.5
    snaps = r.run(1, lambda t: _snap(_job("j", _gpu_rank(1, t, 0.0, 0.0))))
    assert snaps[-1].jobs[0].ranks[0].progress.gpu_spinning_seconds == 0.0
    snaps = r.run(6, lambda t: _snap(_job("j", _gpu_rank(1, t, *_spinning(t)))))
    assert snaps[-1].jobs[0].stranded is None  # the window still holds the gap
    snaps = r.run(30, lambda t: _snap(_job("j", _gpu_rank(1, t, *_spinning(t)))))
    s = snaps[-1].jobs[0].stranded
    assert s is not None and s.since > gap
