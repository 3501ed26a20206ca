"""The round's reads put together as the snapshot's jobs and ranks. A round between two
detailed ones judges nothing: it carries the last published word of foresight and the stall
tracker (``judged``), built in, not copied in afterwards. Part of the sampling round
(``sampler.py``).
"""

from __future__ import annotations

from sidecar.model import CgroupSample, JobSample, ProcKey, RankSample, Snapshot, evolve
from sidecar.sampling.jobs import TrackedJob, TrackedRank
from sidecar.sampling.ranks import RankRead

__all__ = ["RankRows", "carry_forecasts", "job_samples"]

# Per job, each live rank and what the round read of it
RankRows = list[tuple[TrackedJob, list[tuple[TrackedRank, RankRead]]]]


def _rank_sample(
    job: TrackedJob,
    tracked: TrackedRank,
    read: RankRead,
    rank_cgroup: dict[ProcKey, str],
    gpu_by_rank: dict[ProcKey, dict[int, int]],
    gpu_activity: dict[ProcKey, tuple[float, float]],
    judged: RankSample | None = None,
) -> RankSample:
    """``judged``: the rank as last published, whose foresight and stall judgements a
    round between two detailed ones carries."""
    sm, mem = gpu_activity.get(tracked.key, (None, None))
    env = tracked.env
    return RankSample(
        job=job.key or "",
        rank=tracked.rank,
        rank_label=tracked.label,
        local_rank=tracked.local_rank,
        restart=tracked.restart,
        key=tracked.key,
        rss_bytes=read.rss_bytes,
        # VmHWM is the detailed round's, RSS may be a later statm: the mark is at least it
        peak_rss_bytes=None if read.peak_rss_bytes is None else max(read.peak_rss_bytes, read.rss_bytes),
        cpu_seconds=read.cpu_seconds,
        threads=read.threads,
        tree_rss_bytes=read.tree_rss_bytes,
        tree_processes=read.tree_processes,
        cgroup=rank_cgroup.get(tracked.key),
        gpu_memory_bytes=gpu_by_rank.get(tracked.key, {}),
        ns_pids=read.ns_pids,
        flight_recorder=env.flight_recorder if env else None,
        error_file=env.error_file if env else None,
        run_output=env.run_output if env else None,
        uid=read.uid,
        tree_pss_bytes=read.tree_pss_bytes,
        tree_uss_bytes=read.tree_uss_bytes,
        tree_unreclaimable_bytes=read.tree_unreclaimable_bytes,
        workers_uss=read.workers_uss,
        flight_pipe=env.flight_pipe if env else None,
        slurm_times=env.slurm_times if env else None,
        rank_source=tracked.rank_source,
        gpu_sm_percent=sm,
        gpu_memory_percent=mem,
        binding_limit=None if judged is None else judged.binding_limit,
        exhaustion_seconds=None if judged is None else judged.exhaustion_seconds,
        progress=None if judged is None else judged.progress,
    )


def carry_forecasts(cgroups: tuple[CgroupSample, ...], judged: Snapshot | None) -> tuple[CgroupSample, ...]:
    """The cgroups with the time left that the last published snapshot foresaw for them."""
    if judged is None:
        return cgroups
    forecast = {c.path: c.exhaustion_seconds for c in judged.cgroups if c.exhaustion_seconds is not None}
    if not forecast:
        return cgroups
    return tuple(
        c if c.path not in forecast else evolve(c, exhaustion_seconds=forecast[c.path]) for c in cgroups
    )


def job_samples(
    rank_rows: RankRows,
    rank_cgroup: dict[ProcKey, str],
    gpu_by_rank: dict[ProcKey, dict[int, int]],
    gpu_activity: dict[ProcKey, tuple[float, float]],
    judged: Snapshot | None,
    shm: dict[str, tuple[int, int, float]],
) -> list[JobSample]:
    """Each job of the round, its ranks in order; ``judged``: the last published snapshot
    (None in a detailed round, which is judged afresh)."""
    judged_ranks = {} if judged is None else {r.key: r for j in judged.jobs for r in j.ranks}
    judged_jobs = {} if judged is None else {j.key: j for j in judged.jobs}
    samples: list[JobSample] = []
    for job, rows in rank_rows:
        ranks = tuple(
            _rank_sample(
                job, tracked, read, rank_cgroup, gpu_by_rank, gpu_activity, judged_ranks.get(tracked.key)
            )
            for tracked, read in rows
        )
        was = judged_jobs.get(job.key or "")
        samples.append(
            JobSample(
                key=job.key or "",
                agent=job.agent,
                run_id=job.run_id,
                world_size=job.world_size,
                restart_count=job.restart_count,
                max_restarts=job.max_restarts,
                entrypoint=job.entrypoint,
                started_at=job.started_at,
                ranks=ranks,
                agent_alive=job.agent_alive,
                stalled_seconds=0.0 if was is None else was.stalled_seconds,
                suspected_missing=() if was is None else was.suspected_missing,
                shm=shm.get(job.key or ""),
                launcher=job.launcher,
                stranded=None if was is None else was.stranded,
            )
        )
    return samples
