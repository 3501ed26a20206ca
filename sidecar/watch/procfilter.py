"""The process connector's socket filter: a classic BPF program the kernel runs on every
process event before it is queued to trainwatch's socket, so that events about processes
trainwatch does not watch cost the daemon nothing (not a wakeup, not a copy).

The connector multicasts one datagram per event: ``nlmsghdr`` (16 bytes), ``cn_msg``
(20 bytes), then ``struct proc_event``: ``what`` at byte 36, the event's data at 52. The
program passes

* subscription acknowledgements (``what`` = 0);
* the exit of a thread-group leader whose tgid, or whose parent's tgid, is watched (the
  parent rule keeps a rank's exit that comes before the rank joined the watched set);
* the fork of a new process (not a thread) whose parent is watched: a new rank of a
  watched agent, a DataLoader worker of a watched rank;
* a process renaming itself ``pt_elastic``: how torchrun's agent names its main thread,
  which is how a new job is found without listing /proc;

and drops everything else. Loads (``ld [k]``) read big-endian words: a native ``u32`` is
compared as the word its bytes make when read big-endian (``_word``). Classic BPF allows
4096 instructions; each watched pid takes six, so past ``MAX_WATCHED`` pids the program
passes every exit and fork of a leader and the reader filters them (correct, not cheap).
"""

from __future__ import annotations

import ctypes
import socket
import struct
from collections.abc import Iterable

__all__ = ["AGENT_COMM_BYTES", "MAX_WATCHED", "attach", "program"]

PROC_EVENT_NONE = 0x00000000
PROC_EVENT_FORK = 0x00000001
PROC_EVENT_COMM = 0x00000200
PROC_EVENT_EXIT = 0x80000000

SO_ATTACH_FILTER = 26
BPF_MAXINSNS = 4096
MAX_WATCHED = 600  # 6 instructions a pid, under BPF_MAXINSNS with room for the rest
AGENT_COMM_BYTES = b"pt_elastic"

# offsets in the datagram (nlmsghdr 16 + cn_msg 20 = 36: struct proc_event)
WHAT = 36
DATA = 52
EXIT_PID, EXIT_TGID, EXIT_PARENT_TGID = DATA, DATA + 4, DATA + 20
FORK_PARENT_TGID, FORK_CHILD_PID, FORK_CHILD_TGID = DATA + 4, DATA + 8, DATA + 12
COMM_TEXT = DATA + 8

# classic BPF opcodes
LD_W_ABS = 0x20
LDX_MEM = 0x61
ST = 0x02
JA = 0x05
JEQ_K = 0x15
JEQ_X = 0x1D
RET_K = 0x06
ACCEPT = 0xFFFFFFFF
REJECT = 0

_INSN = struct.Struct("=HBBI")


def _word(value: int) -> int:
    """What ``ld [k]`` yields for a native-order u32 ``value`` stored at k."""
    return int.from_bytes(struct.pack("=I", value), "big")


class _Asm:
    """Instructions with forward jumps to labels, resolved at the end."""

    def __init__(self) -> None:
        self.code: list[tuple[int, object, object, object]] = []
        self.labels: dict[str, int] = {}

    def op(self, code: int, k: object = 0, jt: object = 0, jf: object = 0) -> None:
        self.code.append((code, jt, jf, k))

    def label(self, name: str) -> None:
        self.labels[name] = len(self.code)

    def ret(self, value: int) -> None:
        self.op(RET_K, value)

    def load(self, offset: int) -> None:
        self.op(LD_W_ABS, offset)

    def is_leader(self, pid_at: int, tgid_at: int) -> None:
        """Fall through when the words at ``pid_at`` and ``tgid_at`` are equal, else reject."""
        self.load(pid_at)
        self.op(ST, 0)
        self.op(LDX_MEM, 0)
        self.load(tgid_at)
        self.op(JEQ_X, 0, 1, 0)
        self.ret(REJECT)

    def any_of(self, words: list[int]) -> None:
        """Accept when A is one of ``words``; fall through otherwise."""
        for w in words:
            self.op(JEQ_K, w, 0, 1)
            self.ret(ACCEPT)

    def assemble(self) -> bytes:
        out = bytearray()
        for i, (code, jt, jf, k) in enumerate(self.code):
            offs = []
            for target in (jt, jf):
                if isinstance(target, str):
                    target = self.labels[target] - i - 1
                assert isinstance(target, int) and 0 <= target <= 255, (i, target)
                offs.append(target)
            if isinstance(k, str):  # ja to a label: a 32-bit forward offset
                k = self.labels[k] - i - 1
            assert isinstance(k, int)
            out += _INSN.pack(code, offs[0], offs[1], k)
        return bytes(out)


def program(watched: Iterable[int], pass_exits: bool = False) -> bytes:
    """The filter for the set of ``watched`` tgids (see the module's text). ``pass_exits``:
    every leader's exit passes (while the subscription is being proven)."""
    words = sorted({_word(p) for p in watched if 0 < p < 2**32})
    limited = len(words) > MAX_WATCHED
    a = _Asm()
    a.load(WHAT)
    for what, where in ((PROC_EVENT_EXIT, "exit"), (PROC_EVENT_FORK, "fork"), (PROC_EVENT_COMM, "comm")):
        a.op(JEQ_K, _word(what), 0, 1)
        a.op(JA, where)
    a.op(JEQ_K, _word(PROC_EVENT_NONE), 0, 1)
    a.ret(ACCEPT)
    a.ret(REJECT)

    a.label("exit")
    a.is_leader(EXIT_PID, EXIT_TGID)
    if pass_exits or limited:
        a.ret(ACCEPT)
    else:  # A holds the tgid
        a.any_of(words)
        a.load(EXIT_PARENT_TGID)
        a.any_of(words)
        a.ret(REJECT)

    a.label("fork")
    a.is_leader(FORK_CHILD_PID, FORK_CHILD_TGID)  # a new process, not a new thread
    if limited:
        a.ret(ACCEPT)
    else:
        a.load(FORK_PARENT_TGID)
        a.any_of(words)
        a.ret(REJECT)

    a.label("comm")
    name = AGENT_COMM_BYTES.ljust(12, b"\0")  # the kernel pads comm with zeros
    for i in range(3):
        a.load(COMM_TEXT + 4 * i)
        a.op(JEQ_K, int.from_bytes(name[4 * i : 4 * i + 4], "big"), 1, 0)
        a.ret(REJECT)
    a.ret(ACCEPT)
    code = a.assemble()
    assert len(code) // _INSN.size <= BPF_MAXINSNS
    return code


def attach(sock: socket.socket, code: bytes) -> None:
    """Replace the socket's filter with ``code`` (atomically: the kernel swaps it)."""
    buf = ctypes.create_string_buffer(code, len(code))
    fprog = struct.pack("HL", len(code) // _INSN.size, ctypes.addressof(buf))
    sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, fprog)
