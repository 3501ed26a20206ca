"""Headless Chromium (Debian's package) for looking at the HTML postmortem like a person."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARTIFACTS = Path(__file__).resolve().parents[2] / ".ci" / "artifacts"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--enable-logging=stderr",
    "--v=0",
]


def screenshot(html: str, tmp: Path, name: str) -> tuple[Path, str]:
    """Render ``html`` from a file and return (PNG path, Chromium's log). The PNG is also
    kept under .ci/artifacts/ for a person to look at."""
    assert CHROMIUM is not None
    page = tmp / f"{name}.html"
    page.write_text(html)
    png = tmp / f"{name}.png"
    out = subprocess.run(
        [
            CHROMIUM,
            *FLAGS,
            f"--user-data-dir={tmp / 'chromium-profile'}",
            "--window-size=1100,1300",
            f"--screenshot={png}",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    if png.exists():
        shutil.copy(png, ARTIFACTS / png.name)
    return png, out.stdout + out.stderr
