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

__all__ = ["JOIN_MAX_LINES", "LINE_MAX", "join"]

LINE_MAX = 4096  # longer lines are not joined to anything
JOIN_MAX_LINES = 200_000  # past this many lines, a paste is a file: it was not wrapped by hand


def join(lines: list[str], shown: list[int] | None = None) -> str:
    """Wrapped lines joined: a terminal's fixed-width wrap, then a catalog message run
    across a break. ``shown``: each line's length as it was displayed when the copy wrapped
    it, where a prefix the program wrote (Open MPI's tag, a task log's header) has since come
    off the line: a wrap's pieces after the first carry no prefix, and where those lengths
    find such pieces, and more than the lines as they are, their wrap is undone."""
    if len(lines) > JOIN_MAX_LINES:
        return "\n".join(lines)
    unwrapped = _unwrap_web(_unwrap_fixed(lines))
    if shown is not None and len(shown) == len(lines):
        # the wrap the lengths as shown find, where it joins more: a prefix put on every line
        # after the wrap (a viewer's line numbers) leaves it to the lines as they are
        # shifts both alike, one that came off only some lines hides the wrap from the other
        fixed = _unwrap_fixed(lines, shown)
        as_shown = _unwrap_web(fixed, shown if fixed is lines else None)
        if len(as_shown) < len(unwrapped):
            unwrapped = as_shown
    lines = _named_only(unwrapped)
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


# how a record starts: a rank's or a launcher's prefix, a log level, a timestamp, a traceback's
# lines. A line that starts so is never the continuation of a wrapped one.
_BARE_PREFIX = re.compile(r"^\s{0,4}\[(?:rank|default)\d{1,6}\]:\s?$")
_RECORD_START = re.compile(
    r"^(?:\[(?:rank|default)\d{1,6}\]:|\[[EWIF] |\[?[EWIF]\d{4} \d\d:|\[?\d{4}-\d\d-\d\d[ T]|"
    r"\[\s{0,12}\d{1,12}\.\d{1,9}\]|"
    r"(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun|Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec) |"
    r"Traceback \(|\s{2}File \"|(?:INFO|WARNING|ERROR|DEBUG|CRITICAL)[:\s]|\d{1,6}: |"
    # Slurm's programs name themselves first on every line (log.c); a Python logger's name
    # then its level (submitit's '%(name)s %(levelname)s (%(asctime)s)')
    r"(?:slurmstepd|srun|sbatch|salloc|slurmd)(?:-[\w.-]{1,64})?: |"
    r"[\w.]{1,64} (?:INFO|WARNING|ERROR|DEBUG|CRITICAL) |"
    # the last line of a Python traceback: the exception's (dotted) name and a colon
    r"(?:[A-Za-z_]\w{0,64}\.){0,8}[A-Z]\w{0,64}(?:Error|Exception|Interrupt|Exit)(?::|$))"
)


def _unwrap_fixed(lines: list[str], shown: list[int] | None = None) -> list[str]:
    """A terminal wraps at a fixed width: every piece of a long record but its last is
    exactly as long as the widest line. When several lines share that width (and it is a
    terminal's, 40 columns or more), each of them continues on the next line, unless that
    line starts a record of its own (a log's lines of one length are not a wrap). A web
    page's wrap has a few lines that long too (a word that just fitted, one longer than the
    width cut anywhere), among many a little shorter: not a terminal's. ``shown``: the
    lines' lengths as the terminal showed them (``join``); a line whose prefix came off
    starts a line of the program's own, never a piece."""
    lengths, opens = _as_shown(lines, shown)
    width = max(lengths, default=0)
    full = sum(1 for n in lengths if n == width)
    # near the width: a terminal's pieces are all exactly as wide, a web page's breaks (at
    # the last space before the width) spread over the last word's length below it
    near = sum(1 for n in lengths if n >= width - 8)
    if width < 40 or full < 3 or full * 20 < sum(1 for n in lengths if n >= 40) or 2 * full < near:
        return lines
    # a terminal breaks only lines that wide; a web page mostly shorter ones (at a word that
    # did not fit), and cuts at the width only a word longer than it: where breaks before
    # shorter lines outnumber the lines that wide, the page's unwrap undoes both
    short = sum(
        1
        for i in range(len(lines) - 1)
        if lengths[i] < width
        and not opens[i + 1]
        and _web_break(lines[i], lines[i + 1], width, length=lengths[i])
    )
    if short >= 3 and short > full:
        return lines
    out: list[str] = []
    carry = False
    cat = catalog()
    for i, line in enumerate(lines):
        if carry and not opens[i] and not _RECORD_START.match(line):
            following = lines[i + 1] if i + 1 < len(lines) else ""
            out[-1] = _glued(cat, out[-1], line, "" if _RECORD_START.match(following) else following)
        else:
            out.append(line)
        carry = lengths[i] == width
    return out


def _unwrap_web(lines: list[str], shown: list[int] | None = None) -> list[str]:
    """A web page (or an editor) wraps at the last space before its width and drops that
    space: the line before such a break is long (most of the width), the next one does not
    start with a space nor a record of its own, and its first word would not have fitted
    on the line before. When a text has several such breaks, each is undone with the space
    put back. A log that was never wrapped has few: its long lines are followed by a new
    record, an indented line, or a word that would have fitted. ``shown``: the lines'
    lengths as the page showed them (``join``; as for a terminal's)."""
    lengths, opens = _as_shown(lines, shown)
    width = max(lengths, default=0)
    if not _web_wrapped(lines, width, lengths, opens):
        return lines

    out: list[str] = []
    cat = catalog()
    previous, length = "", 0
    for line, n, opening in zip(lines, lengths, opens, strict=True):
        if (
            out
            and not opening
            and _web_break(previous, line, width, short=True, length=length)
            and len(out[-1]) < LINE_MAX
        ):
            # the space back, unless the words read only without it (a word the copy cut:
            # ``closing signal SI`` + ``GTERM``), read with the line before too (a message
            # whose head is there); when the catalog cannot tell, a line as wide as the page
            # with no space in it is one word longer than the width, cut (a path)
            spaced, tight = out[-1].rstrip() + " " + line, out[-1] + line
            before = out[-2] if len(out) > 1 and len(out[-2]) < LINE_MAX else None
            wide, narrow = _read(cat, spaced, before), _read(cat, tight, before)
            cut = length == width and " " not in previous
            out[-1] = tight if wide < narrow or (cut and wide == narrow) else spaced
        else:
            out.append(line)
        previous, length = line, n
    return out


# Python's traceback writes an exception's last line as ``Name: message``, or ``Name`` alone
# when the message is empty (traceback.format_exception_only): a name and its colon ending
# a line are a line whose message a wrap moved to the next one
_NAMED_ONLY = re.compile(
    r"^(?:\[(?:rank|default)\d{1,6}\]: ?)?(?:[A-Za-z_]\w{0,64}\.){0,8}[A-Z]\w{0,64}(?:Error|Exception):$"
)


def _named_only(lines: list[str]) -> list[str]:
    """An exception's name and colon alone on a line, joined with its message on the next
    (not an indented line, nor a record of its own)."""
    out: list[str] = []
    for line in lines:
        if (
            out
            and line
            and not line[0].isspace()
            and _NAMED_ONLY.match(out[-1])
            and not _RECORD_START.match(line)
        ):
            out[-1] = f"{out[-1]} {line}"
        else:
            out.append(line)
    return out


def _web_break(before: str, after: str, width: int, short: bool = False, length: int | None = None) -> bool:
    """A web page's break between ``before`` and ``after``: ``before`` is long, ``after``
    starts no record nor indent, and its first word would not have fitted. ``short``: also
    after a short line whose next word is long (most of the width), as the page put it on a
    line of its own; only once the text is known wrapped. ``length``: ``before``'s length
    as shown, where a prefix has come off it."""
    if not before or not after or after[0].isspace():
        return False
    # a prefix alone (its line's first word did not fit beside it) starts no record of its own
    if not _BARE_PREFIX.match(before) and (before[-1].isspace() or _RECORD_START.match(after)):
        return False
    n = len(before.rstrip()) if length is None else length
    word = after.split(" ", 1)[0]
    long = n >= 0.6 * width or (short and len(word) >= 0.6 * width)
    return long and n + 1 + len(word) > width


def _as_shown(lines: list[str], shown: list[int] | None) -> tuple[list[int], list[bool]]:
    """Each line's length as shown, and whether a prefix came off it (``join``)."""
    if shown is None:
        return [len(line) for line in lines], [False] * len(lines)
    return shown, [n != len(line) for line, n in zip(lines, shown, strict=True)]


def _web_wrapped(lines: list[str], width: int, lengths: list[int], opens: list[bool]) -> bool:
    """Several of the text's long lines end at a web page's break (a log never wrapped has
    few: its long lines are followed by a new record, an indented line, or a word that fits)."""
    if width < 40:
        return False
    breaks = sum(
        1
        for i in range(len(lines) - 1)
        if not opens[i + 1] and _web_break(lines[i], lines[i + 1], width, length=lengths[i])
    )
    long = sum(1 for n in lengths if n >= 0.6 * width)
    return breaks >= 3 and breaks >= 0.2 * long


def _read(cat: Catalog, text: str, before: str | None = None, after: str | None = None) -> set[str]:
    """The catalog messages in ``text``, alone and with the line ``before`` or ``after`` it
    glued on either way (a message whose head or tail is there)."""
    ids = {h.message.id for h in cat.scan(text)}
    for glue in ("", " ") if before or after else ():
        if before:
            ids |= {h.message.id for h in cat.scan(before + glue + text)}
        if after:
            ids |= {h.message.id for h in cat.scan(text + glue + after)}
    return ids


def _glued(cat: Catalog, before: str, after: str, following: str = "") -> str:
    """A terminal's wrap keeps every character (``before + after``); a copy that wrapped
    at a space dropped it. A catalog message that reads only with the space back decides
    (``Sending process 812914`` + ``closing signal SIGTERM``), read with the line after
    too, joined either way, where the message runs on into it (``closing signal SI`` +
    ``GTERM``)."""
    tight = before + after
    if before.endswith(" ") or after.startswith(" "):
        return tight
    spaced = before + " " + after
    wide, narrow = _read(cat, spaced, after=following), _read(cat, tight, after=following)
    return spaced if narrow < wide else tight  # the space reads more, and loses nothing


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
        best: tuple[int, str] | None = None
        messages = [cat.by_id[i] for i in sorted(set().union(*first.values()))]
        for glue in first:
            for glues in itertools.product((glue,), *rest):
                read = _crossing(messages, parts, glues, cut if glue == "" else frozenset())
                if read and (best is None or read > best[0]):
                    best = read, parts[0] + "".join(g + p for g, p in zip(glues, parts[1:], strict=True))
        if best is not None:
            return count, best[1]
        if count < len(after) and _RECORD_START.match(after[count]):
            return None  # a record of its own starts there: no message runs on into it
    return None


def _unspaced(line: str) -> str:
    """``line`` without the one space a terminal's cut leaves at its start when it fell
    right before a space (an indented line keeps its indent)."""
    return line[1:] if line[:1] == " " and line[1:2] not in ("", " ") else line


def _wrapped(line: str) -> bool:
    """``line`` may be the continuation of a wrapped one: not empty, not indented, not the
    start of a record."""
    return bool(line) and not line[0].isspace() and _RECORD_START.match(line) is None


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
) -> int:
    """How many of ``messages`` run across the first break of ``parts`` joined with
    ``glues`` (one a break):
    it starts before the break, ends after it, and the line before the break does not
    hold it from the same start (a pattern whose tail takes any text would otherwise run
    on into whatever line follows), or holds it with fewer of its fields captured (an
    optional tail, a number, that the next line carries)."""
    joined = parts[0] + "".join(g + p for g, p in zip(glues, parts[1:], strict=True))
    before = parts[0]
    edge = len(before)
    low = joined.lower()
    read = 0
    for message in messages:
        if message.anchors and not any(a in (low if message.fold else joined) for a in message.anchors):
            continue  # every match holds one of its anchors
        if _across_one(message, joined, before, edge, message.id in cut):
            read += 1
    return read


def _across_one(message: Message, joined: str, before: str, edge: int, cut: bool = False) -> bool:
    """``message`` runs across the break at ``edge`` of ``joined``, whose text before it
    is ``before`` (see ``_crossing``); with ``cut``, also where the line alone holds it to
    the break and the joined text holds it further (a terminal cut its last field)."""
    rx = message.pattern
    for m in rx.finditer(joined):
        if m.start() < edge < m.end():
            own = rx.search(before, m.start())
            if own is None or own.start() != m.start():
                return True  # it reads only across the break
            if message.generic:  # any exception's last line takes any text: it
                break  # would run on into whatever line follows
            if cut and own.end() == edge and m.end() > edge:
                return True
            # the line alone holds the message but leaves a field the next line fills
            # (the watchdog's "ran for" + "600060 milliseconds ...")
            filled = sum(g is not None for g in m.groups())
            if filled > sum(g is not None for g in own.groups()) and own.end() <= edge:
                return True
            # ... or a run of the message's own words after the break or across it
            # (" milliseconds before timing out", "nonexistent physical" + "address")
            if own.end() <= edge and _words_cross(rx, joined[m.start() : m.end()], edge - m.start()):
                return True
    return False


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
