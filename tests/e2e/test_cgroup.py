"""End to end with a real memory cgroup: a torchrun job runs in a child cgroup without a
limit whose parent has one. trainwatch must name the rank's cgroup, the parent as the
binding level, its limit, and the usage the kernel reports.

Runs on cgroup v1 (this development machine) and on v2 with the memory controller (the
GPU machine); the v2 reader is also tested on fixture trees everywhere."""

from __future__ import annotations

import pytest

from sidecar.front.demo import join_cgroup, memory_cgroup, memory_hierarchy
from tests.support.e2e import DaemonProc, TorchrunJob, value, wait_for
from tests.support.skips import requires

GIB = 1 << 30


HIERARCHY = memory_hierarchy()
pytestmark = [
    pytest.mark.root,
    requires("memcg"),
]


@pytest.fixture
def cgroups():
    with memory_cgroup(3 * GIB, "trainwatch-test") as made:
        yield made


def test_rank_cgroup_limit_and_usage(tmp_path, cgroups):
    version, parent, child = cgroups
    parent_path, child_path = f"/{parent.name}", f"/{parent.name}/job"
    usage_file = child / ("memory.usage_in_bytes" if version == 1 else "memory.current")
    wrap = join_cgroup(child)
    with (
        DaemonProc(tmp_path) as daemon,
        TorchrunJob(tmp_path, "cg", wrap=wrap, hold_mb=300, worker_mb=100, workers=2) as job,
    ):
        job.ready()

        def attached():
            m = daemon.metrics()
            rows = [
                labels
                for labels, _ in m.get("trainwatch_rank_cgroup_info", [])
                if labels["cgroup"] == child_path
            ]
            return (m, rows) if len(rows) == 2 else None

        m, rows = wait_for(attached, 30, "both ranks in the test cgroup")
        key = rows[0]["job"]
        assert all(r["limited_by"] == parent_path for r in rows)
        for rank in ("0", "1"):
            assert value(m, "trainwatch_rank_memory_limit_bytes", job=key, rank=rank) == 3 * GIB
        assert value(m, "trainwatch_cgroup_memory_limit_bytes", cgroup=parent_path) == 3 * GIB
        assert (
            value(m, "trainwatch_cgroup_memory_limit_bytes", cgroup=child_path) is None
        )  # no limit of its own
        usage = value(m, "trainwatch_cgroup_memory_usage_bytes", cgroup=child_path)
        truth = int(usage_file.read_text())
        assert abs(usage - truth) <= 0.1 * truth, (usage, truth)
        # the ranks (2 x 300 MiB) and their workers (4 x 100 MiB) are charged here
        assert usage >= 900 * (1 << 20)
        assert value(m, "trainwatch_cgroup_memory_usage_bytes", cgroup=parent_path) >= usage * 0.95
        assert value(m, "trainwatch_cgroup_oom_kills_total", cgroup=child_path) == 0
        peak = value(m, "trainwatch_cgroup_memory_peak_bytes", cgroup=child_path)
        assert peak >= usage * 0.95

        # the charge split: the ranks' and workers' heaps are anonymous memory. memory.stat is
        # read once a second (every round near a limit), so the split may trail a usage that
        # grows fast by up to a second: wait for a round that read it after the growth
        def split() -> tuple | None:
            m = daemon.metrics()
            anon = value(m, "trainwatch_cgroup_memory_charge_bytes", cgroup=child_path, kind="anon")
            return (m, anon) if anon is not None and anon >= 0.8 * 900 * (1 << 20) else None

        m, _anon = wait_for(split, 10, "the charge split of a detailed round")
        usage = value(m, "trainwatch_cgroup_memory_usage_bytes", cgroup=child_path)
        working = value(m, "trainwatch_cgroup_memory_working_set_bytes", cgroup=child_path)
        assert working is not None and working <= usage * 1.1
        (info,) = [labels for labels, _ in m["trainwatch_cgroup_info"] if labels["cgroup"] == child_path]
        assert info["version"] == str(version) and info["limited_by"] == parent_path

        # PSS and USS of each rank's tree: the workers were forked after the rank took its
        # 300 MiB, so RSS counts those pages three times and PSS once
        def measured() -> dict | None:
            rows = [r for j in daemon.ranks()["jobs"] for r in j["ranks"] if j["job"] == key]
            # measured since the rank took its memory (the first measurement may predate it;
            # the tree's growth brings the next within seconds)
            whole = [r for r in rows if r["tree_processes"] == 3 and (r["tree_pss_bytes"] or 0) >= 500 << 20]
            return {r["label"]: r for r in whole} if len(whole) == 2 else None

        for rank, row in wait_for(measured, 30, "PSS of both ranks' whole trees").items():
            rss, pss, uss = row["tree_rss_bytes"], row["tree_pss_bytes"], row["tree_uss_bytes"]
            assert pss < 0.75 * rss, (rank, rss, pss)
            assert uss < pss, (rank, pss, uss)
        m = daemon.metrics()
        assert value(m, "trainwatch_rank_tree_proportional_memory_bytes", job=key, rank="0")
        assert value(m, "trainwatch_rank_tree_unique_memory_bytes", job=key, rank="0")
        body = daemon.ranks()
        (cg,) = [c for c in body["cgroups"] if c["path"] == child_path]
        assert cg["ancestors"][0] == {"path": parent_path, "limit_bytes": 3 * GIB}
        assert cg["effective_limit_bytes"] == 3 * GIB
        assert job.stop() == 0
        assert daemon.stop() == 0
