"""End to end: real torchrun jobs (gloo on CPU) watched by the real daemon.

Each rank holds memory and has two worker children holding memory of their own, like a
DataLoader. The figures trainwatch exports are checked against /proc read at the same
moment.
"""

from __future__ import annotations

import shutil
import signal
import subprocess

import pytest

from tests.support.e2e import DaemonProc, TorchrunJob, parse_metrics, value, vm_rss, wait_for

MIB = 1 << 20


def job_keys(samples) -> dict[str, str]:
    """agent pid -> job label, from trainwatch_job_info."""
    return {labels["agent_pid"]: labels["job"] for labels, _ in samples.get("trainwatch_job_info", [])}


def ranks_of(samples, job: str) -> dict[str, dict[str, str]]:
    return {
        labels["rank"]: labels
        for labels, _ in samples.get("trainwatch_rank_info", [])
        if labels["job"] == job
    }


def test_two_concurrent_jobs_rss_trees_and_cleanup(tmp_path):
    with (
        DaemonProc(tmp_path) as daemon,
        TorchrunJob(tmp_path, "a", hold_mb=300, worker_mb=120, workers=2) as job_a,
        TorchrunJob(tmp_path, "b", hold_mb=150, worker_mb=60, workers=2) as job_b,
    ):
        pids_a, pids_b = job_a.ready(), job_b.ready()

        def both_attached():
            m = daemon.metrics()
            keys = job_keys(m)
            a, b = keys.get(str(job_a.agent_pid)), keys.get(str(job_b.agent_pid))
            if a and b and len(ranks_of(m, a)) == 2 and len(ranks_of(m, b)) == 2:
                return m, a, b
            return None

        m, key_a, key_b = wait_for(both_attached, 30, "both jobs with two ranks each")
        assert key_a != key_b
        daemon.wait_sampled(job_a, pids_a)  # the tree sums include every settled worker
        daemon.wait_sampled(job_b, pids_b)
        m = daemon.metrics()
        for key, pids in ((key_a, pids_a), (key_b, pids_b)):
            info = ranks_of(m, key)
            for rank, (rank_pid, *workers) in pids.items():
                labels = info[str(rank)]
                assert (
                    labels["pid"] == str(rank_pid)
                    and labels["local_rank"] == str(rank)
                    and labels["restart"] == "0"
                )
                rss = value(m, "trainwatch_rank_resident_memory_bytes", job=key, rank=str(rank))
                truth = vm_rss(rank_pid)
                assert abs(rss - truth) <= 0.03 * truth, (rss, truth)
                tree = value(m, "trainwatch_rank_tree_resident_memory_bytes", job=key, rank=str(rank))
                tree_truth = truth + sum(vm_rss(w) for w in workers)
                assert abs(tree - tree_truth) <= 0.03 * tree_truth, (tree, tree_truth)
                assert tree - rss >= 0.9 * sum(vm_rss(w) for w in workers)
                assert value(m, "trainwatch_rank_tree_processes", job=key, rank=str(rank)) == 1 + len(workers)
                peak = value(m, "trainwatch_rank_peak_resident_memory_bytes", job=key, rank=str(rank))
                assert peak >= rss * 0.99
                assert value(m, "trainwatch_rank_cpu_seconds_total", job=key, rank=str(rank)) > 0
        # the workers hold what they were told to (RSS of a forked child also counts the
        # pages it shares with the rank, so this is a lower bound)
        for rank, (_, *workers) in pids_a.items():
            tree = value(m, "trainwatch_rank_tree_resident_memory_bytes", job=key_a, rank=str(rank))
            rss = value(m, "trainwatch_rank_resident_memory_bytes", job=key_a, rank=str(rank))
            assert tree - rss >= len(workers) * 120 * MIB

        assert job_a.stop() == 0

        def a_gone():
            m = daemon.metrics()
            return m if not ranks_of(m, key_a) and str(job_a.agent_pid) not in job_keys(m) else None

        m = wait_for(a_gone, 15, "job a's series to disappear")
        assert value(m, "trainwatch_rank_resident_memory_bytes", job=key_a, rank="0") is None
        assert len(ranks_of(m, key_b)) == 2
        body = daemon.ranks()
        assert [j["job"] for j in body["jobs"]] == [key_b]
        assert job_b.stop() == 0
        log = daemon.log()
        assert (
            f"job {key_a}: attached rank 0" in log
            and f"job {key_a}: agent pid {job_a.agent_pid} exited" in log
        )
        assert daemon.stop() == 0


def test_only_the_named_agent_with_pid(tmp_path):
    with (
        TorchrunJob(tmp_path, "a", hold_mb=50, workers=1) as job_a,
        TorchrunJob(tmp_path, "b", hold_mb=50, workers=1) as job_b,
    ):
        job_a.ready(), job_b.ready()
        with DaemonProc(tmp_path, "--pid", str(job_a.agent_pid)) as daemon:
            m = wait_for(
                lambda: (
                    lambda m: m if len(ranks_of(m, job_keys(m).get(str(job_a.agent_pid), "?"))) == 2 else None
                )(daemon.metrics()),
                30,
                "job a attached",
            )
            daemon.wait_rounds(5)  # rounds enough to have found job b, were it watched
            m = daemon.metrics()
            assert list(job_keys(m)) == [str(job_a.agent_pid)]
            assert daemon.stop(signal.SIGINT) == 0


def test_elastic_restart_is_followed(tmp_path):
    with (
        DaemonProc(tmp_path) as daemon,
        TorchrunJob(tmp_path, "r", max_restarts=1, hold_mb=80, workers=1, fail_rank=1, fail_after=3) as job,
    ):
        first = job.ready(0)
        key = wait_for(lambda: job_keys(daemon.metrics()).get(str(job.agent_pid)), 30, "the job attached")
        second = job.ready(1)
        assert {r: p[0] for r, p in first.items()} != {r: p[0] for r, p in second.items()}

        def restarted():
            m = daemon.metrics()
            info = ranks_of(m, key)
            if len(info) == 2 and all(i["restart"] == "1" for i in info.values()):
                return m, info
            return None

        m, info = wait_for(restarted, 30, "both ranks of the second attempt")
        assert job_keys(m)[str(job.agent_pid)] == key  # same job label across the restart
        assert {r: int(i["pid"]) for r, i in info.items()} == {str(r): p[0] for r, p in second.items()}
        assert value(m, "trainwatch_job_restarts", job=key) == 1
        assert len(m["trainwatch_rank_resident_memory_bytes"]) == 2  # old generation's series are gone
        assert job.stop() == 0
        assert f"job {key}: restart 1" in daemon.log()


def test_daemon_started_after_the_job_and_health(tmp_path):
    with TorchrunJob(tmp_path, "late", hold_mb=50, workers=0) as job:
        pids = job.ready()
        with DaemonProc(tmp_path, interval=0.1) as daemon:
            m = wait_for(
                lambda: (lambda m: m if m.get("trainwatch_rank_info") else None)(daemon.metrics()),
                20,
                "ranks",
            )
            seen = {int(labels["pid"]) for labels, _ in m["trainwatch_rank_info"]}
            assert seen == {p[0] for p in pids.values()}
            status, body = daemon.get("/healthz")
            assert status == 200 and '"ok"' in body
            assert value(m, "trainwatch_probe_success", probe="gpu") in (0.0, 1.0)
            assert value(m, "trainwatch_probe_success", probe="proc") == 1.0
            daemon.wait_rounds(5)  # the sampler goes on (its schedule: test_daemon_loop, fake clock)
            om_status, om = daemon.get("/metrics", {"Accept": "application/openmetrics-text; version=1.0.0"})
            assert om_status == 200 and om.rstrip().endswith("# EOF")
            text = daemon.get("/metrics")[1]
            parse_metrics(text)
            if shutil.which("promtool"):
                out = subprocess.run(
                    ["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
                )
                assert out.returncode == 0, out.stdout + out.stderr
            assert daemon.stop() == 0
            assert "stopped" in daemon.log()


@pytest.mark.parametrize("launcher", ["run", "launch"])
def test_other_launch_forms(tmp_path, launcher):
    """``python -m torch.distributed.run`` and the deprecated ``torch.distributed.launch``
    are the same agent under another command line."""
    with (
        DaemonProc(tmp_path) as daemon,
        TorchrunJob(tmp_path, launcher, launcher=launcher, hold_mb=50, workers=1) as job,
    ):
        pids = job.ready()

        def attached():
            m = daemon.metrics()
            key = job_keys(m).get(str(job.agent_pid))
            return (key, ranks_of(m, key)) if key and len(ranks_of(m, key)) == 2 else None

        _, info = wait_for(attached, 30, f"the {launcher} job attached")
        assert {r: int(i["pid"]) for r, i in info.items()} == {str(r): p[0] for r, p in pids.items()}
        assert job.stop() == 0
        assert daemon.stop() == 0
