"""A real 2-rank job of many tiny steps under a small budget (TRAINPROF_BUDGET_MB): every rank's
always-on files stay inside it, every step is kept (at full resolution or in blocks), older steps
were folded, the collective detail is a ring of the recent steps, and the analysis of the clean
run stays right (no straggler, every full-resolution step analysed, the resolution said).

TRAINPROF_TEST_LONG_STEPS / TRAINPROF_TEST_LONG_BUDGET_MB run it at the issue's size (20,000
steps, 4 MB: ~7 min on a loaded 2-core machine); the default keeps it to a CI-sized run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

JOB = Path(__file__).resolve().parents[1] / "support" / "jobs" / "long_tiny_job.py"
STEPS = int(os.environ.get("TRAINPROF_TEST_LONG_STEPS", "3000"))
BUDGET_MB = float(os.environ.get("TRAINPROF_TEST_LONG_BUDGET_MB", "1"))


@pytest.mark.multiproc
def test_long_job_stays_in_budget_and_its_analysis_stays_right(tmp_path):
    from trainprof.analysis.run import RunDir

    run_dir = tmp_path / "run"
    env = {**os.environ, "TRAINPROF_BUDGET_MB": f"{BUDGET_MB:g}"}
    res = subprocess.run([sys.executable, "-m", "trainprof", "wrap", "--out", str(run_dir),
                          "--no-analyze", "--profile-steps", "none", "--", sys.executable, "-m",
                          "torch.distributed.run", "--nproc-per-node", "2", str(JOB), "--steps",
                          str(STEPS)], capture_output=True, text=True, env=env, timeout=1800)
    assert res.returncode == 0, res.stderr[-2000:]
    for r in (0, 1):
        d = run_dir / "ranks" / f"rank-{r:05d}"
        size = sum(p.stat().st_size for p in d.rglob("*") if p.is_file())
        assert size <= BUDGET_MB * 2**20, (r, size)
        assert (d / "collectives.prev.jsonl").exists()  # the detail is a ring
        state = json.loads((d / "compact" / "state.json").read_text())
        assert state["folds"] >= 1  # older steps were folded, not dropped
    run = RunDir(run_dir)
    full = run.steps()
    blocks = run.step_blocks()
    for r in (0, 1):
        kept = set(full.loc[full["rank"] == r, "step"].astype(int))
        b = blocks[blocks["rank"] == r]
        for first, last in zip(b["step_first"], b["step_last"]):
            kept |= set(range(int(first), int(last) + 1))
        assert kept == set(range(STEPS)), r  # every step, never a silent stop
    # the per-step time blocked in collectives covers every full-resolution step, also those
    # the ring's detail no longer holds
    series = run.step_series()
    # (the ring's first step: detail windows kept around anomalies, e.g. a slow step on a loaded
    # machine, may hold older steps' detail too)
    from trainprof.rundir.detail import detail_steps

    detail_first = max(detail_steps(run, r)[0] for r in (0, 1))
    old = series[series["step"] < detail_first]
    assert len(old) > 100 and (old["coll_count"] == 4).all()
    out = tmp_path / "out"
    res = subprocess.run([sys.executable, "-m", "trainprof", "analyze", str(run_dir), "--out",
                          str(out), "--no-report"], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    s = json.loads((out / "summary.json").read_text())
    assert not s["errors"], s["errors"]
    # (a straggler the analysis itself explains by another process taking the cores is real)
    assert not [f for f in s["findings"] if f["kind"] == "straggler"
                and f["evidence"].get("cause") != "host_contention"], s["findings"]
    assert s["run"]["resolution"]["blocks"]["steps"][0] == 0
    assert s["run"]["resolution"]["full"]["steps"][1] == STEPS - 1
    n_full = full.groupby("rank")["step"].nunique().min()
    st = s["metrics"]["step_time"]
    assert st["job"]["steps"] >= n_full - 5, (st["job"], n_full)
