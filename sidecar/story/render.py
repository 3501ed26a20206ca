"""The story as text (a terminal, an issue) and as HTML (a browser, the dashboard's link):
the first death and its killer, the chain of events across nodes in order, every rank's
fate, the nodes, their clocks and what could not be seen. Every string in a story came
from other machines' daemons: the HTML escapes all of it and loads nothing."""

from __future__ import annotations

import html
from typing import Any

from sidecar.postmortem.document import epoch_of
from sidecar.postmortem.html import FATE_COLORS, PAGE_STYLE

__all__ = ["render_html", "render_text"]

STORY_FATE_COLORS = {**FATE_COLORS, "collective_failure": "#8e44ad"}


def _e(x: Any) -> str:
    return html.escape("" if x is None else str(x), quote=True)


def _clock(at: Any) -> str:
    """HH:MM:SS.mmm of an ISO time (the date is in the header)."""
    return at[11:23] if isinstance(at, str) and len(at) >= 23 else str(at or "?")


def _pm(u: Any) -> str:
    if not isinstance(u, (int, float)):
        return " (clock not bounded)"
    return f" ±{u * 1000:.0f} ms" if u < 1 else f" ±{u:.1f} s"


def _node(doc: dict[str, Any], instance: Any) -> str:
    for n in doc.get("nodes") or []:
        if isinstance(n, dict) and n.get("instance") == instance and n.get("hostname"):
            return f"{n['hostname']} ({instance})" if n["hostname"] != instance else str(instance)
    return str(instance)


def render_text(doc: dict[str, Any]) -> str:
    first = doc.get("first_death") or {}
    killer = first.get("killer") or {}
    out = [
        f"trainwatch story of job {doc.get('job')} (restart {doc.get('restart')}; "
        f"asked {doc.get('asked_at')})",
        "",
        str(doc.get("summary") or ""),
        "",
        f"First death: rank {first.get('rank')} on {_node(doc, first.get('instance'))}, "
        f"pid {first.get('pid')}, at {first.get('at')}{_pm(first.get('uncertainty_seconds'))}"
        + ("" if first.get("ordered", True) else " (too close to another death to order: see gaps)"),
        f"  {killer.get('kind')} ({killer.get('confidence') or 'confidence not known'}): "
        f"{killer.get('summary')}",
    ]
    for e in (killer.get("evidence") or [])[:6]:
        if isinstance(e, dict):
            out.append(f"    [{e.get('source')}] {str(e.get('detail'))[:200]}")
    if first.get("postmortem"):
        out.append(f"  node postmortem: {first['postmortem']}")
    out += ["", "Across nodes, in order (Prometheus's clock):"]
    for ev in doc.get("chain") or []:
        rank = f"rank {ev.get('rank')}" if ev.get("rank") is not None else "-"
        out.append(
            f"  {_clock(ev.get('at'))}{_pm(ev.get('uncertainty_seconds')):>9}  {ev.get('instance')!s:<22} "
            f"{rank:<8} {ev.get('detail')}"
        )
    out += ["", f"{'rank':>6}  {'node':<22} {'fate':<20} {'kind':<19} died"]
    for r in doc.get("ranks") or []:
        out.append(
            f"{r.get('rank')!s:>6}  {r.get('instance')!s:<22} {r.get('fate')!s:<20} "
            f"{r.get('kind') or '-'!s:<19} "
            f"{_clock(r.get('died')) if r.get('died') else '-'}"
        )
    out += ["", "Nodes:"]
    clocks = {c.get("instance"): c for c in doc.get("clock") or [] if isinstance(c, dict)}
    for n in doc.get("nodes") or []:
        c = clocks.get(n.get("instance")) or {}
        off = c.get("offset_seconds")
        clock = (
            f"clock offset {off['low'] * 1000:+.1f}..{off['high'] * 1000:+.1f} ms "
            f"({c.get('samples')} scrapes)"
            if isinstance(off, dict)
            else "clock not bounded"
        )
        state = "daemon answered" if n.get("reachable") else f"daemon not read: {n.get('error')}"
        pms = ", ".join(n.get("postmortems") or []) or "no postmortem"
        out.append(f"  {_node(doc, n.get('instance'))}: {state}; {pms}; {clock}")
    if doc.get("gaps"):
        out += ["", "What this story could not see:"]
        out += [f"  - {g}" for g in doc["gaps"]]
    for a in doc.get("earlier_attempts") or []:
        out.append(
            f"Earlier attempt {a.get('restart')}: rank {a.get('rank')} on {a.get('instance')} died first "
            f"({a.get('kind')}) at {a.get('at')}"
        )
    return "\n".join(out) + "\n"


def _lanes(doc: dict[str, Any]) -> str:
    """An SVG timeline: one lane per node, a mark per event, the first death in red."""
    events = [e for e in doc.get("chain") or [] if isinstance(e, dict) and epoch_of(e.get("at")) is not None]
    if not events:
        return ""
    nodes = [n.get("instance") for n in doc.get("nodes") or [] if isinstance(n, dict)]
    for e in events:
        if e.get("instance") not in nodes:
            nodes.append(e.get("instance"))
    times = [epoch_of(e["at"]) or 0.0 for e in events]
    t0, t1 = min(times), max(times)
    span = max(t1 - t0, 1e-3)
    left, width, lane = 220, 820, 34
    height = lane * len(nodes) + 40

    def x(t: float) -> float:
        return left + (t - t0) / span * (width - 20)

    parts = []
    for i, inst in enumerate(nodes):
        y = 20 + i * lane + lane / 2
        parts.append(f"<text x='4' y='{y + 4:.0f}' class='lg'>{_e(_node(doc, inst))[:40]}</text>")
        parts.append(f"<line x1='{left}' x2='{left + width - 20}' y1='{y:.0f}' y2='{y:.0f}' stroke='#ddd'/>")
    for e, t in zip(events, times, strict=True):
        y = 20 + nodes.index(e.get("instance")) * lane + lane / 2
        color = STORY_FATE_COLORS.get(
            str(e.get("fate")), "#e67e22" if e.get("event") == "warning" else "#777"
        )
        u = e.get("uncertainty_seconds")
        if isinstance(u, (int, float)) and u > 0:
            w = max(u / span * (width - 20), 1.0)
            parts.append(
                f"<rect x='{x(t) - w:.1f}' y='{y - 7:.0f}' width='{2 * w:.1f}' height='14' "
                f"fill='{color}' opacity='0.2'/>"
            )
        parts.append(
            f"<circle cx='{x(t):.1f}' cy='{y:.0f}' r='5' fill='{color}'><title>{_e(e.get('at'))} rank "
            f"{_e(e.get('rank'))}: {_e(e.get('detail'))}</title></circle>"
        )
    scale = f"{span * 1000:.0f} ms" if span < 2 else f"{span:.1f} s"
    parts.append(f"<text x='{left}' y='{height - 6}' class='ax'>{_e(_clock(events[0].get('at')))}</text>")
    parts.append(f"<text x='{left + width - 120}' y='{height - 6}' class='ax'>+{_e(scale)}</text>")
    return f"<svg width='{left + width}' height='{height}' role='img'>{''.join(parts)}</svg>"


def render_html(doc: dict[str, Any]) -> str:
    first = doc.get("first_death") or {}
    k = first.get("killer") or {}
    chain = "".join(
        f"<tr><td>{_e(_clock(e.get('at')))}"
        f"<span class='muted'>{_e(_pm(e.get('uncertainty_seconds')))}</span></td>"
        f"<td>{_e(_node(doc, e.get('instance')))}</td><td>{_e(e.get('rank'))}</td>"
        f"<td>{_e(e.get('detail'))}</td></tr>"
        for e in doc.get("chain") or []
        if isinstance(e, dict)
    )
    ranks = "".join(
        f"<tr><td>{_e(r.get('rank'))}</td><td>{_e(_node(doc, r.get('instance')))}</td>"
        f"<td>{_e(r.get('pid'))}</td><td><span class='fate' "
        f"style='background:{STORY_FATE_COLORS.get(str(r.get('fate')), '#999')}'>"
        f"{_e(r.get('fate'))}</span></td>"
        f"<td>{_e(r.get('kind'))}</td><td>{_e(r.get('died'))}</td><td>{_e(r.get('postmortem'))}</td></tr>"
        for r in doc.get("ranks") or []
        if isinstance(r, dict)
    )
    evidence = "".join(
        f"<tr><td>{_e(e.get('source'))}</td><td>{_e(e.get('at'))}</td><td><code>{_e(e.get('detail'))}</code></td></tr>"
        for e in k.get("evidence") or []
        if isinstance(e, dict)
    )
    gaps = "".join(f"<li>{_e(g)}</li>" for g in doc.get("gaps") or [])
    nodes = "".join(
        f"<tr><td>{_e(_node(doc, n.get('instance')))}</td>"
        f"<td>{'yes' if n.get('reachable') else 'no: ' + _e(n.get('error'))}</td>"
        f"<td>{_e(', '.join(n.get('postmortems') or []))}</td></tr>"
        for n in doc.get("nodes") or []
        if isinstance(n, dict)
    )
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'">
<title>story of job {_e(doc.get("job"))}: {_e(k.get("kind"))}</title>
<style>
{PAGE_STYLE}
</style></head><body>
<h1>job {_e(doc.get("job"))}: <span class="kind">{_e(k.get("kind"))}</span>
<span class="muted">({_e(k.get("confidence") or "confidence not known")})</span></h1>
<div class="muted">first death: rank {_e(first.get("rank"))} on {_e(_node(doc, first.get("instance")))},
 pid {_e(first.get("pid"))},
 {_e(first.get("at"))}{_e(_pm(first.get("uncertainty_seconds")))} · restart {_e(doc.get("restart"))}
 · node postmortem {_e(first.get("postmortem"))}</div>
<p class="summary">{_e(doc.get("summary"))}</p>
<p>{_e(k.get("summary"))}</p>
<h2>Across nodes</h2>
{_lanes(doc)}
<table><tr><th>at (Prometheus's clock)</th><th>node</th><th>rank</th><th>what</th></tr>{chain}</table>
{f"<h2>What this story could not see</h2><ul>{gaps}</ul>" if gaps else ""}
<h2>Evidence of the first death</h2>
<table><tr><th>source</th><th>at</th><th>detail</th></tr>{evidence}</table>
<h2>Ranks</h2><table><tr><th>rank</th><th>node</th><th>pid</th><th>fate</th><th>kind</th><th>died</th>
<th>postmortem</th></tr>{ranks}</table>
<h2>Nodes</h2><table><tr><th>node</th><th>daemon read</th><th>postmortems</th></tr>{nodes}</table>
<p class="muted">trainwatch story · schema {_e(doc.get("schema"))} · from {_e(doc.get("prometheus"))}</p>
</body></html>
"""
