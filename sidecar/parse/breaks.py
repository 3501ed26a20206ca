"""A copy's own wraps undone: a terminal's at a fixed width, a page's at its last space. Pure.

A terminal wraps at a fixed width, inside words: when many lines are exactly as long as the
widest, each of them continues on the next. A web page (or an editor) wraps at the last space
before its width and drops that space: when many lines break so, each break is undone with the
space put back. A line that starts a record of its own is never a piece. ``wraps.join`` then
joins what the catalog's messages run across.
"""

from __future__ import annotations

import re

from sidecar.catalog import Catalog, catalog

__all__ = ["LINE_MAX", "RECORD_START", "named_only", "unwrap_fixed", "unwrap_web"]

LINE_MAX = 4096  # longer lines are not joined to anything


# the last line of a Python traceback: an exception's (dotted) name, then a colon or nothing
_EXCEPTION_LINE = r"(?:[A-Za-z_]\w{0,64}\.){0,8}[A-Z]\w{0,64}(?:Error|Exception|Interrupt|Exit)(?::|$)"

# how a record starts: a rank's or a launcher's prefix, a log level, a timestamp, a traceback's
# lines. A line that starts so is never the continuation of a wrapped one.
_BARE_PREFIX = re.compile(r"^\s{0,4}\[(?:rank|default)\d{1,6}\]:\s?$")
RECORD_START = re.compile(
    r"^(?:\[(?:rank|default)\d{1,6}\]:|\[[EWIF] |\[?[EWIF]\d{4} \d\d:|\[?\d{4}-\d\d-\d\d[ T]|"
    r"\[\s{0,12}\d{1,12}\.\d{1,9}\]|"
    r"(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun|Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec) |"
    r"Traceback \(|\s{2}File \"|(?:INFO|WARNING|ERROR|DEBUG|CRITICAL)[:\s]|\d{1,6}: |"
    # a shell's word on its child's death, alone on its line (bash's strsignal text)
    r"(?:Killed|Aborted|Segmentation fault|Bus error|Terminated|Hangup)(?: \(core dumped\))?\s*$|"
    # Slurm's programs name themselves first on every line (log.c); a Python logger's name
    # then its level (submitit's '%(name)s %(levelname)s (%(asctime)s)')
    r"(?:slurmstepd|srun|sbatch|salloc|slurmd)(?:-[\w.-]{1,64})?: |"
    r"[\w.]{1,64} (?:INFO|WARNING|ERROR|DEBUG|CRITICAL) |"
    # NCCL's debug lines: "host:pid:tid [cudaDev] NCCL INFO|WARN ..." (debug.cc, every version)
    r"[\w.-]{1,253}:\d{1,10}:\d{1,10} \[\d{1,4}\] NCCL |"
    # the last line of a Python traceback: the exception's (dotted) name and a colon
    f"{_EXCEPTION_LINE})"
)


def unwrap_fixed(lines: list[str], shown: list[int] | None = None) -> list[str]:
    """A terminal wraps at a fixed width: every piece of a long record but its last is
    exactly as long as the widest line. When several lines share that width (and it is a
    terminal's, 40 columns or more), each of them continues on the next line, unless that
    line starts a record of its own (a log's lines of one length are not a wrap). A web
    page's wrap has a few lines that long too (a word that just fitted, one longer than the
    width cut anywhere), among many a little shorter: not a terminal's. ``shown``: the
    lines' lengths as the terminal showed them (``wraps.join``); a line whose prefix came off
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
        if carry and not opens[i] and (not RECORD_START.match(line) or _name_cut(out[-1], line)):
            following = lines[i + 1] if i + 1 < len(lines) else ""
            above = out[-2] if len(out) > 1 and len(out[-2]) < LINE_MAX else ""
            out[-1] = _glued(cat, out[-1], line, "" if RECORD_START.match(following) else following, above)
        else:
            out.append(line)
        carry = lengths[i] == width
    return out


# a dotted name a terminal cut: the line before ends inside it, the piece after goes on with it
_NAME_TAIL = re.compile(r"(?:^|[\s:\]])([A-Za-z_][\w.]{0,200})$")
_EXCEPTION_NAME = re.compile(_EXCEPTION_LINE)


def _name_cut(before: str, piece: str) -> bool:
    """A terminal cut an exception's dotted name (``...framework.e`` + ``rrors_impl.X
    Error:``): the piece reads as a traceback's last line only from inside the name, which the
    line before began."""
    tail = _NAME_TAIL.search(before)
    return tail is not None and piece[:1].isalnum() and _EXCEPTION_NAME.match(tail[1] + piece) is not None


def unwrap_web(lines: list[str], shown: list[int] | None = None) -> list[str]:
    """A web page (or an editor) wraps at the last space before its width and drops that
    space: the line before such a break is long (most of the width), the next one does not
    start with a space nor a record of its own, and its first word would not have fitted
    on the line before. When a text has several such breaks, each is undone with the space
    put back. A log that was never wrapped has few: its long lines are followed by a new
    record, an indented line, or a word that would have fitted. ``shown``: the lines'
    lengths as the page showed them (``wraps.join``; as for a terminal's)."""
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


def named_only(lines: list[str]) -> list[str]:
    """An exception's name and colon alone on a line, joined with its message on the next
    (not an indented line, nor a record of its own)."""
    out: list[str] = []
    for line in lines:
        if (
            out
            and line
            and not line[0].isspace()
            and _NAMED_ONLY.match(out[-1])
            and not RECORD_START.match(line)
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
    if not _BARE_PREFIX.match(before) and (before[-1].isspace() or RECORD_START.match(after)):
        return False
    n = len(before.rstrip()) if length is None else length
    word = after.split(" ", 1)[0]
    long = n >= 0.6 * width or (short and len(word) >= 0.6 * width)
    return long and n + 1 + len(word) > width


def _as_shown(lines: list[str], shown: list[int] | None) -> tuple[list[int], list[bool]]:
    """Each line's length as shown, and whether a prefix came off it (``wraps.join``)."""
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
    glued on either way (a message whose head or tail is there; not one that line holds
    alone: the record above, read the same whichever way this break is undone, would make
    one way look as if it read more)."""
    ids = {h.message.id for h in cat.scan(text)}
    for glue in ("", " ") if before or after else ():
        if before:
            ids |= {h.message.id for h in cat.scan(before + glue + text)} - _own(cat, before)
        if after:
            ids |= {h.message.id for h in cat.scan(text + glue + after)} - _own(cat, after)
    return ids


def _own(cat: Catalog, line: str) -> set[str]:
    return {h.message.id for h in cat.scan(line)}


def _glued(cat: Catalog, before: str, after: str, following: str = "", above: str = "") -> str:
    """A terminal's wrap keeps every character (``before + after``); a copy that wrapped
    at a space dropped it. A catalog message that reads only with the space back decides
    (``Sending process 812914`` + ``closing signal SIGTERM``), read with the line after
    too, joined either way, where the message runs on into it (``closing signal SI`` +
    ``GTERM``), and with the line ``above`` where the message's head is there (a message
    run over three lines, the break undone being its second)."""
    tight = before + after
    if before.endswith(" ") or after.startswith(" "):
        return tight
    spaced = before + " " + after
    wide, narrow = _read(cat, spaced, above or None, following), _read(cat, tight, above or None, following)
    return spaced if narrow < wide else tight  # the space reads more, and loses nothing
