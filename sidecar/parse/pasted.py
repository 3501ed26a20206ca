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

import itertools
import re

from sidecar.catalog import Catalog, Hit, catalog, literal_runs

__all__ = ["launched_by_agent", "plain", "plain_all", "plain_output"]

_ANSI = re.compile(r"\x1b\[[0-9;?]{0,32}[ -/]{0,4}[@-~]|\x1b[@-_]")
_SRUN = re.compile(r"^ {0,4}(\d{1,6}): ")
_CRI = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d{1,9})?(?:Z|[+-]\d\d:\d\d) (?:stdout|stderr) [FP] ")
_DOCKER_JSONISH = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{1,9}Z ")  # docker logs -t
_KUBECTL = re.compile(r"^\[pod/[\w.-]{1,253}/[\w.-]{1,253}\] ")
# a log viewer's or a paste site's line numbers: "[1787] "
_LINENO = re.compile(r"^\[(\d{1,9})\] ")
# journalctl's short and short-iso formats: "Dec 02 11:53:34 host ident[pid]: "
_JOURNAL = re.compile(
    r"^(?:[A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d"
    r"|\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d{1,9})?(?:Z|[+-]\d\d:?\d\d)?) "
    r"[\w.-]{1,253} (?P<ident>[\w.@/-]{1,128}?)(?:\[\d{1,10}\])?: "
)
# the journal's writers whose records are read with their stamp (the kernel's, the OOM
# daemons', the schedulers' and container runtimes'): only a program's own output (a rank, the
# agent, a shell) is made plain, so its tracebacks and rank prefixes start the line again
_DAEMONS = re.compile(
    r"^(?:kernel|systemd(?:-[\w-]{1,40})?|earlyoom|nohang|oomd|kubelet|containerd|dockerd|crio|"
    r"slurmstepd|slurmd|slurmctld|nvidia-[\w-]{1,40}|nv-hostengine|talos[\w-]{0,40}|machined)$"
)
# a launcher's lines in the text: srun then started torchrun agents (one task a node), not ranks
_AGENT = re.compile(
    r"torch\.distributed\.elastic|torch/distributed/elastic|\btorchrun\b|torch\.distributed\.run|"
    r"torch\.multiprocessing\.spawn|deepspeed/launcher|\[launch\.py:\d"
)
_TORCH_RANK = re.compile(r"^\s{0,4}\[(?:rank|default)\d{1,6}\]:")
_NAMES_RANK = re.compile(r"^\s{0,4}\[rank(\d{1,6})\]:|\[Rank (\d{1,6})\]")
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
    m = _JOURNAL.match(line)
    if m and not _DAEMONS.match(m["ident"]):
        line = line[m.end() :]
    return line


def _family(lines: list[str], prefix: re.Pattern[str]) -> bool:
    """Most non-empty lines carry ``prefix`` (one line with it is not a family: ``0: `` or
    ``[12] `` may be anyone's text)."""
    filled = [line for line in lines[:2000] if line.strip()]
    tagged = sum(1 for line in filled if prefix.match(line))
    return len(filled) >= 3 and tagged >= 0.6 * len(filled)


def _all_carry(lines: list[str], prefix: re.Pattern[str]) -> bool:
    """A short text (under three lines) every line of which carries ``prefix``: it is of a
    family the longer texts pasted with it show."""
    filled = [line for line in lines if line.strip()]
    return 0 < len(filled) < 3 and all(prefix.match(line) for line in filled)


def _numbered(lines: list[str]) -> bool:
    """A line-number family: most lines carry ``[N] `` and the numbers mostly count up (a
    text every line of which is numbered one after the other, however short, too)."""
    numbers = [int(m[1]) for m in map(_LINENO.match, lines[:2000]) if m]
    rising = sum(1 for a, b in itertools.pairwise(numbers) if b == a + 1)
    if _all_carry(lines, _LINENO) and rising == len(numbers) - 1:
        return True
    return _family(lines, _LINENO) and rising >= 0.5 * (len(numbers) - 1)


_SRUN_TORCH = re.compile(r"^ {0,4}\d{1,6}: \s{0,4}\[(?:rank|default)\d{1,6}\]:")


def _srun_tasks(lines: list[str]) -> bool:
    """Most non-empty lines carry ``srun -l``'s ``N: `` task prefix, or every one of a few
    does before torch's own ``[rankN]:`` (``7: [rank7]:...``) or a catalog message
    (``0: RuntimeError: DataLoader worker ... is killed``)."""
    filled = [line for line in lines if line.strip()]
    if _family(lines, _SRUN):
        return True

    def tagged(line: str) -> bool:  # a task id before torch's prefix or a known message
        m = _SRUN.match(line)
        return m is not None and (
            _SRUN_TORCH.match(line) is not None or bool(catalog().scan(line[m.end() :]))
        )

    return 0 < len(filled) < 3 and all(tagged(line) for line in filled)


def _untask(lines: list[str], nodes: bool) -> list[str]:
    """``srun -l``'s task ids taken off. A task is a rank when srun started the ranks
    itself: several tasks, and no task's lines name a rank other than its own (torch's
    ``[rankN]:``, the watchdog's ``[Rank N]``); then a line torch has not prefixed gets its
    task's ``[rankN]:``. Otherwise a task is a node or a launcher that started several
    ranks (the elastic agent's lines, ``mp.spawn``): the ranks' own words are all that
    says who wrote a line."""
    named: dict[str, set[str]] = {}
    for line in lines:
        m = _SRUN.match(line)
        if m is not None:
            named.setdefault(m[1], set()).update(r[1] or r[2] for r in _NAMES_RANK.finditer(line[m.end() :]))
    ranks = not nodes and len(named) > 1 and all(said <= {task} for task, said in named.items())
    out = []
    for line in lines:
        m = _SRUN.match(line)
        if m is None:
            out.append(line)
            continue
        rest = line[m.end() :]
        out.append(f"[rank{m[1]}]:{rest}" if ranks and not _TORCH_RANK.match(rest) else rest)
    return out


def _crossing(cat: Catalog, parts: list[str], glues: tuple[str, ...]) -> bool:
    """A catalog message runs across the first break of ``parts`` joined with ``glues``
    (one a break):
    it starts before the break, ends after it, and the line before the break does not
    hold it from the same start (a pattern whose tail takes any text would otherwise run
    on into whatever line follows), or holds it with fewer of its fields captured (an
    optional tail, a number, that the next line carries)."""
    joined = parts[0] + "".join(g + p for g, p in zip(glues, parts[1:], strict=True))
    before = parts[0]
    edge = len(before)
    for hit in cat.scan(joined):
        if hit.message.generic:  # any exception's last line takes any text: not a shape to join by
            continue
        rx = hit.message.pattern
        for m in rx.finditer(joined):
            if m.start() < edge < m.end():
                own = rx.search(before, m.start())
                if own is None or own.start() != m.start():
                    return True
                # the line alone holds the message but leaves a field the next line fills
                # (the watchdog's "ran for" + "600060 milliseconds ...")
                filled = sum(g is not None for g in m.groups())
                if filled > sum(g is not None for g in own.groups()) and own.end() <= edge:
                    return True
                # ... or a run of the message's own words (" milliseconds before timing out")
                if own.end() <= edge:
                    tail = joined[edge : m.end()]
                    if any(len(run.strip()) >= 10 and run.strip() in tail for run in literal_runs(rx)):
                        return True
    return False


def launched_by_agent(texts: list[str]) -> bool:
    """The logs hold a launcher's lines that start the ranks (the torch elastic agent,
    ``mp.spawn``, DeepSpeed's launcher): srun started that launcher, one task a node."""
    return any(_AGENT.search(text) for text in texts)


def plain(text: str) -> str:
    """One text made plain (``plain_all`` of it alone)."""
    return plain_all([text])[0]


def plain_output(text: str) -> str:
    """A process's output as the live daemon reads it from a file: colours, carriage
    returns (a progress bar's redraws) and carried prefixes removed, as for a paste, but no
    line joined (a program writes whole lines; only a copy wraps them)."""
    return plain_all([text], unwrap=False)[0]


def plain_all(texts: list[str], unwrap: bool = True) -> list[str]:
    """Texts pasted together (the files of one incident), each with colours, carriage
    returns and line prefixes removed, ``srun -l`` task ids turned into ``[rankN]:``
    prefixes where srun started the ranks (no text holds the elastic agent's lines), and
    wrapped messages joined. A prefix family one text shows (three lines or more) is also
    taken off a shorter text all of whose lines carry it."""
    split = [[_strip(line) for line in text.split("\n")] for text in texts]
    agents = launched_by_agent(texts)
    numbered = [_numbered(lines) for lines in split]
    tasks = [_srun_tasks(lines) for lines in split]
    out = []
    for lines, num, task in zip(split, numbered, tasks, strict=True):
        if num:
            lines = [_strip(line[m.end() :]) if (m := _LINENO.match(line)) else line for line in lines]
        if task or (any(tasks) and _all_carry(lines, _SRUN)):
            lines = _untask(lines, agents)
        out.append(_join(lines) if unwrap else "\n".join(lines))
    return out


def _join(lines: list[str]) -> str:
    """Wrapped lines joined: a terminal's fixed-width wrap, then a catalog message run
    across a break."""
    if len(lines) > JOIN_MAX_LINES:
        return "\n".join(lines)
    lines = _unwrap_web(_unwrap_fixed(lines))
    cat = catalog()
    found = cat.scan_lines(lines)  # each line's own messages, found once
    joined: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        span = (
            _run(cat, joined[-1], lines[i : i + RUN_MAX], found[i])
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


# how a record starts: a rank's or a launcher's prefix, a log level, a timestamp, a traceback's
# lines. A line that starts so is never the continuation of a wrapped one.
_RECORD_START = re.compile(
    r"^(?:\[(?:rank|default)\d{1,6}\]:|\[[EWIF] |\[?[EWIF]\d{4} \d\d:|\[?\d{4}-\d\d-\d\d[ T]|"
    r"\[\s{0,12}\d{1,12}\.\d{1,9}\]|"
    r"(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun|Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec) |"
    r"Traceback \(|\s{2}File \"|(?:INFO|WARNING|ERROR|DEBUG|CRITICAL)[:\s]|\d{1,6}: )"
)


def _unwrap_fixed(lines: list[str]) -> list[str]:
    """A terminal wraps at a fixed width: every piece of a long record but its last is
    exactly as long as the widest line. When several lines share that width (and it is a
    terminal's, 40 columns or more), each of them continues on the next line, unless that
    line starts a record of its own (a log's lines of one length are not a wrap)."""
    width = max((len(line) for line in lines), default=0)
    full = sum(1 for line in lines if len(line) == width)
    if width < 40 or full < 3 or full * 20 < sum(1 for line in lines if len(line) >= 40):
        return lines
    out: list[str] = []
    carry = False
    cat = catalog()
    for i, line in enumerate(lines):
        if carry and not _RECORD_START.match(line):
            following = lines[i + 1] if i + 1 < len(lines) else ""
            out[-1] = _glued(cat, out[-1], line, "" if _RECORD_START.match(following) else following)
        else:
            out.append(line)
        carry = len(line) == width
    return out


def _unwrap_web(lines: list[str]) -> list[str]:
    """A web page (or an editor) wraps at the last space before its width and drops that
    space: the line before such a break is long (most of the width), the next one does not
    start with a space nor a record of its own, and its first word would not have fitted
    on the line before. When a text has several such breaks, each is undone with the space
    put back. A log that was never wrapped has few: its long lines are followed by a new
    record, an indented line, or a word that would have fitted."""
    width = max((len(line) for line in lines), default=0)
    if width < 40:
        return lines

    def broken(before: str, after: str) -> bool:
        if (
            not before
            or not after
            or before[-1].isspace()
            or after[0].isspace()
            or _RECORD_START.match(after)
        ):
            return False
        word = after.split(" ", 1)[0]
        return len(before) >= 0.6 * width and len(before) + 1 + len(word) > width

    breaks = sum(1 for a, b in itertools.pairwise(lines) if broken(a, b))
    long = sum(1 for line in lines if len(line) >= 0.6 * width)
    if breaks < 3 or breaks < 0.2 * long:
        return lines
    out: list[str] = []
    cat = catalog()
    for line in lines:
        if out and broken(out[-1][-width:], line) and len(out[-1]) < LINE_MAX:
            # the space back, unless the words read only without it (a word the copy cut:
            # ``closing signal SI`` + ``GTERM``)
            spaced, tight = out[-1] + " " + line, out[-1] + line
            wide = {h.message.id for h in cat.scan(spaced)}
            narrow = {h.message.id for h in cat.scan(tight)}
            out[-1] = tight if wide < narrow else spaced
        else:
            out.append(line)
    return out


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

    def found(text: str) -> set[str]:
        ids = {h.message.id for h in cat.scan(text)}
        if following:
            for glue in ("", " "):
                ids |= {h.message.id for h in cat.scan(text + glue + following)}
        return ids

    wide, narrow = found(spaced), found(tight)
    return spaced if narrow < wide else tight  # the space reads more, and loses nothing


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
        # the lengths of the heads that end in each character: a break is tried only at them
        self.lengths: dict[str, tuple[int, ...]] = {}
        ends: dict[str, set[int]] = {}
        for head in self.tails:
            ends.setdefault(head[-1], set()).add(len(head))
        self.lengths = {c: tuple(sorted(n)) for c, n in ends.items()}
        # each head's tails as a set, with their distinct lengths: a lookup per length
        self.sets = {h: (frozenset(t), tuple(sorted({len(x) for x in t}))) for h, t in self.tails.items()}

    def crossed(self, before: str, after: str) -> bool:
        trimmed = before.rstrip(" ")
        if trimmed != before and self._crossed(trimmed, after.lstrip(" ")):
            return True  # the spaces at the break are a pattern's own repeat (`` {1,3}``)
        return self._crossed(before, after)

    def _crossed(self, before: str, after: str) -> bool:
        if not before:
            return False
        for i in self.lengths.get(before[-1], ()):
            if i > len(before):
                break
            found = self.sets.get(before[-i:])
            if found is not None and any(after[:n] in found[0] for n in found[1]):
                return True
        return False


_EDGES: dict[int, _Edges] = {}


def _edges(cat: Catalog) -> _Edges:
    edges = _EDGES.get(id(cat))
    if edges is None:
        edges = _EDGES[id(cat)] = _Edges(cat)
    return edges


def _run(
    cat: Catalog, before: str, after: list[str], hits: list[Hit] | None = None
) -> tuple[int, str] | None:
    """How many of the lines ``after`` continue ``before`` (a message runs across the
    break after it when the first 1..RUN_MAX of them are joined to it), and the text they
    make: each break glued with "" when it fell inside a word or kept its space, with " "
    when the copy dropped it (each break its own: ``failed (exitcode: -6)`` + ``local_rank:
    6 (pid`` + ``: 541332) of binary``)."""
    if len(before) >= LINE_MAX or not after or not after[0]:
        return None
    first = [g for g in _glues(before, after[0]) if _edges(cat).crossed(before + g, after[0])]
    if not first:  # no message's words run across this break: the common case, cheap
        return _reached_back(before, after[0], cat.scan(after[0]) if hits is None else hits)
    for count in range(1, len(after) + 1):
        parts = [before, *after[:count]]
        if not parts[-1] or len(parts[-1]) >= LINE_MAX:
            return None
        rest = [_glues(a, b) for a, b in itertools.pairwise(parts[1:])]
        for glues in itertools.product(first, *rest):
            if _crossing(cat, parts, glues):
                return count, parts[0] + "".join(g + p for g, p in zip(glues, parts[1:], strict=True))
    return None


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
