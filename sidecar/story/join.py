"""One story from many nodes: the ``trainwatch.story/v1`` document, joined from what
``gather`` read (Prometheus's series and each node's postmortems), by these rules:

* The job's latest attempt (restart) that had a death is the story; earlier attempts are
  listed with their first death.
* A death is the rank's **own** (its node named a cause of its own: an OOM kill, a signal,
  a crash), a **collective failure** (its node's postmortem says its own words only report
  a failure elsewhere, ``killer.peer_failure``, or it timed out in a collective), or a
  **teardown** (its agent stopped it). Only an own death can start the story while one
  exists; the first of them, on Prometheus's clock, is the first death and the only
  ``root_cause``.
* Deaths on one node are ordered by that node's clock; across nodes by each node's
  bounded offset (``clock.py``). Two candidates whose intervals overlap are too close to
  order, and the story says so instead of picking one silently.
* Whatever could not be seen is a sentence in ``gaps``: a daemon that does not answer,
  one that stopped before the death, ranks without a daemon, a death whose postmortem is
  gone, a clock that nothing bounds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sidecar.postmortem.document import epoch_of, iso
from sidecar.story.gather import NodeSeen, Seen

__all__ = ["STORY_SCHEMA", "join"]

STORY_SCHEMA = "trainwatch.story/v1"
TEARDOWN_FATE = "terminated_by_agent"
COLLECTIVE_FATE = "collective_failure"  # a fate of the story: its collective failed because a peer died


@dataclass(slots=True)
class Death:
    instance: str
    rank: str
    restart: int
    kind: str
    at_node: float  # the node's clock
    pid: int | None = None
    doc: str | None = None  # the postmortem that tells it
    node_fate: str | None = None
    peer_failure: bool = False
    victim: bool = False  # the victim of its node's postmortem
    exit: dict[str, Any] = field(default_factory=dict)

    @property
    def cls(self) -> str:
        if self.kind == "agent_teardown" or self.node_fate == TEARDOWN_FATE:
            return "teardown"
        if self.peer_failure or self.kind == "collective_timeout":
            return "collective"
        return "own"


def _rank_key(rank: str) -> tuple[int, str]:
    return (int(rank), "") if rank.isdigit() and len(rank) < 10 else (1 << 31, rank)


def _rank_out(rank: str) -> int | str:
    return int(rank) if rank.isdigit() and len(rank) < 10 else rank


def _str(x: Any) -> str | None:
    return x if isinstance(x, str) else (str(x) if isinstance(x, int) and not isinstance(x, bool) else None)


def _dict(x: Any) -> dict[str, Any]:
    return x if isinstance(x, dict) else {}


def _list(x: Any) -> list[Any]:
    return x if isinstance(x, list) else []


def _restart(doc: dict[str, Any]) -> int:
    n = _dict(doc.get("job")).get("restart_count")
    return n if isinstance(n, int) and not isinstance(n, bool) else 0


def _deaths(seen: Seen) -> dict[tuple[str, str, int], Death]:
    deaths: dict[tuple[str, str, int], Death] = {}
    for m in seen.deaths:
        deaths[(m.instance, m.rank, m.restart)] = Death(m.instance, m.rank, m.restart, m.killer, m.at)
    for instance, node in seen.nodes.items():
        for doc in node.docs:
            restart = _restart(doc)
            killer = _dict(doc.get("killer"))
            kind = str(killer["kind"]) if isinstance(killer.get("kind"), str) else "unknown"
            peer = killer.get("peer_failure") is True
            vrank = _str(_dict(doc.get("victim")).get("rank"))
            for r in _list(doc.get("ranks")):
                if not isinstance(r, dict):
                    continue
                rank, fate = _str(r.get("rank")), r.get("fate")
                at = epoch_of(r.get("died_at"))
                if rank is None or at is None or fate in ("exited_cleanly", "running"):
                    continue
                is_victim = rank == vrank
                key = (instance, rank, restart)
                d = deaths.get(key)
                if d is None:
                    rank_kind = kind if is_victim or fate == "same_cause" else "unknown"
                    d = deaths[key] = Death(instance, rank, restart, rank_kind, at)
                    if fate == TEARDOWN_FATE:
                        d.kind = "agent_teardown"
                if is_victim or fate == "same_cause":  # the postmortem's newest word on it
                    d.kind = kind
                elif fate == TEARDOWN_FATE:
                    d.kind = "agent_teardown"
                d.pid = r.get("pid") if isinstance(r.get("pid"), int) else d.pid
                d.doc, d.node_fate, d.victim = _str(doc.get("id")), _str(fate), is_victim
                d.peer_failure = peer and (is_victim or fate == "same_cause")
                d.exit = {k: r.get(k) for k in ("exit_code", "signal") if isinstance(r.get(k), (int, str))}
    return deaths


class _Clock:
    def __init__(self, nodes: dict[str, NodeSeen]) -> None:
        self.nodes = nodes

    def common(self, instance: str, at_node: float) -> float:
        node = self.nodes.get(instance)
        return at_node - (node.offset.middle if node is not None else 0.0)

    def half(self, instance: str) -> float | None:
        node = self.nodes.get(instance)
        return node.offset.half_width if node is not None else None

    def before(self, a: Death, b: Death) -> bool | None:
        """True when ``a`` certainly died before ``b``, False when after, None when too close."""
        if a.instance == b.instance:
            return a.at_node < b.at_node if a.at_node != b.at_node else None
        ha, hb = self.half(a.instance), self.half(b.instance)
        if ha is None or hb is None:
            return None
        ta, tb = self.common(a.instance, a.at_node), self.common(b.instance, b.at_node)
        if ta + ha < tb - hb:
            return True
        if tb + hb < ta - ha:
            return False
        return None


def _name(seen: Seen, instance: str) -> str:
    host = _hostname(seen.nodes.get(instance))
    return f"{host} ({instance})" if host and host != instance else instance


def _hostname(node: NodeSeen | None) -> str | None:
    for doc in node.docs if node else []:
        if isinstance(doc.get("host"), str):
            return str(doc["host"])
    return None


def join(seen: Seen) -> dict[str, Any]:
    clock = _Clock(seen.nodes)
    every = _deaths(seen)
    restart = max(k[2] for k in every)
    deaths = sorted(
        (d for d in every.values() if d.restart == restart),
        key=lambda d: (clock.common(d.instance, d.at_node), _rank_key(d.rank)),
    )
    own = [d for d in deaths if d.cls == "own"] or [d for d in deaths if d.cls == "collective"] or deaths
    first = own[0]
    too_close = [d for d in own[1:] if clock.before(first, d) is not True]
    gaps: list[str] = []
    if too_close:
        others = ", ".join(f"rank {d.rank} on {_name(seen, d.instance)} ({d.kind})" for d in too_close[:4])
        gaps.append(
            f"The first death cannot be told apart in time from {others}: the nodes' clocks are "
            "bounded no closer than the deaths are apart; either may have come first."
        )

    ranks = _ranks(seen, deaths, first, restart, clock)
    chain = _chain(seen, deaths, first, clock)
    nodes = []
    for instance, node in sorted(seen.nodes.items()):
        reachable = node.error is None
        nodes.append(
            {
                "instance": instance,
                "hostname": _hostname(node),
                "reachable": reachable,
                "health": node.health,
                "postmortems": [str(doc.get("id")) for doc in node.docs],
                "error": node.error,
            }
        )
    gaps += _gaps(seen, every, first, restart, clock)
    first_at = clock.common(first.instance, first.at_node)
    return {
        "schema": STORY_SCHEMA,
        "job": seen.job,
        "summary": _summary(seen, first, deaths, ranks),
        "asked_at": iso(seen.asked_at),
        "prometheus": seen.prometheus,
        "restart": restart,
        "first_death": {
            "instance": first.instance,
            "hostname": _hostname(seen.nodes.get(first.instance)),
            "rank": _rank_out(first.rank),
            "pid": first.pid,
            "at": iso(first_at),
            "uncertainty_seconds": _round(clock.half(first.instance)),
            "ordered": not too_close,
            "postmortem": first.doc,
            "killer": _killer(seen, first),
        },
        "ranks": ranks,
        "nodes": nodes,
        "chain": chain,
        "clock": [{"instance": i, **n.offset.as_dict()} for i, n in sorted(seen.nodes.items())],
        "gaps": gaps,
        "earlier_attempts": _earlier(seen, every, restart, clock),
    }


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 6)


def _killer(seen: Seen, first: Death) -> dict[str, Any]:
    """The node postmortem's killer object, unchanged; from Prometheus's label alone when
    the node's postmortem cannot be read."""
    node = seen.nodes.get(first.instance)
    for doc in node.docs if node else []:
        if doc.get("id") == first.doc and isinstance(doc.get("killer"), dict):
            return dict(doc["killer"])
    return {
        "kind": first.kind,
        "confidence": None,
        "summary": f"Only Prometheus's death series names this death ({first.kind}); its node's "
        "postmortem could not be read, so its evidence is not here.",
        "evidence": [],
    }


def _fate(d: Death, first: Death) -> str:
    if d is first:
        return "root_cause"
    if d.cls == "teardown":
        return TEARDOWN_FATE
    if d.cls == "collective":
        return COLLECTIVE_FATE
    if d.instance == first.instance and d.doc is not None and d.doc == first.doc and d.node_fate:
        return d.node_fate
    return "same_cause" if d.kind == first.kind else "unknown"


def _ranks(
    seen: Seen, deaths: list[Death], first: Death, restart: int, clock: _Clock
) -> list[dict[str, Any]]:
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for r in seen.ranks:
        if r.restart == restart:
            out[(r.instance, r.rank)] = {
                "instance": r.instance,
                "rank": _rank_out(r.rank),
                "local_rank": _rank_out(r.local_rank) if r.local_rank else None,
                "pid": int(r.pid) if r.pid.isdigit() and len(r.pid) < 10 else None,
                "fate": "unknown",
                "died": None,
                "kind": None,
            }
    for instance, node in seen.nodes.items():  # what a node's postmortem says of ranks still alive
        for doc in node.docs:
            if _restart(doc) != restart:
                continue
            for r in _list(doc.get("ranks")):
                rank = _str(r.get("rank")) if isinstance(r, dict) else None
                if rank is None:
                    continue
                entry = out.setdefault(
                    (instance, rank),
                    {"instance": instance, "rank": _rank_out(rank), "local_rank": r.get("local_rank"),
                     "pid": r.get("pid"), "fate": "unknown", "died": None, "kind": None},
                )  # fmt: skip
                if r.get("fate") in ("exited_cleanly", "running", "stranded"):
                    entry["fate"] = r["fate"]
    for d in deaths:
        entry = out.setdefault(
            (d.instance, d.rank),
            {"instance": d.instance, "rank": _rank_out(d.rank), "local_rank": None, "pid": d.pid},
        )
        entry.update(
            {
                "fate": _fate(d, first),
                "died": iso(clock.common(d.instance, d.at_node)),
                "kind": d.kind,
                "pid": d.pid if d.pid is not None else entry.get("pid"),
                "postmortem": d.doc,
                **d.exit,
            }
        )
    return sorted(out.values(), key=lambda e: (_rank_key(str(e["rank"])), e["instance"]))


def _chain(seen: Seen, deaths: list[Death], first: Death, clock: _Clock) -> list[dict[str, Any]]:
    events: list[tuple[float, dict[str, Any]]] = []
    for d in deaths:
        fate = _fate(d, first)
        what = {
            "root_cause": f"died first: {d.kind}",
            TEARDOWN_FATE: "stopped by its agent after the failure",
            COLLECTIVE_FATE: f"its collective failed after rank {first.rank}'s death ({d.kind})",
        }.get(fate, f"died: {d.kind} ({fate})")
        t = clock.common(d.instance, d.at_node)
        events.append((t, _event(t, d.instance, d.rank, "death", d.kind, what, clock, fate=fate)))
    for instance, node in seen.nodes.items():
        for doc in node.docs:
            for w in _list(doc.get("warnings")):
                at = epoch_of(w.get("at")) if isinstance(w, dict) else None
                if at is None:
                    continue
                secs = w.get("exhaustion_seconds")
                what = "foresight: memory growing toward its limit" + (
                    f", reached in {secs:.1f} s at that trend" if isinstance(secs, (int, float)) else ""
                )
                t = clock.common(instance, at)
                events.append((t, _event(t, instance, _str(w.get("rank")), "warning", None, what, clock)))
            stall = doc.get("stall") if isinstance(doc.get("stall"), dict) else None
            at = epoch_of(stall.get("detected_at")) if stall else None
            if at is not None:
                t = clock.common(instance, at)
                events.append((t, _event(t, instance, None, "stall", None, "no rank made progress", clock)))
        if node.last_round is not None and node.last_round < first.at_node + _skew(seen, node, first):
            t = clock.common(instance, node.last_round)
            what = "its daemon's last sampling round that Prometheus kept (it stopped or lost contact)"
            events.append((t, _event(t, instance, None, "daemon_gone", None, what, clock)))
    events.sort(key=lambda e: e[0])
    return [e for _, e in events]


def _skew(seen: Seen, node: NodeSeen, first: Death) -> float:
    """``first``'s node time moved to ``node``'s clock, as an addend to ``first.at_node``."""
    other = seen.nodes.get(first.instance)
    return node.offset.middle - (other.offset.middle if other else 0.0)


def _event(
    t: float,
    instance: str,
    rank: str | None,
    kind: str,
    killer: str | None,
    what: str,
    clock: _Clock,
    **extra: Any,
) -> dict[str, Any]:
    return {
        "at": iso(t),
        "uncertainty_seconds": _round(clock.half(instance)),
        "instance": instance,
        "rank": _rank_out(rank) if rank is not None else None,
        "event": kind,
        "kind": killer,
        "detail": what,
        **extra,
    }


def _gaps(
    seen: Seen, every: dict[tuple[str, str, int], Death], first: Death, restart: int, clock: _Clock
) -> list[str]:
    gaps = []
    for instance, node in sorted(seen.nodes.items()):
        name = _name(seen, instance)
        if node.error is not None:
            gaps.append(
                f"The daemon of {name} could not be read ({node.error}); its ranks' fates come from "
                "Prometheus alone."
            )
        elif node.health == "down":
            gaps.append(f"Prometheus cannot scrape {name} now ({node.last_error or 'down'}).")
        if node.last_round is not None and node.last_round < first.at_node + _skew(seen, node, first):
            gaps.append(
                f"The daemon of {name} stopped sampling (or lost Prometheus) at "
                f"{iso(clock.common(instance, node.last_round))}, before the first death: deaths on that "
                "node after it were not seen."
            )
        for what in node.dropped[:3]:
            gaps.append(f"{name} served something that is not a postmortem of this job: {what}.")
        if not node.offset.known:
            gaps.append(
                f"Nothing bounds the clock of {name} (no scrapes near the deaths): its deaths are not "
                "ordered against other nodes'."
            )
        elif node.offset.stepped:
            gaps.append(
                f"The clock of {name} moved during the deaths (its scrapes disagree): its offset is wide."
            )
    docs_ok = {i for i, n in seen.nodes.items() if n.error is None}
    missing = sorted(
        (d for d in every.values() if d.restart == restart and d.doc is None and d.instance in docs_ok),
        key=lambda d: (d.instance, _rank_key(d.rank)),
    )
    for d in missing[:8]:
        gaps.append(
            f"Prometheus kept the death of rank {d.rank} on {_name(seen, d.instance)} ({d.kind}), but its "
            "daemon no longer has a postmortem that tells it (removed, or its directory was lost)."
        )
    world = max(
        (doc["job"]["world_size"] for n in seen.nodes.values() for doc in n.docs
         if isinstance(doc.get("job"), dict) and isinstance(doc["job"].get("world_size"), int)),
        default=None,
    )  # fmt: skip
    if world is not None:
        known = {k[1] for k in every if k[2] == restart} | {
            r.rank for r in seen.ranks if r.restart == restart
        }
        absent = [str(r) for r in range(world) if str(r) not in known]
        if absent:
            shown = ", ".join(absent[:16]) + (" ..." if len(absent) > 16 else "")
            gaps.append(
                f"Ranks {shown} of the world of {world} appear on no node this Prometheus scrapes: their "
                "nodes have no trainwatch daemon, or it is not scraped."
            )
    return gaps


def _earlier(
    seen: Seen, every: dict[tuple[str, str, int], Death], restart: int, clock: _Clock
) -> list[dict[str, Any]]:
    out = []
    for r in sorted({k[2] for k in every if k[2] < restart}):
        ds = sorted(
            (d for d in every.values() if d.restart == r), key=lambda d: clock.common(d.instance, d.at_node)
        )
        own = [d for d in ds if d.cls == "own"] or ds
        d = own[0]
        out.append({"restart": r, "instance": d.instance, "rank": _rank_out(d.rank), "kind": d.kind,
                    "at": iso(clock.common(d.instance, d.at_node))})  # fmt: skip
    return out


def _summary(seen: Seen, first: Death, deaths: list[Death], ranks: list[dict[str, Any]]) -> str:
    nodes = len({r["instance"] for r in ranks})
    follow: dict[str, int] = {}
    for d in deaths:
        if d is not first:
            follow[_fate(d, first)] = follow.get(_fate(d, first), 0) + 1
    words = {COLLECTIVE_FATE: ("collective failure", "collective failures"),
             TEARDOWN_FATE: ("stopped by its agent", "stopped by their agents"),
             "same_cause": ("of the same cause", "of the same cause"),
             "unknown": ("unexplained", "unexplained")}  # fmt: skip
    then = ", ".join(
        f"{n} {words.get(f, (f, f))[n != 1]}" for f, n in sorted(follow.items(), key=lambda x: -x[1])
    )
    return (
        f"Rank {first.rank} on {_name(seen, first.instance)} died first ({first.kind}); "
        + (
            f"{len(deaths) - 1} more rank{'s' if len(deaths) > 2 else ''} died after it ({then})"
            if then
            else "no other rank died"
        )
        + f", across {nodes} node{'s' if nodes != 1 else ''}."
    )
