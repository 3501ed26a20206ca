"""The dashboard's content: every panel with its queries, the deaths annotation and the
variables, as data (``Target``, ``Panel``). ``sidecar.dashboard`` lays them out as
Grafana's JSON and checks every metric they query against the metric table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["ANNOTATION", "DS", "VARIABLES", "Panel", "Target", "panels"]

DS = {"type": "prometheus", "uid": "${datasource}"}
SEL_NODE = 'instance=~"$instance"'
SEL_JOB = 'instance=~"$instance", job=~"$job"'
SEL_RANK = 'instance=~"$instance", job=~"$job", rank=~"$rank"'
DEATH_TIMES = "trainwatch_rank_death_timestamp_seconds"


@dataclass(frozen=True)
class Target:
    expr: str
    legend: str = ""
    instant: bool = False
    table: bool = False


@dataclass(frozen=True)
class Panel:
    title: str
    kind: str  # timeseries | stat | table | barchart | state-timeline | row
    targets: tuple[Target, ...] = ()
    unit: str = ""
    description: str = ""
    w: int = 12
    h: int = 8
    needs: str = ""  # "gpu": returns series only on a machine with NVIDIA GPUs
    extra: dict[str, Any] = field(default_factory=dict)


def story_link(job: str) -> dict[str, Any]:
    """A data link to the job's story across nodes (GET /story on the daemon the
    ``story_url`` variable names: one started with --prometheus URL)."""
    return {"title": "Story of this job across nodes", "url": f"${{story_url}}/story?job={job}&format=html",
            "targetBlank": True}  # fmt: skip


def _row(title: str) -> Panel:
    return Panel(title, "row", w=24, h=1)


def panels() -> list[Panel]:
    """The dashboard's panels, top to bottom (rows start new sections)."""
    headroom_expr = (
        "min by (instance, job) (\n"
        f'  label_replace(trainwatch_rank_cgroup_info{{{SEL_JOB}, limited_by!=""}}, '
        '"cgroup", "$1", "limited_by", "(.+)")\n'
        "  * on (instance, cgroup) group_left ()\n"
        "  (trainwatch_cgroup_memory_limit_bytes - trainwatch_cgroup_memory_usage_bytes)\n)"
    )
    return [
        _row("Headroom"),
        Panel(
            "Headroom to the binding cgroup limit",
            "stat",
            (Target(headroom_expr, "{{job}} on {{instance}}"),),
            unit="bytes",
            w=6,
            h=5,
            description="Memory left under the tightest cgroup limit over the job's ranks (limit minus "
            "usage of the cgroup whose limit binds them). At 0 the kernel kills a process of that cgroup.",
            extra={"thresholds": [("red", None), ("orange", 2 << 30), ("green", 8 << 30)]},
        ),
        Panel(
            "Host memory available",
            "stat",
            (Target(f"trainwatch_host_memory_available_bytes{{{SEL_NODE}}}", "{{instance}}"),),
            unit="bytes",
            w=6,
            h=5,
            description="MemAvailable: what the node can still give before the kernel's OOM killer runs.",
            extra={"thresholds": [("red", None), ("orange", 4 << 30), ("green", 16 << 30)]},
        ),
        Panel(
            "Ranks killed",
            "stat",
            (
                Target(
                    f"count(max by (instance, job, rank, restart) (last_over_time({DEATH_TIMES}"
                    f'{{{SEL_JOB}, killer!="agent_teardown"}}[$__range])))',
                ),
            ),
            w=6,
            h=5,
            description="Ranks that died abnormally in the time range, the ones the agent stopped "
            "afterwards not counted. Each has a postmortem: GET /postmortems on its node.",
            extra={"thresholds": [("green", None), ("red", 1)], "noValue": "0"},
        ),
        Panel(
            "First death of the job (all nodes)",
            "stat",
            (
                Target(
                    f'min by (job) (last_over_time({DEATH_TIMES}{{job=~"$job"}}[$__range])) * 1000',
                    "{{job}}",
                ),
            ),
            unit="dateTimeAsIso",
            w=6,
            h=5,
            description="The earliest rank death of the job over every node's daemon: where to look "
            "first. "
            "Click it for the job's story across nodes (which node's rank died first, of what, and what "
            "every other rank did after it), served by the daemon named in the story_url variable (one "
            "started with --prometheus).",
            extra={"links": [story_link("${__field.labels.job}")]},
        ),
        Panel(
            "Predicted time until the memory limit",
            "timeseries",
            (
                Target(f"trainwatch_rank_memory_exhaustion_seconds{{{SEL_RANK}}}", "rank {{rank}}"),
                Target(f"trainwatch_cgroup_memory_exhaustion_seconds{{{SEL_NODE}}}", "{{cgroup}}"),
            ),
            unit="s",
            description="trainwatch's forecast: for a rank whose memory that reclaim cannot take back "
            "(anon + shmem) keeps growing, the seconds until the limit that binds it (its tightest cgroup "
            "limit, or the host's memory) is reached at the trend of that limit's charge; and the same "
            "for each limited cgroup. No line while nothing grows. A checkpoint load (a step) does not "
            "count as growth.",
            extra={"thresholds": [("red", None), ("orange", 120), ("green", 900)]},
        ),
        Panel(
            "What the cgroup's charge is made of",
            "timeseries",
            (Target(f"trainwatch_cgroup_memory_charge_bytes{{{SEL_NODE}}}", "{{cgroup}} {{kind}}"),),
            unit="bytes",
            description="memory.stat of each cgroup that holds ranks or binds them: anon (heaps, tensors), "
            "shmem (/dev/shm, tmpfs: counts toward the limit and no reclaim frees it), file (page cache, "
            "reclaimed before an OOM) and kernel memory.",
        ),
        _row("Ranks"),
        Panel(
            "Rank memory against its limit",
            "timeseries",
            (
                Target(f"trainwatch_rank_tree_resident_memory_bytes{{{SEL_RANK}}}", "rank {{rank}} tree"),
                Target(f"trainwatch_rank_resident_memory_bytes{{{SEL_RANK}}}", "rank {{rank}}"),
                Target(f"trainwatch_rank_memory_limit_bytes{{{SEL_RANK}}}", "rank {{rank}} limit"),
                Target(f"trainwatch_host_memory_available_bytes{{{SEL_NODE}}}", "{{instance}} available"),
            ),
            unit="bytes",
            w=24,
            h=9,
            description="Each rank's resident memory, with its DataLoader workers (tree), against the "
            "tightest cgroup limit over its cgroup (dashed) and the host's available memory (dotted).",
            extra={"dashed": "limit$", "dotted": "available$"},
        ),
        Panel(
            "Rank peak RSS (VmHWM)",
            "barchart",
            (
                Target(
                    # over the range: the rank that died (whose series ended) is the one to see
                    "max by (instance, job, rank) (max_over_time("
                    f"trainwatch_rank_peak_resident_memory_bytes{{{SEL_RANK}}}[$__range]))",
                    "{{instance}} rank {{rank}}",
                    instant=True,
                    table=True,
                ),
            ),
            unit="bytes",
            w=8,
            description="The highest resident set each rank reached in the time range, dead ranks included.",
            extra={"xField": "rank"},
        ),
        Panel(
            "Rank CPU",
            "timeseries",
            (
                Target(
                    f"rate(trainwatch_rank_cpu_seconds_total{{{SEL_RANK}}}[$__rate_interval])",
                    "rank {{rank}}",
                ),
            ),
            unit="percentunit",
            w=8,
            description="CPU seconds per second of each rank process (1 = one core).",
        ),
        Panel(
            "Job stalled for",
            "timeseries",
            (
                Target(f"trainwatch_job_stalled_seconds{{{SEL_JOB}}}", "{{job}}"),
                Target(f"trainwatch_rank_stalled{{{SEL_RANK}}}", "rank {{rank}} stalled (0/1)"),
            ),
            unit="s",
            w=8,
            description="How long the job's longest-stalled rank has made no progress (no CPU and no "
            "GPU use, or its GPU busy in a collective while a peer's is silent), and which ranks are "
            "stalled now: a hang shows as a ramp long before the NCCL timeout ends it; /ranks names "
            "the ranks the others wait for.",
        ),
        Panel(
            "Processes per rank (DataLoader workers)",
            "timeseries",
            (Target(f"trainwatch_rank_tree_processes{{{SEL_RANK}}}", "rank {{rank}}"),),
            w=8,
            h=6,
        ),
        Panel(
            "Ranks and restarts",
            "timeseries",
            (
                Target(f"trainwatch_job_ranks{{{SEL_JOB}}}", "{{job}} live ranks"),
                Target(f"trainwatch_job_restarts{{{SEL_JOB}}}", "{{job}} restarts"),
            ),
            w=8,
            h=6,
        ),
        Panel(
            "Stranded after a death",
            "timeseries",
            (
                Target(f"trainwatch_job_stranded_ranks{{{SEL_JOB}}}", "{{job}} stranded ranks"),
                Target(f"trainwatch_job_stranded_gpu_memory_bytes{{{SEL_JOB}}}", "{{job}} GPU memory held"),
            ),
            w=8,
            h=6,
            description="Ranks left alive and making no progress after another rank of their job died "
            "(a Slurm step without --kill-on-bad-exit, an orphaned Lightning rank, another node's "
            "peers), and the GPU memory they hold until a collective timeout ends them; 0 otherwise.",
            extra={"rightAxisBytes": "GPU memory held$"},
        ),
        _row("Cgroups and host"),
        Panel(
            "Cgroup memory against its limit",
            "timeseries",
            (
                Target(f"trainwatch_cgroup_memory_usage_bytes{{{SEL_NODE}}}", "{{cgroup}} usage"),
                Target(f"trainwatch_cgroup_memory_limit_bytes{{{SEL_NODE}}}", "{{cgroup}} limit"),
            ),
            unit="bytes",
            description="The memory cgroups that hold ranks, and those whose limits bind them.",
            extra={"dashed": "limit$"},
        ),
        Panel(
            "Host memory",
            "timeseries",
            (
                Target(f"trainwatch_host_memory_available_bytes{{{SEL_NODE}}}", "{{instance}} available"),
                Target(f"trainwatch_host_memory_total_bytes{{{SEL_NODE}}}", "{{instance}} total"),
            ),
            unit="bytes",
            extra={"dashed": "total$"},
        ),
        Panel(
            "OOM kills",
            "timeseries",
            (
                Target(
                    f"increase(trainwatch_host_oom_kills_total{{{SEL_NODE}}}[$__rate_interval])",
                    "{{instance}} host (kernel)",
                ),
                Target(
                    f"increase(trainwatch_cgroup_oom_kills_total{{{SEL_NODE}}}[$__rate_interval])",
                    "{{cgroup}}",
                ),
            ),
            w=8,
            description="Processes killed by the kernel's OOM killer, on the whole node (/proc/vmstat) "
            "and in each cgroup that holds ranks.",
            extra={"bars": True},
        ),
        Panel(
            "Memory pressure",
            "timeseries",
            (Target(f"trainwatch_host_memory_pressure_ratio{{{SEL_NODE}}}", "{{instance}} {{kind}}"),),
            unit="percentunit",
            w=8,
            description="Share of the last 10 s in which some (or all) tasks waited on memory "
            "(/proc/pressure/memory): reclaim before an OOM.",
        ),
        Panel(
            "/dev/shm",
            "timeseries",
            (
                Target(f"trainwatch_host_shm_used_bytes{{{SEL_NODE}}}", "{{instance}} used"),
                Target(f"trainwatch_host_shm_size_bytes{{{SEL_NODE}}}", "{{instance}} size"),
            ),
            unit="bytes",
            w=8,
            description="DataLoader workers pass batches through /dev/shm; when it fills they die of SIGBUS.",
            extra={"dashed": "size$"},
        ),
        _row("GPUs"),
        Panel(
            "GPU memory per rank",
            "timeseries",
            (
                Target(
                    f"trainwatch_rank_gpu_memory_bytes{{{SEL_RANK}}}",
                    "rank {{rank}} on GPU {{gpu}}",
                ),
            ),
            unit="bytes",
            needs="gpu",
        ),
        Panel(
            "GPU memory per device",
            "timeseries",
            (
                Target(f"trainwatch_gpu_memory_used_bytes{{{SEL_NODE}}}", "{{instance}} GPU {{gpu}} used"),
                Target(f"trainwatch_gpu_memory_total_bytes{{{SEL_NODE}}}", "{{instance}} GPU {{gpu}} total"),
            ),
            unit="bytes",
            needs="gpu",
            extra={"dashed": "total$"},
        ),
        Panel(
            "GPUs lost",
            "state-timeline",
            (Target(f"trainwatch_gpu_lost{{{SEL_NODE}}}", "{{instance}} GPU {{gpu}}"),),
            w=24,
            h=4,
            needs="gpu",
            description="1 when NVML reports the GPU lost (fallen off the bus): the ranks on it die next.",
            extra={"thresholds": [("green", None), ("red", 1)]},
        ),
        _row("Deaths"),
        Panel(
            "Rank deaths",
            "table",
            (
                Target(
                    f"max by (instance, job, rank, restart, killer) "
                    f"(last_over_time({DEATH_TIMES}{{{SEL_JOB}}}[$__range])) * 1000",
                    instant=True,
                    table=True,
                ),
            ),
            w=16,
            description="Every rank death in the range, oldest first over all nodes: the first row is the "
            "job's first death. agent_teardown: stopped by the torchrun agent after another rank failed. "
            "The postmortem is at GET /postmortems on the node (instance); click the job for its story "
            "across nodes.",
            extra={"table_time": True, "job_link": story_link("${__data.fields.job}")},
        ),
        Panel(
            "Deaths by killer",
            "barchart",
            (
                Target(
                    f"sum by (killer) (trainwatch_rank_deaths_total{{{SEL_JOB}}})",
                    "{{killer}}",
                    instant=True,
                    table=True,
                ),
            ),
            w=8,
            description="Rank deaths counted by the daemons since they started, by the killer named "
            "in the postmortem.",
            extra={"xField": "killer"},
        ),
        _row("trainwatch"),
        Panel(
            "Probe success",
            "state-timeline",
            (Target(f"trainwatch_probe_success{{{SEL_NODE}}}", "{{instance}} {{probe}}"),),
            w=12,
            description="1 when the probe's last run succeeded. gpu is 0 on nodes without an NVIDIA driver.",
            extra={"thresholds": [("red", None), ("green", 1)]},
        ),
        Panel(
            "Sample age",
            "timeseries",
            (
                Target(
                    f"time() - trainwatch_last_sample_timestamp_seconds{{{SEL_NODE}}}",
                    "{{instance}}",
                ),
            ),
            unit="s",
            w=6,
            description="Seconds since the last finished sampling round; above a few intervals the "
            "sampler is stalled.",
        ),
        Panel(
            "Sampling cost",
            "timeseries",
            (
                Target(f"trainwatch_sample_duration_seconds{{{SEL_NODE}}}", "{{instance}} round"),
                Target(
                    f"rate(trainwatch_sampler_overruns_total{{{SEL_NODE}}}[$__rate_interval])",
                    "{{instance}} overruns/s",
                ),
                Target(
                    f"trainwatch_probe_duration_seconds{{{SEL_NODE}}}",
                    "{{instance}} {{probe}}",
                ),
            ),
            unit="s",
            w=6,
        ),
    ]


ANNOTATION = Target(
    f"max by (instance, job, rank, restart, killer) "
    f'({DEATH_TIMES}{{{SEL_JOB}, killer!="agent_teardown"}}) * 1000'
)

VARIABLES = {
    "instance": "label_values(trainwatch_build_info, instance)",
    "job": 'label_values(trainwatch_job_info{instance=~"$instance"}, job)',
    "rank": 'label_values(trainwatch_rank_info{instance=~"$instance", job=~"$job"}, rank)',
}
