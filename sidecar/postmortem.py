"""The postmortem: the ``trainwatch.postmortem/v1`` document (CONTRACTS.md), assembled from
a verdict and what the daemon recorded, and its store.

The store writes each document atomically (temp file, fsync, rename) with mode 0640 into
the postmortem directory and keeps the newest ones in memory too, so a full disk or a
read-only directory loses nothing that is being served (the error is logged once). At
start it loads what earlier runs wrote. Ids are validated before any file is touched.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import socket
import threading
from collections import OrderedDict
from datetime import datetime, timezone
from typing import Any

__all__ = ["ID_PATTERN", "PostmortemStore", "iso", "make_id"]

log = logging.getLogger(__name__)

SCHEMA = "trainwatch.postmortem/v1"
ID_PATTERN = re.compile(r"^[0-9]{8}T[0-9]{6}Z-[A-Za-z0-9_.-]{1,64}-[0-9]{1,10}-r[A-Za-z0-9_.-]{1,32}$")
KEEP_IN_MEMORY = 64


def iso(epoch: float | None) -> str | None:
    """ISO-8601 with offset (UTC), millisecond precision."""
    if epoch is None:
        return None
    return datetime.fromtimestamp(epoch, tz=timezone.utc).isoformat(timespec="milliseconds")


def make_id(
    died_at: float, agent_pid: int, rank_label: str, host: str | None = None, restart: int = 0
) -> str:
    """``<UTC second>-<host>-<agent pid>-r<rank>``, plus ``-a<restart>`` for a later worker
    generation (whose rank of the same label may die within the same second)."""
    host = re.sub(r"[^A-Za-z0-9_.-]", "-", (host or socket.gethostname()))[:64] or "host"
    stamp = datetime.fromtimestamp(died_at, tz=timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    label = re.sub(r"[^A-Za-z0-9_.-]", "-", rank_label)[:32] or "x"
    return f"{stamp}-{host}-{agent_pid}-r{label}" + (f"-a{restart}" if restart else "")


class PostmortemStore:
    """Postmortem documents by id, newest last; on disk under ``directory`` when it is usable."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._docs: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._lock = threading.Lock()
        self.written_total = 0
        self._disk_error: str | None = None
        self._load()

    def _load(self) -> None:
        try:
            names = sorted(n for n in os.listdir(self.directory) if n.endswith(".json"))
        except OSError:
            return
        for name in names[-KEEP_IN_MEMORY:]:
            ident = name[:-5]
            if not ID_PATTERN.match(ident):
                continue
            try:
                with open(os.path.join(self.directory, name), encoding="utf-8") as f:
                    doc = json.load(f)
            except (OSError, ValueError) as exc:
                log.warning("postmortem %s is unreadable, skipped: %s", name, exc)
                continue
            if isinstance(doc, dict) and doc.get("schema") == SCHEMA:
                self._docs[ident] = doc
        if self._docs:
            log.info("loaded %d postmortem(s) from %s", len(self._docs), self.directory)

    def put(self, doc: dict[str, Any], first: bool) -> None:
        """Store (or update) a document; ``first`` counts it as a new postmortem."""
        ident = doc["id"]
        with self._lock:
            self._docs[ident] = doc
            self._docs.move_to_end(ident)
            while len(self._docs) > KEEP_IN_MEMORY:
                self._docs.popitem(last=False)
            if first:
                self.written_total += 1
        self._write(ident, doc)

    def _write(self, ident: str, doc: dict[str, Any]) -> None:
        path = os.path.join(self.directory, ident + ".json")
        tmp = path + ".tmp"
        try:
            os.makedirs(self.directory, mode=0o750, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o640)
            try:
                os.write(fd, json.dumps(doc, indent=1, sort_keys=False).encode())
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
            if self._disk_error is not None:
                log.info("postmortem directory %s is writable again", self.directory)
                self._disk_error = None
        except OSError as exc:
            message = f"cannot write postmortem {path}: {exc.strerror}; it is kept in memory and served"
            if message != self._disk_error:
                log.error("%s", message)
                self._disk_error = message
            with contextlib.suppress(OSError):
                os.unlink(tmp)

    def get(self, ident: str) -> dict[str, Any] | None:
        if not ID_PATTERN.match(ident):
            return None
        with self._lock:
            return self._docs.get(ident)

    def documents(self) -> list[dict[str, Any]]:
        """Every document in memory, oldest first."""
        with self._lock:
            return list(self._docs.values())

    def path_of(self, ident: str) -> str | None:
        """The file of a stored postmortem, None when it exists in memory only."""
        path = os.path.join(self.directory, ident + ".json")
        return path if ID_PATTERN.match(ident) and os.path.exists(path) else None

    def newest(self) -> dict[str, Any] | None:
        with self._lock:
            return next(reversed(self._docs.values()), None) if self._docs else None

    def listing(self) -> list[dict[str, Any]]:
        with self._lock:
            docs = list(self._docs.values())
        docs.sort(key=lambda d: d.get("created_at") or "", reverse=True)
        return [
            {
                "id": d["id"],
                "created_at": d.get("created_at"),
                "victim": {"rank": (d.get("victim") or {}).get("rank")},
                "killer": {
                    "kind": (d.get("killer") or {}).get("kind"),
                    "summary": (d.get("killer") or {}).get("summary"),
                },
            }
            for d in docs
        ]


def _size(n: Any) -> str:
    if not isinstance(n, (int, float)):
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


_BARS = " ▁▂▃▄▅▆▇█"


def _spark(values: list[int]) -> str:
    if not values:
        return ""
    top = max(values) or 1
    return "".join(_BARS[min(8, round(v / top * 8))] for v in values)


def render_text(doc: dict[str, Any]) -> str:
    """The postmortem for a terminal or an issue: verdict first, then evidence, fates,
    memory, the curve before death and the advice."""
    v, k, mem = doc.get("victim") or {}, doc.get("killer") or {}, doc.get("memory") or {}
    job = doc.get("job") or {}
    how = v.get("signal") or f"exit status {v.get('exit_code')}"
    key = job.get("key") or job.get("run_id") or job.get("agent_pid")
    lines = [
        f"trainwatch postmortem {doc.get('id')}",
        f"job {key} (agent pid {job.get('agent_pid')}, {job.get('entrypoint') or '?'}, "
        f"world size {job.get('world_size')}, restart {job.get('restart_count')})",
        f"rank {v.get('rank')} (pid {v.get('pid')}) died {v.get('died_at')}: {how} "
        f"(exit code {v.get('exit_code')})",
        "",
        f"killer: {k.get('kind')} ({k.get('confidence')})",
        f"  {k.get('summary')}",
        "",
        "evidence:",
    ]
    lines += [
        f"  [{e.get('source')}] " + (f"{e['at']} " if e.get("at") else "") + f"{e.get('detail')}".rstrip()
        for e in k.get("evidence") or []
    ]
    lines += [
        "",
        "ranks:",
        f"  {'rank':>4}  {'pid':>8}  {'fate':<20} {'exit':>5}  {'rss':>10}  {'peak':>10}  {'tree':>10}",
    ]
    for r in doc.get("ranks") or []:
        lines.append(
            f"  {r.get('rank')!s:>4}  {r.get('pid')!s:>8}  {r.get('fate')!s:<20} {r.get('exit_code')!s:>5}  "
            f"{_size(r.get('rss_bytes')):>10}  {_size(r.get('peak_rss_bytes')):>10}  "
            f"{_size(r.get('tree_rss_bytes')):>10}"
        )
    host, cg = mem.get("host") or {}, mem.get("cgroup")
    lines += [
        "",
        "memory at death:",
        f"  host: {_size(host.get('available_bytes_at_death'))} available of {_size(host.get('total_bytes'))}"
        f" (lowest in the window: {_size(host.get('min_available_bytes'))})",
    ]
    if cg:
        lines.append(
            f"  cgroup {cg.get('path')} (v{cg.get('version')}): {_size(cg.get('usage_bytes_at_death'))} used "
            + (f"of a {_size(cg['limit_bytes'])} limit" if cg.get("limit_bytes") else "(no limit)")
            + f", peak {_size(cg.get('peak_bytes'))}, "
            f"OOM kills {cg.get('oom_kills')}"
        )
    timeline = doc.get("timeline") or []
    label = str(v.get("rank"))
    curve = [p.get("rss_bytes", {}).get(label) for p in timeline]
    curve = [c for c in curve if isinstance(c, int)]
    if curve:
        lines += [
            "",
            f"rank {label} RSS over the last {len(timeline)} samples (max {_size(max(curve))}):",
            f"  {_spark(curve[-72:])}",
        ]
    advice = doc.get("advice") or []
    if advice:
        lines += ["", "advice:"] + [f"  - {a}" for a in advice]
    return "\n".join(lines) + "\n"
