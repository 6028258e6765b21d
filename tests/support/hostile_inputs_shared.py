"""Shared by test_hostile_inputs.py and test_hostile_files.py (single-process and job tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


MAX_RSS_MB = 500      # a clean analysis of the small run peaks at ~100-250 MB


MAX_SECONDS = 60      # a clean analysis takes 2-5 s on 2 cores


# The measuring process: runs one command as its only child, then reports the child's peak RSS
# (RUSAGE_CHILDREN covers the whole waited-for subtree) and wall time as JSON.
_MEASURE = r"""
import json, resource, subprocess, sys, time
spec = json.loads(sys.argv[1])
if spec.get("drop_dac"):  # root without CAP_DAC_OVERRIDE/READ_SEARCH obeys file permissions
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            sys.exit(97)
t = time.monotonic()
with open(spec["out"], "wb") as out, open(spec["err"], "wb") as err:
    p = subprocess.Popen(spec["cmd"], stdout=out, stderr=err, stdin=subprocess.DEVNULL)
    try:
        rc = p.wait(timeout=spec["timeout"])
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        rc = "timeout"
print(json.dumps({"rc": rc, "seconds": time.monotonic() - t,
                  "rss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))
"""


class Result:
    def __init__(self, info: dict, out: Path, err: Path):
        self.rc, self.seconds, self.rss_mb = info["rc"], info["seconds"], info["rss_mb"]
        self.out_bytes = out.read_bytes()
        self.stdout = self.out_bytes.decode("utf-8", "replace")
        self.stderr = err.read_bytes().decode("utf-8", "replace")

    def bounded(self):
        assert self.rc != "timeout", f"did not finish in {MAX_SECONDS * 2} s"
        assert self.seconds < MAX_SECONDS, self.seconds
        assert self.rss_mb < MAX_RSS_MB, f"peak RSS {self.rss_mb:.0f} MB"
        assert "Traceback" not in self.stderr, self.stderr[-3000:]
        return self


def cli(tmp_path: Path, *args, env: dict | None = None, drop_dac: bool = False) -> Result:
    n = len(list(tmp_path.glob("cli-*.out")))
    out, err = tmp_path / f"cli-{n}.out", tmp_path / f"cli-{n}.err"
    spec = {"cmd": [sys.executable, "-m", "trainprof", *map(str, args)], "out": str(out),
            "err": str(err), "timeout": MAX_SECONDS * 2, "drop_dac": drop_dac}
    e = dict(os.environ)
    e.update(env or {})
    proc = subprocess.run([sys.executable, "-c", _MEASURE, json.dumps(spec)], env=e,
                          capture_output=True, text=True, timeout=MAX_SECONDS * 3)
    if proc.returncode == 97:
        pytest.skip("cannot drop CAP_DAC_OVERRIDE to make permissions bite as root")
    assert proc.returncode == 0, proc.stderr
    return Result(json.loads(proc.stdout), out, err)


def analyze(tmp_path: Path, run: Path, *extra, env=None, drop_dac=False) -> tuple[Result, dict | None]:
    out = tmp_path / f"out-{len(list(tmp_path.glob('out-*')))}"
    res = cli(tmp_path, "analyze", run, "--out", out, "--no-report", *extra, env=env,
              drop_dac=drop_dac)
    s = out / "summary.json"
    return res, (json.loads(s.read_text()) if s.exists() else None)


def problems_with(summary: dict, *words) -> list[str]:
    return [p for p in summary["problems"] if all(w in p for w in words)]


def shared_list_bomb(depth: int, fan: int = 10):
    x = [0]
    for _ in range(depth):
        x = [x] * fan
    return x
