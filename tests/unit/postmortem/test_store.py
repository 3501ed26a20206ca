"""The postmortem store (atomic, private, survives a restart, refuses bad ids), its text view
and the CLI, and the HTML view."""

from __future__ import annotations

import subprocess

from sidecar.postmortem import PostmortemStore, make_id
from tests.support.postmortems import stored_doc


def test_store_is_atomic_private_and_survives_a_restart(tmp_path):
    ident = make_id(1796212414.0, 4356, "1", "node-17")
    assert ident == "20261202T115334Z-node-17-4356-r1"
    store = PostmortemStore(str(tmp_path / "pm"))
    store.put(stored_doc(ident), first=True)
    path = tmp_path / "pm" / f"{ident}.json"
    assert oct(path.stat().st_mode & 0o777) == "0o640" and not list((tmp_path / "pm").glob("*.tmp"))
    again = PostmortemStore(str(tmp_path / "pm"))
    assert again.get(ident)["id"] == ident and again.newest()["id"] == ident
    assert again.listing()[0]["killer"]["kind"] == "cgroup_oom"


def test_store_rejects_bad_ids_and_skips_junk(tmp_path):
    (tmp_path / "20261202T114014Z-h-1-r1.json").write_text("{not json")
    store = PostmortemStore(str(tmp_path))
    for bad in ("../../etc/passwd", "x", "20261202T114014Z-h-1-r1/../../x", ""):
        assert store.get(bad) is None
    assert store.newest() is None


def test_unwritable_directory_keeps_the_postmortem_in_memory(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    store = PostmortemStore(str(blocker / "pm"))
    ident = make_id(1796212414.0, 1, "0", "h")
    store.put(stored_doc(ident), first=True)
    store.put(stored_doc(ident), first=False)
    assert store.get(ident) is not None and store.written_total == 1
    assert sum("kept in memory" in r.getMessage() for r in caplog.records) == 1


def test_text_view_and_cli(tmp_path):
    import sys

    from sidecar.postmortem import render_text

    doc = stored_doc(make_id(1796212414.0, 4356, "1", "node-17"))
    doc.update(
        {
            "victim": {
                "rank": 1,
                "pid": 4387,
                "exit_code": -9,
                "signal": "SIGKILL",
                "died_at": "2026-12-02T11:53:34+00:00",
            },
            "killer": {
                "kind": "cgroup_oom",
                "confidence": "certain",
                "summary": "rank 1 hit /pod's limit",
                "evidence": [{"source": "kmsg", "at": None, "detail": "oom-kill:...pid=4387"}],
            },
            "ranks": [
                {
                    "rank": 0,
                    "pid": 4386,
                    "fate": "terminated_by_agent",
                    "exit_code": -15,
                    "rss_bytes": 3 << 30,
                },
                {"rank": 1, "pid": 4387, "fate": "root_cause", "exit_code": -9, "rss_bytes": 5 << 30},
            ],
            "memory": {
                "host": {"total_bytes": 64 << 30},
                "cgroup": {"path": "/pod", "version": 2, "limit_bytes": 8 << 30},
            },
            "timeline": [{"rss_bytes": {"1": n << 30}} for n in (1, 2, 4, 5)],
            "advice": ["raise the limit"],
        }
    )
    text = render_text(doc)
    for needle in (
        "killer: cgroup_oom (certain)",
        "[kmsg]",
        "terminated_by_agent",
        "5.0 GiB",
        "/pod (v2)",
        "- raise the limit",
        "▂▃▆█",
    ):
        assert needle in text, needle
    store = PostmortemStore(str(tmp_path))
    store.put(doc, first=True)
    out = subprocess.run(
        [sys.executable, "-m", "sidecar", "postmortem", "--postmortem-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0 and out.stdout == text
    bad = subprocess.run(
        [sys.executable, "-m", "sidecar", "postmortem", str(tmp_path / "missing.json")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr


def test_html_view_is_self_contained_and_escaped():
    from sidecar.postmortem.html import render_html

    doc = stored_doc(make_id(1796212414.0, 1, "1", "h"))
    doc.update(
        {
            "killer": {
                "kind": "cgroup_oom",
                "confidence": "certain",
                "summary": "<script>alert(1)</script>",
                "evidence": [{"source": "kmsg", "at": None, "detail": "a & b"}],
            },
            "ranks": [
                {
                    "rank": 1,
                    "pid": 2,
                    "fate": "root_cause",
                    "died_at": "2026-12-02T11:53:40+00:00",
                    "rss_bytes": 5 << 30,
                }
            ],
            "memory": {"cgroup": {"path": "/pod", "version": 2, "limit_bytes": 8 << 30}},
            "timeline": [
                {
                    "at": f"2026-12-02T11:53:3{i}+00:00",
                    "rss_bytes": {"1": i << 30},
                    "tree_rss_bytes": {"1": i << 30},
                    "host_available_bytes": 50 << 30,
                    "cgroup_usage_bytes": i << 30,
                }
                for i in range(10)
            ],
        }
    )
    page = render_html(doc)
    assert "<script>" not in page and "&lt;script&gt;" in page and "a &amp; b" in page
    assert page.count("<polyline") >= 3 and "cgroup limit 8.0 GiB" in page and "✕ rank 1" in page
    assert "default-src 'none'" in page
    assert "https://" not in page and "http://" not in page.replace("http://www.w3.org/2000/svg", "")
