"""The postmortem as one self-contained HTML page: the verdict at the top, an inline SVG
chart of the last minutes (each rank's RSS solid and tree RSS dashed, the cgroup's usage
and limit, host available memory, a marker at each death), then the evidence, the
ranks' fates, memory and advice. No scripts, no external assets: a Content-Security-
Policy forbids loading anything, so the page shows the same on an air-gapped node.
"""

from __future__ import annotations

import html
import math
from typing import Any

from sidecar.model import Fate
from sidecar.postmortem.document import epoch_of
from sidecar.units import GIB, MIB, gib_or_mib

__all__ = ["render_html"]

COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22")
FATE_COLORS: dict[str, str] = {
    Fate.ROOT_CAUSE: "#c0392b",
    Fate.SAME_CAUSE: "#e67e22",
    Fate.TERMINATED_BY_AGENT: "#7f8c8d",
    Fate.EXITED_CLEANLY: "#27ae60",
    Fate.RUNNING: "#2980b9",
    Fate.STRANDED: "#e67e22",
    Fate.UNKNOWN: "#95a5a6",
}
W, H, PAD_L, PAD_R, PAD_T, PAD_B = 960, 360, 70, 200, 20, 40
CHARGE_SERIES = (
    ("anon", "anon", "#8e44ad"),
    ("shmem", "shmem", "#16a085"),
    ("page cache", "file", "#7f8c8d"),
)


# The pages' look, one for both: the postmortem's and trainwatch story's (story/render.py)
PAGE_STYLE = """\
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px;color:#222;max-width:1100px}
h1{font-size:22px;margin:0 0 4px} .kind{color:#c0392b} .muted{color:#777} code{font-size:12px}
.summary{font-size:17px;margin:8px 0 16px} table{border-collapse:collapse;margin:8px 0 18px}
td,th{border-bottom:1px solid #eee;padding:4px 10px;text-align:left;vertical-align:top}
.fate{color:#fff;border-radius:3px;padding:1px 6px;font-size:12px} .ax{font-size:11px;fill:#666}
.lg{font-size:11px} h2{font-size:15px;margin:18px 0 4px} h3{font-size:13px;margin:10px 0 2px}
pre{font-size:12px;background:#f6f6f6;padding:6px;overflow-x:auto}"""


# round steps for the memory axis: MiB below a GiB, then quarters, halves and wholes of GiB
_BYTE_STEPS = [m * MIB for m in (1, 2, 5, 10, 20, 25, 50, 100)] + [
    int(g * GIB) for g in (0.25, 0.5, 1, 2, 2.5, 5, 10, 20, 25, 50, 100, 200, 250, 500, 1000)
]
_SECOND_STEPS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600)


def byte_ticks(top: float, most: int = 5) -> list[int]:
    """Round values from 0 up to (and past) ``top``: at most ``most`` steps of one of
    ``_BYTE_STEPS`` (0, 512 MiB, 1 GiB, 1.5 GiB ... not 0, 415, 829 MiB)."""
    step = next(
        (s for s in _BYTE_STEPS if top / s <= most),
        _BYTE_STEPS[-1] * (1 + int(top // (_BYTE_STEPS[-1] * most))),
    )
    n = max(1, math.ceil(top / step - 1e-9))
    return [k * step for k in range(n + 1)]


def tick_label(v: float) -> str:
    """A round byte value as people say it: 768 MiB, 1 GiB, 1.25 GiB."""

    def num(x: float) -> str:
        return f"{x:.2f}".rstrip("0").rstrip(".")

    if v >= GIB:
        return f"{num(v / GIB)} GiB"
    return f"{num(v / MIB)} MiB" if v else "0"


def second_ticks(lo: float, hi: float, most: int = 5) -> list[float]:
    """Round offsets in seconds from a reference (the death) between ``lo`` and ``hi``
    (-30, -20, -10, 0, +10 ...), at most ``most`` steps of one of ``_SECOND_STEPS``."""
    span = max(hi - lo, 1e-9)
    step = next((s for s in _SECOND_STEPS if span / s <= most), _SECOND_STEPS[-1] * (1 + int(span // 18000)))
    first, last = math.ceil(lo / step - 1e-9), math.floor(hi / step + 1e-9)
    return [float(k * step) for k in range(first, last + 1)]


def _e(value: Any) -> str:
    return html.escape("" if value is None else str(value))


def _chart(doc: dict[str, Any]) -> str:
    points = [(t, p) for p in doc.get("timeline") or [] if (t := epoch_of(p.get("at"))) is not None]
    deaths = [(r, t) for r in doc.get("ranks") or [] if (t := epoch_of(r.get("died_at"))) is not None]
    if not points:
        return "<p class='muted'>No samples were recorded before the death.</p>"
    cg = (doc.get("memory") or {}).get("cgroup") or {}
    limit = cg.get("limit_bytes") if isinstance(cg.get("limit_bytes"), int) else None
    series: list[tuple[str, str, str, list[tuple[float, float]]]] = []  # label, color, dash, points
    labels = sorted({k for _, p in points for k in (p.get("rss_bytes") or {})}, key=lambda x: (len(x), x))
    for i, label in enumerate(labels):
        color = COLORS[i % len(COLORS)]
        series.append(
            (
                f"rank {label} RSS",
                color,
                "",
                [(t, p["rss_bytes"][label]) for t, p in points if label in (p.get("rss_bytes") or {})],
            )
        )
        series.append(
            (
                f"rank {label} tree",
                color,
                "5,4",
                [
                    (t, p["tree_rss_bytes"][label])
                    for t, p in points
                    if label in (p.get("tree_rss_bytes") or {})
                ],
            )
        )
    usage = [(t, p["cgroup_usage_bytes"]) for t, p in points if isinstance(p.get("cgroup_usage_bytes"), int)]
    if usage:
        series.append(("cgroup usage", "#000000", "2,3", usage))
    for name, key, color in CHARGE_SERIES:  # what the usage was made of (memory.stat)
        part = [
            (t, p["cgroup_charge_bytes"][key])
            for t, p in points
            if isinstance(p.get("cgroup_charge_bytes"), dict)
            and isinstance(p["cgroup_charge_bytes"].get(key), int)
        ]
        if part and max(v for _, v in part) >= 2**20:
            series.append((f"cgroup {name}", color, "1,2", part))
    warned = [(w, t) for w in doc.get("warnings") or [] if (t := epoch_of(w.get("at"))) is not None]
    avail = [
        (t, p["host_available_bytes"]) for t, p in points if isinstance(p.get("host_available_bytes"), int)
    ]
    t0 = min([t for t, _ in points] + [t for _, t in warned])
    t1 = max([t for t, _ in points] + [t for _, t in deaths])
    t1 = t1 if t1 > t0 else t0 + 1
    ticks = byte_ticks(
        float(max([v for _, _, _, pts in series for _, v in pts] + ([limit] if limit else []) + [1]))
    )
    top = float(ticks[-1])

    def x(t: float) -> float:
        return PAD_L + (t - t0) / (t1 - t0) * (W - PAD_L - PAD_R)

    def y(v: float) -> float:
        return PAD_T + (1 - v / top) * (H - PAD_T - PAD_B)

    out = [
        f"<svg xmlns='http://www.w3.org/2000/svg' viewBox='0 0 {W} {H}' width='{W}' height='{H}' role='img' "
        f"aria-label='memory before death'>",
        f"<rect x='0' y='0' width='{W}' height='{H}' fill='#fff'/>",
    ]
    for v in ticks:  # horizontal grid at round sizes
        out.append(f"<line x1='{PAD_L}' x2='{W - PAD_R}' y1='{y(v):.1f}' y2='{y(v):.1f}' stroke='#eee'/>")
        out.append(
            f"<text x='{PAD_L - 6}' y='{y(v) + 4:.1f}' text-anchor='end' class='ax'>{tick_label(v)}</text>"
        )
    died = epoch_of((doc.get("victim") or {}).get("died_at"))
    ref = died if died is not None and t0 <= died <= t1 else t1
    for off in second_ticks(t0 - ref, t1 - ref):  # round seconds from the death (or the end)
        label = ("death" if died is not None and ref == died else "0 s") if off == 0 else f"{off:+g} s"
        out.append(
            f"<text x='{x(ref + off):.1f}' y='{H - 18}' text-anchor='middle' class='ax'>{label}</text>"
        )
    if limit:
        out.append(
            f"<line x1='{PAD_L}' x2='{W - PAD_R}' y1='{y(limit):.1f}' y2='{y(limit):.1f}' stroke='#c0392b' "
            f"stroke-width='2' stroke-dasharray='8,4'/>"
        )
        out.append(
            f"<text x='{PAD_L + 4}' y='{y(limit) - 5:.1f}' class='lg' fill='#c0392b'>cgroup limit "
            f"{gib_or_mib(limit)}</text>"
        )
    if avail:
        scale = max(v for _, v in avail)
        line = " ".join(f"{x(t):.1f},{PAD_T + (1 - v / scale) * (H - PAD_T - PAD_B):.1f}" for t, v in avail)
        out.append(f"<polyline points='{line}' fill='none' stroke='#bbb' stroke-width='1.5'/>")
    for _, color, dash, pts in series:
        if pts:
            coords = " ".join(f"{x(t):.1f},{y(v):.1f}" for t, v in pts)
            out.append(
                f"<polyline points='{coords}' fill='none' stroke='{color}' stroke-width='2'"
                + (f" stroke-dasharray='{dash}'" if dash else "")
                + "/>"
            )
    for i, (r, t) in enumerate(sorted(deaths, key=lambda d: d[1])):
        color = FATE_COLORS.get(r.get("fate"), "#555")
        out.append(
            f"<line x1='{x(t):.1f}' x2='{x(t):.1f}' y1='{PAD_T}' y2='{H - PAD_B}' stroke='{color}' "
            f"stroke-width='1.5'/>"
        )
        out.append(
            f"<text x='{x(t) - 3:.1f}' y='{H - PAD_B - 6 - 14 * i}' text-anchor='end' class='lg' "
            f"fill='{color}'>✕ rank {_e(r.get('rank'))} {_e(r.get('signal') or r.get('exit_code'))}</text>"
        )
    for w, t in warned:  # foresight's warnings: each episode's first, and the news after it
        out.append(
            f"<line x1='{x(t):.1f}' x2='{x(t):.1f}' y1='{PAD_T}' y2='{H - PAD_B}' stroke='#d4a017' "
            f"stroke-width='1.5' stroke-dasharray='4,3'/>"
        )
        out.append(
            f"<text x='{x(t) + 3:.1f}' y='{PAD_T + 12}' class='lg' fill='#b8860b'>⚠ rank {_e(w.get('rank'))}: "
            f"{_e(w.get('exhaustion_seconds'))} s left</text>"
        )
    legend_y = PAD_T + 30
    entries = [(label, color, dash) for label, color, dash, _ in series] + (
        [("host available (own scale)", "#bbb", "")] if avail else []
    )
    for i, (label, color, dash) in enumerate(entries[:14]):
        ly = legend_y + i * 16
        out.append(
            f"<line x1='{W - PAD_R + 6}' x2='{W - PAD_R + 26}' y1='{ly}' y2='{ly}' stroke='{color}' "
            f"stroke-width='2'" + (f" stroke-dasharray='{dash}'" if dash else "") + "/>"
        )
        out.append(f"<text x='{W - PAD_R + 30}' y='{ly + 4}' class='lg'>{_e(label)}</text>")
    out.append("</svg>")
    return "".join(out)


def render_html(doc: dict[str, Any]) -> str:
    k, v = doc.get("killer") or {}, doc.get("victim") or {}
    mem, job = doc.get("memory") or {}, doc.get("job") or {}
    rows = "".join(
        f"<tr><td>{_e(r.get('rank'))}</td><td>{_e(r.get('pid'))}</td>"
        f"<td><span class='fate' style='background:{FATE_COLORS.get(r.get('fate'), '#999')}'>{_e(r.get('fate'))}"
        f"</span></td><td>{_e(r.get('exit_code'))}</td><td>{_e(r.get('signal'))}</td>"
        f"<td>{gib_or_mib(r['rss_bytes']) if isinstance(r.get('rss_bytes'), int) else ''}</td>"
        f"<td>{gib_or_mib(r['peak_rss_bytes']) if isinstance(r.get('peak_rss_bytes'), int) else ''}</td>"
        f"<td>{gib_or_mib(r['tree_rss_bytes']) if isinstance(r.get('tree_rss_bytes'), int) else ''}</td>"
        f"<td>{_e(r.get('died_at'))}</td></tr>"
        for r in doc.get("ranks") or []
    )
    evidence = "".join(
        f"<tr><td>{_e(e.get('source'))}</td><td>{_e(e.get('at'))}</td><td><code>{_e(e.get('detail'))}"
        "</code></td></tr>"
        for e in k.get("evidence") or []
    )
    advice = "".join(f"<li>{_e(a)}</li>" for a in doc.get("advice") or [])
    warnings = "".join(
        f"<li>{_e(w.get('at'))}: rank {_e(w.get('rank'))} would reach the "
        f"{_e((w.get('limit') or {}).get('kind'))} limit {_e((w.get('limit') or {}).get('path') or '')} in "
        f"{_e(w.get('exhaustion_seconds'))} s</li>"
        for w in doc.get("warnings") or []
    )
    stall = doc.get("stall") if isinstance(doc.get("stall"), dict) else None
    stall_html = ""
    if stall:
        suspects = ", ".join(str(x) for x in stall.get("suspected_missing") or [])
        stall_html = (
            f"<h2>Stalled before the death</h2><p>flagged {_e(stall.get('detected_at'))} after "
            f"{_e(stall.get('stalled_seconds'))} s without progress"
            + (
                f"; waiting for rank {_e(suspects)} (told by {_e(stall.get('suspected_by'))})"
                if suspects
                else ""
            )
            + "</p>"
            + (f"<p><code>{_e(stall['flight_recorder'])}</code></p>" if stall.get("flight_recorder") else "")
            + "".join(
                f"<h3>rank {_e(r.get('label'))}: {_e(r.get('reason') or 'working')}, CPU "
                f"{'busy' if r.get('cpu_busy') else 'idle'}, GPU {_e(r.get('gpu_sm_percent'))} %</h3>"
                + (
                    f"<pre>{_e(r.get('stack'))}</pre>"
                    if r.get("stack")
                    else f"<p class='muted'>{_e(r.get('stack_error'))}</p>"
                )
                for r in stall.get("ranks") or []
            )
        )
    host, cg = mem.get("host") or {}, mem.get("cgroup")
    mem_lines = []
    if isinstance(host.get("total_bytes"), int):
        avail = host.get("available_bytes_at_death")
        mem_lines.append(
            f"host: {gib_or_mib(avail) if isinstance(avail, int) else '?'} available of "
            f"{gib_or_mib(host['total_bytes'])} at death"
        )
    if cg:
        usage, limit = cg.get("usage_bytes_at_death"), cg.get("limit_bytes")
        mem_lines.append(
            f"cgroup <code>{_e(cg.get('path'))}</code> (v{_e(cg.get('version'))}): "
            f"{gib_or_mib(usage) if isinstance(usage, int) else '?'} used of "
            f"{gib_or_mib(limit) if isinstance(limit, int) else 'no'} limit, OOM kills {_e(cg.get('oom_kills'))}"
        )
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'; img-src data:">
<title>postmortem {_e(doc.get("id"))}: {_e(k.get("kind"))}</title>
<style>
{PAGE_STYLE}
</style></head><body>
<h1><span class="kind">{_e(k.get("kind"))}</span> <span class="muted">({_e(k.get("confidence"))})</span></h1>
<div class="muted">rank {_e(v.get("rank"))} · pid {_e(v.get("pid"))} · {_e(v.get("signal") or v.get("exit_code"))}
 · died {_e(v.get("died_at"))} · job {_e(job.get("key") or job.get("run_id"))} (agent {_e(job.get("agent_pid"))},
 {_e(job.get("entrypoint"))}) · host {_e(doc.get("host"))}</div>
<p class="summary">{_e(k.get("summary"))}</p>
<h2>Memory before death</h2>
{_chart(doc)}
{f"<h2>Warned before the death</h2><ul>{warnings}</ul>" if warnings else ""}
{stall_html}
<h2>Advice</h2><ul>{advice or '<li class="muted">none</li>'}</ul>
<h2>Evidence</h2><table><tr><th>source</th><th>at</th><th>detail</th></tr>{evidence}</table>
<h2>Ranks</h2><table><tr><th>rank</th><th>pid</th><th>fate</th><th>exit</th><th>signal</th><th>RSS</th>
<th>peak</th><th>tree RSS</th><th>died</th></tr>{rows}</table>
<h2>Memory at death</h2><p>{"<br>".join(mem_lines) or '<span class="muted">not recorded</span>'}</p>
<p class="muted">trainwatch postmortem {_e(doc.get("id"))} · schema {_e(doc.get("schema"))}</p>
</body></html>
"""
