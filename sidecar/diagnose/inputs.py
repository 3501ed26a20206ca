"""The inputs of ``trainwatch diagnose``: each path's text (``-`` for standard input), the
last ``MAX_BYTES`` of a bigger file, refused when it cannot be read or is not text."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import BinaryIO

__all__ = ["MAX_BYTES", "DiagnoseError", "LogInput", "read_inputs"]

MAX_BYTES = 64 << 20  # of each input, the tail that is read


class DiagnoseError(Exception):
    """An input that cannot be read: one line, exit status 2."""


@dataclass(frozen=True, slots=True)
class LogInput:
    name: str
    text: str
    truncated: bool = False
    mtime: float | None = None  # a file's modification time (dates its year-less stamps)


_CONTROL = bytes(b for b in range(32) if b not in (9, 10, 12, 13, 27))


def _decode(name: str, data: bytes, truncated: bool, mtime: float | None = None) -> LogInput:
    text = data.decode("utf-8", "replace")
    sample = data[: 1 << 16]
    odd = len(sample) - len(sample.translate(None, _CONTROL)) + text[: 1 << 16].count("\ufffd")
    if sample and odd > len(sample) // 10:
        raise DiagnoseError(f"{name}: not a text log (binary data)")
    return LogInput(name, text, truncated, mtime)


def read_inputs(paths: list[str], stdin: BinaryIO | None = None) -> list[LogInput]:
    """Each path's text, ``-`` for standard input. Raises DiagnoseError for the first one
    that cannot be read."""
    out = []
    for path in paths or ["-"]:
        if path == "-":
            stream = stdin if stdin is not None else sys.stdin.buffer
            data = stream.read()
            truncated = len(data) > MAX_BYTES
            out.append(_decode("<stdin>", data[-MAX_BYTES:], truncated))
            continue
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                size = st.st_size
                if size > MAX_BYTES:
                    f.seek(size - MAX_BYTES)
                data = f.read(MAX_BYTES)
        except IsADirectoryError:
            raise DiagnoseError(f"{path}: is a directory (give the log files in it)") from None
        except OSError as exc:
            raise DiagnoseError(f"{path}: {exc.strerror or exc}") from None
        out.append(_decode(path, data, size > MAX_BYTES, st.st_mtime))
    return out
