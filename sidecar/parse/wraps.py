"""Wrapped lines joined back, as a copy from a terminal or a web page broke them. Pure.

A terminal wraps at a fixed width, inside words: when many lines are exactly as long as
the widest, each of them continues on the next. A web page (or an editor) wraps at the
last space before its width and drops that space: when many lines break so, each break is
undone with the space put back. Any other break is undone only where a message of the
emitter catalog runs across it: its literal words cut at the break, a line that starts
with its words, or (a break inside a field: a path cut at the width) a line at the break
that holds some of a message's words but not the message. Nothing else is joined: only a
known message shape decides it.
"""

from __future__ import annotations

import functools
import itertools
import re

from sidecar.catalog import Catalog, Hit, Message, catalog, literal_runs
from sidecar.parse.breaks import LINE_MAX, RECORD_START, named_only, unwrap_fixed, unwrap_web

__all__ = ["JOIN_MAX_LINES", "LINE_MAX", "join"]

JOIN_MAX_LINES = 200_000  # past this many lines, a paste is a file: it was not wrapped by hand


def join(lines: list[str], shown: list[int] | None = None) -> str:
    """Wrapped lines joined: a terminal's fixed-width wrap, then a catalog message run
    across a break. ``shown``: each line's length as it was displayed when the copy wrapped
    it, where a prefix the program wrote (Open MPI's tag, a task log's header) has since come
    off the line: a wrap's pieces after the first carry no prefix, and where those lengths
    find such pieces, and more than the lines as they are, their wrap is undone."""
    if len(lines) > JOIN_MAX_LINES:
        return "\n".join(lines)
    unwrapped = unwrap_web(unwrap_fixed(lines))
    if shown is not None and len(shown) == len(lines):
        # the wrap the lengths as shown find, where it joins more: a prefix that came off only
        # some lines (the pieces after a wrap's first carry none) hides the wrap from the lines
        # as they are
        fixed = unwrap_fixed(lines, shown)
        as_shown = unwrap_web(fixed, shown if fixed is lines else None)
        # (as many, where that is a terminal's: pieces exactly one width are firmer than the
        # page's breaks the lines as they are may seem to show)
        if len(as_shown) < len(unwrapped) or (fixed is not lines and len(as_shown) == len(unwrapped)):
            unwrapped = as_shown
    lines = named_only(unwrapped)
    cat = catalog()
    found = cat.scan_lines(lines)  # each line's own messages, found once
    edges = _edges(cat)
    width = max((len(line) for line in lines), default=0)
    joined: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        span = (
            _run(
                cat,
                joined[-1],
                lines[i : i + RUN_MAX],
                found[i],
                _begun(edges, lines, found, i),
                _cut_short(cat, joined[-1], lines, i, width),
            )
            if joined and joined[-1] and line
            else None
        )
        if span is not None:
            count, joined[-1] = span
            i += count
            continue
        joined.append(line)
        i += 1
    return "\n".join(joined)


RUN_MAX = 4  # a message wrapped over more than five lines is not rebuilt here


def _begun(edges: _Edges, lines: list[str], found: list[list[Hit]], i: int) -> frozenset[str]:
    """The messages the break before line ``i`` may have cut inside a field (a path, a
    number): the line before is long, the line may continue it, and one of the two holds
    some of a message's words but not the message."""
    if i == 0 or len(lines[i - 1]) < 40 or not _wrapped(_unspaced(lines[i])):
        return frozenset()
    return frozenset(edges.begun(lines[i - 1], found[i - 1]) | edges.begun(lines[i], found[i]))


def _cut_short(cat: Catalog, joined: str, lines: list[str], i: int, width: int) -> frozenset[str]:
    """The messages the text before line ``i`` (``joined``: that line's own, or more lines
    already joined) holds up to its very end, when line ``i - 1`` is as wide as the
    paste's widest (60 or more: a terminal's width) and line ``i`` may continue it: a
    terminal cut there, and the field the message ends with (a number, a path) may go on
    in line ``i`` (``worker_count=179`` + ``2, timeout=...``)."""
    if width < 60 or i == 0 or len(lines[i - 1]) != width or not _wrapped(_unspaced(lines[i])):
        return frozenset()
    ends = set()
    for hit in cat.scan(joined):
        m = hit.message.pattern.search(joined)
        if not hit.message.generic and m is not None and m.end() == len(joined):
            ends.add(hit.message.id)
    return frozenset(ends)


class _Edges:
    """Which messages' literal words a break could cut: for every literal run of every
    pattern, each way to cut it in two (head, tail), the whole run with an empty tail
    among them, with the messages that hold it. A break is a candidate when the text
    before it ends with a head and the text after it starts with that head's tail, or
    the text after it starts with a whole run; only those messages are then tried
    across it. A message whose words all lie on one side of a break cannot be the reason
    to join it, unless a line at the break holds some of its words but not the message
    (``begun``: a break inside one of its fields)."""

    def __init__(self, cat: Catalog) -> None:
        self.tails: dict[str, dict[str, set[str]]] = {}
        for m in cat.messages:
            for run in literal_runs(m.pattern):
                for i in range(1, len(run) + 1):  # a whole run before the break: the message may go on
                    self.tails.setdefault(run[:i], {}).setdefault(run[i:], set()).add(m.id)
        # the lengths of the heads that end in each character: a break is tried only at them
        ends: dict[str, set[int]] = {}
        for head in self.tails:
            ends.setdefault(head[-1], set()).add(len(head))
        self.lengths = {c: tuple(sorted(n)) for c, n in ends.items()}
        # each head's tails' distinct lengths: a lookup per length
        self.sizes = {h: tuple(sorted({len(x) for x in t})) for h, t in self.tails.items()}
        # the runs a line may start with (a break right before a message's words), by
        # their first four characters; and those of the messages that do not take any
        # text, by their first two
        self.starts: dict[str, dict[str, set[str]]] = {}
        words: dict[str, set[str]] = {}
        for m in cat.messages:
            for run in literal_runs(m.pattern):
                run = run.strip()
                if len(run) >= 5:
                    self.starts.setdefault(run[:4], {}).setdefault(run, set()).add(m.id)
                    if not m.generic:
                        words.setdefault(run, set()).add(m.id)
        self.words: dict[str, list[tuple[str, frozenset[str]]]] = {}
        for run, ids in words.items():
            self.words.setdefault(run[:2], []).append((run, frozenset(ids)))

    def begun(self, line: str, hits: list[Hit]) -> set[str]:
        """The messages a run of whose words ``line`` holds, but not the message."""
        held = {h.message.id for h in hits}
        out: set[str] = set()
        for pair in {line[i : i + 2] for i in range(min(len(line), LINE_MAX) - 1)}:
            for run, ids in self.words.get(pair, ()):
                if run in line:
                    out |= ids - held
        return out

    def crossed(self, before: str, after: str) -> set[str]:
        """The messages whose words the break between ``before`` and ``after`` cuts, or
        that ``after`` starts with."""
        found = self._crossed(before, after)
        trimmed = before.rstrip(" ")
        if trimmed != before:  # the spaces at the break are a pattern's own repeat (`` {1,3}``)
            found |= self._crossed(trimmed, after.lstrip(" "))
        return found

    def _crossed(self, before: str, after: str) -> set[str]:
        found: set[str] = set()
        if not before:
            return found
        lead = after.lstrip(" ")  # a terminal's cut may leave the space at the line's start
        for run, ids in self.starts.get(lead[:4], {}).items():
            if lead.startswith(run):
                found |= ids  # the break fell right before a message's words
        for i in self.lengths.get(before[-1], ()):
            if i > len(before):
                break
            head = before[-i:]
            tails = self.tails.get(head)
            if tails is not None:
                for n in self.sizes[head]:
                    found |= tails.get(after[:n], set())
        return found


_EDGES: dict[int, _Edges] = {}


def _edges(cat: Catalog) -> _Edges:
    edges = _EDGES.get(id(cat))
    if edges is None:
        edges = _EDGES[id(cat)] = _Edges(cat)
    return edges


def _run(
    cat: Catalog,
    before: str,
    after: list[str],
    hits: list[Hit] | None = None,
    begun: frozenset[str] = frozenset(),
    cut: frozenset[str] = frozenset(),
) -> tuple[int, str] | None:
    """How many of the lines ``after`` continue ``before`` (a message runs across the
    break after it when the first 1..RUN_MAX of them are joined to it), and the text they
    make: each break glued with "" when it fell inside a word or kept its space, with " "
    when the copy dropped it (each break its own: ``failed (exitcode: -6)`` + ``local_rank:
    6 (pid`` + ``: 541332) of binary``). Tried for the messages whose literal words run
    across the break, and those (``begun``) a line at it holds words of but not the
    message: a break inside a field (a path cut at the width), and (``cut``) those the
    line before holds to its very end, cut by a terminal inside their last field."""
    if len(before) >= LINE_MAX or not after or not after[0]:
        return None
    edges = _edges(cat)
    glues = _glues(before, after[0])
    first = {g: edges.crossed(before + g, after[0]) for g in glues}
    crossing = {g: ids | begun | (cut if g == "" else set()) for g, ids in first.items()}
    crossing = {g: ids for g, ids in crossing.items() if ids}
    if crossing:
        joined = _across(cat, before, after, crossing, cut)
        if joined is not None or any(first.values()):
            return joined
    # no message's words at this break: the common case, cheap
    return _reached_back(before, after[0], cat.scan(after[0]) if hits is None else hits)


def _across(
    cat: Catalog, before: str, after: list[str], first: dict[str, set[str]], cut: frozenset[str] = frozenset()
) -> tuple[int, str] | None:
    """The fewest of the lines ``after`` that a message runs into from ``before``, the
    first break glued each way ``first`` lists, with the messages to try across it."""
    for count in range(1, len(after) + 1):
        parts = [before, *after[:count]]
        if not parts[-1] or len(parts[-1]) >= LINE_MAX:
            return None
        rest = [_glues(a, b) for a, b in itertools.pairwise(parts[1:])]
        # every way to glue the breaks, and the messages each makes read across the
        # first: the way that reads the most (a field that takes any text reads either
        # way; the message whose words need the space back reads one way only)
        best: tuple[tuple[int, int], str] | None = None
        messages = [cat.by_id[i] for i in sorted(set().union(*first.values()))]
        for glue in first:
            for glues in itertools.product((glue,), *rest):
                read = _crossing(messages, parts, glues, cut if glue == "" else frozenset())
                if any(read) and (best is None or read > best[0]):
                    best = read, parts[0] + "".join(g + p for g, p in zip(glues, parts[1:], strict=True))
        if best is not None:
            return count, best[1]
        if count < len(after) and RECORD_START.match(after[count]):
            return None  # a record of its own starts there: no message runs on into it
    return None


def _unspaced(line: str) -> str:
    """``line`` without the one space a terminal's cut leaves at its start when it fell
    right before a space (an indented line keeps its indent)."""
    return line[1:] if line[:1] == " " and line[1:2] not in ("", " ") else line


def _wrapped(line: str) -> bool:
    """``line`` may be the continuation of a wrapped one: not empty, not indented, not the
    start of a record."""
    return bool(line) and not line[0].isspace() and RECORD_START.match(line) is None


def _reached_back(before: str, after: str, hits: list[Hit]) -> tuple[int, str] | None:
    """A message found on the line after the break whose optional head (free text, no
    literal words at the break) is on the line before: joined, its match starts before the
    break and captures more fields (DeepSpeed's ``sigkill_handler] ['/usr/bin/python', ...``
    + ``'--local_rank=0', ...] exits with return code = -7``)."""
    if not hits:
        return None
    for glue in _glues(before, after):
        joined = before + glue + after
        edge = len(before) + len(glue)
        for hit in hits:
            if hit.message.generic:
                continue
            rx = hit.message.pattern
            alone = rx.search(after)
            m = rx.search(joined)
            if alone is None or m is None or m.start() >= len(before):
                continue
            if m.end() > edge and sum(g is not None for g in m.groups()) > sum(
                g is not None for g in alone.groups()
            ):
                return 1, joined
    return None


def _glues(before: str, after: str) -> tuple[str, ...]:
    """How a break may be undone: as it is when a space is still at it, else without a
    space (a word cut) or with one (a space the copy dropped)."""
    return ("",) if before.endswith(" ") or after.startswith(" ") else ("", " ")


def _crossing(
    messages: list[Message], parts: list[str], glues: tuple[str, ...], cut: frozenset[str] = frozenset()
) -> tuple[int, int]:
    """How many of ``messages`` run across the first break of ``parts`` joined with
    ``glues`` (one a break), by their own words, then only by a field a terminal cut (a
    message read across by its words is firmer than a free-text tail that runs on):
    it starts before the break, ends after it, and the line before the break does not
    hold it from the same start (a pattern whose tail takes any text would otherwise run
    on into whatever line follows), or holds it with fewer of its fields captured (an
    optional tail, a number, that the next line carries)."""
    joined = parts[0] + "".join(g + p for g, p in zip(glues, parts[1:], strict=True))
    before = parts[0]
    edge = len(before)
    low = joined.lower()
    words = fields = 0
    for message in messages:
        if message.anchors and not any(a in (low if message.fold else joined) for a in message.anchors):
            continue  # every match holds one of its anchors
        how = _across_one(message, joined, before, edge, message.id in cut)
        words += how == "words"
        fields += how == "cut"
    return words, fields


def _across_one(message: Message, joined: str, before: str, edge: int, cut: bool = False) -> str | None:
    """How ``message`` runs across the break at ``edge`` of ``joined``, whose text before
    it is ``before`` (see ``_crossing``): ``"words"``; with ``cut``, ``"cut"`` where only the
    line alone holds it to the break and the joined text holds it further (a terminal cut its
    last field); None where it does not."""
    rx = message.pattern
    for m in rx.finditer(joined):
        if m.start() < edge < m.end():
            own = rx.search(before, m.start())
            if own is None or own.start() != m.start():
                return "words"  # it reads only across the break
            if message.generic:  # any exception's last line takes any text: it
                break  # would run on into whatever line follows
            if cut and own.end() == edge and m.end() > edge:
                return "cut"
            # the line alone holds the message but leaves a field the next line fills
            # (the watchdog's "ran for" + "600060 milliseconds ...")
            filled = sum(g is not None for g in m.groups())
            if filled > sum(g is not None for g in own.groups()) and own.end() <= edge:
                return "words"
            # ... or a run of the message's own words after the break or across it
            # (" milliseconds before timing out", "nonexistent physical" + "address")
            if own.end() <= edge and _words_cross(rx, joined[m.start() : m.end()], edge - m.start()):
                return "words"
    return None


@functools.lru_cache(maxsize=4096)
def _long_runs(rx: re.Pattern[str]) -> tuple[str, ...]:
    """The pattern's runs of ten or more literal characters, spaces at their ends aside."""
    return tuple(run for run in (r.strip() for r in literal_runs(rx)) if len(run) >= 10)


def _words_cross(rx: re.Pattern[str], match: str, edge: int) -> bool:
    """A run of ten or more of the pattern's literal characters lies in ``match`` after
    ``edge`` or across it."""
    for run in _long_runs(rx):
        at = match.find(run)
        while at >= 0:
            if at + len(run) > edge:
                return True
            at = match.find(run, at + 1)
    return False
