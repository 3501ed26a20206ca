"""The emitter catalog: the messages every emitter that can kill a rank prints, as data.

Each ``*.toml`` file beside this one is one emitter (the torch elastic agent, c10d, the CUDA
runtime, the kernel, glibc, Slurm, Kubernetes, ...), each ``[[message]]`` one message shape
recorded from the emitter's source (README.md says how to add one). ``catalog()`` loads
them once; ``Catalog.scan`` finds them in log lines. ``trainwatch diagnose`` and the live
daemon read ranks' output, agents' logs, error files and kernel records through the same
catalog, so a message learnt once is known on both paths.

A message carries what it can decide on its own: the ``kind`` of killer it names, its
``layer`` (a mechanism beats a symptom; a report never decides), the highest
``confidence`` it may carry alone, and whether it is ``first_hand`` (the dying process's or
the killer's own word). Patterns are searched in lines the caller has already stripped of
prefixes; each message's literal words are looked for first, so a line costs a substring
test or a few per message, and the regular expression runs only where its words are.
"""

from __future__ import annotations

import logging
import re
import sys
from bisect import bisect_right
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

from sidecar.model import Confidence, Kind

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - 3.10
    import tomli as tomllib  # type: ignore[no-redef, import-not-found, unused-ignore]

__all__ = [
    "CHANNELS",
    "LAYERS",
    "Catalog",
    "CatalogError",
    "Hit",
    "Message",
    "catalog",
    "literal_runs",
    "load",
]

log = logging.getLogger(__name__)

LAYERS = ("mechanism", "symptom", "report", "context")
# where a message is written: the process's own output (stderr, its error file), the
# launcher's or agent's log, the kernel log, a shell, a scheduler or container runtime
CHANNELS = ("output", "agent", "kernel", "shell", "scheduler")
LINE_MAX = 4096  # what a scan looks at of one line: a message is far shorter; longer is glued or hostile


_SAYS_FIELD = re.compile(r"\{(\w+)\}")
_MISSING_ASIDE = re.compile(r" ?\((?=[^()]{0,60}\x00)[^()]{0,60}\)")
_MISSING_AMOUNT = re.compile(r"(?: (?:after|of|for|with))? \x00 (?:ms|s|bytes|B|KiB|MiB|GiB|TiB|free|left)\b")
_MISSING = re.compile(
    r"(?: (?:on|in|of|for|at|by|from|with))?"
    r"(?: (?:local rank|rank|pid|node|GPU|seq|exit code|code|thread|container))? ?\x00"
)


class CatalogError(ValueError):
    """A catalog file that does not follow README.md's format."""


@dataclass(frozen=True, slots=True)
class Message:
    """One message shape of one emitter (README.md's fields)."""

    id: str
    emitter: str
    versions: str
    source: str
    format: str
    pattern: re.Pattern[str]
    kind: Kind | None
    layer: str
    confidence: Confidence
    first_hand: bool
    mechanism: str
    says: str
    real: tuple[tuple[str, str], ...]  # (url, text)
    channel: str
    generic: bool  # its shape is any death of its kind (any exception's last line, any terminate)
    anchors: tuple[str, ...]  # literal words one of which every match holds (see _anchors)
    fold: bool  # the pattern ignores case
    exit_code: int | None = None  # the status its emitter's source fixes for the process it reports
    vetoes: tuple[str, ...] = ()  # messages whose exit status, beside this one, no process ended with
    # a report that another process of the job (a worker, an actor, a child) died abruptly,
    # with no word of its own on why: a memory killer's record of the job explains it
    relays_death: bool = False
    # a fatal-signal handler's report, from inside the process, of the signal it caught: a
    # process dies of the first fatal signal it reports; a later one came while it died
    caught: bool = False

    def said(self, fields: tuple[tuple[str, str], ...] | dict[str, str]) -> str:
        """``says`` with its ``{field}`` placeholders filled from what the pattern captured
        (each value cut to 200 characters); a placeholder with nothing captured is left out."""
        values = dict(fields)

        def fill(m: re.Match[str]) -> str:
            value = values.get(m[1])
            return value.strip()[:200] if value else "\x00"

        # a missing value goes with the words that name it ("on rank {rank}", "pid {pid}",
        # "(seq {seq})", "after {ran_ms} ms")
        text = _SAYS_FIELD.sub(fill, self.says)
        text = _MISSING_ASIDE.sub("", _MISSING_AMOUNT.sub("", text))
        text = _MISSING.sub("", text)
        text = re.sub(r"\(\s*\)|\[\s*\]", "", text)
        return re.sub(r" {2,}", " ", text).strip().rstrip(":,").strip()

    def told(self, who: str, fields: tuple[tuple[str, str], ...] | dict[str, str]) -> str:
        """The verdict's sentence: ``who`` (a rank, a pid) and what the message says of it;
        a ``says`` about "the process" is said of ``who`` itself."""
        said = self.said(fields).rstrip(".")  # one full stop, whatever the message ended with
        if said.startswith("the process "):
            return f"{who} {said[len('the process ') :]}."
        return f"{who}: {said}."

    def untold_sigterm(self, signal: str | None) -> bool:
        """A word that SIGTERM came (a launcher's, Lightning's) names no sender: a scheduler or a
        kill, or as well an OOM daemon (earlyoom) or an eviction: external_signal at most
        possible. ``signal``: what the pattern captured, if it captures the signal."""
        if self.kind != Kind.EXTERNAL_SIGNAL:
            return False
        return (signal or "").strip().removeprefix("Signals.") in ("15", "SIGTERM") or (
            signal is None and "SIGTERM" in self.format
        )

    @property
    def decides(self) -> bool:
        """It names a killer: a mechanism or a symptom with a kind, or a report of what
        happened elsewhere that names its kind (it decides last, and at most possible)."""
        if self.kind is None or self.layer == "context":
            return False
        return self.layer != "report" or self.kind != Kind.AGENT_TEARDOWN


@dataclass(frozen=True, slots=True)
class Hit:
    """A message found in a line: the line as scanned and the fields its pattern captured."""

    message: Message
    line: str
    fields: tuple[tuple[str, str], ...]

    def get(self, name: str) -> str | None:
        got = next((v for k, v in self.fields if k == name), None)
        if got is None and name == "exit_code" and self.message.exit_code is not None:
            return str(self.message.exit_code)  # fixed by the emitter's source, not printed
        return got


class Catalog:
    """The messages of every emitter; ``scan`` finds them in a line."""

    def __init__(self, messages: list[Message]) -> None:
        self.messages = tuple(messages)
        self.by_id = {m.id: m for m in messages}
        self._plain = [m for m in messages if not m.fold]
        self._folded = [m for m in messages if m.fold]
        self._parts: dict[tuple[str, ...], Catalog] = {}
        # for scan_lines: each anchor's messages (by catalog order), folded anchors apart
        order = {m.id: i for i, m in enumerate(messages)}
        self._order = order
        self._by_anchor: dict[tuple[str, bool], list[Message]] = {}
        self._anchorless = [m for m in messages if not m.anchors]
        for m in messages:
            for a in m.anchors:
                self._by_anchor.setdefault((a, m.fold), []).append(m)
        # for scan: the anchors by their first two characters (an anchor is 4 or longer)
        self._by_pair: dict[str, list[tuple[str, list[Message]]]] = {}
        self._by_pair_folded: dict[str, list[tuple[str, list[Message]]]] = {}
        self._unindexed = [m for m in messages if not m.anchors or any(len(a) < 2 for a in m.anchors)]
        for (a, fold), found in self._by_anchor.items():
            if len(a) < 2:
                continue
            (self._by_pair_folded if fold else self._by_pair).setdefault(a[:2], []).append((a, found))

    def __len__(self) -> int:
        return len(self.messages)

    def scan(self, line: str) -> list[Hit]:
        """Every message found in ``line`` (its first ``LINE_MAX`` characters), in
        catalog order."""
        line = line[:LINE_MAX]
        low = line.lower() if self._folded else line
        todo = {m.id: m for m in self._unindexed}
        # only the anchors that start with a pair of characters the line has are looked for
        for text, index in ((line, self._by_pair), (low, self._by_pair_folded)):
            if not index:
                continue
            for pair in {text[i : i + 2] for i in range(len(text) - 1)}:
                for anchor, messages in index.get(pair, ()):
                    if anchor in text:
                        todo.update((m.id, m) for m in messages)
        hits = []
        for m in sorted(todo.values(), key=lambda m: (m.fold, self._order[m.id])):
            found = m.pattern.search(line)
            if found is not None:
                hits.append(_hit(m, line, found))
        return hits

    def scan_lines(self, lines: list[str]) -> list[list[Hit]]:
        """``scan`` of every line, the same hits, found faster on long texts: each anchor
        is looked for once in the whole text (``str.find``), and only the lines an anchor
        is in are searched with the patterns of its messages. A rank's output of
        megabytes is read at every death."""
        return self._scan_lines(lines)[0]

    def _scan_lines(self, lines: list[str]) -> tuple[list[list[Hit]], dict[int, set[str]]]:
        cut = [line[:LINE_MAX] for line in lines]
        joined = "\n".join(cut)
        starts = [0]
        for line in cut[:-1]:
            starts.append(starts[-1] + len(line) + 1)
        lowered = joined.lower() if any(fold for _, fold in self._by_anchor) else joined
        candidates: dict[int, set[str]] = {}
        for (anchor, fold), messages in self._by_anchor.items():
            text = lowered if fold else joined
            at = text.find(anchor)
            while at >= 0:
                index = bisect_right(starts, at) - 1
                candidates.setdefault(index, set()).update(m.id for m in messages)
                nxt = starts[index + 1] if index + 1 < len(starts) else len(text)
                at = text.find(anchor, nxt)
        out: list[list[Hit]] = [[] for _ in cut]
        for index in range(len(cut)) if self._anchorless else sorted(candidates):
            ids = candidates.get(index, set())
            line = cut[index]
            todo = sorted(
                [self.by_id[i] for i in ids] + self._anchorless, key=lambda m: (m.fold, self._order[m.id])
            )
            for m in todo:
                found = m.pattern.search(line)
                if found is not None:
                    out[index].append(_hit(m, line, found))
        return out, candidates

    def part(self, *channels: str, deciding: bool = False, reports: bool = False) -> Catalog:
        """The messages written on ``channels`` (those that decide alone, with
        ``deciding``; with ``reports`` too, those that report a failure elsewhere and name no
        killer), as a catalog of their own; made once."""
        key = (*channels, "deciding" if deciding else "", "reports" if reports else "")
        part = self._parts.get(key)
        if part is None:
            part = Catalog(
                [
                    m
                    for m in self.messages
                    if m.channel in channels
                    and (m.decides or not deciding or (reports and m.layer == "report" and m.kind is None))
                ]
            )
            self._parts[key] = part
        return part

    def emitters(self) -> list[str]:
        return sorted({m.emitter for m in self.messages})


def _hit(m: Message, line: str, found: re.Match[str]) -> Hit:
    return Hit(m, line, tuple((k, v) for k, v in found.groupdict().items() if v is not None))


def _parse(pattern: re.Pattern[str]) -> Any:
    """The parsed form of a compiled pattern (the re module's own parser), None when that
    parser's details differ from what is read here."""
    try:
        from re import _parser as parser  # type: ignore[attr-defined]
    except ImportError:  # pragma: no cover - before 3.11
        import sre_parse as parser
    try:
        return parser, parser.parse(pattern.pattern, pattern.flags)
    except Exception:  # a parser detail changed: no literal words known
        return parser, None


def literal_runs(pattern: re.Pattern[str], shortest: int = 4) -> list[str]:
    """Every run of literal characters (``shortest`` or longer) anywhere in a pattern, in
    optional parts and alternatives too, case as written."""
    parser, tree = _parse(pattern)
    runs: list[str] = []

    def walk(items: Any) -> None:
        run: list[str] = []
        for op, arg in items:
            if op is parser.LITERAL:
                run.append(chr(arg))
                continue
            runs.append("".join(run))
            run = []
            if op is parser.SUBPATTERN:
                walk(arg[3])
            elif op is parser.BRANCH:
                for alternative in arg[1]:
                    walk(alternative)
            elif op in (parser.MAX_REPEAT, parser.MIN_REPEAT):
                walk(arg[2])
        runs.append("".join(run))

    if tree is not None:
        walk(tree)
    return [r for r in runs if len(r) >= shortest]


def _anchors(pattern: re.Pattern[str]) -> tuple[str, ...]:
    """Literal words one of which every match of ``pattern`` contains: the longest run of
    literal characters of its top level (or of a plain group in it), or, for alternatives,
    one such run from each alternative. () when the pattern has none (it is then searched
    in every line). Lower-case when the pattern ignores case."""
    parser, tree = _parse(pattern)
    if tree is None:
        return ()

    def best(candidates: list[tuple[str, ...]]) -> tuple[str, ...]:
        usable = [c for c in candidates if c and all(c)]
        return max(usable, key=lambda c: min(len(x) for x in c), default=())

    def sequence(items: Any) -> tuple[str, ...]:
        candidates: list[tuple[str, ...]] = []
        run: list[str] = []
        for op, arg in items:
            if op is parser.LITERAL:
                run.append(chr(arg))
                continue
            candidates.append(("".join(run),))
            run = []
            if op is parser.SUBPATTERN and arg[1] == 0 and arg[2] == 0:  # a group, no flag change
                candidates.append(sequence(arg[3]))
            elif op is parser.BRANCH:
                each = [sequence(alternative) for alternative in arg[1]]
                if all(each):
                    candidates.append(tuple(x for alternative in each for x in alternative))
        candidates.append(("".join(run),))
        return best(candidates)

    found = sequence(tree)
    if pattern.flags & re.IGNORECASE:
        found = tuple(x.lower() for x in found)
    return tuple(dict.fromkeys(found))


_FIELDS = (
    "id",
    "versions",
    "source",
    "format",
    "pattern",
    "kind",
    "layer",
    "confidence",
    "first_hand",
    "mechanism",
    "says",
)


def _message(raw: dict[str, Any], emitter: str, channel: str, where: str) -> Message:
    missing = [f for f in _FIELDS if f not in raw]
    if missing:
        raise CatalogError(f"{where}: {raw.get('id', '?')}: missing {', '.join(missing)}")
    ident = str(raw["id"])
    if not ident.startswith(emitter + "."):
        raise CatalogError(f"{where}: {ident}: an id starts with its emitter's id ({emitter}.)")
    try:
        pattern = re.compile(str(raw["pattern"]))
    except re.error as exc:
        raise CatalogError(f"{where}: {ident}: pattern: {exc}") from None
    kind_text = str(raw["kind"])
    try:
        kind = Kind(kind_text) if kind_text else None
        confidence = Confidence(str(raw["confidence"]))
    except ValueError as exc:
        raise CatalogError(f"{where}: {ident}: {exc}") from None
    layer = str(raw["layer"])
    if layer not in LAYERS:
        raise CatalogError(f"{where}: {ident}: layer {layer!r} is not one of {', '.join(LAYERS)}")
    real = tuple((str(r.get("url", "")), str(r.get("text", ""))) for r in raw.get("real", []))
    channel = str(raw.get("channel", channel))
    if channel not in CHANNELS:
        raise CatalogError(f"{where}: {ident}: channel {channel!r} is not one of {', '.join(CHANNELS)}")
    anchors = _anchors(pattern)
    if not real and confidence == Confidence.CERTAIN:
        # a pattern written from the source but never matched against a real log may miss
        # how a version or a wrapper prints it, or catch a neighbour's words: it decides
        # at most `likely` until a real public log confirms it (README.md)
        confidence = Confidence.LIKELY
    return Message(
        id=ident,
        emitter=emitter,
        versions=str(raw["versions"]),
        source=str(raw["source"]),
        format=str(raw["format"]),
        pattern=pattern,
        kind=kind,
        layer=layer,
        confidence=confidence,
        first_hand=bool(raw["first_hand"]),
        mechanism=str(raw["mechanism"]),
        says=str(raw["says"]),
        real=real,
        channel=channel,
        generic=bool(raw.get("generic", False)),
        anchors=anchors,
        fold=bool(pattern.flags & re.IGNORECASE),
        exit_code=int(raw["exit_code"]) if "exit_code" in raw else None,
        vetoes=tuple(str(v) for v in raw.get("vetoes", ())),
        relays_death=bool(raw.get("relays_death", False)),
        caught=bool(raw.get("caught", False)),
    )


def load(texts: dict[str, str]) -> Catalog:
    """A catalog from TOML texts (file name -> text). Raises CatalogError."""
    messages: list[Message] = []
    seen: set[str] = set()
    for name in sorted(texts):
        try:
            doc = tomllib.loads(texts[name])
        except tomllib.TOMLDecodeError as exc:
            raise CatalogError(f"{name}: {exc}") from None
        head = doc.get("emitter", {})
        emitter = str(head.get("id", ""))
        if not emitter:
            raise CatalogError(f"{name}: no [emitter] id")
        for raw in doc.get("message", []):
            m = _message(raw, emitter, str(head.get("channel", "")), name)
            if m.id in seen:
                raise CatalogError(f"{name}: {m.id}: a second message with this id")
            seen.add(m.id)
            messages.append(m)
    for m in messages:
        unknown = [v for v in m.vetoes if v not in seen]
        if unknown:
            raise CatalogError(f"{m.id}: vetoes {', '.join(unknown)}: no such message")
    return Catalog(messages)


# The files the catalog is made of, one per emitter family. A test holds this list equal to
# the folder's *.toml files; an installation that lacks one is broken (a wheel built without
# its data), and loading says so instead of reading fewer messages.
_NAMES = (
    "absl alloc c10d caffe2 cuda gpualloc hsa iris k8s launchers libc linux mpi mxnet nccl nvrm oomd paddle "
    "python sglang sighandlers slurm submitit yarn tcnn torchelastic tvmffi systemd tensorflow vllm xla"
)
FILES = tuple(f"{name}.toml" for name in _NAMES.split())


def texts() -> dict[str, str]:
    """The catalog files shipped with trainwatch: name -> text. Raises CatalogError when one
    of ``FILES`` is not installed."""
    here = resources.files(__name__)
    found = {
        entry.name: entry.read_text(encoding="utf-8")
        for entry in here.iterdir()
        if entry.name.endswith(".toml")
    }
    lost = [name for name in FILES if name not in found]
    if lost:
        raise CatalogError(f"not installed: {', '.join(lost)} (a broken installation: reinstall trainwatchd)")
    return found


@cache
def catalog() -> Catalog:
    """The shipped catalog, loaded once. A shipped file that does not load (the tests load
    every one) must not take the death path with it: the error is logged once and the
    catalog is empty, so the parsers of the structured records still run."""
    try:
        return load(texts())
    except (CatalogError, OSError, UnicodeDecodeError) as exc:
        log.error("the emitter catalog did not load, so messages are not read by it: %s", exc)
        return Catalog([])
