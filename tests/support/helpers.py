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


# What a rank of a bare gloo job (no trainprof in it) prints when torch aborts it at teardown
# (SIGABRT after the job's last line, seen on a loaded machine): not the job's result.
GLOO_TEARDOWN_ABORT = "terminate called without an active exception"


def run_bare_job(cmd, retries: int = 1, before=None, **kw) -> subprocess.CompletedProcess:
    """A job without trainprof (a test's reference or trace source), run again up to ``retries``
    times when it failed only by gloo's teardown abort; any other failure is returned as is.
    ``before()`` runs before every try (clears what a lost try wrote)."""
    kw.setdefault("capture_output", True)
    kw.setdefault("text", True)
    while True:
        if before is not None:
            before()
        res = subprocess.run([str(a) for a in cmd], **kw)
        if retries <= 0 or res.returncode == 0 or GLOO_TEARDOWN_ABORT not in (res.stderr or ""):
            return res
        retries -= 1


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


def write_worker_exits(root: Path, t_s: float, at_close: dict, final: dict) -> None:
    """RUN/worker-exits.jsonl as the torchrun agent writes it (probes/elastic_agent.py): one
    workers_closed record at t_s, each rank's exit code when the agent closed and at the end."""
    import json

    rec = {"t_ns": int(t_s * 1e9), "event": "workers_closed", "host": "h", "agent_pid": 1,
           "restart": 0, "workers": [{"rank": r, "local_rank": r, "pid": 100 + r,
                                      "exitcode_at_close": at_close.get(r), "exitcode": final[r]}
                                     for r in sorted(final)]}
    (Path(root) / "worker-exits.jsonl").write_text(json.dumps(rec) + "\n")
