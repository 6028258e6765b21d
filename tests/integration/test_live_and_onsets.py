"""Real 2-rank gloo jobs of short steps: a rank that turns slow mid-run is found with its onset
and its peer's waiting attributed to it; a run in progress is analyzed as a snapshot and watched;
`wrap --analyze-every` leaves a summary of a job SIGKILLed with its launcher."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import TRAINPROF, run_cli, wait_for
from paths import JOBS

JOB = JOBS / "midrun_job.py"

pytestmark = pytest.mark.multiproc


def _torchrun(*args):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            str(JOB), *map(str, args)]


def test_midrun_straggler_real_job(tmp_path):
    # rank 1 starts 6 ms of extra compute per step at step 600 of 1,000 (40 % of the run)
    out = tmp_path / "run"
    p = run_cli(["wrap", "--out", out, "--no-analyze", "--profile-steps", "none", "--",
                 *_torchrun("--steps", 1000, "--slow-rank", 1, "--slow-from", 600, "--slow-ms", 6)],
                timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    p = run_cli(["analyze", out, "--out", tmp_path / "a", "--no-report", "--json"], timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads(p.stdout)
    assert s["run"]["state"] == "ended"
    found = [f for f in s["findings"] if f["kind"] == "straggler"]
    assert [f["ranks"] for f in found] == [[1]], [f["message"] for f in s["findings"]]
    f = found[0]
    assert abs(f["onset"]["step"] - 600) <= 10, f["onset"]  # within 1 % of the run's steps
    assert "end" not in f and "from step" in f["message"]
    # rank 0's waits in those steps are rank 1's doing, not exposed communication
    assert f["evidence"]["waiters"] == [0] and f["evidence"]["waiters_wait_ms"] >= 3.0
    ex = [x for x in s["findings"] if x["kind"] == "exposed_comm"]
    assert all("late rank 1" in x["message"] for x in ex), [x["message"] for x in ex]
    assert s["metrics"]["collectives"]["blocked"]["median_fraction_excl_late_ranks"] < \
        s["metrics"]["collectives"]["blocked"]["median_fraction"]


def _kill_tree(pid: int) -> None:
    import psutil

    try:
        procs = [psutil.Process(pid)] + psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return
    for p in procs:  # SIGKILL to the whole allocation, as a scheduler's wall-time limit does
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs[1:], timeout=20)  # (not the Popen's own child: its status is ours)


def _steps(out: Path) -> int:
    try:
        return sum(1 for _ in open(out / "ranks" / "rank-00001" / "steps.jsonl"))
    except OSError:
        return 0


def _summary_step(out: Path):
    try:
        return json.loads((out / "summary.json").read_text())["run"]["last_step"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def test_live_snapshot_watch_and_sigkill(tmp_path):
    out = tmp_path / "run"
    log = open(tmp_path / "wrap.err", "w")
    wrap = subprocess.Popen(
        TRAINPROF + ["wrap", "--out", str(out), "--analyze-every", "0.05", "--profile-steps", "none",
                     "--", *_torchrun("--steps", 10_000_000, "--step-sleep-ms", 5)],
        stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
    err = lambda: (tmp_path / "wrap.err").read_text()[-3000:]  # noqa: E731
    try:
        assert wait_for(lambda: _steps(out) >= 200, timeout=120), err()
        # a snapshot while the job runs: outputs elsewhere, run.state running, the last step
        p = run_cli(["analyze", out, "--out", tmp_path / "snap", "--json", "--no-report"], timeout=120)
        assert p.returncode == 0, p.stderr[-3000:]
        s = json.loads(p.stdout)
        assert s["run"]["state"] == "running" and s["run"]["last_step"] >= 150, s["run"]
        # the live view, once, as a user runs it, and rendered headless in-process
        w = run_cli(["watch", out, "--once", "--rows", "5"], timeout=60,
                    env={"COLUMNS": "120"})
        assert w.returncode == 0 and "running at step" in w.stdout and "steps/s" in w.stdout, w
        assert "rank" in w.stdout and "heartbeat age" in w.stdout
        from rich.console import Console

        from trainprof.analyzers.live import snapshot
        from trainprof.reports.live import render_watch

        snap = snapshot(out, 60)
        assert snap["state"] == "running" and snap["steps_per_s"] > 1 and snap["hang"] is None
        c = Console(record=True, width=120, file=open(os.devnull, "w"))
        c.print(render_watch(snap, rows=1))
        text = c.export_text()
        assert "1 more ranks" in text and f"{snap['ranks']} rank(s)" in text
        # --analyze-every wrote a summary while the job ran (a refresh made in the job's first
        # seconds says no step yet: wait for one made after step 100)
        assert wait_for(lambda: (_summary_step(out) or 0) >= 100, timeout=120), err()
        step_at_kill = _steps(out)
    finally:
        _kill_tree(wrap.pid)
    assert wrap.wait(30) == -signal.SIGKILL, err()
    left = json.loads((out / "summary.json").read_text())  # a recent analysis survives SIGKILL
    assert left["run"]["state"] in ("running", "stopped") and left["run"]["last_step"] >= 100
    assert (out / "report.html").exists()
    assert left["run"]["last_step"] <= step_at_kill + 50
    time.sleep(0.5)
    p = run_cli(["analyze", out, "--out", tmp_path / "after", "--json", "--no-report"], timeout=120)
    assert json.loads(p.stdout)["run"]["state"] == "stopped"
