"""The observability stack's files: the dashboard is the generator's output and queries
only metrics that exist; promtool accepts the scrape config and the rules and passes their
unit tests; the Kubernetes manifests validate against the Kubernetes schemas; the systemd
unit verifies (the real daemon run with exactly its capabilities is
tests/e2e/test_systemd_unit.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from sidecar import dashboard
from sidecar.metrics.table import METRICS
from tests.support.e2e import REPO
from tests.support.prom import DEPLOY, PROMTOOL
from tests.support.skips import requires

DASHBOARD = REPO / "dashboards" / "trainwatch.json"
KUBE = REPO / "deploy" / "kubernetes"
UNIT = REPO / "deploy" / "systemd" / "trainwatch.service"
GRAFANA_VARS = {"datasource", "instance", "job", "rank", "__rate_interval", "__range"}


def test_the_dashboard_file_is_the_generators_output():
    assert json.loads(DASHBOARD.read_text()) == dashboard.build(), (
        "dashboards/trainwatch.json is stale: python -m sidecar.dashboard > dashboards/trainwatch.json"
    )


def test_every_query_names_known_metrics_and_variables():
    board = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    exprs += [a["expr"] for a in board["annotations"]["list"] if "expr" in a]
    exprs += [v["definition"] for v in board["templating"]["list"] if v["type"] == "query"]
    assert len(exprs) >= 30
    defined = {v["name"] for v in board["templating"]["list"]}
    for expr in exprs:
        names = dashboard.metric_names(expr)
        assert names, expr
        assert names <= set(METRICS), (expr, names - set(METRICS))
        used = set(re.findall(r"\$(\w+)", expr)) - {"1"}
        assert used <= GRAFANA_VARS, (expr, used)
        assert {u for u in used if not u.startswith("__")} <= defined, expr
    # what the issue asks to see at a glance is there
    queried = set().union(*(dashboard.metric_names(e) for e in exprs))
    for name in (
        "trainwatch_rank_resident_memory_bytes",
        "trainwatch_rank_tree_resident_memory_bytes",
        "trainwatch_rank_memory_limit_bytes",
        "trainwatch_cgroup_memory_limit_bytes",
        "trainwatch_host_memory_available_bytes",
        "trainwatch_rank_gpu_memory_bytes",
        "trainwatch_gpu_memory_used_bytes",
        "trainwatch_host_oom_kills_total",
        "trainwatch_cgroup_oom_kills_total",
        "trainwatch_rank_death_timestamp_seconds",
        "trainwatch_rank_deaths_total",
        "trainwatch_host_memory_pressure_ratio",
        "trainwatch_probe_success",
        "trainwatch_last_sample_timestamp_seconds",
    ):
        assert name in queried, name


def test_the_dashboard_imports_as_is():
    board = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    for p in board["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24 and g["w"] > 0 and g["h"] > 0, p["title"]
        if p["type"] != "row":
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
            assert all(t["datasource"]["uid"] == "${datasource}" for t in p["targets"])
    (ds,) = [v for v in board["templating"]["list"] if v["name"] == "datasource"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    # no panel overlaps another
    cells = set()
    for p in board["panels"]:
        g = p["gridPos"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, p["title"]
        cells |= mine


def test_a_panel_on_a_metric_that_does_not_exist_fails_the_build(monkeypatch):
    bad = dashboard.Panel("typo", "timeseries", (dashboard.Target("trainwatch_rank_rss_bytes"),))
    monkeypatch.setattr(dashboard, "panels", lambda: [bad])
    with pytest.raises(ValueError, match="trainwatch_rank_rss_bytes"):
        dashboard.build()


@requires("promtool")
@pytest.mark.parametrize(
    "args",
    [
        ("check", "config", "prometheus.yml"),
        ("check", "rules", "trainwatch-rules.yml"),
        ("test", "rules", "tests/trainwatch-rules.test.yml"),
    ],
    ids=["check-config", "check-rules", "test-rules"],
)
def test_promtool(args):
    r = subprocess.run([PROMTOOL, *args], cwd=DEPLOY, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout + r.stderr


def test_the_scrape_job_keeps_trainwatchs_job_label():
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    assert job["job_name"] == "trainwatch" and job["honor_labels"] is True
    rules = yaml.safe_load((DEPLOY / "trainwatch-rules.yml").read_text())
    names = {r.get("alert") or r.get("record") for g in rules["groups"] for r in g["rules"]}
    tested = (DEPLOY / "tests" / "trainwatch-rules.test.yml").read_text()
    for name in names:  # every rule has a unit test
        assert name in tested, name
    for g in rules["groups"]:
        for r in g["rules"]:
            assert dashboard.metric_names(r["expr"]) <= set(METRICS), r


def _manifests() -> list[tuple[str, dict]]:
    out = []
    for path in sorted(KUBE.glob("*.yaml")):
        out += [(path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return out


@pytest.mark.parametrize("name,doc", _manifests(), ids=lambda v: v if isinstance(v, str) else v["kind"])
def test_kubernetes_manifests_validate(name, doc):
    if doc["apiVersion"] == "monitoring.coreos.com/v1":
        _check_monitor(doc)
        return
    kubernetes_validate.validate(doc, "1.37.0", strict=True)


# The fields of prometheus-operator's PodMonitor and ServiceMonitor (monitoring.coreos.com/v1)
# that these manifests use; the schemas ship only with the operator's CRDs.
_ENDPOINT = {"port", "path", "interval", "honorLabels", "relabelings", "scheme", "scrapeTimeout"}
_ENDPOINT |= {"tlsConfig", "basicAuth"}
_TLS = {"ca", "cert", "keySecret", "serverName", "insecureSkipVerify"}
_MONITOR = {
    "PodMonitor": ("podMetricsEndpoints", {"selector", "namespaceSelector", "podMetricsEndpoints"}),
    "ServiceMonitor": ("endpoints", {"selector", "namespaceSelector", "endpoints"}),
}


def _check_monitor(doc: dict) -> None:
    key, allowed = _MONITOR[doc["kind"]]
    assert set(doc) == {"apiVersion", "kind", "metadata", "spec"}
    assert doc["metadata"]["name"] and set(doc["spec"]) <= allowed
    assert set(doc["spec"]["selector"]) <= {"matchLabels", "matchExpressions"}
    assert set(doc["spec"]["namespaceSelector"]) <= {"any", "matchNames"}
    for ep in doc["spec"][key]:
        assert set(ep) <= _ENDPOINT, ep
        assert ep["port"] == "metrics" and ep["path"] == "/metrics" and ep["honorLabels"] is True
        for rl in ep.get("relabelings", []):
            assert set(rl) <= {"sourceLabels", "targetLabel", "regex", "replacement", "action", "separator"}
        tls = ep.get("tlsConfig", {})
        assert set(tls) <= _TLS, tls
        for ref in [tls[k] for k in ("ca", "cert") if k in tls]:
            (source,) = ref  # a SecretOrConfigMap: one of them
            assert source in ("secret", "configMap") and set(ref[source]) == {"name", "key"}, ref
        for selector in ep.get("basicAuth", {}).values():
            assert set(selector) == {"name", "key"}, selector


def test_the_monitors_select_the_pods_that_serve_metrics():
    docs = {(d["kind"], d["metadata"]["name"]): d for _, d in _manifests()}
    ds = docs[("DaemonSet", "trainwatch")]
    svc = docs[("Service", "trainwatch")]
    sm = docs[("ServiceMonitor", "trainwatch")]
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    (port,) = ds["spec"]["template"]["spec"]["containers"][0]["ports"]
    assert port["name"] == "metrics" and svc["spec"]["ports"][0]["targetPort"] == "metrics"
    assert ds["spec"]["template"]["spec"]["hostPID"] is True
    pod = docs[("Pod", "train-llm")]
    pm = docs[("PodMonitor", "trainwatch-sidecars")]
    assert pm["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert pod["spec"]["shareProcessNamespace"] is True
    (sidecar,) = pod["spec"]["initContainers"]
    assert sidecar["restartPolicy"] == "Always" and sidecar["ports"][0]["name"] == "metrics"
    for c in (sidecar, ds["spec"]["template"]["spec"]["containers"][0]):
        assert "--attach-torchrun" in c["args"] and "0.0.0.0" in c["args"]
        # beyond loopback only with TLS and basic auth, the probes on HTTPS
        assert "--web-config" in c["args"]
        for probe in ("readinessProbe", "livenessProbe"):
            if probe in c:
                assert c[probe]["httpGet"]["scheme"] == "HTTPS" and c[probe]["httpGet"]["path"] == "/healthz"
    for ep in (*sm["spec"]["endpoints"], *pm["spec"]["podMetricsEndpoints"]):
        assert ep["scheme"] == "https" and set(ep["basicAuth"]) == {"username", "password"}, ep


def test_the_dockerfile_installs_this_package_and_runs_the_daemon():
    """The image builds the wheel from the context and installs that wheel (with the web
    extra), as CI's smoke test of the wheel does by running these same lines
    (scripts/wheel-smoke); the context keeps what the wheel is built from."""
    import fnmatch

    text = (REPO / "deploy" / "docker" / "Dockerfile").read_text()
    for line in text.splitlines():
        if line.startswith("COPY") and "--from=" not in line:
            for src in line.split()[1:-1]:
                assert (REPO / src).exists(), src
    stages = text.split("\nFROM ")[1:]
    assert len(stages) == 2, "two stages: build the wheel, install it"
    assert "pip wheel" in stages[0] and "--no-deps" in stages[0]
    assert "COPY --from=" in stages[1] and re.search(
        r"pip install .*trainwatchd-\*\.whl\)?\[web\]", stages[1]
    )
    assert 'ENTRYPOINT ["trainwatch"]' in text and 'CMD ["--attach-torchrun"]' in text
    ignored = [
        p.strip()
        for p in (REPO / ".dockerignore").read_text().splitlines()
        if p.strip() and not p.startswith("#")
    ]
    for needed in ("pyproject.toml", "setup.py", "README.md", "LICENSE", "sidecar"):
        assert not any(fnmatch.fnmatch(needed, p) for p in ignored), needed


@requires("systemd-analyze")
def test_the_systemd_unit_verifies(tmp_path):
    # verify checks that ExecStart exists: point it at this checkout's trainwatch
    exe = Path(sys.executable).parent / "trainwatch"
    text = re.sub(r"^ExecStart=\S+", f"ExecStart={exe}", UNIT.read_text(), flags=re.M)
    unit = tmp_path / "trainwatch.service"
    unit.write_text(text)
    r = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and not r.stderr.strip(), r.stderr
