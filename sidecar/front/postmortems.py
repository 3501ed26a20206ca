"""Where ``trainwatch postmortem`` finds the document it prints: a URL (a daemon's
``/postmortem``), a path, an id or the newest in the postmortem directory, else what the local
daemon serves. Whatever it finds must be a postmortem (``SCHEMA``), or ``ConfigError`` says why."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from typing import Any

from sidecar.errors import ConfigError
from sidecar.postmortem import ID_PATTERN, SCHEMA, PostmortemStore

__all__ = ["find_postmortem"]


def find_postmortem(what: str | None, directory: str, local: str) -> dict[str, Any]:
    """The postmortem ``what`` names (a URL, a path, an id; None: the newest in ``directory``,
    else the one the daemon at ``local`` serves)."""
    doc = None
    if what and (what.startswith("http://") or what.startswith("https://")):
        url = what if "/postmortem" in what else what.rstrip("/") + "/postmortem"
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                doc = json.loads(r.read())
        except (urllib.error.URLError, ValueError, OSError) as exc:
            raise ConfigError(f"{what}: cannot fetch a postmortem: {getattr(exc, 'reason', exc)}") from None
    elif what and (os.path.sep in what or what.endswith(".json")):
        try:
            with open(what, encoding="utf-8") as f:
                doc = json.load(f)
        except OSError as exc:
            raise ConfigError(f"{what}: {exc.strerror}") from None
        except ValueError:
            raise ConfigError(f"{what}: not a postmortem (not JSON)") from None
    else:
        if what and not ID_PATTERN.match(what):
            raise ConfigError(f"{what!r} is not a postmortem id, a path or a URL")
        store = PostmortemStore(directory)
        doc = store.get(what) if what else store.newest()
        if doc is None and what is None:
            try:
                with urllib.request.urlopen(local, timeout=3) as r:
                    doc = json.loads(r.read())
            except (urllib.error.URLError, ValueError, OSError):
                doc = None
        if doc is None:
            raise ConfigError(
                f"no postmortem {what or 'yet'} in {directory}" + ("" if what else f" nor at {local}")
            )
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise ConfigError(f"not a {SCHEMA} document")
    return doc
