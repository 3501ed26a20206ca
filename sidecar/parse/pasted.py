"""Logs as people paste them, made plain before any rule reads them. Pure.

What a copy adds and what it breaks, undone here:

* colours (ANSI escape sequences) and carriage returns (CRLF files, progress bars that
  redraw a line) are removed;
* prefixes a tool puts on every line are recognised and taken off, and what they say is
  kept: ``srun -l``'s task id (``3: ...``, a rank) becomes the ``[rank3]:`` prefix torch
  itself writes, so the rules attribute the line as they would torch's own; a container
  runtime's ``2026-12-02T11:53:34.123456789Z stdout F `` and ``kubectl logs --prefix``'s
  ``[pod/name/container] `` are dropped;
* a line a terminal or a web page wrapped is joined back to the one before it when a
  message of the emitter catalog runs across the
  break: joined without a space when the break fell inside a word (``closing signal SI`` +
  ``GTERM``), with one otherwise. Nothing is joined on a guess: only a known message shape
  that neither line holds alone decides it.
"""

from __future__ import annotations

import re

from sidecar.catalog import Catalog, catalog

__all__ = ["plain"]

_ANSI = re.compile(r"\x1b\[[0-9;?]{0,32}[ -/]{0,4}[@-~]|\x1b[@-_]")
_SRUN = re.compile(r"^ {0,4}(\d{1,6}): ")
_CRI = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d{1,9})?(?:Z|[+-]\d\d:\d\d) (?:stdout|stderr) [FP] ")
_DOCKER_JSONISH = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{1,9}Z ")  # docker logs -t
_KUBECTL = re.compile(r"^\[pod/[\w.-]{1,253}/[\w.-]{1,253}\] ")
LINE_MAX = 4096  # longer lines are not joined to anything
JOIN_MAX_LINES = 200_000  # past this many lines, a paste is a file: it was not wrapped by hand


def _strip(line: str) -> str:
    if "\x1b" in line:
        line = _ANSI.sub("", line)
    if "\r" in line:  # a redrawn line keeps what was drawn last; a CRLF end is dropped
        line = line.rstrip("\r").rsplit("\r", 1)[-1]
    m = _CRI.match(line) or _DOCKER_JSONISH.match(line) or _KUBECTL.match(line)
    if m:
        line = line[m.end() :]
    return line


def _srun_tasks(lines: list[str]) -> bool:
    """Most non-empty lines carry ``srun -l``'s ``N: `` task prefix (one line with it is
    not a prefix family: ``0: `` may be anyone's text)."""
    filled = [line for line in lines[:2000] if line.strip()]
    tagged = sum(1 for line in filled if _SRUN.match(line))
    return len(filled) >= 3 and tagged >= 0.6 * len(filled)


def _crossing(cat: Catalog, before: str, after: str, glue: str) -> bool:
    """A catalog message runs across the break between
    ``before`` and ``after`` joined with ``glue``, and neither holds it alone."""
    joined = before + glue + after
    edge = len(before)
    alone = {h.message.id for h in cat.scan(before)} | {h.message.id for h in cat.scan(after)}
    for hit in cat.scan(joined):
        if hit.message.id in alone:
            continue
        for m in hit.message.pattern.finditer(joined):
            if m.start() < edge < m.end():
                return True
    return False


def plain(text: str) -> str:
    """``text`` with colours, carriage returns and line prefixes removed, ``srun -l`` task
    ids turned into ``[rankN]:`` prefixes, and wrapped messages joined."""
    lines = [_strip(line) for line in text.split("\n")]
    if _srun_tasks(lines):
        out = []
        for line in lines:
            m = _SRUN.match(line)
            out.append(f"[rank{m[1]}]:{line[m.end() :]}" if m else line)
        lines = out
    if len(lines) > JOIN_MAX_LINES:
        return "\n".join(lines)
    cat = catalog()
    joined: list[str] = []
    for line in lines:
        if joined and line and joined[-1] and len(joined[-1]) < LINE_MAX and len(line) < LINE_MAX:
            before = joined[-1]
            glues = ("", " ") if not before.endswith(" ") and not line.startswith(" ") else ("",)
            glue = next((g for g in glues if _crossing(cat, before, line, g)), None)
            if glue is not None:
                joined[-1] = before + glue + line
                continue
        joined.append(line)
    return "\n".join(joined)
