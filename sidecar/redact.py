"""Secrets never reach a log line or a postmortem: command-line arguments and environment
variables whose names look like tokens, keys, secrets or passwords keep their name and
lose their value."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

__all__ = ["REDACTED", "looks_secret", "redact_argv", "redact_env"]

REDACTED = "<redacted>"
_SECRET = re.compile(
    r"(token|secret|passw(or)?d|passphrase|api[_-]?key|access[_-]?key|private[_-]?key|"
    r"credential|auth|cookie|session[_-]?key|\bpat\b|bearer)",
    re.IGNORECASE,
)


def looks_secret(name: str) -> bool:
    return bool(_SECRET.search(name))


def redact_argv(argv: Sequence[str]) -> list[str]:
    """``--hf-token=abc`` -> ``--hf-token=<redacted>``; ``--password abc`` -> ``--password
    <redacted>``; ``API_KEY=abc`` (an env assignment before the command) likewise."""
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next:
            out.append(REDACTED)
            hide_next = False
            continue
        name, sep, _value = arg.partition("=")
        if sep and looks_secret(name):
            out.append(f"{name}={REDACTED}")
        elif arg.startswith("-") and not sep and looks_secret(arg):
            out.append(arg)
            hide_next = True
        else:
            out.append(arg)
    return out


def redact_env(env: Mapping[str, str]) -> dict[str, str]:
    return {k: (REDACTED if looks_secret(k) else v) for k, v in env.items()}
