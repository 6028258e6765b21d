"""Shared helpers for tests: running the CLI as a user would, in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

TRAINPROF = [sys.executable, "-m", "trainprof"]


def run_cli(args, cwd=None, timeout=600, env=None, **kw) -> subprocess.CompletedProcess:
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run(TRAINPROF + [str(a) for a in args], cwd=cwd, env=e, timeout=timeout,
                          capture_output=True, text=True, **kw)


def wait_for(predicate, timeout=60.0, interval=0.1):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(interval)
    return False


def write_script(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def union_length(intervals) -> float:
    """Total length covered by (start, end) intervals, computed plainly: an independent check
    of the analyzers' interval unions."""
    busy, cur_s, cur_e = 0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            busy += (cur_e - cur_s) if cur_e is not None else 0
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return busy + ((cur_e - cur_s) if cur_e is not None else 0)
