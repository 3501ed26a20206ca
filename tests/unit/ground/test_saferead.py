"""The safe-read helper on real files: what a job may name and what it may not, with openat2
and with the walk that replaces it on kernels without, and the deadline that keeps a hung
read from holding the autopsy."""

from __future__ import annotations

import os
import stat
import threading

import pytest

from sidecar import saferead
from sidecar.saferead import JobRoot, Refused, read_fd_file, read_job_file
from tests.support.e2e import wait_for
from tests.support.paths import REPO
from tests.support.skips import met, skip

ME = os.getuid()


@pytest.fixture(params=["openat2", "walk"])
def resolver(request, monkeypatch):
    """Every case runs twice: with openat2, and with the component walk of old kernels. A
    kernel without openat2 (before 5.6, gVisor) has only the walk: the openat2 cases skip
    there rather than run the walk under openat2's name."""
    if request.param == "walk":
        monkeypatch.setattr(saferead, "_openat2_works", False)
    elif not met("openat2"):
        skip("openat2")
    return request.param


@pytest.fixture
def root(tmp_path):
    fd = os.open(tmp_path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    yield fd
    os.close(fd)


def _read(root: int, path: str, **kw):
    kw.setdefault("owner", ME)
    kw.setdefault("cap", 1 << 20)
    return read_job_file(root, path, **kw)


def test_a_regular_file_of_the_rank_is_read(tmp_path, root, resolver):
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "error.json").write_text('{"message": "x"}')
    got = _read(root, "/dir/error.json")
    assert got.data == b'{"message": "x"}' and got.size == 16 and got.mtime > 0


def test_paths_resolve_inside_the_jobs_root_never_the_daemons(tmp_path, root, resolver):
    """An absolute link inside a container's root points into that root."""
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "hostname").write_text("inside")
    (tmp_path / "in").mkdir()
    os.symlink("/etc", tmp_path / "in" / "etc")
    if resolver == "walk":
        with pytest.raises(Refused, match="a symbolic link or a non-directory in the path"):
            _read(root, "/in/etc/hostname")
    else:
        assert _read(root, "/in/etc/hostname").data == b"inside"  # not the host's /etc/hostname
    with pytest.raises(Refused, match=r"'\.\.'"):
        _read(root, "/in/../../etc/passwd")
    with pytest.raises(Refused, match="not an absolute path"):
        _read(root, "etc/hostname")


def test_what_a_job_may_not_name(tmp_path, root, resolver):
    os.mkfifo(tmp_path / "fifo")
    os.symlink("/etc/shadow", tmp_path / "link")
    (tmp_path / "dir").mkdir()
    (tmp_path / "big").write_bytes(b"x" * 5000)
    cases = {
        "/fifo": "a FIFO, not a regular file",
        "/link": r"a symbolic link \(not followed\)",
        "/dir": "a directory, not a regular file",
    }
    for path, why in cases.items():
        with pytest.raises(Refused, match=why):
            _read(root, path)
    # a character device: the machine's own /dev/null, through a root at /dev (making a
    # device node takes CAP_MKNOD and a file system that allows one)
    dev = os.open("/dev", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
        with pytest.raises(Refused, match="a character device, not a regular file"):
            _read(dev, "/null")
    finally:
        os.close(dev)
    with pytest.raises(Refused, match="5000 bytes, more than the 4096 read"):
        _read(root, "/big", cap=4096)
    assert _read(root, "/big", cap=4096, tail=True).data == b"x" * 4096  # a log: its tail
    with pytest.raises(FileNotFoundError):
        _read(root, "/missing")


def test_the_file_must_be_the_ranks(tmp_path, root, resolver):
    (tmp_path / "theirs").write_text("secret")
    try:
        os.chown(tmp_path / "theirs", 4242, 4242)  # another user's file: made as root
    except PermissionError:
        skip("root", "a file of another user to refuse")
    with pytest.raises(Refused, match=f"owned by uid 4242, not by the rank's user \\(uid {ME}\\)"):
        _read(root, "/theirs")
    assert _read(root, "/theirs", owner=4242).data == b"secret"


def test_a_log_is_read_from_where_it_was_first_seen_and_must_be_the_same_file(tmp_path, root, resolver):
    log = tmp_path / "train.log"
    log.write_text("old run\n")
    st = log.stat()
    with log.open("a") as f:
        f.write("this run\n")
    got = _read(root, "/train.log", tail=True, since=st.st_size, expect=(st.st_dev, st.st_ino))
    assert got.data == b"this run\n"
    log.rename(tmp_path / "train.log.1")  # rotated: kept, so the new file has another inode
    log.write_text("another file at the same path\n")
    with pytest.raises(Refused, match="another file now"):
        _read(root, "/train.log", tail=True, expect=(st.st_dev, st.st_ino))


def test_a_live_processs_own_descriptor(tmp_path):
    """Through /proc/PID/fd: the process's open file, checked the same way."""
    out = tmp_path / "out.log"
    with out.open("w") as f:
        f.write("hello\n")
        f.flush()
        st = os.fstat(f.fileno())
        got = read_fd_file(
            "/proc", os.getpid(), f.fileno(), owner=None, cap=100, expect=(st.st_dev, st.st_ino)
        )
        assert got.data == b"hello\n"
    r, w = os.pipe()
    try:
        with pytest.raises(Refused, match="a FIFO, not a regular file"):
            read_fd_file("/proc", os.getpid(), r, owner=None, cap=100, expect=None)
    finally:
        os.close(r)
        os.close(w)


def test_a_job_root_outlives_the_process_it_was_taken_from(tmp_path):
    import subprocess
    import sys

    (tmp_path / "f").write_text("kept")
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        job = JobRoot("/proc", p.pid)
    finally:
        p.kill()
        p.wait()
    try:  # the process is gone; its root (here the host's) still resolves
        assert read_job_file(job, str(tmp_path / "f"), owner=ME, cap=100).data == b"kept"
    finally:
        job.close()


def test_a_read_that_hangs_costs_a_thread_not_the_autopsy(monkeypatch):
    """Whatever blocks (a FUSE or NFS read), the caller gets Refused at the deadline; once
    MAX_STUCK reads hang, further ones are refused at once until they return."""
    monkeypatch.setattr(saferead, "_stuck", 0)
    release = threading.Event()
    for _ in range(saferead.MAX_STUCK):
        with pytest.raises(Refused, match=r"did not finish within 0\.05 s"):
            saferead._with_deadline(lambda: release.wait(30), 0.05)
    with pytest.raises(Refused, match="earlier reads are still hung"):
        saferead._with_deadline(lambda: 1, 0.05)
    release.set()  # the hung reads return: their threads are free again
    wait_for(lambda: saferead._stuck == 0, 10, "the stuck readers to come back")
    assert saferead._with_deadline(lambda: 7, 0.5) == 7
    readers = [t for t in threading.enumerate() if t.name == "trainwatch-read"]
    assert len(readers) <= saferead.MAX_STUCK + 2  # reused, not one per read


def test_reader_threads_exist_before_any_read():
    saferead.prestart(2)
    before = {t.ident for t in threading.enumerate() if t.name == "trainwatch-read"}
    assert len(before) >= 2
    for _ in range(20):
        assert saferead._with_deadline(lambda: 1, 1.0) == 1
    after = {t.ident for t in threading.enumerate() if t.name == "trainwatch-read"}
    assert after == before  # twenty reads, no new thread


def test_errors_inside_the_read_reach_the_caller():
    def boom() -> None:
        raise PermissionError(13, "Permission denied")

    with pytest.raises(PermissionError):
        saferead._with_deadline(boom, 0.5)


def test_no_path_a_job_names_is_opened_without_the_helper():
    """The rooms that handle job-named paths open nothing themselves."""
    for room in (
        "sidecar/deaths/gather.py",
        "sidecar/probes/outputs.py",
        "sidecar/stalls/tracker.py",
        "sidecar/stalls/stacks.py",
    ):
        text = (REPO / room).read_text()
        assert "open(" not in text.replace("saferead.", "").replace("JobRoot(", ""), room
