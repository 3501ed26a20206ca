"""The collector: every metric family built fresh from the latest Snapshot (and the death
counters, the web guard's counts, the daemon's protections) on each scrape, on a private
registry. A scrape does no I/O, so series of a rank that is gone simply are not produced:
nothing stale is left behind."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import Metric
from prometheus_client.registry import Collector, CollectorRegistry

from sidecar import __version__
from sidecar.metrics.families import Families, Lines
from sidecar.model import Snapshot
from sidecar.model.ledger import DeathLedger

__all__ = ["TrainwatchCollector", "make_registry"]


class TrainwatchCollector(Collector):
    """Turns the latest snapshot (and the death ledger) into metric families."""

    def __init__(
        self,
        snapshot: Callable[[], Snapshot | None],
        deaths: Callable[[], DeathLedger] = DeathLedger,
        postmortems: Callable[[], int] = lambda: 0,
        protection: Callable[[], Iterable[tuple[str, bool]]] = tuple,
        lost: Callable[[], dict[str, int]] = dict,
        web: Callable[[], tuple[int, int, int, bool] | None] = lambda: None,
    ) -> None:
        self._web = web
        self._protection = protection
        self._lost = lost
        self._snapshot = snapshot
        self._deaths = deaths
        self._postmortems = postmortems

    def describe(self) -> Iterator[Metric]:
        return iter(())  # families depend on the snapshot; no up-front description

    def collect(self) -> Iterator[Metric]:
        f = Families()
        self._populate(f)
        yield from f.families.values()

    def exposition(self, openmetrics: bool = False) -> bytes:
        """The text of every family, as ``exposition.render(self.collect())`` writes it."""
        lines = Lines(openmetrics)
        self._populate(lines)
        return lines.body()

    def _populate(self, f: Families | Lines) -> None:
        f.add("trainwatch_build_info", 1, __version__)
        f.add("trainwatch_postmortems_written_total", self._postmortems())
        for kind, granted in self._protection():
            f.add("trainwatch_self_protection", 1 if granted else 0, kind)
        web = self._web()
        if web is not None:  # --web-config in force
            auth, limited, tls_refused, reload_ok = web
            f.add("trainwatch_http_auth_failures_total", auth)
            f.add("trainwatch_http_rate_limited_total", limited)
            f.add("trainwatch_http_tls_refused_total", tls_refused)
            f.add("trainwatch_web_config_last_reload_successful", 1 if reload_ok else 0)
        for source, count in sorted(self._lost().items()):
            f.add("trainwatch_lost_events_total", count, source)
        ledger = self._deaths()
        for (job, killer), count in sorted(ledger.totals.items()):
            f.add("trainwatch_rank_deaths_total", count, job, killer)
        for (job, rank, restart), (killer, at) in sorted(ledger.times.items()):
            f.add("trainwatch_rank_death_timestamp_seconds", at, job, rank, str(restart), killer)
        snap = self._snapshot()
        if snap is not None:
            self._fill(f, snap)

    def _fill(self, f: Families | Lines, snap: Snapshot) -> None:
        f.add("trainwatch_last_sample_timestamp_seconds", snap.taken_at)
        f.add("trainwatch_sample_duration_seconds", snap.sample_duration_seconds)
        f.add("trainwatch_samples_total", snap.samples_total)
        f.add("trainwatch_smaps_cpu_seconds_total", snap.smaps_cpu_seconds)
        f.add("trainwatch_sampler_overruns_total", snap.overruns_total)
        f.add("trainwatch_unreadable_processes", snap.unreadable_processes)
        f.add("trainwatch_attached_jobs", len(snap.jobs))
        for probe, status in sorted(snap.probes.items()):
            f.add("trainwatch_probe_success", 1 if status.success else 0, probe)
            f.add("trainwatch_probe_duration_seconds", status.duration_seconds, probe)
        cgroups = {c.path: c for c in snap.cgroups}
        for job in snap.jobs:
            f.add(
                "trainwatch_job_info",
                1,
                job.key,
                str(job.agent.pid),
                job.run_id or "",
                "" if job.world_size is None else str(job.world_size),
                job.entrypoint or "",
            )
            f.add("trainwatch_job_restarts", job.restart_count, job.key)
            f.add("trainwatch_job_ranks", len(job.ranks), job.key)
            f.add("trainwatch_job_stalled_seconds", job.stalled_seconds, job.key)
            stranded = job.stranded
            f.add("trainwatch_job_stranded_ranks", len(stranded.ranks) if stranded else 0, job.key)
            f.add(
                "trainwatch_job_stranded_gpu_memory_bytes",
                stranded.gpu_memory_bytes if stranded else 0,
                job.key,
            )
            for r in job.ranks:
                labels = (job.key, r.rank_label)
                f.add(
                    "trainwatch_rank_info",
                    1,
                    job.key,
                    r.rank_label,
                    "" if r.local_rank is None else str(r.local_rank),
                    str(r.key.pid),
                    str(r.restart),
                    job.launcher,
                )
                f.add("trainwatch_rank_resident_memory_bytes", r.rss_bytes, *labels)
                f.add("trainwatch_rank_tree_resident_memory_bytes", r.tree_rss_bytes, *labels)
                f.add("trainwatch_rank_tree_processes", r.tree_processes, *labels)
                if r.progress is not None:
                    f.add("trainwatch_rank_stalled", 0 if r.progress.reason is None else 1, *labels)
                if r.tree_pss_bytes is not None:
                    f.add("trainwatch_rank_tree_proportional_memory_bytes", r.tree_pss_bytes, *labels)
                if r.tree_uss_bytes is not None:
                    f.add("trainwatch_rank_tree_unique_memory_bytes", r.tree_uss_bytes, *labels)
                if r.workers_uss:
                    f.add(
                        "trainwatch_rank_workers_unique_memory_bytes",
                        sum(u for _, u, _ in r.workers_uss),
                        *labels,
                    )
                if r.exhaustion_seconds is not None:
                    f.add("trainwatch_rank_memory_exhaustion_seconds", r.exhaustion_seconds, *labels)
                if r.peak_rss_bytes is not None:
                    f.add("trainwatch_rank_peak_resident_memory_bytes", r.peak_rss_bytes, *labels)
                f.add("trainwatch_rank_cpu_seconds_total", r.cpu_seconds, *labels)
                f.add("trainwatch_rank_threads", r.threads, *labels)
                for gpu, used in sorted(r.gpu_memory_bytes.items()):
                    f.add("trainwatch_rank_gpu_memory_bytes", used, *labels, str(gpu))
                cg = cgroups.get(r.cgroup) if r.cgroup is not None else None
                if cg is not None:
                    f.add("trainwatch_rank_cgroup_info", 1, *labels, cg.path, cg.limited_by or "")
                    if cg.effective_limit_bytes is not None:
                        f.add("trainwatch_rank_memory_limit_bytes", cg.effective_limit_bytes, *labels)
        for device in snap.gpus:
            index = str(device.index)
            f.add("trainwatch_gpu_info", 1, index, device.uuid or "", device.name or "")
            f.add("trainwatch_gpu_lost", 1 if device.lost else 0, index)
            if device.used_bytes is not None:
                f.add("trainwatch_gpu_memory_used_bytes", device.used_bytes, index)
            if device.total_bytes is not None:
                f.add("trainwatch_gpu_memory_total_bytes", device.total_bytes, index)
        for cg in snap.cgroups:
            f.add("trainwatch_cgroup_info", 1, cg.path, str(cg.version), cg.limited_by or "")
            if cg.limit_bytes is not None:
                f.add("trainwatch_cgroup_memory_limit_bytes", cg.limit_bytes, cg.path)
            if cg.usage_bytes is not None:
                f.add("trainwatch_cgroup_memory_usage_bytes", cg.usage_bytes, cg.path)
            if cg.peak_bytes is not None:
                f.add("trainwatch_cgroup_memory_peak_bytes", cg.peak_bytes, cg.path)
            if cg.oom_kills is not None:
                f.add("trainwatch_cgroup_oom_kills_total", cg.oom_kills, cg.path)
            if cg.exhaustion_seconds is not None:
                f.add("trainwatch_cgroup_memory_exhaustion_seconds", cg.exhaustion_seconds, cg.path)
            c = cg.charge
            if c is not None:
                f.add("trainwatch_cgroup_memory_charge_bytes", c.anon_bytes, cg.path, "anon")
                f.add("trainwatch_cgroup_memory_charge_bytes", c.file_bytes, cg.path, "file")
                f.add("trainwatch_cgroup_memory_charge_bytes", c.shmem_bytes, cg.path, "shmem")
                if c.kernel_bytes is not None:
                    f.add("trainwatch_cgroup_memory_charge_bytes", c.kernel_bytes, cg.path, "kernel")
                if c.working_set_bytes is not None:
                    f.add("trainwatch_cgroup_memory_working_set_bytes", c.working_set_bytes, cg.path)
            for event, count in cg.events.items():
                f.add("trainwatch_cgroup_memory_events_total", count, cg.path, event)
            for kind, ratio, stall in zip(
                ("some", "full"), cg.pressure_ratio or (), cg.pressure_stall_seconds or (), strict=False
            ):
                if ratio is not None:
                    f.add("trainwatch_cgroup_memory_pressure_ratio", ratio, cg.path, kind)
                if stall is not None:
                    f.add("trainwatch_cgroup_memory_pressure_stall_seconds_total", stall, cg.path, kind)
        host = snap.host
        if host is not None:
            f.add("trainwatch_host_memory_available_bytes", host.available_bytes)
            f.add("trainwatch_host_memory_total_bytes", host.total_bytes)
            if host.oom_kills is not None:
                f.add("trainwatch_host_oom_kills_total", host.oom_kills)
            if host.psi_some_avg10_ratio is not None:
                f.add("trainwatch_host_memory_pressure_ratio", host.psi_some_avg10_ratio, "some")
            if host.psi_full_avg10_ratio is not None:
                f.add("trainwatch_host_memory_pressure_ratio", host.psi_full_avg10_ratio, "full")
            if host.psi_some_total_seconds is not None:
                f.add(
                    "trainwatch_host_memory_pressure_stall_seconds_total", host.psi_some_total_seconds, "some"
                )
            if host.psi_full_total_seconds is not None:
                f.add(
                    "trainwatch_host_memory_pressure_stall_seconds_total", host.psi_full_total_seconds, "full"
                )
            if host.shm_used_bytes is not None:
                f.add("trainwatch_host_shm_used_bytes", host.shm_used_bytes)
            if host.shm_total_bytes is not None:
                f.add("trainwatch_host_shm_size_bytes", host.shm_total_bytes)


def make_registry(collector: TrainwatchCollector) -> CollectorRegistry:
    """A private registry holding only trainwatch's collector (no process_/python_ metrics
    of the daemon itself mixed into the job's namespace)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry
