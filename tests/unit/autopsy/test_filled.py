"""What filled the limit (sidecar/autopsy/filled.py) on charges and curves of known shape, the
advice it selects, and how the text view tells a warning. The real deaths that produce each
class are in tests/e2e/test_foresight.py."""

from __future__ import annotations

import json
from datetime import datetime

import pytest

from sidecar.autopsy.advice import advice
from sidecar.autopsy.evidence import RankState, Verdict
from sidecar.autopsy.filled import Filling, what_filled
from sidecar.model import Confidence, Kind, MemoryCharge, TimelinePoint
from sidecar.postmortem.html import render_html
from sidecar.postmortem.text import render_text
from tests.support.paths import DEVICE_H200

MIB = 2**20
GIB = 2**30
FIXTURES = DEVICE_H200


def _charge(anon: int = 0, file: int = 0, shmem: int = 0, kernel: int = 50 * MIB) -> MemoryCharge:
    return MemoryCharge(anon, file, shmem, kernel, anon + shmem + kernel, file // 2)


def _points(rss: dict[str, list[int]], children: dict[str, list[int]] | None = None) -> list[TimelinePoint]:
    n = len(next(iter(rss.values())))
    children = children or {k: [0] * n for k in rss}
    return [
        TimelinePoint(
            at=1000.0 + i,
            host_available_bytes=None,
            cgroup_usage_bytes=None,
            rss_bytes={k: v[i] for k, v in rss.items()},
            tree_rss_bytes={k: v[i] + children[k][i] for k, v in rss.items()},
            gpu_memory_bytes={},
        )
        for i in range(n)
    ]


def test_shmem_that_holds_most_of_the_charge_filled_it() -> None:
    f = what_filled(_charge(anon=1 * GIB, shmem=3 * GIB), 1, [])
    assert f is not None and f.kind == "shmem" and f.part_bytes == 3 * GIB


@pytest.mark.parametrize(("version", "expected"), [(1, "page_cache"), (2, None)])
def test_page_cache_fills_only_a_v1_limit(version: int, expected: str | None) -> None:
    f = what_filled(_charge(anon=1 * GIB, file=3 * GIB), version, [])
    assert (f.kind if f else None) == expected


def test_one_rank_that_grew_alone_is_the_leak() -> None:
    flat = [1 * GIB] * 60
    leaky = [1 * GIB + 50 * MIB * i for i in range(60)]
    f = what_filled(_charge(anon=5 * GIB), 1, _points({"0": flat, "1": leaky, "2": flat}))
    assert f is not None and f.kind == "one_rank" and f.rank == "1"
    assert f.rate_bytes_per_second == pytest.approx(50 * MIB)
    assert f.grown_bytes == 59 * 50 * MIB


def test_ranks_that_grew_alike_each_hold_a_copy() -> None:
    ramp = [100 * MIB + 35 * MIB * i for i in range(60)]
    f = what_filled(_charge(anon=5 * GIB), 1, _points({str(r): ramp for r in range(4)}))
    assert f is not None and f.kind == "every_rank" and set(f.held) == {"0", "1", "2", "3"}


def test_growth_in_the_workers_is_named_as_theirs() -> None:
    flat = [1 * GIB] * 60
    workers = [200 * MIB + 30 * MIB * i for i in range(60)]
    f = what_filled(_charge(anon=4 * GIB), 1, _points({"0": flat, "1": flat}, {"0": workers, "1": workers}))
    assert f is not None and f.kind == "workers" and f.grown_bytes == 2 * 59 * 30 * MIB


def test_nothing_is_named_without_growth_or_a_dominant_part() -> None:
    flat = [2 * GIB] * 60
    assert what_filled(_charge(anon=4 * GIB, file=1 * GIB), 1, _points({"0": flat, "1": flat})) is None
    assert what_filled(None, None, []) is None


def _verdict(kind: Kind) -> Verdict:
    return Verdict(RankState("3", 3, 3, 42), kind, Confidence.CERTAIN, "s", (), {})


def test_the_advice_is_chosen_by_what_filled_the_limit() -> None:
    v = _verdict(Kind.CGROUP_OOM)
    tips = advice(
        v,
        [],
        filling=Filling(
            "one_rank", rank="3", grown_bytes=4 * GIB, rate_bytes_per_second=80 * MIB, seconds=50
        ),
    )
    assert tips[0].startswith("Rank 3 alone grew, by 4.0 GiB in 50 s at 80 MiB/s")
    # flat over its last stretch (the rate rounds to nothing): said without one
    flat = Filling("one_rank", rank="1", grown_bytes=3 * GIB, rate_bytes_per_second=100 * 1024, seconds=52)
    tips = advice(v, [], filling=flat)
    assert tips[0].startswith("Rank 1 alone grew, by 3.0 GiB in 52 s, while"), tips[0]
    half = Filling("one_rank", rank="1", grown_bytes=3 * GIB, rate_bytes_per_second=2**19, seconds=52)
    assert "0 MiB/s" not in advice(v, [], filling=half)[0]  # rounds to nothing: unsaid
    tips = advice(v, [], filling=Filling("shmem", part_bytes=3 * GIB, total_bytes=4 * GIB))
    assert tips[0].startswith("Shared memory filled the limit: 3.0 GiB of the 4.0 GiB")
    # not an OOM: what filled the memory is not the story
    crash = _verdict(Kind.SEGFAULT)
    assert not any("Shared memory" in t for t in advice(crash, [], filling=Filling("shmem")))


def test_the_text_view_times_a_warning_from_the_death() -> None:
    doc = {
        "id": "x",
        "victim": {"rank": 1, "pid": 5, "died_at": "2026-12-03T10:00:41.000+00:00"},
        "killer": {"kind": "cgroup_oom", "confidence": "certain", "summary": "s"},
        "warnings": [
            {
                "at": "2026-12-03T10:00:00.000+00:00",
                "rank": 1,
                "exhaustion_seconds": 38.0,
                "rate_bytes_per_second": 52 * MIB,
                "limit": {"kind": "cgroup", "path": "/job", "limit_bytes": 6 * GIB},
            }
        ],
        "timeline": [
            {
                "at": f"2026-12-03T10:00:{s:02d}.000+00:00",
                "cgroup_charge_bytes": {"anon": s * 100 * MIB, "file": 0},
            }
            for s in range(40)
        ],
    }
    text = render_text(doc)
    assert (
        "predicted at T-41 s: 38 s left; rank 1 growing, the limit of cgroup /job (6.0 GiB) "
        "filling at 52.0 MiB/s" in text
    )
    assert "cgroup charge over the last 39 s:" in text and "anon" in text
    assert "page cache" not in text.split("cgroup charge")[1]  # a part that was never there is left out


def test_the_rank_the_kill_took_counts_up_to_its_last_sample() -> None:
    """The samples after the kill no longer have the victim: its growth is still its own."""
    flat = [1 * GIB] * 60
    leaky = [1 * GIB + 50 * MIB * i for i in range(60)]
    points = _points({"0": flat, "1": leaky})
    points.append(TimelinePoint(1060.0, None, None, {"0": GIB}, {"0": GIB}, {}))
    f = what_filled(None, None, points)
    assert f is not None and f.kind == "one_rank" and f.rank == "1"


def test_copy_on_access_is_seen_in_the_workers_uss_not_their_rss() -> None:
    """RSS flat (the pages were mapped before, shared), the charge and the workers' USS grow."""
    points = _points({"0": [1 * GIB] * 30}, {"0": [2 * GIB] * 30})
    points = [
        TimelinePoint(p.at, None, None, p.rss_bytes, p.tree_rss_bytes, {},
                      {"anon": 3 * GIB + 40 * MIB * i, "file": 0, "shmem": 0},
                      {"0": 100 * MIB + 40 * MIB * i})
        for i, p in enumerate(points)
    ]  # fmt: skip
    f = what_filled(_charge(anon=4 * GIB), 1, points)
    assert f is not None and f.kind == "workers" and f.grown_bytes == 29 * 40 * MIB
    assert advice(_verdict(Kind.CGROUP_OOM), [], filling=f)[0].startswith(
        "The ranks' child processes (DataLoader workers) grew by 1.1 GiB of memory of their own (USS) in 29 s"
    )


def test_workers_uss_measured_long_before_the_kill_leaves_it_to_their_rss() -> None:
    """A loaded node measured the workers' USS last 20 s before the kill, before most of
    their growth: that measurement cannot speak for it, and the workers' RSS does (here it
    grew too: fresh allocations, not copy-on-access)."""
    n = 40
    points = _points({"0": [1 * GIB] * n}, {"0": [1 * GIB + 40 * MIB * i for i in range(n)]})
    points = [
        TimelinePoint(p.at, None, None, p.rss_bytes, p.tree_rss_bytes, {},
                      {"anon": 3 * GIB + 40 * MIB * i, "file": 0, "shmem": 0},
                      {"0": 100 * MIB + 40 * MIB * min(i, 5)})  # measured until 20 s in, then no more
        for i, p in enumerate(points)
    ]  # fmt: skip
    f = what_filled(_charge(anon=4 * GIB), 1, points)
    assert f is not None and f.kind == "workers" and f.grown_bytes == (n - 1) * 40 * MIB, f


def test_a_real_v2_leak_was_warned_before_the_kill_and_charged_to_anon() -> None:
    """The cgroup v2 run on the GPU machine (tests/fixtures/device-h200/foresight-v2-leak.*):
    the warning precedes the kill by most of the leak's life, the charge at the kill is
    anon, and the advice names the one rank that grew."""
    doc = json.loads((FIXTURES / "foresight-v2-leak.postmortem.json").read_text())
    cg = doc["memory"]["cgroup"]
    assert (doc["killer"]["kind"], doc["killer"]["confidence"], cg["version"]) == ("cgroup_oom", "certain", 2)
    assert cg["charge"]["anon_bytes"] > 0.95 * cg["usage_bytes_at_death"]
    (w,) = doc["warnings"]
    kill = min(
        datetime.fromisoformat(e["at"]).timestamp()
        for e in doc["killer"]["evidence"]
        if e["source"] == "kmsg"
    )
    lead = kill - datetime.fromisoformat(w["at"]).timestamp()
    assert lead > 30 and abs(w["exhaustion_seconds"] / lead - 1) < 0.25, (lead, w)
    assert any(a.startswith("Rank 1 alone grew") for a in doc["advice"])
    log = (FIXTURES / "foresight-v2-leak.daemon.log").read_text()
    assert "WARNING sidecar.foresight: memory: rank 1 of job" in log
    text = render_text(doc)
    assert "warned before the death:" in text and "cgroup charge over the last" in text


def test_the_html_chart_draws_the_charge_split_and_marks_the_warning() -> None:
    doc = json.loads((FIXTURES / "foresight-v2-leak.postmortem.json").read_text())
    page = render_html(doc)
    assert "cgroup anon" in page  # the charge split is a series of its own
    assert "⚠ rank 1:" in page and "Warned before the death" in page
