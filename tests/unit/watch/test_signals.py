"""The signal:signal_generate tracepoint: its trace lines, and a killed daemon's tracefs
instance cleaned up."""

from __future__ import annotations

from pathlib import Path

from tests.support.skips import requires


def test_trace_lines_of_signal_generate():
    from sidecar.watch.signals import parse_trace_line

    # captured on the development machine (EVIDENCE.md §2.3), trace_clock=mono
    e = parse_trace_line(
        "kill-8787           [001] d..1. 721.695636: signal_generate: sig=9  errno=0 code=0 "
        "comm=sleep pid=8784 grp=1 res=0".replace("sig=9  ", "sig=9 ")
    )
    assert (e.sender_comm, e.sender_pid, e.target_pid, e.signal, e.code) == ("kill", 8787, 8784, 9, 0)
    assert e.monotonic_ns == 721_695_636_000
    oom = parse_trace_line(
        "python3-8740 [000] d..2. 710.978684: signal_generate: sig=9 errno=0 code=128 "
        "comm=python3 pid=8740 grp=1 res=0"
    )
    assert oom.from_kernel and oom.sender_pid == oom.target_pid == 8740
    spaced = parse_trace_line(
        "   pt_main thread-17 (  17) [003] ..... 5.000001: signal_generate: sig=15 errno=0 "
        "code=0 comm=python pid=20 grp=1 res=0"
    )
    assert spaced.sender_comm == "pt_main thread" and spaced.signal == 15
    # the GPU machine: a sender the trace buffer's name cache did not hold prints as <...>;
    # the name is then unknown (the sender's /proc gives it), not "<...>"
    unnamed = parse_trace_line(
        "           <...>-624     [011] d..2.  1461.246418: signal_generate: sig=9 errno=0 code=0 "
        "comm=python3 pid=667 grp=1 res=0"
    )
    assert (unnamed.sender_comm, unnamed.sender_pid, unnamed.target_pid) == ("", 624, 667)
    assert parse_trace_line("# tracer: nop") is None


@requires("tracefs")
def test_a_killed_daemons_tracefs_instance_is_cleaned_up():
    from sidecar.watch.signals import SignalWatcher

    stale = Path("/sys/kernel/tracing/instances/trainwatch-999999999")  # above any pid_max: never alive
    stale.mkdir()
    watcher = SignalWatcher(lambda e: None)
    try:
        watcher.start()
        assert not stale.exists()
        assert Path(watcher.instance, "buffer_size_kb").read_text().strip() != "1410"
    finally:
        watcher.stop()
        if stale.exists():
            stale.rmdir()
    assert not Path(watcher.instance).exists()


def test_tracefs_is_found_where_it_is_mounted(tmp_path):
    """Its own mount point first, else inside debugfs; where neither has the tracepoint, the
    first (whose error says it is not mounted there)."""
    from sidecar.watch.signals import find_tracefs

    own, debug = str(tmp_path / "tracing"), str(tmp_path / "debug" / "tracing")
    assert find_tracefs((own, debug)) == own  # neither
    Path(debug, "events/signal/signal_generate").mkdir(parents=True)
    assert find_tracefs((own, debug)) == debug
    Path(own, "events/signal/signal_generate").mkdir(parents=True)
    assert find_tracefs((own, debug)) == own
