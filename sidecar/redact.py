"""One redactor for everything that leaves the daemon: log lines, postmortems (evidence,
rank output, error files, command lines, environment-derived values), ``/ranks`` and the
HTML page. A secret keeps its name and loses its value.

What counts as a secret, by mechanism:

* **shapes of real credentials**, wherever they appear: Hugging Face (``hf_``), GitHub
  (``ghp_``/``gho_``/``ghu_``/``ghs_``/``ghr_``, ``github_pat_``), GitLab (``glpat-``), AWS
  access key ids (``AKIA``/``ASIA``), OpenAI-style ``sk-`` keys, Slack ``xox?-`` tokens,
  Google API keys (``AIza``), JSON web tokens, PEM private keys, ``Bearer``/``Basic``
  authorization values, the password (or lone token) in a URL's user info;
* **values named as secrets**: ``NAME=value``, ``NAME: value``, ``"name": "value"``,
  ``--flag value`` and ``--flag=value`` where a *word* of the name is ``token``,
  ``secret``, ``password``/``passwd``/``pwd``, ``passphrase``, ``pat``, ``credential(s)``,
  ``auth``, ``cookie``, ``apikey``, or ``key`` qualified as a credential (``api``,
  ``access``, ``private``, ``secret``, ``hf``, ``wandb`` ...). Words, not substrings:
  ``--tokenizer``, ``--max-new-tokens 2048`` and ``--author`` stay readable;
* ``-p VALUE`` (the password flag of mysql, sshpass and friends) unless VALUE is a port;
* a 40-hex-digit key on a line that mentions wandb (a git commit id elsewhere stays).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "REDACTED",
    "RedactingFilter",
    "looks_secret",
    "redact_argv",
    "redact_doc",
    "redact_env",
    "redact_text",
]

REDACTED = "<redacted>"

_SECRET_WORDS = frozenset(
    {
        "token",
        "secret",
        "secrets",
        "password",
        "passwd",
        "pwd",
        "passphrase",
        "pat",
        "credential",
        "credentials",
        "auth",
        "cookie",
        "apikey",
        "bearer",
        "privatekey",
    }
)
# "key" is a credential when a word before it says which kind
_KEY_QUALIFIERS = frozenset(
    {
        "api",
        "access",
        "private",
        "secret",
        "hf",
        "huggingface",
        "wandb",
        "openai",
        "anthropic",
        "ssh",
        "signing",
        "encryption",
        "license",
        "master",
        "client",
        "service",
        "account",
        "auth",
        "session",
        "aws",
        "azure",
        "gcp",
        "comet",
        "neptune",
        "mlflow",
        "storage",
    }
)
_HARMLESS_NAMES = frozenset({"PWD", "OLDPWD"})  # the shell's working directories


def _words(name: str) -> list[str]:
    name = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name)  # camelCase -> camel_Case
    return [w for w in re.split(r"[^A-Za-z0-9]+", name.lower()) if w]


def looks_secret(name: str) -> bool:
    """Whether a variable, flag or field of this name holds a secret (by its words)."""
    bare = name.lstrip("-")
    if bare in _HARMLESS_NAMES:
        return False
    words = _words(bare)
    if not words:
        return False
    if any(w in _SECRET_WORDS for w in words):
        return True
    if words == ["key"] or (words == ["p"] and name.startswith("-") and not name.startswith("--")):
        return True
    return any(w == "key" and i > 0 and words[i - 1] in _KEY_QUALIFIERS for i, w in enumerate(words))


# -- shapes ---------------------------------------------------------------------------

_SHAPES = [
    re.compile(r"\bhf_[A-Za-z0-9]{20,}"),
    re.compile(r"\bgh[pousr]_[A-Za-z0-9]{30,}"),
    re.compile(r"\bgithub_pat_[A-Za-z0-9_]{20,}"),
    re.compile(r"\bglpat-[A-Za-z0-9_-]{20,}"),
    re.compile(r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"),
    re.compile(r"\bsk-(?:proj-|ant-|live_|test_)?[A-Za-z0-9_-]{20,}"),
    re.compile(r"\bxox[abposr]-[A-Za-z0-9-]{10,}"),
    re.compile(r"\bAIza[0-9A-Za-z_-]{35}"),
    re.compile(r"\beyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}"),  # a JWT
]
_PEM = re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----.*?(-----END [A-Z ]*PRIVATE KEY-----|$)", re.S)
_BEARER = re.compile(r"\b(Bearer)\s+([A-Za-z0-9._~+/=-]{8,})")
# Basic credentials are base64: never a plain lower-case word of prose ("Basic understanding")
_BASIC = re.compile(r"\b(Basic)\s+([A-Za-z0-9+/]{12,}={0,2})(?![A-Za-z0-9+/=])")
# scheme://user:password@host
_URL_CREDS = re.compile(r"\b([a-z][a-z0-9+.-]{1,20}://)([^/\s:@]*):([^/\s@]+)@")
_WANDB_HEX = re.compile(r"\b[0-9a-f]{40}\b")
_PORT = re.compile(r"\d{1,5}(:\d{1,5})?")
# "--flag value", or NAME=value / NAME: value / "name": "value" / --flag=value
# Names start where a word starts and are at most 64 long: a long run of word characters
# is tried once, not from each of its positions (which made a 3 KiB line take 150 ms).
_NAMED = re.compile(
    r"""(?<![A-Za-z0-9_.-])(?:(?P<flag>--?[A-Za-z][A-Za-z0-9_.-]{0,63})[ \t]+(?P<fvalue>[^\s"',;]+)"""
    r"""|(?P<name>-{0,2}[A-Za-z_][A-Za-z0-9_.-]{0,63})["']?[ \t]*[=:][ \t]*["']?(?P<value>[^\s"',;]+))"""
)


def _named(m: re.Match[str]) -> str:
    if m["flag"] is not None:
        name, group = m["flag"], "fvalue"
        value = m[group]
        if value.startswith("-") or (name == "-p" and _PORT.fullmatch(value)):
            return m[0]  # the next flag (this one took no value), or a port
    else:
        name, group = m["name"], "value"
        value = m[group]
    if value == REDACTED or not looks_secret(name):
        return m[0]
    start, end = m.start(group) - m.start(0), m.end(group) - m.start(0)
    return m[0][:start] + REDACTED + m[0][end:]


def _basic(m: re.Match[str]) -> str:
    token = m[2]
    if not re.search(r"[A-Z0-9+/=]", token):
        return m[0]
    return f"{m[1]} {REDACTED}"


def redact_text(text: str) -> str:
    """A line (or a block) of free text with every secret's value replaced."""
    if not text:
        return text
    out = _PEM.sub("-----BEGIN PRIVATE KEY----- " + REDACTED, text)
    out = _URL_CREDS.sub(lambda m: f"{m[1]}{m[2]}:{REDACTED}@", out)
    out = _BEARER.sub(lambda m: f"{m[1]} {REDACTED}", out)
    out = _BASIC.sub(_basic, out)
    for shape in _SHAPES:
        out = shape.sub(REDACTED, out)
    out = _NAMED.sub(_named, out)
    if "wandb" in out.lower():
        out = _WANDB_HEX.sub(REDACTED, out)
    return out


def redact_argv(argv: Sequence[str]) -> list[str]:
    """``--hf-token=abc`` -> ``--hf-token=<redacted>``; ``--password abc`` -> ``--password
    <redacted>``; ``API_KEY=abc`` (an env assignment before the command) likewise; any
    argument with a credential's shape, or a URL with a password, too."""
    out: list[str] = []
    for i, arg in enumerate(argv):
        flag = argv[i - 1] if i else ""
        takes = flag.startswith("-") and "=" not in flag and looks_secret(flag) and not arg.startswith("-")
        if takes and not (flag == "-p" and _PORT.fullmatch(arg)):
            out.append(REDACTED)
            continue
        name, sep, _ = arg.partition("=")
        if sep and looks_secret(name):
            out.append(f"{name}={REDACTED}")
        else:
            out.append(redact_text(arg))
    return out


def redact_env(env: Mapping[str, str]) -> dict[str, str]:
    return {k: (REDACTED if looks_secret(k) else redact_text(v)) for k, v in env.items()}


def redact_doc(value: Any) -> Any:
    """A JSON-like value with every string redacted (keys are names the daemon wrote)."""
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, dict):
        return {k: redact_doc(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact_doc(v) for v in value]
    return value


class RedactingFilter(logging.Filter):
    """Installed on the daemon's log handlers: the formatted message is redacted before
    any handler writes it (a rank's line quoted in a warning, an argv, an exception)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = redact_text(message)
        if clean != message:
            record.msg, record.args = clean, ()
        if record.exc_info and record.exc_text is None and record.exc_info[0] is not None:
            record.exc_text = redact_text(logging.Formatter().formatException(record.exc_info))
        return True
