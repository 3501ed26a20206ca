"""``trainwatch story`` without a job: the clock bounds (property-tested against clocks
with a known offset), the join on the records of real two-node runs
(tests/fixtures/story/, recorded by tests/e2e/test_story.py) and on constructed cases (two
first deaths too close to order, a clock nothing bounds, a postmortem gone, ranks on no
node, restarts), and every way Prometheus or a node can answer badly: garbage, an error,
a hang, a slow drip, a huge or deeply nested body. Each is a one-line error or a gap, in
bounded time, never a traceback or a hang."""

from __future__ import annotations

import copy
import json
import socket
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.story import load_peer_config, parse_window, render_html, render_text, tell
from sidecar.story.clock import SCHEDULING_S, Offset, from_rounds, from_stamps
from sidecar.story.fetch import FetchError, get_json
from sidecar.story.gather import MetricDeath, NodeSeen, RankSeen, Seen
from sidecar.story.join import join
from sidecar.story.prom import PromError, Prometheus, quote
from sidecar.units import go_duration
from tests.support.e2e import REPO
from tests.support.storyfakes import PromAnswers, recorded, reply, server

# -- the clock ---------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(
    offset=st.floats(-3600, 3600),
    scrapes=st.lists(
        st.tuples(
            st.floats(0, 0.5),  # the scrape's duration
            st.floats(0, 1),  # where in it the daemon read its clock (share of the duration)
            st.floats(-1, 1),  # Prometheus's alignment of the timestamp (share of the tolerance)
            st.floats(0, 1),  # its goroutine's wait before timing the scrape (share of the allowance)
        ),
        min_size=1,
        max_size=30,
    ),
    tolerance=st.sampled_from([0.0, 0.002, 0.025]),
)
def test_scrape_stamps_bound_the_true_offset(
    offset: float, scrapes: list[tuple[float, float, float, float]], tolerance: float
) -> None:
    stamps, durations = [], {}
    for i, (d, where, align, wait) in enumerate(scrapes):
        start = 1_800_000_000.0 + 15 * i  # Prometheus's clock when it read the scrape's time
        t = start + align * tolerance  # the timestamp it keeps
        timed = start + wait * SCHEDULING_S  # where scrape_duration_seconds starts
        stamps.append((t, timed + where * d + offset))  # the daemon's clock while answering
        durations[t] = d
    got = from_stamps(stamps, durations, tolerance)
    assert got.known and not got.stepped
    assert got.low is not None and got.high is not None
    assert got.low - 1e-6 <= offset <= got.high + 1e-6
    # and no wider than one scrape allows
    assert got.high - got.low <= min(d for d, *_ in scrapes) + 2 * tolerance + SCHEDULING_S + 3e-6


@settings(max_examples=200, deadline=None)
@given(
    offset=st.floats(-60, 60),
    interval=st.floats(0.1, 5),
    phases=st.lists(st.floats(0, 1), min_size=3, max_size=20),
)
def test_last_rounds_bound_the_true_offset(offset: float, interval: float, phases: list[float]) -> None:
    rounds, durations = [], {}
    for i, phase in enumerate(phases):
        start = 1_800_000_000.0 + 15 * i
        answered = start + 0.004
        finished = answered - phase * interval  # the last round finished at most an interval before
        rounds.append((start, finished + offset))
        durations[start] = 0.004
    # rounds every interval: their finishing times are a multiple of it apart
    got = from_rounds(rounds, durations, 0.0)
    assert got.low is not None and got.high is not None
    assert got.low - 1e-6 <= offset <= got.high + 1e-6


def test_scrapes_that_disagree_say_the_clock_moved() -> None:
    stamps = [(100.0, 100.001), (115.0, 125.0)]  # the node's clock jumped 10 s between them
    got = from_stamps(stamps, {100.0: 0.002, 115.0: 0.002}, 0.0)
    assert got.stepped and got.low is not None and got.high is not None
    assert got.low <= 0.001 and got.high >= 10.0
    assert from_stamps([], {}).as_dict()["offset_seconds"] is None


def test_go_durations_and_promql_strings() -> None:
    assert go_duration("2ms") == pytest.approx(0.002)
    assert go_duration("1m30s") == 90
    assert go_duration("0s") == 0
    assert go_duration("2 ms") is None and go_duration("") is None and go_duration("5") is None
    assert quote('a"b\\c\nd') == '"a\\"b\\\\c\\nd"'
    assert parse_window("6h") == 21600 and parse_window("1d") == 86400 and parse_window("90") == 90
    for bad in ("0s", "1x", "", "-5m", "500d"):
        with pytest.raises(ValueError):
            parse_window(bad)


# -- the join on real runs ---------------------------------------------------------------


def test_the_recorded_two_node_run_starts_on_node_b() -> None:
    seen = recorded("two-nodes-seen.json")
    doc = join(seen)
    b = next(d.instance for d in seen.deaths if d.killer == "cgroup_oom")
    first = doc["first_death"]
    assert (first["instance"], first["killer"]["kind"], first["ordered"]) == (b, "cgroup_oom", True)
    (doc_b,) = seen.nodes[b].docs
    assert first["killer"] == doc_b["killer"] and first["postmortem"] == doc_b["id"]
    assert first["rank"] == doc_b["victim"]["rank"] and first["pid"] == doc_b["victim"]["pid"]
    fates = {(r["instance"], r["rank"]): r["fate"] for r in doc["ranks"]}
    assert len(fates) == 4 and "unknown" not in fates.values()
    assert list(fates.values()).count("root_cause") == 1
    # node A's ranks: one whose gloo collective failed (its postmortem says it only reported a
    # peer's failure), and the one its agent stopped
    a = next(i for i in seen.nodes if i != b)
    assert sorted(f for (i, _), f in fates.items() if i == a) == ["collective_failure", "terminated_by_agent"]
    (doc_a,) = seen.nodes[a].docs
    assert doc_a["killer"].get("peer_failure") is True
    deaths = [e for e in doc["chain"] if e["event"] == "death"]
    assert deaths[0]["fate"] == "root_cause" and [e["at"] for e in deaths] == sorted(e["at"] for e in deaths)
    assert doc["gaps"] == [] and all(n["reachable"] for n in doc["nodes"])
    assert all(c["offset_seconds"]["low"] <= 0 <= c["offset_seconds"]["high"] for c in doc["clock"])
    text, page = render_text(doc), render_html(doc)
    assert f"First death: rank {first['rank']} on" in text and "collective_failure" in text
    assert "<svg" in page and "cgroup_oom" in page


def test_the_recorded_run_without_node_a_says_what_it_missed() -> None:
    seen = recorded("node-a-daemon-stopped-seen.json")
    doc = join(seen)
    a = next(i for i, n in seen.nodes.items() if n.error is not None)
    assert doc["first_death"]["killer"]["kind"] == "cgroup_oom" and doc["first_death"]["instance"] != a
    assert all(r["fate"] == "unknown" for r in doc["ranks"] if r["instance"] == a)
    gaps = " ".join(doc["gaps"])
    assert f"The daemon of {a} could not be read" in gaps and "before the first death" in gaps
    assert any(e["event"] == "daemon_gone" and e["instance"] == a for e in doc["chain"])


# -- constructed cases ---------------------------------------------------------------------


def node(
    instance: str,
    docs: list[dict[str, Any]] | None = None,
    offset: tuple[float, float] | None = (0, 0.002),
    **kw: Any,
) -> NodeSeen:
    off = Offset(*offset, 10, "trainwatch_time_seconds") if offset else Offset(None, None, 0, "none")
    return NodeSeen(instance, url=f"http://{instance}", health="up", docs=docs or [], offset=off, **kw)


def pm(
    ident: str, victim: int, kind: str, ranks: list[tuple[int, str, float | None]], **killer: Any
) -> dict[str, Any]:
    """A node postmortem: ``ranks`` (rank, fate, time of death)."""
    from sidecar.postmortem.document import iso

    return {
        "schema": "trainwatch.postmortem/v1",
        "id": ident,
        "host": ident.split("-")[1],
        "job": {"key": "j", "restart_count": 0, "world_size": 8},
        "victim": {"rank": victim, "pid": 100 + victim},
        "killer": {"kind": kind, "confidence": "certain", "summary": "s", "evidence": [], **killer},
        "ranks": [
            {"rank": r, "pid": 100 + r, "fate": f, "died_at": iso(t), "exit_code": -9} for r, f, t in ranks
        ],
    }


T = 1_800_000_000.0


def test_two_own_deaths_closer_than_the_clocks_are_not_ordered() -> None:
    seen = Seen(
        "j",
        3600,
        T + 60,
        "http://p",
        [
            MetricDeath("a:1", "0", 0, "kernel_oom", T + 0.010),
            MetricDeath("b:1", "4", 0, "segfault", T + 0.012),
        ],
        [],
        {"a:1": node("a:1", offset=(-0.02, 0.02)), "b:1": node("b:1", offset=(-0.02, 0.02))},
    )
    doc = join(seen)
    assert doc["first_death"]["ordered"] is False
    assert any("cannot be told apart in time" in g for g in doc["gaps"])
    # with tight clocks, the same 2 ms apart are ordered
    for n in seen.nodes.values():
        n.offset = Offset(0.0, 0.0002, 10, "trainwatch_time_seconds")
    doc = join(seen)
    assert doc["first_death"]["ordered"] is True and doc["first_death"]["rank"] == 0


def test_an_own_death_starts_the_story_before_an_earlier_clocked_report() -> None:
    """A collective failure on node A clocked before node B's OOM kill (a skewed or wide
    clock) is still what followed: only an own death can start the story."""
    a = pm(
        "n-a-1",
        0,
        "python_exception",
        [(0, "root_cause", T + 1.0), (1, "terminated_by_agent", T + 1.1)],
        peer_failure=True,
    )
    b = pm("n-b-1", 4, "cgroup_oom", [(4, "root_cause", T + 1.2), (5, "terminated_by_agent", T + 1.3)])
    seen = Seen("j", 3600, T + 60, "http://p", [], [], {"a:1": node("a:1", [a]), "b:1": node("b:1", [b])})
    doc = join(seen)
    assert (doc["first_death"]["instance"], doc["first_death"]["rank"]) == ("b:1", 4)
    fates = {(r["instance"], r["rank"]): r["fate"] for r in doc["ranks"]}
    assert fates == {
        ("a:1", 0): "collective_failure",
        ("a:1", 1): "terminated_by_agent",
        ("b:1", 4): "root_cause",
        ("b:1", 5): "terminated_by_agent",
    }
    # ranks 2, 3, 6, 7 of the world of 8 are on no node this Prometheus scrapes
    assert any("Ranks 2, 3, 6, 7 of the world of 8" in g for g in doc["gaps"])


def test_a_death_whose_postmortem_is_gone_and_a_clock_not_bounded_are_gaps() -> None:
    seen = Seen(
        "j",
        3600,
        T + 60,
        "http://p",
        [MetricDeath("a:1", "0", 0, "cgroup_oom", T)],
        [],
        {"a:1": node("a:1", offset=None)},
    )
    doc = join(seen)
    assert doc["first_death"]["killer"]["confidence"] is None  # Prometheus's label alone
    assert doc["first_death"]["uncertainty_seconds"] is None
    gaps = " ".join(doc["gaps"])
    assert "no longer has a postmortem" in gaps and "Nothing bounds the clock" in gaps
    assert "clock not bounded" in render_text(doc)


def test_the_latest_attempt_is_the_story_and_earlier_ones_are_listed() -> None:
    seen = Seen(
        "j",
        3600,
        T + 60,
        "http://p",
        [
            MetricDeath("a:1", "1", 0, "segfault", T),
            MetricDeath("a:1", "0", 0, "agent_teardown", T + 0.5),
            MetricDeath("a:1", "1", 1, "cuda_oom", T + 100),
        ],
        [RankSeen("a:1", "0", "0", "10", 1), RankSeen("a:1", "1", "1", "11", 1)],
        {"a:1": node("a:1")},
    )
    doc = join(seen)
    assert doc["restart"] == 1 and doc["first_death"]["killer"]["kind"] == "cuda_oom"
    assert doc["earlier_attempts"] == [
        {
            "restart": 0,
            "instance": "a:1",
            "rank": 1,
            "kind": "segfault",
            "at": doc["earlier_attempts"][0]["at"],
        }
    ]
    assert {r["rank"]: r["fate"] for r in doc["ranks"]} == {0: "unknown", 1: "root_cause"}


def test_hostile_postmortem_fields_are_ignored_and_escaped() -> None:
    evil = pm("n-x-1", 0, "<script>alert(1)</script>", [(0, "root_cause", T)])
    evil["ranks"] += [None, {"rank": {"x": 1}}, {"rank": 1, "died_at": 5}, "str"]
    evil["warnings"] = [{"at": "not a time"}, 7]
    evil["host"] = "<img src=x onerror=alert(1)>"
    seen = Seen("j", 3600, T + 60, "http://p", [], [], {"x:1": node("x:1", [evil])})
    doc = join(seen)
    page = render_html(doc)
    assert "<script>" not in page and "<img" not in page and "&lt;script&gt;" in page


# -- hostile servers -----------------------------------------------------------------------


def hang(h: BaseHTTPRequestHandler) -> None:
    time.sleep(30)


def drip(h: BaseHTTPRequestHandler) -> None:
    h.send_response(200)
    h.end_headers()
    for _ in range(60):
        h.wfile.write(b" ")
        h.wfile.flush()
        time.sleep(0.5)


def endless(h: BaseHTTPRequestHandler) -> None:
    h.send_response(200)
    h.end_headers()
    chunk = b"[" * 65536
    for _ in range(10_000):
        h.wfile.write(chunk)


BAD = {
    "garbage": reply(b"<html>not the API</html>"),
    "error": reply(b'{"status":"error","error":"boom"}', 500),
    "refused query": reply(b'{"status":"error","errorType":"bad_data","error":"parse error"}', 400),
    "wrong shape": reply(
        b'{"status":"success","data":{"resultType":"vector","result":[{"metric":{"a":1}}]}}'
    ),
    "deep": reply(b"[" * 200_000 + b"]" * 200_000),
    "hang": hang,
    "drip": drip,
    "endless": endless,
}


@pytest.mark.parametrize("kind", list(BAD))
def test_a_bad_prometheus_is_one_line_and_exit_2_in_bounded_time(kind: str) -> None:
    with server(BAD[kind]) as url:
        t0 = time.monotonic()
        out = subprocess.run(
            [sys.executable, "-m", "sidecar", "story", "--prometheus", url, "--timeout", "1"],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=REPO,
        )
        took = time.monotonic() - t0
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("trainwatch: error: ") and "Prometheus" in lines[0], lines
    assert "Traceback" not in out.stderr and out.stdout == ""
    assert took < 30, f"{kind}: {took:.1f} s"  # a hang guard: the deadline is 5 s a request


def test_an_unreachable_prometheus_and_bad_options_are_one_line() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there
    for args, says in (
        (["--prometheus", f"http://127.0.0.1:{port}"], "cannot be asked"),
        (["--prometheus", "ftp://x"], "expected an http(s) URL"),
        ([], "--prometheus URL is needed"),
        (["--prometheus", "http://x:1", "--window", "forever"], "--window"),
        (["--prometheus", "http://x:1", "--timeout", "0"], "--timeout"),
    ):
        out = subprocess.run(
            [sys.executable, "-m", "sidecar", "story", *args],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=REPO,
            env={"PATH": "/usr/bin:/bin"},
        )
        assert out.returncode == 2 and says in out.stderr and len(out.stderr.strip().splitlines()) == 1, out


@pytest.mark.parametrize("kind", ["garbage", "deep", "hang", "drip", "endless", "not a postmortem"])
def test_a_bad_node_is_a_gap_never_a_hang(kind: str) -> None:
    """Prometheus answers well (served from the recorded two-node run); node B's daemon
    answers badly: the story still comes, with B's trouble in ``gaps``."""
    seen = recorded("two-nodes-seen.json")
    good_a, bad_b = sorted(seen.nodes, key=lambda i: seen.nodes[i].docs[0]["killer"]["kind"] == "cgroup_oom")
    docs = {d["id"]: d for d in seen.nodes[good_a].docs}
    not_pm = reply(json.dumps([{"id": "20261205T051013Z-vm-1-r2", "job": seen.job}]).encode())

    def good(h: BaseHTTPRequestHandler) -> None:
        if h.path.startswith("/postmortems?"):
            return reply(json.dumps([{"id": i, "job": seen.job} for i in docs]).encode())(h)
        return reply(json.dumps(docs[h.path.rsplit("/", 1)[1]]).encode())(h)

    def bad(h: BaseHTTPRequestHandler) -> None:
        if kind == "not a postmortem":
            if h.path.startswith("/postmortems?"):
                return not_pm(h)
            return reply(b'{"schema": "something/else"}')(h)
        return BAD[kind](h)

    with server(good) as a_url, server(bad) as b_url:
        prom = PromAnswers.from_seen(seen, {good_a: a_url, bad_b: b_url})
        with server(prom.handle) as p_url:
            t0 = time.monotonic()
            doc = tell(p_url, seen.job, timeout=1.0)
            took = time.monotonic() - t0
    b_inst = b_url.removeprefix("http://")
    nodes = {n["instance"]: n for n in doc["nodes"]}
    gaps = " ".join(doc["gaps"])
    assert b_inst in gaps, gaps
    if kind == "not a postmortem":
        assert nodes[b_inst]["reachable"] and "not a trainwatch.postmortem/v1 document" in gaps
    else:
        assert not nodes[b_inst]["reachable"] and "could not be read" in gaps
    assert doc["first_death"]["instance"] == b_inst  # Prometheus's series still name it
    assert took < 20, f"{kind}: {took:.1f} s"  # a hang guard: a node has 2 s in all here


# -- credentials ---------------------------------------------------------------------------


def test_peer_config_is_checked_whole_and_never_shows_its_password(tmp_path: Path) -> None:
    from sidecar.errors import ConfigError

    (tmp_path / "pass").write_text("s3cret\n")
    good = tmp_path / "peers.yml"
    good.write_text(
        "basic_auth: {username: story, password_file: pass}\n"
        "prometheus:\n  basic_auth: {username: p, password: q}\n"
    )
    peers = load_peer_config(str(good))
    assert peers.nodes.headers()["Authorization"].startswith("Basic ")
    assert peers.nodes.password == "s3cret" and "s3cret" not in repr(peers)
    assert peers.prometheus.username == "p"
    for text, says in (
        ("basic_auth: {username: a, pasword: b}\n", "unknown key 'pasword'"),
        ("tls_conifg: {}\n", "unknown key 'tls_conifg'"),
        ("tls_config: {ca_file: nope.crt}\n", "no such file"),
        ("tls_config: {cert_file: pass}\n", "both cert_file and key_file"),
        ("tls_config: {insecure_skip_verify: maybe}\n", "true or false"),
        ("- a list\n", "must be a mapping"),
        ("basic_auth: [\n", "not YAML"),
    ):
        bad = tmp_path / "bad.yml"
        bad.write_text(text)
        with pytest.raises(ConfigError, match=says.replace("(", r"\(")):
            load_peer_config(str(bad))


def test_credentials_reach_a_node_that_asks_for_them() -> None:
    from sidecar.story.fetch import ClientConfig

    def guarded(h: BaseHTTPRequestHandler) -> None:
        if h.headers.get("Authorization") != "Basic c3Rvcnk6czNjcmV0":  # story:s3cret
            return reply(b'{"detail":"no"}', 401)(h)
        return reply(b"[]")(h)

    with server(guarded) as url:
        with pytest.raises(FetchError, match="401: credentials refused"):
            get_json(url + "/postmortems", timeout=2, limit=1000)
        assert (
            get_json(url + "/postmortems", timeout=2, limit=1000, config=ClientConfig("story", "s3cret"))
            == []
        )


def test_prometheus_answers_are_parsed_strictly() -> None:
    ok = {
        "status": "success",
        "data": {
            "resultType": "matrix",
            "result": [{"metric": {"instance": "a"}, "values": [[2.0, "5"], [1.0, "NaN"], [0.5, "3"]]}],
        },
    }
    with server(reply(json.dumps(ok).encode())) as url:
        (s,) = Prometheus(url).query("x[1m]")
    assert s.samples == ((0.5, 3.0), (2.0, 5.0))  # NaN dropped, oldest first
    weird = copy.deepcopy(ok)
    weird["data"]["result"][0]["values"] = [[1.0, True]]
    with server(reply(json.dumps(weird).encode())) as url, pytest.raises(PromError, match="not a number"):
        Prometheus(url).query("x[1m]")


def test_story_route_answers_503_when_prometheus_cannot_be_asked_and_reuses_answers() -> None:
    from sidecar.web.server import StoryRoute

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there
    route = StoryRoute(f"http://127.0.0.1:{port}", None)
    status, doc = route.answer("4711")
    assert status == 503 and "cannot be asked" in doc["detail"]
    assert route.answer("x" * 300)[0] == 400
    assert StoryRoute(None, None).answer("4711")[0] == 404
    seen = recorded("two-nodes-seen.json")
    calls: list[str] = []
    prom = PromAnswers.from_seen(seen, {i: "http://127.0.0.1:9" for i in seen.nodes})

    def counted(h: Any) -> None:
        calls.append(h.path)
        prom.handle(h)

    with server(counted) as url:
        route = StoryRoute(url, None)
        first = route.answer(seen.job)
        asked = len(calls)
        assert first[0] == 200 and route.answer(seen.job) == first and len(calls) == asked  # reused
