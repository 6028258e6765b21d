"""The Python API (session, step markers, run info) and step-boundary detection."""

from __future__ import annotations

import json
import subprocess
import sys

from trainprof.rundir import RunDir


def run_py(code: str, cwd) -> subprocess.CompletedProcess:
    res = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    return res


def test_session_optimizer_hook_and_run_info(tmp_path):
    run_py("""
import torch, trainprof
m = torch.nn.Linear(8, 8); a = torch.optim.SGD(m.parameters(), lr=0.1)
b = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)   # a second optimizer per step
trainprof.set_run_info(tokens_per_step=128)
with trainprof.session("run", profile_steps="none"):
    for _ in range(5):
        m(torch.randn(2, 8)).sum().backward(); a.step(); b.step()
for _ in range(3):   # after the session: nothing is recorded any more
    a.step()
""", tmp_path)
    run = RunDir(tmp_path / "run")
    steps = run.steps()
    assert list(steps["step"]) == [0, 1, 2, 3, 4]  # one per training step, not per optimizer
    assert set(steps["source"]) == {"optimizer"}
    meta = run.rank_meta(0)
    assert meta["run_info"] == {"tokens_per_step": 128} and meta["activated_by"] == "session"
    assert meta["steps_recorded"] == 5 and "ended_ns" in meta
    assert not (tmp_path / "run" / "profiler").exists()


def test_explicit_marker_wins_over_optimizer_hook(tmp_path):
    run_py("""
import torch, trainprof
m = torch.nn.Linear(8, 8); opt = torch.optim.SGD(m.parameters(), lr=0.1)
with trainprof.session("run", profile_steps="none"):
    for step in range(4):
        for micro in range(3):               # gradient accumulation: 3 optimizer calls per step
            m(torch.randn(2, 8)).sum().backward(); opt.step()
        trainprof.step()
""", tmp_path)
    steps = RunDir(tmp_path / "run").steps()
    # the 3 optimizer steps before the first marker count; from the first marker on, only markers
    assert list(steps["source"]) == ["optimizer"] * 3 + ["marker"] * 4


def test_api_is_inert_without_probes(tmp_path):
    res = run_py("""
import trainprof, sys
trainprof.step(); trainprof.set_run_info(x=1)
print('torch' in sys.modules)
""", tmp_path)
    assert res.stdout.strip() == "False"  # no torch import, no files
    assert list(tmp_path.iterdir()) == []


def test_probes_off_leaves_named_probes_out_and_says_so(tmp_path):
    code = """
import torch, trainprof
m = torch.nn.Linear(8, 8); opt = torch.optim.SGD(m.parameters(), lr=0.1)
with trainprof.session("{d}", profile_steps="none"):
    for _ in range(3):
        m(torch.randn(2, 8)).sum().backward(); opt.step()
"""
    run_py(code.format(d="on"), tmp_path)
    env = {**__import__("os").environ, "TRAINPROF_PROBES_OFF": "nan_watch, heartbeat,bogus"}
    res = subprocess.run([sys.executable, "-c", code.format(d="off")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "no probe named bogus" in res.stderr
    on, off = RunDir(tmp_path / "on"), RunDir(tmp_path / "off")
    assert on.stream(0, "nan") and on.stream(0, "heartbeat")  # the control: both probes write
    assert not off.stream(0, "nan") and not off.stream(0, "heartbeat")
    assert list(off.steps()["step"]) == [0, 1, 2]              # the others still run
    assert off.rank_meta(0)["probes_off"] == ["heartbeat", "nan_watch"]
    from trainprof.analysis import analyze
    summary = analyze(off)
    assert summary["run"]["probes_off"] == {"heartbeat": [0], "nan_watch": [0]}
    assert any("nan_watch was left out" in p for p in summary["problems"])
    assert "probes_off" not in analyze(on)["run"]
