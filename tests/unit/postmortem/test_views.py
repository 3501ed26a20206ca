"""The postmortem's views agree with their numbers: the text view's sparklines end at the
death, marked, with the values beside them read from the same points; the HTML chart's
axes fall on round sizes and round seconds before the death."""

from __future__ import annotations

import itertools
import re

from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.postmortem import render_text
from sidecar.postmortem.html import byte_ticks, render_html, second_ticks, tick_label

MIB, GIB = 2**20, 2**30


def _doc(died_s: int = 30, after: int = 10) -> dict:
    def at(s: int) -> str:
        return f"2026-12-03T10:00:{s:02d}.000+00:00"

    grow = [int(1.5 * GIB * s / died_s) for s in range(died_s + 1)]
    timeline = [
        {"at": at(s), "rss_bytes": {"1": v}, "cgroup_charge_bytes": {"anon": v, "file": 0}}
        for s, v in enumerate(grow)
    ]
    # sampled after the kill: the memory is freed (what the curve must not end on)
    timeline += [
        {"at": at(died_s + k), "rss_bytes": {"1": 0}, "cgroup_charge_bytes": {"anon": 0, "file": 0}}
        for k in range(1, after + 1)
    ]
    return {
        "schema": "trainwatch.postmortem/v1",
        "id": "x",
        "victim": {"rank": 1, "pid": 5, "died_at": at(died_s)},
        "killer": {"kind": "cgroup_oom", "confidence": "certain", "summary": "s", "evidence": []},
        "ranks": [{"rank": 1, "pid": 5, "fate": "root_cause", "died_at": at(died_s), "signal": "SIGKILL"}],
        # read at the death, a little after the last sample
        "memory": {"cgroup": {"limit_bytes": int(1.6 * GIB), "charge": {"anon_bytes": int(1.6 * GIB)}}},
        "timeline": timeline,
    }


def test_sparklines_end_at_the_death_and_agree_with_their_numbers() -> None:
    text = render_text(_doc())
    rss = text.split("rank 1 RSS over the last")[1].splitlines()
    assert rss[0].strip().endswith("(max 1.5 GiB, at death 1.5 GiB):"), rss[0]
    assert rss[1].strip().endswith("█✕"), rss[1]  # the top of the curve, then the kill
    anon = next(line for line in text.splitlines() if line.strip().startswith("anon ") and "->" in line)
    assert "█✕" in anon and anon.strip().endswith("0 B -> 1.6 GiB"), anon  # as "made of" says
    assert "made of: anon 1.6 GiB" in text
    # without a time of death (a hand-made document), no mark and every point
    doc = _doc()
    doc["victim"]["died_at"] = None
    assert "✕" not in render_text(doc)


def test_the_chart_axes_fall_on_round_values() -> None:
    page = render_html(_doc())
    labels = re.findall(r"class='ax'>([^<]+)</text>", page)
    sizes = [x for x in labels if x == "0" or x.endswith("iB")]
    seconds = [x for x in labels if x.endswith(" s") or x == "death"]
    assert sizes == ["0", "512 MiB", "1 GiB", "1.5 GiB", "2 GiB"], sizes
    assert seconds == ["-30 s", "-20 s", "-10 s", "death", "+10 s"], seconds


@settings(max_examples=300, deadline=None)
@given(top=st.floats(1, 2**50))
def test_byte_ticks_cover_the_top_in_at_most_five_round_steps(top: float) -> None:
    ticks = byte_ticks(top)
    assert ticks[0] == 0 and ticks[-1] >= top and 2 <= len(ticks) <= 6
    step = ticks[1]
    assert all(b - a == step for a, b in itertools.pairwise(ticks))
    for v in ticks:  # every label a round number of its unit
        assert re.fullmatch(r"0|\d+ MiB|\d+(\.(25|5|75))? GiB", tick_label(v)), tick_label(v)


@settings(max_examples=200, deadline=None)
@given(before=st.floats(0, 86400), after=st.floats(0, 3600))
def test_second_ticks_are_round_and_within_the_window(before: float, after: float) -> None:
    ticks = second_ticks(-before, after)
    assert all(-before - 1e-6 <= t <= after + 1e-6 for t in ticks) and len(ticks) <= 7
    assert 0 in ticks  # the death (the reference) is always marked
    steps = {round(b - a, 6) for a, b in itertools.pairwise(ticks)}
    assert len(steps) <= 1 and all(float(s).is_integer() for s in steps)


def test_the_curves_end_at_the_kernels_kill_not_at_the_exit_seen_after_it() -> None:
    """Between the kernel's kill and the exit the daemon hears, a sample can show the memory
    already freed: the curve ends at the kill record's time."""
    doc = _doc()
    kill = {"source": "kmsg", "at": "2026-12-03T10:00:29.000+00:00", "detail": "Killed"}
    doc["killer"]["evidence"] = [kill]
    doc["timeline"][30]["rss_bytes"]["1"] = 0  # sampled at the exit, after the kill
    doc["timeline"][30]["cgroup_charge_bytes"]["anon"] = 0
    text = render_text(doc)
    rss = text.split("rank 1 RSS over the last")[1].splitlines()
    assert "at death 1.4 GiB" in rss[0] and rss[1].strip().endswith("█✕"), rss
