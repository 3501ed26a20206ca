"""The postmortems' store.

It writes each document atomically (temp file, fsync, rename) with mode 0640 into
the postmortem directory and keeps the newest ones in memory too, so a full disk or a
read-only directory loses nothing that is being served (the error is logged once), and
writes them when the directory takes them again (``retry``, every few seconds). At
start it loads what earlier runs wrote. Ids are validated before any file is touched.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from collections import OrderedDict
from typing import Any

from sidecar.postmortem.document import ID_PATTERN, SCHEMA

__all__ = ["PostmortemStore"]

log = logging.getLogger(__name__)

KEEP_IN_MEMORY = 64


class PostmortemStore:
    """Postmortem documents by id, newest last; on disk under ``directory`` when it is usable."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._docs: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._lock = threading.Lock()
        self.written_total = 0
        self._disk_error: str | None = None
        self._unwritten: set[str] = set()  # ids whose newest version is in memory only
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
            with self._lock:
                self._unwritten.discard(ident)
            if self._disk_error is not None:
                log.info("postmortem directory %s is writable again", self.directory)
                self._disk_error = None
        except OSError as exc:
            with self._lock:
                self._unwritten.add(ident)
            message = f"cannot write postmortem {path}: {exc.strerror}; it is kept in memory and served"
            if message != self._disk_error:
                log.error("%s", message)
                self._disk_error = message
            with contextlib.suppress(OSError):
                os.unlink(tmp)

    @property
    def unwritten(self) -> int:
        """Postmortems served from memory whose file could not be written yet."""
        with self._lock:
            return len(self._unwritten)

    def retry(self) -> None:
        """Write again what could not be written (the directory was full or read-only):
        called every few seconds while anything is pending."""
        with self._lock:
            pending = [(i, self._docs[i]) for i in sorted(self._unwritten) if i in self._docs]
            self._unwritten &= {i for i, _ in pending}
        for ident, doc in pending:
            self._write(ident, doc)

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

    def listing(self, job: str | None = None) -> list[dict[str, Any]]:
        """Newest first: what a list shows of each, and what ``trainwatch story`` needs to
        join nodes (the job key, the victim's rank, pid, restart and time of death).
        ``job``: only the postmortems of that job key (the metrics' ``job`` label)."""
        with self._lock:
            docs = list(self._docs.values())
        if job is not None:
            docs = [d for d in docs if (d.get("job") or {}).get("key") == job]
        docs.sort(key=lambda d: d.get("created_at") or "", reverse=True)
        return [
            {
                "id": d["id"],
                "created_at": d.get("created_at"),
                "job": (d.get("job") or {}).get("key"),
                "restart": (d.get("job") or {}).get("restart_count"),
                "victim": {
                    "rank": (d.get("victim") or {}).get("rank"),
                    "pid": (d.get("victim") or {}).get("pid"),
                    "died_at": (d.get("victim") or {}).get("died_at"),
                },
                "killer": {
                    "kind": (d.get("killer") or {}).get("kind"),
                    "summary": (d.get("killer") or {}).get("summary"),
                },
            }
            for d in docs
        ]
