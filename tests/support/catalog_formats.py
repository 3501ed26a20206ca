"""The emitter catalog's message formats (sidecar/catalog/*.toml, ``format``): their
placeholders (``{name}`` or ``{name:type}``) and the text a format renders with given values."""

from __future__ import annotations

import re

PLACEHOLDER = re.compile(r"\{(\w+)(?::(\w+))?\}")


def render(fmt: str, values: dict[str, str]) -> str:
    """The catalog format with each placeholder replaced by its value ({{ and }} are braces)."""
    guarded = fmt.replace("{{", "\x00").replace("}}", "\x01")
    out = PLACEHOLDER.sub(lambda m: values[m[1]], guarded)
    return out.replace("\x00", "{").replace("\x01", "}")


def placeholders(fmt: str) -> list[tuple[str, str]]:
    """(name, type) of each placeholder of a catalog format, in order; type "text" when unsaid."""
    guarded = fmt.replace("{{", "").replace("}}", "")
    return [(m[1], m[2] or "text") for m in PLACEHOLDER.finditer(guarded)]
