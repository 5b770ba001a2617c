"""Headless Chromium for the MLflow UI tests: the rendered page's DOM and a screenshot, on loopback URLs only."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage"]


def require_chromium() -> str:
    """The chromium binary; skip when it is missing, except under CI=true, where a missing part fails the run."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        missing = "chromium is not installed (`make test` installs Debian's `chromium` when run as root)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{missing}: under CI=true a missing part fails the run")
        pytest.skip(missing)
    return found


def dump_dom(chromium: str, url: str, profile_dir: str, budget_ms: int) -> str:
    """The DOM after `budget_ms` of virtual time (the MLflow UI renders in the browser from its REST API)."""
    out = subprocess.run([chromium, *FLAGS, f"--user-data-dir={profile_dir}", f"--virtual-time-budget={budget_ms}",
                          "--dump-dom", url], capture_output=True, text=True, timeout=180, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def screenshot(chromium: str, url: str, profile_dir: str, path: Path, budget_ms: int = 20000) -> None:
    """A 1400×1000 PNG of the page at `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    out = subprocess.run([chromium, *FLAGS, f"--user-data-dir={profile_dir}", f"--virtual-time-budget={budget_ms}",
                          "--window-size=1400,1000", "--hide-scrollbars", f"--screenshot={path}", url],
                         capture_output=True, text=True, timeout=180, check=False)
    assert out.returncode == 0 and path.exists(), out.stderr[-3000:]
