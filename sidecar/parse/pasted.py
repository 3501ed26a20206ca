"""Logs as people paste them, made plain before any rule reads them. Pure.

What a copy adds and what it breaks, undone here:

* colours (ANSI escape sequences) and carriage returns (CRLF files, progress bars that
  redraw a line) are removed; fullwidth ASCII (a CJK locale's or input method's
  punctuation) is read as ASCII;
* prefixes a tool puts on every line are recognised and taken off, and what they say is
  kept: ``srun -l``'s task id (``3: ...``, a rank) becomes the ``[rank3]:`` prefix torch
  itself writes, so the rules attribute the line as they would torch's own; a container
  runtime's ``2026-12-02T11:53:34.123456789Z stdout F `` and ``kubectl logs --prefix``'s
  ``[pod/name/container] `` are dropped; Open MPI's ``[1,3]<stderr>:`` becomes ``[rank3]:``;
* wrapped lines are joined back (``sidecar.parse.wraps``): a terminal's fixed-width
  wrap, a web page's wrap at spaces, and any break a catalog message runs across; lines a
  copy glued into one (each with torch's ``[rankN]:`` prefix, or a traceback's header inside
  a line) are split again.
"""

from __future__ import annotations

import itertools
import re

from sidecar.catalog import catalog
from sidecar.parse.wraps import join

__all__ = ["launched_by_agent", "plain", "plain_all", "plain_output"]

_ANSI = re.compile(r"\x1b\[[0-9;?]{0,32}[ -/]{0,4}[@-~]|\x1b[@-_]")
_SRUN = re.compile(r"^ {0,4}(\d{1,6}): ")
_CRI = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d{1,9})?(?:Z|[+-]\d\d:\d\d) (?:stdout|stderr) [FP] ")
_DOCKER_JSONISH = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{1,9}Z ")  # docker logs -t
_KUBECTL = re.compile(r"^\[pod/[\w.-]{1,253}/[\w.-]{1,253}\] ")
# Determined's task logs (master/pkg/model task.go TaskLog.Message: "[<RFC 3339 time>]
# <container id, 8 characters, or 8 spaces> [rank=N] || [LEVEL: ]<line>", the level the one
# ship_logs.py took off the line's own start, so left on); experiment.go's older
# "[<time>] [<container>] [rank=N] || "), and its launch layer's own prefix on every worker line
# (harness/determined/launch/wrap_rank.py: "[rank=N] "): the rank becomes torch's "[rankN]:"
_DETERMINED = re.compile(
    r"^(?:<[^>\n]{0,40}>\s{0,12})?(?:\[\d{4}-\d\d-\d\d[T ][\d:.]{8,16}Z?\]\s{1,2}"
    r"(?:\[?[0-9a-f]{1,8}\]?|\s{8})\s(?:\[rank=(?P<rank>\d{1,6})\]\s)?\|\|(?:\s|$)"
    r"|\[rank=(?P<wrapped>\d{1,6})\]\s)"
)
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
# Open MPI's --tag-output (mpirun -tag-output, horovodrun): "[jobid,rank]<stderr>:" before each
# line of a process's output (orte iof, "[%s,%d]<%s>:"; --timestamp-output puts ctime's date
# before it); Horovod's Gloo runner writes "[rank]<stderr>:"
_MPI_STAMP = r"(?:[A-Z][a-z]{2} [A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d \d{4})?"
_MPI_TAG = re.compile(
    rf"^{_MPI_STAMP}(?P<tag>\[(?:\d{{1,9}},)?(?P<rank>\d{{1,6}})\]<(?:stdout|stderr|stddiag)>:) ?"
)
_NAMES_RANK = re.compile(r"^\s{0,4}\[rank(\d{1,6})\]:|\[Rank (\d{1,6})\]")
# a copy whose selection began inside the first line's torch prefix ("ank7]:[E126 ..."): the
# prefix's rest still names the rank the line is from
_CUT_RANK = re.compile(r"^(?:rank|ank|nk)(?=\d{1,6}\]:)")


# fullwidth forms of ASCII (U+FF01-FF5E) and the ideographic space, as ASCII: a CJK locale's
# translations (bash's "已放弃（核心已转储）") and a copy through a CJK input method or site
# turn an emitter's ASCII punctuation fullwidth, which no log message means
_FULLWIDTH = {0xFF01 + i: 0x21 + i for i in range(0x5E)} | {0x3000: 0x20}
_WIDE_OPEN = re.compile(r"(?<=[^\s\uff08\uff3b])[\uff08\uff3b]")  # （ ［ after a non-space


def _strip(line: str) -> str:
    if not line.isascii():
        # a fullwidth bracket carries its own spacing: the space before it was dropped
        line = _WIDE_OPEN.sub(" \\g<0>", line).translate(_FULLWIDTH)
    line = _shown(line)
    m = _CRI.match(line) or _DOCKER_JSONISH.match(line) or _KUBECTL.match(line)
    if m:
        line = line[m.end() :]
    m = _JOURNAL.match(line)
    if m and not _DAEMONS.match(m["ident"]):
        line = line[m.end() :]
    if ("||" in line or "[rank=" in line) and (m := _DETERMINED.match(line)):
        line = _strip(line[m.end() :])  # wrap_rank's prefix under the master's
        rank = m["rank"] or m["wrapped"]
        if rank is not None and not _TORCH_RANK.match(line):
            line = f"[rank{rank}]: {line}"
    return line


def _shown(line: str) -> str:
    """A line as a terminal or a page showed it: its colours gone, a redrawn line as drawn
    last (a CRLF end dropped), a markdown escape as the page shows it (``\\#``: a ``#`` at a
    line's start would make a heading); its prefixes on."""
    if "\x1b" in line:
        line = _ANSI.sub("", line)
    if "\r" in line:
        line = line.rstrip("\r").rsplit("\r", 1)[-1]
    return line.replace("\\#", "#") if "\\#" in line else line


def _added_after(shown: list[int], was: list[str], now: list[str]) -> None:
    """``shown`` less what came off each line between ``was`` and ``now``: a prefix put on
    after the copy wrapped the line (a viewer's line numbers, a quote's markers), which the
    wrap's width never held."""
    for i, (a, b) in enumerate(zip(was, now, strict=True)):
        if a != b:
            shown[i] -= len(a) - len(b)


_QUOTE = re.compile(r"^ {0,3}>(?: |$)")


def _unquoted(lines: list[str]) -> list[str]:
    """A markdown quote copied as it shows (``> `` before each line of someone's log) without
    its markers."""
    if not (_family(lines, _QUOTE) or _all_carry(lines, _QUOTE)):
        return lines
    return [_strip(line[m.end() :]) if (m := _QUOTE.match(line)) else line for line in lines]


# docker compose's "<service>-<n>  | " before each line of a service (padded to the longest
# name; a report that groups lines may leave the name out), a column of "| " in all
_COMPOSE = re.compile(r"^\s{0,16}(?:[\w.-]{1,64}\s{1,16})?\| ")


def _uncolumned(lines: list[str]) -> list[str]:
    """docker compose's service column (``trainer-1  | ``) off each line that carries it,
    where most lines do."""
    if not _family(lines, _COMPOSE):
        return lines
    return [_strip(line[m.end() :]) if (m := _COMPOSE.match(line)) else line for line in lines]


# markdown's bold markers around text a log's line starts with (after srun's task id and a
# rank's prefix): a log pasted into an issue outside a code block, its important line made
# bold. Never a line of asterisks (torchrun's OMP_NUM_THREADS banner), nor "**kwargs" inside
# a line
_BOLD = re.compile(r"^((?:\d{1,6}: )?(?:\[[\w ]{1,20}\]: ?)*)\*\*([^*\s](?:[^*]{0,2000}[^*\s])?)\*\*")


def _unbolded(lines: list[str]) -> list[str]:
    return [_BOLD.sub(r"\1\2", line, count=1) if "**" in line else line for line in lines]


# torch writes its ``[rankN]:`` prefix at the start of each line a rank prints, never inside
# one: a line that begins with it and holds it again after a space is lines whose newlines a
# copy lost (a web page that showed the log as one paragraph)
_RANK_AGAIN = re.compile(r" (?=\[rank\d{1,6}\]:)")


# Python's traceback module writes its header as a line of its own: inside a line (after an
# exception's name, a markdown backtick), the copy lost the newline before it
# (not after a prefix's colon: "[rank1]:Traceback" is torch's, srun's or mpirun's line start)
_TRACEBACK_AGAIN = re.compile(r"(?<=[^\s:])(?=Traceback \(most recent call last\):)")


_BARE_RANK = re.compile(r"^\s{0,4}\[rank\d{1,6}\]:\s*$")


def _unglued(lines: list[str]) -> list[str]:
    """Lines whose newlines a copy lost, split again: at each ``[rankN]:`` inside a line that
    begins with one (in a text that holds such a line, inside any line: a page wrapped the
    paragraph anywhere), before a traceback's header inside a line. A rank prefix the split
    left alone at a line's end takes the next line (the page put its words there)."""
    glued = any(" [rank" in line and _TORCH_RANK.match(line) and _RANK_AGAIN.search(line) for line in lines)
    out: list[str] = []
    for line in lines:
        if " [rank" in line and (glued or _TORCH_RANK.match(line)) and _RANK_AGAIN.search(line):
            out.extend(_strip(piece) for piece in _RANK_AGAIN.split(line))
        elif "Traceback (most" in line and _TRACEBACK_AGAIN.search(line):
            out.extend(_TRACEBACK_AGAIN.split(line))
        elif glued and out and _BARE_RANK.match(out[-1]) and line and not _TORCH_RANK.match(line):
            out[-1] = f"{out[-1].rstrip()} {line}"
        else:
            out.append(line)
    return out


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
_TASK_BEFORE_RANK = re.compile(r"^(?: {0,4}\d{1,6}: ){1,3}(?=\s{0,4}\[(?:rank|default)\d{1,6}\]:)")


def _srun_tasks(lines: list[str]) -> bool:
    """Most non-empty lines carry ``srun -l``'s ``N: `` task prefix, or every one of a few
    does and one of them before torch's own ``[rankN]:`` (``7: [rank7]:...``) or a catalog
    message (``0: RuntimeError: DataLoader worker ... is killed``): the others are its wrap's
    pieces or its other lines."""
    filled = [line for line in lines if line.strip()]
    if _family(lines, _SRUN):
        return True

    def tagged(line: str) -> bool:  # a task id before torch's prefix or a known message
        m = _SRUN.match(line)
        return m is not None and (
            _SRUN_TORCH.match(line) is not None or bool(catalog().scan(line[m.end() :]))
        )

    return (
        0 < len(filled) < 3
        and all(_SRUN.match(line) for line in filled)
        and any(tagged(line) for line in filled)
    )


def _tags_are_ranks(named: dict[str, set[str]], nodes: bool) -> bool:
    """A launcher's per-process tags (srun's task ids, mpirun's ranks; ``named``: the ranks
    each tag's lines name) are the ranks where it started them itself: several tags, none
    under an agent that starts ranks of its own (``nodes``), and no tag's lines naming a
    rank other than its own."""
    return not nodes and len(named) > 1 and all(said <= {tag} for tag, said in named.items())


def _unchunked(rest: str, tag: str) -> str:
    """A tagged line less its own tag inside it: orte's iof puts the tag before each chunk it
    reads from the process's pipe, not before each line, so a line written in several writes
    (faulthandler's ``Fatal Python error: `` then ``Segmentation fault``) comes out with the
    tag between its pieces. Only that process's tag on that stream is taken out, and only
    after the line's first character: iof writes no empty chunk, so a tag right after the
    tag is no chunk's but a second launcher's (a tagged log run through mpirun again)."""
    if tag not in rest[1:]:
        return rest
    return rest[:1] + re.sub(_MPI_STAMP + re.escape(tag), "", rest[1:])


def _untagged(lines: list[str], nodes: bool) -> list[str]:
    """Open MPI's (and Horovod's) output tags taken off. A tagged process is a rank where
    mpirun started the ranks itself (as for srun's tasks: several processes, and no line of
    one names a rank other than its own): its lines get its rank's ``[rankN]:`` prefix
    (unless torch wrote one). Under a launcher (the elastic agent's lines) a process is a
    node's."""
    if not any("]<std" in line for line in lines[:2000]):
        return lines
    named: dict[str, set[str]] = {}
    for line in lines:
        if (m := _MPI_TAG.match(line)) is not None:
            named.setdefault(m["rank"], set()).update(
                r[1] or r[2] for r in _NAMES_RANK.finditer(line[m.end() :])
            )
    nodes = not _tags_are_ranks(named, nodes)
    out = []
    for line in lines:
        if (m := _MPI_TAG.match(line)) is not None:
            rest = _strip(_unchunked(line[m.end() :], m["tag"]))  # Determined's prefix under it
            out.append(rest if nodes or _TORCH_RANK.match(rest) else f"[rank{m['rank']}]:{rest}")
        elif (t := _TORCH_RANK.match(line)) is not None and (m := _MPI_TAG.match(line[t.end() :].lstrip())):
            out.append(line[: t.end()] + " " + line[t.end() :].lstrip()[m.end() :])  # the rank said once
        else:
            out.append(line)
    return out


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
    ranks = _tags_are_ranks(named, nodes)
    out = []
    for line in lines:
        m = _SRUN.match(line)
        if m is None:
            out.append(line)
            continue
        rest = _strip(line[m.end() :])  # what the copy put under the task id
        out.append(f"[rank{m[1]}]:{rest}" if ranks and not _TORCH_RANK.match(rest) else rest)
    return out


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
    returns, a markdown quote's markers (a paste's only) and line prefixes removed, ``srun -l``
    task ids turned into ``[rankN]:`` prefixes where srun started the ranks (no text holds the
    elastic agent's lines), and wrapped messages joined. A prefix family one text shows (three
    lines or more) is also taken off a shorter text all of whose lines carry it."""
    split = [[_strip(line) for line in text.split("\n")] for text in texts]
    # each line's length as shown before its prefixes came off: a program wrote them (Open
    # MPI's tags, a task log's header) before a terminal or a page wrapped the line
    shown = [[len(_shown(line)) for line in text.split("\n")] for text in texts] if unwrap else []
    if unwrap:  # a copy from a web page; a program's own output keeps what it wrote
        quoted = split
        split = [_unquoted(lines) for lines in split]
        # a quote's markers and a viewer's line numbers were put on after the copy wrapped
        for widths, was, now in zip(shown, quoted, split, strict=True):
            _added_after(widths, was, now)
    agents = launched_by_agent(texts)
    numbered = [_numbered(lines) for lines in split]
    tasks = [_srun_tasks(lines) for lines in split]
    out = []
    for n, (lines, num, task) in enumerate(zip(split, numbered, tasks, strict=True)):
        if num:
            was = lines
            lines = [_strip(line[m.end() :]) if (m := _LINENO.match(line)) else line for line in lines]
            if unwrap:
                _added_after(shown[n], was, lines)
        for _ in range(3):  # after a viewer's line numbers; tags inside tags (a copy of a copy)
            untagged = _untagged(lines, agents)
            if untagged == lines:
                break
            lines = untagged
        if task or (any(tasks) and _all_carry(lines, _SRUN)):
            lines = _untagged(_untask(lines, agents), agents)  # srun ran mpirun's processes
        if unwrap:  # after the line numbers and task ids a copy or srun put before them
            was, lines = lines, _unquoted(lines)  # a quote copied under the prefixes
            _added_after(shown[n], was, lines)
            # wraps joined before glued lines are split (a wrap cuts a glued line anywhere) and
            # before compose's column comes off (the program wrote it, a terminal then wrapped)
            prefixed = [len(line) for line in lines] != shown[n]
            lines = _unbolded(_unglued(_uncolumned(join(lines, shown[n] if prefixed else None).split("\n"))))
        # srun's task id left before torch's own rank prefix (under a viewer's numbers, a tag,
        # another id, or on a wrapped line's first piece): torch's prefix names the rank
        lines = [_TASK_BEFORE_RANK.sub("", line, count=1) if ": [" in line else line for line in lines]
        if unwrap and (m := _CUT_RANK.match(lines[0])):
            lines[0] = "[rank" + lines[0][m.end() :]
        out.append("\n".join(lines))
    return out
