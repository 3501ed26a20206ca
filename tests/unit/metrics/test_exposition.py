"""The exposition and the HTTP routes, on snapshots of the captured job."""

from __future__ import annotations

import subprocess
import time

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from sidecar.daemon import Daemon
from sidecar.web.server import create_app
from tests.conftest import RANK0
from tests.support.samplers import make_sampler
from tests.support.skips import requires


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


@pytest.fixture
def daemon(proc_tree, tmp_path):
    sampler = make_sampler(proc_tree, tmp_path, gpu="two_gpus")
    d = Daemon(sampler.settings, sampler, watch_deaths=False)
    d.sample_now()
    return d


def test_metrics_exposition(daemon):
    with TestClient(create_app(daemon, manage_daemon=False)) as client:
        r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    m = samples(r.text)
    job = "8d6de2d1"
    assert (
        m[
            (
                "trainwatch_rank_info",
                (
                    ("job", job),
                    ("launcher", "torchrun"),
                    ("local_rank", "0"),
                    ("pid", str(RANK0)),
                    ("rank", "0"),
                    ("restart", "0"),
                ),
            )
        ]
        == 1
    )
    assert m[("trainwatch_rank_resident_memory_bytes", (("job", job), ("rank", "0")))] == 283560 * 1024
    assert m[("trainwatch_rank_gpu_memory_bytes", (("gpu", "0"), ("job", job), ("rank", "0")))] == 2 << 30
    assert m[("trainwatch_gpu_memory_total_bytes", (("gpu", "1"),))] == 143771 << 20
    assert m[("trainwatch_host_memory_total_bytes", ())] == 24683584 * 1024
    assert m[("trainwatch_probe_success", (("probe", "gpu"),))] == 1
    assert ("trainwatch_rank_cpu_seconds_total", (("job", job), ("rank", "1"))) in m
    assert m[("trainwatch_rank_memory_limit_bytes", (("job", job), ("rank", "0")))] == 8192 << 20
    assert m[("trainwatch_cgroup_memory_limit_bytes", (("cgroup", "/process_api"),))] == 8192 << 20
    names = {name for name, _ in m}
    for required in (
        "trainwatch_build_info",
        "trainwatch_rank_tree_resident_memory_bytes",
        "trainwatch_rank_peak_resident_memory_bytes",
        "trainwatch_gpu_memory_used_bytes",
        "trainwatch_cgroup_memory_usage_bytes",
        "trainwatch_cgroup_memory_peak_bytes",
        "trainwatch_cgroup_oom_kills_total",
        "trainwatch_host_memory_available_bytes",
        "trainwatch_host_oom_kills_total",
        "trainwatch_postmortems_written_total",
        "trainwatch_probe_duration_seconds",
        "trainwatch_last_sample_timestamp_seconds",
    ):
        assert required in names, required
    for name, labels in m:
        assert not any(k in ("pid", "hostname", "cmdline") for k, _ in labels) or name.endswith("_info")


def test_openmetrics_on_request(daemon):
    with TestClient(create_app(daemon, manage_daemon=False)) as client:
        r = client.get("/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    assert r.headers["content-type"].startswith("application/openmetrics-text")
    assert r.text.rstrip().endswith("# EOF")


@requires("promtool")
def test_promtool_accepts_the_exposition(daemon):
    with TestClient(create_app(daemon, manage_daemon=False)) as client:
        text = client.get("/metrics").text
    out = subprocess.run(
        ["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_ranks_view(daemon):
    with TestClient(create_app(daemon, manage_daemon=False)) as client:
        body = client.get("/ranks").json()
    (job,) = body["jobs"]
    assert job["job"] == "8d6de2d1" and job["world_size"] == 2
    r0 = job["ranks"][0]
    assert r0["rank"] == 0 and r0["pid"] == RANK0 and r0["tree_processes"] == 3
    assert r0["cgroup"]["limited_by"] == "/process_api" and r0["gpu_memory_bytes"] == {"0": 2 << 30}
    assert body["host"]["total_bytes"] == 24683584 * 1024 and len(body["gpus"]) == 2


def test_healthz_follows_the_sampler(proc_tree, tmp_path):
    sampler = make_sampler(proc_tree, tmp_path)
    d = Daemon(sampler.settings, sampler, watch_deaths=False)
    app = create_app(d, manage_daemon=False)
    with TestClient(app) as client:
        assert client.get("/healthz").status_code == 503  # not started
        d.start()
        deadline = time.monotonic() + 10
        while client.get("/healthz").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client.get("/healthz").json()["status"] == "ok"
        d._last_done = time.monotonic() - 60  # a sampler stuck for a minute
        d.stop()
        assert client.get("/healthz").status_code == 503


def test_scrape_does_not_wait_for_a_slow_sampler(proc_tree, tmp_path):
    """A sampling round that blocks must not block /metrics (it reads the last snapshot)."""
    import threading

    sampler = make_sampler(proc_tree, tmp_path)
    d = Daemon(sampler.settings, sampler, watch_deaths=False)
    d.sample_now()
    gate = threading.Event()
    real = sampler.sample

    def slow(plan):
        gate.wait(5)
        return real(plan)

    sampler.sample = slow  # type: ignore[method-assign]
    d.start()
    try:
        with TestClient(create_app(d, manage_daemon=False)) as client:
            t0 = time.monotonic()
            r = client.get("/metrics")
            assert r.status_code == 200 and time.monotonic() - t0 < 2.0
            assert "trainwatch_rank_info" in r.text
    finally:
        gate.set()
        d.stop()


def _parsed(text: str, openmetrics: bool):
    from prometheus_client.openmetrics.parser import text_string_to_metric_families as om_parse

    parse = om_parse if openmetrics else text_string_to_metric_families
    return sorted(
        (f.name, f.type, f.documentation, s.name, tuple(sorted(s.labels.items())), s.value)
        for f in parse(text)
        for s in f.samples
    )


@pytest.mark.parametrize("openmetrics", [False, True])
def test_fast_renderer_matches_prometheus_client(daemon, openmetrics):
    """Our renderer and prometheus_client's encoders say the same thing, read back by
    prometheus_client's own parsers, escapes included."""
    from prometheus_client import generate_latest
    from prometheus_client.core import GaugeMetricFamily
    from prometheus_client.openmetrics.exposition import generate_latest as om_latest

    from sidecar.metrics.collector import TrainwatchCollector, make_registry
    from sidecar.metrics.exposition import render

    collector = TrainwatchCollector(lambda: daemon.snapshot)
    tricky = GaugeMetricFamily(
        "trainwatch_test_escapes", 'help with \\ and "quotes"\nand a newline', labels=("path",)
    )
    tricky.add_metric(['C:\\dir "x"\nnext'], 0.25)
    tricky.add_metric(["inf"], float("inf"))

    class Both(TrainwatchCollector):
        def collect(self):
            yield from collector.collect()
            yield tricky

    both = Both(lambda: daemon.snapshot)
    ours = render(both.collect(), openmetrics=openmetrics).decode()
    theirs = (om_latest if openmetrics else generate_latest)(make_registry(both)).decode()
    assert _parsed(ours, openmetrics) == _parsed(theirs, openmetrics)


@pytest.mark.parametrize("openmetrics", [False, True])
def test_the_direct_exposition_is_the_rendering_of_the_families(daemon, openmetrics):
    """/metrics writes its text as the families are filled (no prometheus_client objects):
    byte for byte what rendering the collected families gives, on a snapshot with jobs,
    ranks, GPUs, cgroups, and counters with and without labels."""
    from sidecar.metrics.collector import TrainwatchCollector
    from sidecar.metrics.exposition import render
    from sidecar.model.ledger import DeathLedger

    ledger = DeathLedger().counted(("8d6de2d1", "0", 0), "kernel_oom", 1.0e9)
    ledger = ledger.counted(("8d6de2d1", "1", 0), "kernel_oom", 1.1e9)
    collector = TrainwatchCollector(
        lambda: daemon.snapshot,
        deaths=lambda: ledger,
        postmortems=lambda: 3,
        protection=lambda: [("mlock", True)],
        lost=lambda: {"kmsg": 1},
    )
    direct = collector.exposition(openmetrics)
    assert direct == render(collector.collect(), openmetrics=openmetrics)
    assert b"trainwatch_rank_deaths_total{" in direct and b"trainwatch_rank_info{" in direct


def test_the_cgroup_charge_events_and_pressure_families():
    """A v2 cgroup's charge split, working set, memory.events and memory.pressure, as the
    collector exports them (the probe that reads them: tests/unit/probes/test_cgroup.py)."""
    from sidecar.metrics.collector import TrainwatchCollector
    from sidecar.metrics.exposition import render
    from sidecar.model import CgroupSample, MemoryCharge, Snapshot

    cg = CgroupSample(
        "/pod", 2, 1000, 2000, None, 1, 1, charge=MemoryCharge(600, 200, 100, 50, 800, 200),
        events={"high": 4, "max": 2, "oom_kill": 1}, pressure_ratio=(0.25, None),
        pressure_stall_seconds=(1.5, None),
    )  # fmt: skip
    snap = Snapshot(1.0, 1.0, (), None, (), (cg,), {}, 1, 0, 0.0, 0)
    body = render(TrainwatchCollector(lambda: snap).collect(), openmetrics=False)
    got = samples(body.decode() if isinstance(body, bytes) else body)
    for kind, n in {"anon": 600, "file": 200, "shmem": 100, "kernel": 50}.items():
        assert got[("trainwatch_cgroup_memory_charge_bytes", (("cgroup", "/pod"), ("kind", kind)))] == n
    assert got[("trainwatch_cgroup_memory_working_set_bytes", (("cgroup", "/pod"),))] == 800
    assert got[("trainwatch_cgroup_memory_events_total", (("cgroup", "/pod"), ("event", "high")))] == 4
    assert got[("trainwatch_cgroup_memory_pressure_ratio", (("cgroup", "/pod"), ("kind", "some")))] == 0.25
    assert (
        got[("trainwatch_cgroup_memory_pressure_stall_seconds_total", (("cgroup", "/pod"), ("kind", "some")))]
        == 1.5
    )
    assert not any(name == "trainwatch_cgroup_memory_pressure_ratio" and ("kind", "full") in labels
                   for name, labels in got)  # fmt: skip


def test_scrapes_between_rounds_reuse_the_body_and_a_new_round_or_death_renews_it(daemon, monkeypatch):
    from sidecar.metrics.collector import TrainwatchCollector

    calls = []
    real = TrainwatchCollector.exposition
    monkeypatch.setattr(
        TrainwatchCollector,
        "exposition",
        lambda self, openmetrics=False: calls.append(1) or real(self, openmetrics),
    )

    def unclocked(body: str) -> str:
        return "".join(line for line in body.splitlines(True) if "trainwatch_time_seconds" not in line)

    with TestClient(create_app(daemon, manage_daemon=False)) as client:
        first = client.get("/metrics").text
        second = client.get("/metrics").text
        assert unclocked(second) == unclocked(first) and len(calls) == 1  # the same round: not rendered again
        # but every answer carries the daemon's clock at that scrape (story bounds node clocks by it)
        clock = [samples(b)[("trainwatch_time_seconds", ())] for b in (first, second)]
        assert clock[0] <= clock[1] and abs(clock[1] - time.time()) < 60
        om = client.get("/metrics", headers={"Accept": "application/openmetrics-text"}).text
        assert om.endswith("# EOF\n") and len(calls) == 2  # another format is another body
        assert "trainwatch_time_seconds" in om.split("# EOF")[0]
        watch = daemon.deaths.autopsies  # a death between rounds: the worker swaps its ledger
        watch.ledger = watch.ledger.counted(("8d6de2d1", "0", 0), "kernel_oom", time.time())
        m = samples(client.get("/metrics").text)
        assert m[("trainwatch_rank_deaths_total", (("job", "8d6de2d1"), ("killer", "kernel_oom")))] == 1
        assert len(calls) == 3
        before = samples(client.get("/metrics").text)[("trainwatch_samples_total", ())]
        daemon.sample_now()  # a new round
        after = samples(client.get("/metrics").text)[("trainwatch_samples_total", ())]
        assert after == before + 1 and len(calls) == 4


def test_listing_of_one_job_and_the_summary_view(daemon):
    """What ``trainwatch story`` asks each node: one job's postmortems (with the victim's
    pid, time of death and restart), and each without its memory curve."""
    from sidecar.postmortem import make_id
    from tests.support.postmortems import stored_doc

    for n, job in enumerate(("4711", "other", "4711")):
        doc = stored_doc(make_id(1796212414.0 + n, 4356 + n, "1", "node-17"))
        doc.update(job={"key": job, "restart_count": n}, timeline=[{"at": "x"}])
        doc["created_at"] = f"2026-12-02T11:40:2{n}.000+00:00"
        doc["victim"].update(pid=100 + n, died_at=f"2026-12-02T11:40:1{n}.000+00:00")
        daemon.store.put(doc, first=True)
    with TestClient(create_app(daemon, manage_daemon=False)) as client:
        listing = client.get("/postmortems", params={"job": "4711"}).json()
        assert [(e["job"], e["restart"], e["victim"]["pid"]) for e in listing] == [
            ("4711", 2, 102),
            ("4711", 0, 100),
        ]
        assert len(client.get("/postmortems").json()) == 3
        assert client.get("/postmortems", params={"job": "nope"}).json() == []
        ident = listing[0]["id"]
        summary = client.get(f"/postmortems/{ident}", params={"view": "summary"}).json()
        assert "timeline" not in summary and summary["victim"]["pid"] == 102
        assert client.get(f"/postmortems/{ident}").json()["timeline"] == [{"at": "x"}]
        status = client.get("/story", params={"job": "4711"})
        assert status.status_code == 404 and "--prometheus" in status.json()["detail"]
