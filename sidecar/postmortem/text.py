"""The postmortem as text, for a terminal or an issue, whichever path wrote it: the verdict
first, then what was read (diagnose), the evidence, every rank's fate, the memory at death,
the curve before it, the advice and what to collect next time. Sections the document has
no data for are left out rather than printed empty.
"""

from __future__ import annotations

from typing import Any

from sidecar.postmortem.document import epoch_of
from sidecar.units import format_bytes

__all__ = ["render_text"]

_BARS = " ▁▂▃▄▅▆▇█"


# the charge's parts as the text view names them, the unreclaimable first
CHARGE_PARTS = (
    ("anon", "anon_bytes"),
    ("shmem", "shmem_bytes"),
    ("page cache", "file_bytes"),
    ("kernel", "kernel_bytes"),
)


def _size(n: Any) -> str:
    return format_bytes(n) if isinstance(n, (int, float)) else "-"


def _spark(values: list[int]) -> str:
    if not values:
        return ""
    top = max(values) or 1
    return "".join(_BARS[min(8, round(v / top * 8))] for v in values)


def _or_dash(value: Any) -> str:
    return "-" if value is None else str(value)


def _label(r: dict[str, Any]) -> str:
    """A rank's global rank; from logs that name only the local one, ``local N``."""
    if r.get("rank") is not None:
        return str(r["rank"])
    if r.get("local_rank") is not None:
        return f"local {r['local_rank']}" + ("?" if r.get("local_rank_inferred") else "")
    return "?"


def _header(doc: dict[str, Any]) -> list[str]:
    v, job = doc.get("victim") or {}, doc.get("job") or {}
    lines = [f"trainwatch postmortem {doc.get('id')}" + (" (from logs)" if "inputs" in doc else "")]
    if job.get("agent_pid") is not None or job.get("key") is not None:
        key = job.get("key") or job.get("run_id") or job.get("agent_pid")
        lines.append(
            f"job {key} (agent pid {job.get('agent_pid')}, {job.get('entrypoint') or '?'}, "
            f"world size {job.get('world_size')}, restart {job.get('restart_count')})"
        )
    if v.get("pid") is not None or v.get("rank") is not None or v.get("local_rank") is not None:
        if v.get("rank") is not None:
            who = f"rank {v['rank']}"
        elif v.get("local_rank") is not None:
            who = f"local rank {v['local_rank']}"
        else:
            who = "the process"
        code = v.get("exit_code")
        how = v.get("signal") or (f"exit status {code}" if code is not None else "exit status unknown")
        lines.append(
            f"{who}"
            + (f" (pid {v['pid']})" if v.get("pid") is not None else "")
            + " died"
            + (f" {v['died_at']}" if v.get("died_at") else "")
            + f": {how}"
            + (f" (exit code {code})" if code is not None else "")
        )
    return lines


def _ranks(ranks: list[dict[str, Any]]) -> list[str]:
    timed = any(r.get("died_at") for r in ranks)
    head = f"  {'rank':>8}  {'pid':>8}  {'fate':<20} {'exit':>5}  {'rss':>10}  {'peak':>10}  {'tree':>10}"
    lines = ["", "ranks:", head + ("  died" if timed else "")]
    for r in ranks:
        row = (
            f"  {_label(r):>8}  {_or_dash(r.get('pid')):>8}  {r.get('fate')!s:<20} "
            f"{_or_dash(r.get('exit_code')):>5}  "
            f"{_size(r.get('rss_bytes')):>10}  {_size(r.get('peak_rss_bytes')):>10}  "
            f"{_size(r.get('tree_rss_bytes')):>10}"
        )
        lines.append(row + (f"  {r.get('died_at') or '-'}" if timed else ""))
    return lines


def _memory(doc: dict[str, Any]) -> list[str]:
    mem = doc.get("memory") or {}
    host, cg = mem.get("host") or {}, mem.get("cgroup")
    lines = []
    if host.get("available_bytes_at_death") is not None:
        lines.append(
            f"  host: {_size(host.get('available_bytes_at_death'))} available of "
            f"{_size(host.get('total_bytes'))} "
            f"(lowest in the window: {_size(host.get('min_available_bytes'))})"
        )
    elif host.get("total_bytes") is not None:
        lines.append(f"  host: {_size(host['total_bytes'])} of RAM")
    if cg:
        lines.append(
            f"  cgroup {cg.get('path')} (v{cg.get('version')}): {_size(cg.get('usage_bytes_at_death'))} used "
            + (f"of a {_size(cg['limit_bytes'])} limit" if cg.get("limit_bytes") else "(no limit)")
            + f", peak {_size(cg.get('peak_bytes'))}, OOM kills {cg.get('oom_kills')}"
        )
        charge = cg.get("charge")
        if isinstance(charge, dict):
            parts = [
                f"{name} {_size(charge.get(key))}"
                for name, key in CHARGE_PARTS
                if charge.get(key) is not None
            ]
            lines.append("    made of: " + ", ".join(parts))
    return ["", "memory at death:", *lines] if lines else []


def _killed_at(doc: dict[str, Any]) -> float | None:
    """When the victim was killed: the kernel's kill record when there is one (the exit is
    seen a little later, and samples between the two show the memory already freed), else
    its time of death."""
    died = epoch_of((doc.get("victim") or {}).get("died_at"))
    if died is None:
        return None
    kills = [
        t
        for e in (doc.get("killer") or {}).get("evidence") or []
        if isinstance(e, dict) and e.get("source") == "kmsg"
        and (t := epoch_of(e.get("at"))) is not None and died - 5 <= t <= died
    ]  # fmt: skip
    return min(kills, default=died)


def _until_death(doc: dict[str, Any], points: list[tuple[float, int]]) -> tuple[list[tuple[float, int]], str]:
    """The points up to the victim's death and the mark that ends a sparkline there ("✕"):
    what was sampled after the kill (the memory freed) is not the curve that led to it."""
    died = _killed_at(doc)
    if died is None:
        return points, ""
    return [(t, v) for t, v in points if t <= died + 1e-3], "✕"


def _curve(doc: dict[str, Any]) -> list[str]:
    timeline = doc.get("timeline") or []
    label = str((doc.get("victim") or {}).get("rank"))
    curve = [  # a point without a time (a hand-made document) keeps its place
        (epoch_of(p.get("at")) or float(i), c)
        for i, p in enumerate(timeline)
        if isinstance(c := (p.get("rss_bytes") or {}).get(label), int)
    ]
    curve, mark = _until_death(doc, curve)
    if not curve:
        return []
    return [
        "",
        f"rank {label} RSS over the last {curve[-1][0] - curve[0][0]:.0f} s "
        f"(max {_size(max(v for _, v in curve))}, {'at death' if mark else 'last'} {_size(curve[-1][1])}):",
        f"  {_spark(_by_time(curve))}{mark}",
    ]


def _warnings(doc: dict[str, Any]) -> list[str]:
    """What foresight predicted before the death, timed from it ("predicted at T-41 s: 38 s
    left"); ranks warned of the same limit in the same second share a line."""
    died = epoch_of((doc.get("victim") or {}).get("died_at"))
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for w in doc.get("warnings") or []:
        limit = w.get("limit") or {}
        at = epoch_of(w.get("at"))
        key = (round(at) if at is not None else w.get("at"), limit.get("kind"), limit.get("path"))
        groups.setdefault(key, []).append(w)
    lines = []
    for ws in groups.values():
        w, limit = ws[0], ws[0].get("limit") or {}
        at = epoch_of(w.get("at"))
        when = f"T-{died - at:.0f} s" if at is not None and died is not None else str(w.get("at"))
        where = f"cgroup {limit.get('path')}" if limit.get("kind") == "cgroup" else "the host's memory"
        who = ", ".join(str(x.get("rank")) for x in ws)
        rate = w.get("rate_bytes_per_second")
        seconds = w.get("exhaustion_seconds")
        lines.append(
            f"  predicted at {when}: {seconds:.0f} s left; rank{'s' if len(ws) > 1 else ''} {who} growing"
            + f", the limit of {where} ({_size(limit.get('limit_bytes'))})"
            + (f" filling at {_size(rate)}/s" if isinstance(rate, (int, float)) else "")
        )
    return ["", "warned before the death:", *lines] if lines else []


def _secs(v: Any) -> str:
    return f"{v:.0f} s" if isinstance(v, (int, float)) else "?"


STACK_LINES = 12  # the innermost frames of each stack, in the text view (the JSON has all)


def _stall(doc: dict[str, Any]) -> list[str]:
    """The snapshot taken when the job stalled before the death: who waited, for whom, how
    that was told, and each rank's innermost frames."""
    stall = doc.get("stall")
    if not isinstance(stall, dict):
        return []
    died = epoch_of((doc.get("victim") or {}).get("died_at"))
    at = epoch_of(stall.get("detected_at"))
    when = f"T-{died - at:.0f} s" if at is not None and died is not None else str(stall.get("detected_at"))
    suspects = ", ".join(str(x) for x in stall.get("suspected_missing") or [])
    by = {"flight_recorder": "the flight recorder", "stacks": "the stacks", "activity": "activity"}
    told = by.get(str(stall.get("suspected_by")), "?")
    head = f"stalled before the death: flagged at {when}, after {_secs(stall.get('stalled_seconds'))}"
    lines = [
        "",
        head + " without progress" + (f"; waiting for rank {suspects} (told by {told})" if suspects else ""),
    ]
    if stall.get("flight_recorder"):
        lines.append(f"  flight recorder: {stall['flight_recorder']}")
    for r in stall.get("ranks") or []:
        gpu = r.get("gpu_sm_percent")
        lines.append(
            f"  rank {r.get('label')}: {r.get('reason') or 'working'}"
            + f", CPU {'busy' if r.get('cpu_busy') else 'idle'}"
            + (f", GPU {gpu:.0f} % busy" if isinstance(gpu, (int, float)) else "")
            + ("" if r.get("stack") else f"; no stack: {r.get('stack_error')}")
        )
        frames = [ln for ln in str(r.get("stack") or "").splitlines() if ln.startswith("    ")]
        lines += [f"  {ln}" for ln in frames[:STACK_LINES]]
    return lines


def _by_time(points: list[tuple[float, int]], most: int = 72) -> list[int]:
    """At most ``most`` values evenly spaced in time (the sampler runs faster near a limit,
    so the last points would otherwise crowd out the minutes before)."""
    if len(points) <= most:
        return [v for _, v in points]
    t0, t1 = points[0][0], points[-1][0]
    out, i = [], 0
    for k in range(most):
        t = t0 + (t1 - t0) * k / (most - 1)
        while i + 1 < len(points) and points[i + 1][0] <= t:
            i += 1
        out.append(points[i][1])
    return out


def _charge_curve(doc: dict[str, Any]) -> list[str]:
    """The binding cgroup's charge split over the window before the death, each part's
    sparkline ending at the death (marked) and its first and last values beside it."""
    points = [
        (at, p["cgroup_charge_bytes"])
        for p in doc.get("timeline") or []
        if isinstance(p.get("cgroup_charge_bytes"), dict) and (at := epoch_of(p.get("at"))) is not None
    ]
    died = _killed_at(doc)
    points = [(at, c) for at, c in points if died is None or at <= died + 1e-3]
    mark = "✕" if died is not None else ""
    if len(points) < 2:
        return []
    lines = [f"cgroup charge over the last {points[-1][0] - points[0][0]:.0f} s:"]
    # the split read at the death ("made of" above) is the curve's last point, so both agree
    at_death = ((doc.get("memory") or {}).get("cgroup") or {}).get("charge") or {}
    for name, key in (("anon", "anon"), ("shmem", "shmem"), ("page cache", "file"), ("kernel", "kernel")):
        values = [(at, c[key]) for at, c in points if isinstance(c.get(key), int)]
        final = at_death.get(f"{key}_bytes") if isinstance(at_death, dict) else None
        if died is not None and isinstance(final, int) and values:
            values.append((max(died, values[-1][0]), final))
        if not values or max(v for _, v in values) < 2**20:
            continue
        lines.append(
            f"  {name:<10} {_spark(_by_time(values))}{mark}  {_size(values[0][1])} -> {_size(values[-1][1])}"
        )
    return ["", *lines] if len(lines) > 1 else []


def render_text(doc: dict[str, Any]) -> str:
    """The document as text (the daemon's ``GET /postmortem?format=text``, ``trainwatch
    postmortem`` and ``trainwatch diagnose``)."""
    k = doc.get("killer") or {}
    lines = [*_header(doc), "", f"killer: {k.get('kind')} ({k.get('confidence')})", f"  {k.get('summary')}"]
    if doc.get("inputs"):
        lines += ["", "read:"] + [f"  {i['name']}: {', '.join(i['kinds'])}" for i in doc["inputs"]]
    if k.get("evidence"):
        lines += ["", "evidence:"]
        lines += [
            f"  [{e.get('source')}] " + (f"{e['at']} " if e.get("at") else "") + f"{e.get('detail')}".rstrip()
            for e in k["evidence"]
        ]
    if doc.get("ranks"):
        lines += _ranks(doc["ranks"])
    lines += _memory(doc)
    lines += _warnings(doc)
    lines += _stall(doc)
    lines += _curve(doc)
    lines += _charge_curve(doc)
    if doc.get("advice"):
        lines += ["", "advice:"] + [f"  - {a}" for a in doc["advice"]]
    if doc.get("collect"):
        lines += ["", "to decide next time, collect:"] + [f"  - {c}" for c in doc["collect"]]
    return "\n".join(lines) + "\n"
