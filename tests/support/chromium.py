"""Shared by test_report.py and test_report_jobs.py (single-process and job tests)."""

from __future__ import annotations

import re
import shutil
import subprocess


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


# src=, href=, url(...) or @import that would load anything from a network
NETWORK_REF = re.compile(r"""(?:src|href)\s*=\s*["']?\s*(?:https?:)?//|url\(\s*["']?\s*(?:https?:)?//|@import""",
                         re.IGNORECASE)


def _chromium(args, tmp_path):
    # Any network load would go through a proxy that does not exist and fail: the dump proves the
    # page renders with no network at all.
    cmd = [CHROMIUM, "--headless", "--disable-gpu", "--no-sandbox", "--no-first-run",
           "--proxy-server=127.0.0.1:9", f"--user-data-dir={tmp_path / 'profile'}", *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc
