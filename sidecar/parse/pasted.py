"""Logs as people paste them, made plain before any rule reads them. Pure.

What a copy adds and what it breaks, undone here:

* colours (ANSI escape sequences) and carriage returns (CRLF files, progress bars that
  redraw a line) are removed;
* prefixes a tool puts on every line are recognised and taken off, and what they say is
  kept: ``srun -l``'s task id (``3: ...``, a rank) becomes the ``[rank3]:`` prefix torch
  itself writes, so the rules attribute the line as they would torch's own; a container
  runtime's ``2026-12-02T11:53:34.123456789Z stdout F `` and ``kubectl logs --prefix``'s
  ``[pod/name/container] `` are dropped;
* a terminal's wrap is undone when many lines are exactly as long as the widest (the
  terminal's width): each of those continues on the next line;
* any other wrapped line (a web page's) is joined back to the one before it when a message
  of the emitter catalog runs across the break: joined without a space when the break fell
  inside a word or kept its space (``closing signal SI`` + ``GTERM``), with one otherwise.
  Nothing else is joined: only a known message shape decides it.
"""

from __future__ import annotations

import re

from sidecar.catalog import Catalog, catalog, literal_runs

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


def _crossing(cat: Catalog, parts: list[str], glue: str) -> bool:
    """A catalog message runs across the first break of ``parts`` joined with ``glue``:
    it starts before the break, ends after it, and the line before the break does not
    hold it from the same start (a pattern whose tail takes any text would otherwise run
    on into whatever line follows)."""
    joined = glue.join(parts)
    before = parts[0]
    edge = len(before)
    for hit in cat.scan(joined):
        rx = hit.message.pattern
        for m in rx.finditer(joined):
            if m.start() < edge < m.end():
                own = rx.search(before, m.start())
                if own is None or own.start() != m.start():
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
    lines = _unwrap_fixed(lines)
    cat = catalog()
    joined: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        span = _run(cat, joined[-1], lines[i : i + RUN_MAX]) if joined and joined[-1] and line else None
        if span is not None:
            count, glue = span
            joined[-1] = glue.join([joined[-1], *lines[i : i + count]])
            i += count
            continue
        joined.append(line)
        i += 1
    return "\n".join(joined)


RUN_MAX = 4  # a message wrapped over more than five lines is not rebuilt here


def _unwrap_fixed(lines: list[str]) -> list[str]:
    """A terminal wraps at a fixed width: every piece of a long record but its last is
    exactly as long as the widest line. When several lines share that width (and it is a
    terminal's, 40 columns or more), each of them continues on the next line."""
    width = max((len(line) for line in lines), default=0)
    full = sum(1 for line in lines if len(line) == width)
    if width < 40 or full < 3 or full * 20 < sum(1 for line in lines if len(line) >= 40):
        return lines
    out: list[str] = []
    carry = False
    for line in lines:
        if carry:
            out[-1] += line
        else:
            out.append(line)
        carry = len(line) == width
    return out


class _Edges:
    """Which breaks a catalog message's literal words could cross: for every literal run
    of every pattern, each way to cut it in two (head, tail), the whole run with an empty
    tail among them. A break is a candidate when the text before it ends with a head and
    the text after it starts with that head's tail; only then is the catalog searched
    across it. A message whose words all lie on
    one side of a break cannot be the reason to join it."""

    def __init__(self, cat: Catalog) -> None:
        self.tails: dict[str, list[str]] = {}
        for m in cat.messages:
            for run in literal_runs(m.pattern):
                for i in range(1, len(run) + 1):  # a whole run before the break: the message may go on
                    self.tails.setdefault(run[:i], []).append(run[i:])
        self.longest = max((len(head) for head in self.tails), default=0)

    def crossed(self, before: str, after: str) -> bool:
        for i in range(1, min(self.longest, len(before)) + 1):
            tails = self.tails.get(before[-i:])
            if tails is not None and any(after.startswith(t) for t in tails):
                return True
        return False


_EDGES: dict[int, _Edges] = {}


def _edges(cat: Catalog) -> _Edges:
    edges = _EDGES.get(id(cat))
    if edges is None:
        edges = _EDGES[id(cat)] = _Edges(cat)
    return edges


def _run(cat: Catalog, before: str, after: list[str]) -> tuple[int, str] | None:
    """How many of the lines ``after`` continue ``before`` (a message runs across the
    break after it when the first 1..RUN_MAX of them are joined to it), and the glue: ""
    when the break fell inside a word or kept its space, " " when the copy dropped it."""
    if len(before) >= LINE_MAX or not after or not after[0]:
        return None
    spaced = before.endswith(" ") or after[0].startswith(" ")
    glues = [g for g in (("",) if spaced else ("", " ")) if _edges(cat).crossed(before + g, after[0])]
    if not glues:  # no message's words run across this break: the common case, cheap
        return None
    for count in range(1, len(after) + 1):
        parts = [before, *after[:count]]
        if not parts[-1] or len(parts[-1]) >= LINE_MAX:
            return None
        for glue in glues:
            if _crossing(cat, parts, glue):
                return count, glue
    return None
