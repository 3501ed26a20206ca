"""The metric table: every family's name, type, labels and help text (``METRICS``), the one
table the exposition, the dashboard and the tests are built from; CONTRACTS.md fixes the
minimum set."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["METRICS", "Spec"]


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
        ("job", "rank", "local_rank", "pid", "restart", "launcher"),
        "A live rank (worker process), always 1; pid is the rank's pid as seen by trainwatch; "
        "launcher: what started it (torchrun, deepspeed, spawn, lightning, mpi, slurm)",
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
    "trainwatch_job_stranded_ranks": Spec(
        "gauge",
        ("job",),
        "Live ranks of the job left stranded: alive and making no progress after another rank of the job died; 0 when none",
    ),
    "trainwatch_job_stranded_gpu_memory_bytes": Spec(
        "gauge",
        ("job",),
        "GPU memory held by the job's stranded ranks (their trees, as NVML attributes it); 0 when none",
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


def render_metrics() -> str:
    """docs/metrics.md: the table above as a page (``python -m sidecar.metrics.table``)."""
    lines = [
        "# Metrics",
        "",
        "<!-- Generated from sidecar/metrics/table.py (METRICS) by",
        "     `python -m sidecar.metrics.table > docs/metrics.md`;",
        "     tests/unit/front/test_front_door.py checks it is current. Do not edit by hand. -->",
        "",
        f"Every family the daemon exports on `/metrics` ({len(METRICS)} of them), in base units with the",
        "`trainwatch_` prefix. A series of a rank that is gone disappears with it; a series known to",
        "exist starts at 0. The same table builds the exposition, the Grafana dashboard",
        "(`dashboards/trainwatch.json`) and the tests.",
        "",
        "| metric | type | labels | what it is |",
        "| --- | --- | --- | --- |",
    ]
    for name, spec in METRICS.items():
        labels = ", ".join(f"`{label}`" for label in spec.labels)
        text = spec.help.replace("|", "\\|")
        lines.append(f"| `{name}` | {spec.kind} | {labels} | {text} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    import sys

    sys.stdout.write(render_metrics())
