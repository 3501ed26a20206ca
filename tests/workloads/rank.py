"""A torchrun worker for trainwatch's end-to-end tests (gloo on CPU).

Each rank joins a gloo process group, holds ``--hold-mb`` MiB of touched memory, starts
``--workers`` child processes (stand-ins for DataLoader workers) that each hold
``--worker-mb`` MiB, then all-reduces a small tensor every 0.2 s until ``--stop-file``
exists or ``--duration`` seconds pass. ``--fail-rank R --fail-after S`` makes rank R exit
with status 1 after S seconds in the first attempt only (restart count 0), so an elastic
restart follows. A ``ready`` file per rank (``<ready-dir>/rank<R>.r<restart>``) holds the
pids of the rank and its workers once everything is allocated.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import threading
import time


def hold(mb: int) -> bytearray:
    buf = bytearray(mb * 1024 * 1024)
    for i in range(0, len(buf), 4096):
        buf[i] = 1
    return buf


# --cow-mb: a "dataset" of Python ints built before the workers fork; the workers then read
# it, and reading a Python object writes its reference count: each page is copied
DATASET: list[int] = []


def worker(mb: int, parent: int, held: object, cow_file: str | None = None, cow_seconds: float = 0) -> None:
    _buf = hold(mb)
    held.set()  # type: ignore[attr-defined]
    touched = 0
    while os.getppid() == parent:
        if DATASET and cow_file and os.path.exists(cow_file) and touched < len(DATASET):
            step = max(1, len(DATASET) // max(1, round(cow_seconds / 0.5)))
            for _item in DATASET[touched : touched + step]:  # copy-on-access, a slice every 0.5 s
                pass
            touched += step
            time.sleep(0.5)
            continue
        time.sleep(0.2)


def load_batches(mb: int) -> None:
    import torch
    from torch.utils.data import DataLoader, Dataset

    class Big(Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int) -> torch.Tensor:
            # Write the batch through a shared-memory mapping, as libraries that skip
            # fallocate do: past the end of a full /dev/shm the write is a SIGBUS.
            import mmap

            path = f"/dev/shm/trainwatch-test-{os.getpid()}-{i}"
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                os.ftruncate(fd, mb << 20)
                with mmap.mmap(fd, mb << 20) as m:
                    m[:] = b"\1" * (mb << 20)
            finally:
                os.close(fd)
                os.unlink(path)
            return torch.full((mb << 18,), float(i))  # mb MiB of float32

    for _batch in DataLoader(Big(), batch_size=1, num_workers=2):
        pass


def stray(spin: int) -> None:
    """The --hang-rank's detour, away from every collective: asleep, or busy on its CPU."""
    if not spin:
        time.sleep(0.2)
        return
    end = time.monotonic() + 0.2
    n = 0
    while time.monotonic() < end:
        n += 1


def _colour_terminal() -> None:
    """A progress bar redrawn in place, then every later traceback in red, line by line (as
    rich and friends print them)."""
    for i in range(4):
        sys.stderr.write(f"\r\x1b[32mtraining {i}/4 |{'#' * i}{' ' * (4 - i)}|\x1b[0m")
        sys.stderr.flush()
    sys.stderr.write("\n")

    import io

    before = sys.excepthook  # torch's own, which prefixes the lines with [rankN]:

    def hook(kind: type[BaseException], value: BaseException, tb: object) -> None:
        real, sys.stderr = sys.stderr, io.StringIO()
        try:
            before(kind, value, tb)  # type: ignore[arg-type]
            text = sys.stderr.getvalue()
        finally:
            sys.stderr = real
        sys.stderr.write("".join(f"\x1b[1;31m{line}\x1b[0m\n" for line in text.splitlines()))
        sys.stderr.flush()

    sys.excepthook = hook


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hold-mb", type=int, default=64)
    ap.add_argument(
        "--gpu-mb", type=int, default=0, help="MiB each rank holds on GPU LOCAL_RANK %% count, if CUDA works"
    )
    ap.add_argument(
        "--load-mb",
        type=int,
        default=0,
        help="every rank then loads this many MiB of 'model' into host memory, 64 MiB every 0.1 s "
        "(checkpoint shards), as every rank of the opening story did; the seconds it took and "
        "when it ended (epoch seconds) go to <ready-dir>/rank<R>.load",
    )
    ap.add_argument("--worker-mb", type=int, default=32)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument(
        "--worker-context",
        default="fork",
        help="the multiprocessing start method of the workers (spawn: fresh interpreters, as a "
        "DataLoader with multiprocessing_context='spawn' starts)",
    )
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--stop-file", default=None)
    ap.add_argument("--ready-dir", default=None)
    ap.add_argument("--fail-rank", type=int, default=-1)
    ap.add_argument("--fail-after", type=float, default=0.0)
    ap.add_argument(
        "--grow-rank", type=int, default=-1, help="this rank keeps allocating after --grow-after s"
    )
    ap.add_argument("--grow-after", type=float, default=1.0)
    ap.add_argument("--grow-file", default=None, help="--grow-rank waits for this file too")
    ap.add_argument("--grow-mb", type=int, default=64, help="MiB added every --grow-interval by --grow-rank")
    ap.add_argument("--grow-interval", type=float, default=0.02, help="seconds between --grow-mb additions")
    ap.add_argument(
        "--grow-shm",
        type=int,
        default=0,
        help="1: --grow-rank grows by writing /dev/shm files (trainwatch-test-shm-<pid>-<n>), not its heap",
    )
    ap.add_argument("--cow-rank", type=int, default=-1, help="this rank's workers grow by copy-on-access")
    ap.add_argument(
        "--cow-mb", type=int, default=0, help="MiB of Python ints the --cow-rank builds before forking"
    )
    ap.add_argument("--cow-file", default=None, help="its workers start reading the ints once this exists")
    ap.add_argument("--cow-seconds", type=float, default=40.0, help="... and take this long to read them all")
    ap.add_argument(
        "--load-interval", type=float, default=0.1, help="seconds between 64 MiB --load-mb shards"
    )
    ap.add_argument(
        "--load-after", type=float, default=0.0, help="seconds of steady running before the --load-mb load"
    )
    ap.add_argument("--ignore-sigterm-rank", type=int, default=-1, help="this rank ignores SIGTERM")
    ap.add_argument(
        "--handoff",
        type=int,
        default=0,
        help="1: no collectives; each step every rank but 0 hands rank 0 a key through the store, which "
        "rank 0 waits for (a pipeline's hand-off): when a peer dies, rank 0 waits in the store, alive",
    )
    ap.add_argument(
        "--pause-after", type=float, default=-1.0, help="every rank pauses (sleeps) once, this many s in"
    )
    ap.add_argument("--pause-for", type=float, default=0.0, help="... for this long (the stop file ends it)")
    ap.add_argument("--hang-rank", type=int, default=-1, help="this rank stops joining collectives")
    ap.add_argument("--hang-after", type=float, default=2.0)
    ap.add_argument("--hang-file", default=None, help="the --hang-rank also stops once this file exists")
    ap.add_argument(
        "--hang-spin", type=int, default=0, help="1: the --hang-rank spins its CPU instead of sleeping"
    )
    ap.add_argument("--pg-timeout", type=float, default=1800.0, help="init_process_group timeout, s")
    ap.add_argument("--raise-rank", type=int, default=-1, help="this rank raises an exception")
    ap.add_argument("--raise-after", type=float, default=2.0)
    ap.add_argument(
        "--raise-linger",
        type=float,
        default=0.0,
        help="the --raise-rank first starts a non-daemon thread that lives this long: the "
        "process outlives its traceback (Python waits for the thread), its sockets open",
    )
    ap.add_argument(
        "--colour",
        action="store_true",
        help="print as a pretty terminal does: a progress bar redrawn with carriage returns, "
        "the traceback in ANSI colours",
    )
    ap.add_argument(
        "--record",
        type=int,
        default=0,
        help="1: run under torch.distributed.elastic's @record (writes TORCHELASTIC_ERROR_FILE)",
    )
    ap.add_argument("--segfault-rank", type=int, default=-1, help="this rank dereferences NULL")
    ap.add_argument(
        "--segfault-unhandled", type=int, default=0, help="1: with no SIGSEGV handler (not faulthandler's)"
    )
    ap.add_argument(
        "--abort-rank", type=int, default=-1, help="this rank calls abort() once --abort-file exists"
    )
    ap.add_argument("--abort-file", default=None)
    ap.add_argument(
        "--double-free-rank",
        type=int,
        default=-1,
        help="this rank frees a C heap block twice after --raise-after: the C library aborts it",
    )
    ap.add_argument(
        "--rust-alloc-rank",
        type=int,
        default=-1,
        help="after --raise-after this rank's address space is capped and a Rust extension (pydantic-core) "
        "allocates past it: Rust's allocation error handler aborts the process",
    )
    ap.add_argument(
        "--flood-rank", type=int, default=-1, help="once --flood-file exists, this rank forks --flood-count"
    )
    ap.add_argument("--flood-file", default=None)
    ap.add_argument(
        "--flood-count", type=int, default=500, help="children that exit 3 at once (writes FILE.done after)"
    )
    ap.add_argument(
        "--loader-rank",
        type=int,
        default=-1,
        help="this rank iterates a DataLoader (2 workers, shared memory)",
    )
    ap.add_argument("--loader-mb", type=int, default=8, help="MiB per batch the --loader-rank's workers pass")
    ap.add_argument(
        "--error-file",
        default=None,
        help="name PATH as this rank's TORCHELASTIC_ERROR_FILE (by re-executing itself with it, as "
        "any process may: the path in its environment is the job's choice)",
    )
    ap.add_argument("--hf-token", default=None, help="ignored: a credential on the command line")
    ap.add_argument("--print-secrets", type=int, default=0, help="1: print credentials before the loop")
    ap.add_argument(
        "--local_rank",
        "--local-rank",
        type=int,
        default=None,
        help="DeepSpeed's (LOCAL_RANK is read)",
    )
    args = ap.parse_args()
    if args.error_file and os.environ.get("TW_REEXECUTED") != "1":
        env = dict(os.environ, TW_REEXECUTED="1", TORCHELASTIC_ERROR_FILE=args.error_file)
        os.execve(sys.executable, [sys.executable, *sys.argv], env)

    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    if os.environ.get("TW_GROW_LOCAL_RANK") == os.environ.get("LOCAL_RANK"):
        args.grow_rank = rank  # a multi-node test names the grower by its node (its agent's env)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if rank == args.ignore_sigterm_rank:
        import signal

        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # A store prefix per attempt: the agent's store outlives a restart, and gloo would
    # otherwise find the first attempt's (dead) peer addresses in it. torchrun's agent
    # serves the store (it says so: TORCHELASTIC_USE_AGENT_STORE); under any other launcher
    # (DeepSpeed's, ...) rank 0 serves it at MASTER_PORT, as init_process_group's env://
    # would.
    world = int(os.environ["WORLD_SIZE"])
    if dist.is_initialized():  # a launcher that set the group up itself (Lightning's Fabric)
        attempt_store = dist.distributed_c10d._get_default_store()
    else:
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" and rank == 0,
            timeout=__import__("datetime").timedelta(seconds=60),
        )
        attempt_store = dist.PrefixStore(f"attempt{restart}", store)
        dist.init_process_group(
            "gloo",
            store=attempt_store,
            rank=rank,
            world_size=world,
            timeout=__import__("datetime").timedelta(seconds=args.pg_timeout),
        )
    buf = hold(args.hold_mb)
    on_gpu = None
    if args.gpu_mb and torch.cuda.is_available():  # GPU memory NVML attributes to this rank
        device = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
        on_gpu = torch.ones(args.gpu_mb << 20, dtype=torch.uint8, device=f"cuda:{device}")
    ctx = mp.get_context(args.worker_context)
    if rank == args.cow_rank and restart == 0:
        DATASET.extend(range(10**6, 10**6 + args.cow_mb * 2**20 // 36))  # 28 B an int, 8 B its slot
    held = [ctx.Event() for _ in range(args.workers)]
    procs = [
        ctx.Process(
            target=worker, args=(args.worker_mb, os.getpid(), e, args.cow_file, args.cow_seconds), daemon=True
        )
        for e in held
    ]
    for p in procs:
        p.start()
    for e in held:  # "ready" means every worker holds its memory (slow machines take a while)
        e.wait(120)
    if rank == args.cow_rank and restart == 0:  # the kernel's choice, not one of its workers
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    time.sleep(0.2)
    if args.ready_dir:
        path = os.path.join(args.ready_dir, f"rank{rank}.r{restart}")
        with open(path + ".tmp", "w") as f:
            f.write(" ".join(str(x) for x in [os.getpid(), *[p.pid for p in procs]]))
        os.rename(path + ".tmp", path)
    if args.print_secrets:  # shapes of real credentials (none is one), as careless code prints them
        print("export HF_TOKEN=hf_aBcDeFgHiJkLmNoPqRsTuVwXyZ012345", flush=True)
        print("wandb login 0123456789abcdef0123456789abcdef01234567", file=sys.stderr, flush=True)
        print("db: postgres://trainer:pgpass123SECRET@db:5432/runs", file=sys.stderr, flush=True)
        print("args: --hf-key hf_ZyXwVuTsRqPoNmLkJiHgFeDcBa543210 --lr 1e-4", file=sys.stderr, flush=True)
    start = time.monotonic()
    grown: list[bytearray] = []
    grow_next = 0.0
    model: list[bytearray] = []
    load_began = 0.0
    step = 0
    paused = False
    if rank == args.grow_rank and restart == 0:
        with open("/proc/self/oom_score_adj", "w") as f:  # be the OOM killer's choice
            f.write("1000")
    while True:
        elapsed = time.monotonic() - start
        # Whether this rank would stop: the stop file, or its --duration. Ranks in collectives
        # agree on it through the all_reduce below, so all of them leave in the same round: a
        # rank that left on its own while a peer waited in all_reduce would fail that peer.
        stop = bool(args.stop_file and os.path.exists(args.stop_file)) or elapsed >= args.duration
        if restart == 0 and rank == args.fail_rank and elapsed > args.fail_after:
            print(f"rank {rank}: failing on purpose", file=sys.stderr, flush=True)
            os._exit(1)
        if not paused and 0 <= args.pause_after <= elapsed:  # a pause of every rank (a checkpoint elsewhere)
            paused = True
            until = time.monotonic() + args.pause_for
            while time.monotonic() < until and not (args.stop_file and os.path.exists(args.stop_file)):
                time.sleep(0.2)
            continue
        if len(model) * 64 < args.load_mb and restart == 0 and elapsed >= args.load_after:
            load_began = load_began or time.monotonic()
            model.append(hold(64))  # every rank its own full copy
            if len(model) * 64 >= args.load_mb and args.ready_dir:  # how long memory took to take it
                with open(os.path.join(args.ready_dir, f"rank{rank}.load"), "w") as f:
                    f.write(f"{time.monotonic() - load_began:.3f} {time.time():.3f}")
            time.sleep(args.load_interval)
            continue
        if (
            rank == args.hang_rank
            and restart == 0
            and (elapsed > args.hang_after or (args.hang_file and os.path.exists(args.hang_file)))
        ):
            if stop:
                break
            stray(args.hang_spin)  # alive, but never in a collective again: its peers time out
            continue
        if (
            rank == args.flood_rank
            and restart == 0
            and args.flood_file
            and os.path.exists(args.flood_file)
            and not os.path.exists(args.flood_file + ".done")
        ):
            # a burst of short-lived children: forks and exits the connector passes (their
            # parent is watched), as a rank that shells out in a loop makes
            for _ in range(args.flood_count):
                child = os.fork()
                if child == 0:
                    os._exit(3)
                os.waitpid(child, 0)
            open(args.flood_file + ".done", "w").close()
        if rank == args.abort_rank and restart == 0 and args.abort_file and os.path.exists(args.abort_file):
            os.abort()  # SIGABRT, as a CUDA runtime does on a fatal device error
        if rank == args.double_free_rank and restart == 0 and elapsed > args.raise_after:
            import ctypes

            libc = ctypes.CDLL(None)
            libc.malloc.restype = ctypes.c_void_p
            libc.free.argtypes = [ctypes.c_void_p]
            block = libc.malloc(64)
            libc.free(block)
            libc.free(block)  # glibc: "free(): double free detected in tcache 2", then abort()
        if rank == args.rust_alloc_rank and restart == 0 and elapsed > args.raise_after:
            import resource

            import pydantic_core

            data = ["x" * 1000] * 200_000  # one string, 200k times: ~200 MB of JSON from 1.6 MB
            with open("/proc/self/statm") as f:
                cap = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE") + (64 << 20)
            resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
            pydantic_core.to_json(data)  # "memory allocation of N bytes failed", then abort()
        if rank == args.segfault_rank and restart == 0 and elapsed > args.raise_after:
            import ctypes
            import faulthandler
            import signal

            if args.segfault_unhandled:  # the kernel then logs its own "segfault at" record
                faulthandler.disable()
                signal.signal(signal.SIGSEGV, signal.SIG_DFL)

            ctypes.string_at(0)  # SIGSEGV
        if rank == args.loader_rank and restart == 0 and elapsed > args.raise_after:
            load_batches(args.loader_mb)  # through /dev/shm: a small one ends in SIGBUS
        if rank == args.raise_rank and restart == 0 and elapsed > args.raise_after:
            if args.colour:
                _colour_terminal()
            if args.raise_linger > 0:  # a prefetcher's or a logger's thread, as real jobs have
                threading.Thread(target=time.sleep, args=(args.raise_linger,), daemon=False).start()
            if args.print_secrets:  # careless code puts a credential in its exception
                raise ValueError("login failed for HF_TOKEN=hf_QwErTyUiOpAsDfGhJkLzXcVbNm987654")
            raise ValueError(f"rank {rank}: a bad batch on purpose (shape mismatch)")
        if (
            rank == args.grow_rank
            and restart == 0
            and elapsed > args.grow_after
            and (args.grow_file is None or os.path.exists(args.grow_file))
        ):
            if stop:
                break
            if args.grow_shm:  # tmpfs pages: charged to this cgroup, and no kill frees them
                path = f"/dev/shm/trainwatch-test-shm-{os.getpid()}-{len(grown)}"
                with open(path, "wb") as f:
                    f.write(b"\1" * (args.grow_mb << 20))
                grown.append(bytearray(0))
            else:
                grown.append(hold(args.grow_mb))  # until a memory limit stops it
            # paced by deadline, so the rate is grow_mb / grow_interval however long a chunk took
            grow_next = max(time.monotonic(), grow_next + args.grow_interval)
            time.sleep(max(0.0, grow_next - time.monotonic()))
            continue
        if rank == args.ignore_sigterm_rank:  # that one only waits (a peer's death must not fail it)
            if stop:
                break
        elif args.handoff:
            step += 1
            if rank != 0:
                attempt_store.set(f"handoff{step}-{rank}", "stop" if stop else "go")
                if stop:
                    break
            elif any(attempt_store.get(f"handoff{step}-{r}") == b"stop" for r in range(1, world)):
                break
        else:
            flag = torch.tensor([1.0 if stop else 0.0])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item() > 0:
                break
        time.sleep(0.2)
    del buf, on_gpu
    for p in procs:
        p.terminate()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    if "--record=1" in sys.argv:
        from torch.distributed.elastic.multiprocessing.errors import record

        sys.exit(record(main)())
    sys.exit(main())
