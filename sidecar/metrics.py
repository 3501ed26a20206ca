"""Prometheus exposition: a custom Collector on a private registry that builds every
metric family fresh from the latest Snapshot on each scrape. A scrape does no I/O, so
series of a rank that is gone simply are not produced: nothing stale is left behind.

Names, types and help texts live in one table (``METRICS``); CONTRACTS.md fixes the
minimum set.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from sidecar import __version__
from sidecar.exposition import escape_help, escape_value, number
from sidecar.model import Snapshot

__all__ = ["METRICS", "TrainwatchCollector", "make_registry"]


@dataclass(frozen=True, slots=True)
class Spec:
    kind: str  # gauge | counter
    labels: tuple[str, ...]
    help: str


R = ("job", "rank")
METRICS: dict[str, Spec] = {
    "trainwatch_build_info": Spec("gauge", ("version",), "trainwatch build, always 1"),
    "trainwatch_rank_info": Spec(
        "gauge",
        ("job", "rank", "local_rank", "pid", "restart"),
        "A live torchrun rank (worker process), always 1; pid is the rank's pid as seen by trainwatch",
    ),
    "trainwatch_job_info": Spec(
        "gauge",
        ("job", "agent_pid", "run_id", "world_size", "entrypoint"),
        "A torchrun job (agent) on this machine, always 1",
    ),
    "trainwatch_job_restarts": Spec(
        "gauge", ("job",), "TORCHELASTIC_RESTART_COUNT of the job's live workers"
    ),
    "trainwatch_job_ranks": Spec("gauge", ("job",), "Number of live ranks of the job on this machine"),
    "trainwatch_job_stalled_seconds": Spec(
        "gauge",
        ("job",),
        "Seconds for which the job's longest-stalled rank has made no progress (no CPU and no GPU use, or its GPU busy while a peer's ran nothing); 0 while every rank works",
    ),
    "trainwatch_rank_stalled": Spec(
        "gauge", R, "1 while the rank makes no progress (idle, or waiting in a collective for a peer), else 0"
    ),
    "trainwatch_rank_resident_memory_bytes": Spec(
        "gauge", R, "Resident set size of the rank process in bytes (VmRSS, /proc/PID/status)"
    ),
    "trainwatch_rank_tree_proportional_memory_bytes": Spec(
        "gauge",
        R,
        "PSS of the rank and its descendants in bytes (smaps_rollup, every 30 s or on growth): shared pages split among the processes that map them",
    ),
    "trainwatch_rank_tree_unique_memory_bytes": Spec(
        "gauge",
        R,
        "USS of the rank and its descendants in bytes (smaps_rollup Private_*): the pages only one process of the tree maps",
    ),
    "trainwatch_rank_workers_unique_memory_bytes": Spec(
        "gauge",
        R,
        "USS of the rank's descendants (DataLoader workers) together, as last measured: copy-on-access "
        "growth (a forked worker un-sharing the dataset's pages) shows here and not in RSS",
    ),
    "trainwatch_rank_tree_resident_memory_bytes": Spec(
        "gauge",
        R,
        "RSS of the rank plus all its descendants (DataLoader and compile workers) in bytes, /proc/PID/stat; shared pages count once per process",
    ),
    "trainwatch_rank_memory_exhaustion_seconds": Spec(
        "gauge",
        R,
        "While the rank's own unreclaimable memory (anon + shmem of its tree) grows: predicted seconds "
        "until the limit that binds it (its tightest cgroup limit, or the host's memory) is reached at "
        "the trend of that limit's charge; no series while it does not grow",
    ),
    "trainwatch_rank_tree_processes": Spec(
        "gauge", R, "Number of live processes in the rank's tree, the rank included"
    ),
    "trainwatch_rank_peak_resident_memory_bytes": Spec(
        "gauge", R, "Peak resident set size of the rank process in bytes (VmHWM, /proc/PID/status)"
    ),
    "trainwatch_rank_cpu_seconds_total": Spec(
        "counter", R, "User plus system CPU time of the rank process in seconds (/proc/PID/stat)"
    ),
    "trainwatch_rank_threads": Spec("gauge", R, "Threads of the rank process (/proc/PID/stat)"),
    "trainwatch_rank_gpu_memory_bytes": Spec(
        "gauge",
        ("job", "rank", "gpu"),
        "GPU memory used by the rank's processes in bytes, CUDA context included (NVML per-process usedGpuMemory)",
    ),
    "trainwatch_rank_memory_limit_bytes": Spec(
        "gauge",
        R,
        "The tightest memory cgroup limit over the rank's cgroup and its ancestors in bytes; absent when none is set",
    ),
    "trainwatch_rank_cgroup_info": Spec(
        "gauge",
        ("job", "rank", "cgroup", "limited_by"),
        "The rank's memory cgroup and the level whose limit binds it, always 1",
    ),
    "trainwatch_gpu_memory_used_bytes": Spec(
        "gauge",
        ("gpu",),
        "GPU memory in use in bytes, the driver's reservation excluded where NVML can split it out (nvmlDeviceGetMemoryInfo)",
    ),
    "trainwatch_gpu_memory_total_bytes": Spec(
        "gauge", ("gpu",), "GPU memory size in bytes (nvmlDeviceGetMemoryInfo)"
    ),
    "trainwatch_gpu_info": Spec("gauge", ("gpu", "uuid", "name"), "A GPU NVML sees, always 1"),
    "trainwatch_gpu_lost": Spec(
        "gauge", ("gpu",), "1 when NVML reports the GPU lost (fell off the bus), else 0"
    ),
    "trainwatch_cgroup_memory_limit_bytes": Spec(
        "gauge",
        ("cgroup",),
        "Memory limit of the cgroup in bytes (v1 memory.limit_in_bytes, v2 memory.max); absent when unlimited",
    ),
    "trainwatch_cgroup_memory_usage_bytes": Spec(
        "gauge",
        ("cgroup",),
        "Memory usage of the cgroup in bytes (v1 memory.usage_in_bytes, v2 memory.current)",
    ),
    "trainwatch_cgroup_memory_peak_bytes": Spec(
        "gauge",
        ("cgroup",),
        "Peak memory usage of the cgroup in bytes (v1 memory.max_usage_in_bytes, v2 memory.peak)",
    ),
    "trainwatch_cgroup_oom_kills_total": Spec(
        "counter",
        ("cgroup",),
        "Processes of the cgroup killed by an OOM killer (v1 memory.oom_control oom_kill, v2 memory.events oom_kill)",
    ),
    "trainwatch_cgroup_memory_charge_bytes": Spec(
        "gauge",
        ("cgroup", "kind"),
        "What the cgroup's charge is made of (memory.stat): anon, file (page cache without shmem), "
        "shmem (tmpfs, /dev/shm), kernel (slab, stacks, page tables, sockets)",
    ),
    "trainwatch_cgroup_memory_exhaustion_seconds": Spec(
        "gauge",
        ("cgroup",),
        "While the cgroup's unreclaimable charge (anon + shmem + kernel) grows: predicted seconds until "
        "its own limit is reached at that trend; no series while it does not grow",
    ),
    "trainwatch_cgroup_memory_working_set_bytes": Spec(
        "gauge", ("cgroup",), "usage - inactive_file, as kubelet computes it (what it evicts on)"
    ),
    "trainwatch_cgroup_memory_events_total": Spec(
        "counter",
        ("cgroup", "event"),
        "v2 memory.events: times the cgroup went over low, high or max, hit an OOM, had a process OOM-killed",
    ),
    "trainwatch_cgroup_memory_pressure_ratio": Spec(
        "gauge",
        ("cgroup", "kind"),
        "v2: share of the last 10 s the cgroup's tasks stalled on memory (memory.pressure avg10, 0..1)",
    ),
    "trainwatch_cgroup_memory_pressure_stall_seconds_total": Spec(
        "counter", ("cgroup", "kind"), "v2: cumulative memory stall time of the cgroup's tasks in seconds"
    ),
    "trainwatch_cgroup_info": Spec(
        "gauge",
        ("cgroup", "version", "limited_by"),
        "A memory cgroup holding ranks (or binding them by its limit), always 1",
    ),
    "trainwatch_host_memory_available_bytes": Spec("gauge", (), "MemAvailable of /proc/meminfo in bytes"),
    "trainwatch_host_memory_total_bytes": Spec("gauge", (), "MemTotal of /proc/meminfo in bytes"),
    "trainwatch_host_oom_kills_total": Spec(
        "counter", (), "Processes killed by the kernel OOM killer, global and cgroup (/proc/vmstat oom_kill)"
    ),
    "trainwatch_host_memory_pressure_ratio": Spec(
        "gauge",
        ("kind",),
        "Share of the last 10 s in which some/all tasks stalled on memory (/proc/pressure/memory avg10 / 100)",
    ),
    "trainwatch_host_memory_pressure_stall_seconds_total": Spec(
        "counter", ("kind",), "Cumulative memory stall time in seconds (/proc/pressure/memory total)"
    ),
    "trainwatch_host_shm_used_bytes": Spec("gauge", (), "Bytes in use on /dev/shm (statvfs)"),
    "trainwatch_host_shm_size_bytes": Spec("gauge", (), "Size of /dev/shm in bytes (statvfs)"),
    "trainwatch_rank_deaths_total": Spec(
        "counter", ("job", "killer"), "Ranks that died abnormally, by the killer named in their postmortem"
    ),
    "trainwatch_rank_death_timestamp_seconds": Spec(
        "gauge",
        ("job", "rank", "restart", "killer"),
        "Unix time at which the rank died abnormally, by the killer named in its postmortem (agent_teardown for ranks the agent stopped); the newest 64 deaths",
    ),
    "trainwatch_postmortems_written_total": Spec("counter", (), "Postmortem documents written"),
    "trainwatch_probe_success": Spec("gauge", ("probe",), "1 when the probe's last run succeeded, else 0"),
    "trainwatch_probe_duration_seconds": Spec(
        "gauge", ("probe",), "Duration of the probe's last run in seconds"
    ),
    "trainwatch_last_sample_timestamp_seconds": Spec(
        "gauge", (), "Unix time of the last finished sampling round in seconds"
    ),
    "trainwatch_http_auth_failures_total": Spec(
        "counter",
        (),
        "HTTP requests refused by basic authentication (--web-config): no, malformed or wrong credentials",
    ),
    "trainwatch_http_rate_limited_total": Spec(
        "counter", (), "HTTP requests refused by the --web-config rate_limit (429)"
    ),
    "trainwatch_http_tls_refused_total": Spec(
        "counter", (), "TLS connections ended because the client certificate has none of client_allowed_sans"
    ),
    "trainwatch_web_config_last_reload_successful": Spec(
        "gauge",
        (),
        "1 when the --web-config file in force is the file on disk; 0 when a changed file could not be used",
    ),
    "trainwatch_time_seconds": Spec(
        "gauge",
        (),
        "The daemon's clock when it answered this scrape (Unix seconds): against Prometheus's scrape "
        "timestamp it bounds this node's clock offset (trainwatch story orders deaths across nodes by it)",
    ),
    "trainwatch_sample_duration_seconds": Spec("gauge", (), "Duration of the last sampling round in seconds"),
    "trainwatch_samples_total": Spec("counter", (), "Sampling rounds run"),
    "trainwatch_smaps_cpu_seconds_total": Spec(
        "counter",
        (),
        "CPU seconds the daemon spent reading smaps_rollup for PSS and USS (off with --disable smaps)",
    ),
    "trainwatch_sampler_overruns_total": Spec(
        "counter", (), "Sampling deadlines missed because a round ran past its interval"
    ),
    "trainwatch_unreadable_processes": Spec(
        "gauge", (), "Worker processes whose environment could not be read (permission denied)"
    ),
    "trainwatch_attached_jobs": Spec("gauge", (), "torchrun jobs currently attached"),
    "trainwatch_lost_events_total": Spec(
        "counter",
        ("source",),
        "Evidence lost before the daemon read it: kernel log records overwritten unread (source=kmsg), "
        "process connector overruns, each losing an unknown number of exits (source=connector)",
    ),
    "trainwatch_self_protection": Spec(
        "gauge",
        ("kind",),
        "1 when the kernel granted the daemon this protection at start (oom_score_adj, mlock, priority), else 0",
    ),
}


class _Families:
    def __init__(self) -> None:
        self.families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}

    def add(self, name: str, value: float, *labels: str) -> None:
        family = self.families.get(name)
        if family is None:
            spec = METRICS[name]
            if spec.kind == "counter":
                family = CounterMetricFamily(name.removesuffix("_total"), spec.help, labels=spec.labels)
            else:
                family = GaugeMetricFamily(name, spec.help, labels=spec.labels)
            self.families[name] = family
        family.add_metric(list(labels), value)


class _Lines:
    """The exposition written as the families are filled: byte for byte what
    ``exposition.render(collect())`` gives, without building prometheus_client's family
    and sample objects (most of a scrape's time at 64 ranks)."""

    def __init__(self, openmetrics: bool) -> None:
        self.openmetrics = openmetrics
        self.families: dict[str, list[str]] = {}

    def add(self, name: str, value: float, *labels: str) -> None:
        lines = self.families.get(name)
        spec = METRICS[name]
        if lines is None:
            header = name.removesuffix("_total") if spec.kind == "counter" and self.openmetrics else name
            lines = self.families[name] = [
                f"# HELP {header} {escape_help(spec.help, self.openmetrics)}\n",
                f"# TYPE {header} {spec.kind}\n",
            ]
        if labels:
            inner = ",".join(f'{k}="{escape_value(v)}"' for k, v in zip(spec.labels, labels, strict=False))
            lines.append(f"{name}{{{inner}}} {number(value)}\n")
        else:
            lines.append(f"{name} {number(value)}\n")

    def body(self) -> bytes:
        text = "".join(line for lines in self.families.values() for line in lines)
        return (text + "# EOF\n" if self.openmetrics else text).encode()


def with_clock(body: bytes, openmetrics: bool, now: float) -> bytes:
    """``body`` with ``trainwatch_time_seconds`` at ``now`` appended (before OpenMetrics'
    ``# EOF``): written per scrape, outside the cache of rendered bodies."""
    lines = _Lines(openmetrics)
    lines.add("trainwatch_time_seconds", now)
    clock = "".join(lines.families["trainwatch_time_seconds"]).encode()
    if openmetrics and body.endswith(b"# EOF\n"):
        return body[: -len(b"# EOF\n")] + clock + b"# EOF\n"
    return body + clock


class TrainwatchCollector(Collector):
    """Turns the latest snapshot (and the death counters) into metric families."""

    def __init__(
        self,
        snapshot: Callable[[], Snapshot | None],
        deaths: Callable[[], dict[tuple[str, str], int]] = dict,
        postmortems: Callable[[], int] = lambda: 0,
        death_times: Callable[[], dict[tuple[str, str, int], tuple[str, float]]] = dict,
        protection: Callable[[], list[tuple[str, bool]]] = list,
        lost: Callable[[], dict[str, int]] = dict,
        web: Callable[[], tuple[int, int, int, bool] | None] = lambda: None,
    ) -> None:
        self._web = web
        self._protection = protection
        self._lost = lost
        self._snapshot = snapshot
        self._deaths = deaths
        self._death_times = death_times
        self._postmortems = postmortems

    def describe(self) -> Iterator[Metric]:
        return iter(())  # families depend on the snapshot; no up-front description

    def collect(self) -> Iterator[Metric]:
        f = _Families()
        self._populate(f)
        yield from f.families.values()

    def exposition(self, openmetrics: bool = False) -> bytes:
        """The text of every family, as ``exposition.render(self.collect())`` writes it."""
        lines = _Lines(openmetrics)
        self._populate(lines)
        return lines.body()

    def _populate(self, f: _Families | _Lines) -> None:
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
        for (job, killer), count in sorted(self._deaths().items()):
            f.add("trainwatch_rank_deaths_total", count, job, killer)
        for (job, rank, restart), (killer, at) in sorted(self._death_times().items()):
            f.add("trainwatch_rank_death_timestamp_seconds", at, job, rank, str(restart), killer)
        snap = self._snapshot()
        if snap is not None:
            self._fill(f, snap)

    def _fill(self, f: _Families | _Lines, snap: Snapshot) -> None:
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
