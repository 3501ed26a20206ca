"""Samples made by hand: a round's snapshot and a job of one rank, for the tests that feed
the timeline, the death watch and its journal without a sampler."""

from __future__ import annotations

from sidecar.model import JobSample, ProcKey, RankSample, Snapshot


def make_snapshot(i: int, jobs: tuple[JobSample, ...], at: float | None = None) -> Snapshot:
    """A round's snapshot: round i, taken at 1000 + i s (or at), holding these jobs."""
    return Snapshot(
        taken_at=1000.0 + i if at is None else at,
        monotonic=float(i),
        jobs=jobs,
        host=None,
        gpus=(),
        cgroups=(),
        probes={},
        samples_total=i,
        overruns_total=0,
        sample_duration_seconds=0.001,
        unreadable_processes=0,
    )


def make_job(key: str, rss: int) -> JobSample:
    """A job of one rank (pid 10, under agent pid 9) whose RSS is rss, its tree twice that."""
    rank = RankSample(
        job=key,
        rank=0,
        rank_label="0",
        local_rank=0,
        restart=0,
        key=ProcKey(10, 1),
        rss_bytes=rss,
        peak_rss_bytes=rss,
        cpu_seconds=0.0,
        threads=1,
        tree_rss_bytes=2 * rss,
        tree_processes=2,
        cgroup=None,
    )
    return JobSample(
        key=key,
        agent=ProcKey(9, 1),
        run_id=None,
        world_size=1,
        restart_count=0,
        max_restarts=0,
        entrypoint="t.py",
        started_at=0.0,
        ranks=(rank,),
    )
