"""The postmortem: one document for the daemon and ``trainwatch diagnose`` (``document``),
its store on disk and in memory (``store``), and its two views (``text``, ``html``)."""

from sidecar.postmortem.document import ID_PATTERN, SCHEMA, build, iso, make_id
from sidecar.postmortem.store import PostmortemStore
from sidecar.postmortem.text import render_text

__all__ = ["ID_PATTERN", "SCHEMA", "PostmortemStore", "build", "iso", "make_id", "render_text"]
