"""``trainwatch story``: one story per job across nodes. Prometheus already gathers every
node's death series (with the ``instance`` it scraped); the story asks it which nodes saw
the job die, reads each node's postmortems from that node's daemon, bounds each node's
clock, and joins them into one ``trainwatch.story/v1`` document: the first death and its
killer, every rank's fate across nodes, the chain of events in order, and what it could
not see.

    gather.py   what Prometheus and the nodes say (bounded, hostile-safe reads)
    clock.py    each node's clock offset, from Prometheus's scrapes
    join.py     the document, from what was gathered
    render.py   text and HTML
"""

from __future__ import annotations

import urllib.parse
from typing import Any

from sidecar.story.fetch import FetchError, PeerConfig, load_peer_config
from sidecar.story.gather import NoDeath, Seen, gather
from sidecar.story.join import STORY_SCHEMA, join
from sidecar.story.prom import PromError, Prometheus
from sidecar.story.render import render_html, render_text

__all__ = [
    "STORY_SCHEMA",
    "FetchError",
    "NoDeath",
    "PeerConfig",
    "PromError",
    "Seen",
    "load_peer_config",
    "parse_window",
    "render_html",
    "render_text",
    "tell",
]

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_window(text: str) -> float:
    """``90s``, ``30m``, ``6h``, ``7d``, ``2w`` or plain seconds; ValueError otherwise."""
    text = text.strip()
    unit = _UNITS.get(text[-1:])
    number = text[:-1] if unit else text
    value = float(number) * (unit or 1)
    if not 60 <= value <= 400 * 86400:
        raise ValueError("between 1m and 400d")
    return value


def shown_url(url: str) -> str:
    """The URL without credentials (a story is shown and served)."""
    parts = urllib.parse.urlsplit(url)
    netloc = parts.netloc.rsplit("@", 1)[-1]
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def tell(
    prometheus: str,
    job: str | None = None,
    *,
    window: float = 86400.0,
    peers: PeerConfig | None = None,
    timeout: float = 3.0,
) -> dict[str, Any]:
    """The story of ``job`` (the newest job with a death when None). PromError when
    Prometheus cannot be asked, NoDeath when it holds no death of the job."""
    peers = peers or PeerConfig()
    prom = Prometheus(prometheus, peers.prometheus, timeout=max(timeout, 5.0))
    seen = gather(prom, job, window=window, nodes_config=peers.nodes, timeout=timeout)
    seen.prometheus = shown_url(seen.prometheus)
    return join(seen)
