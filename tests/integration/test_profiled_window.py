"""A profiler window that holds no training step (the job ended before trainprof's window, so
the trace recorded teardown only) is no measurement: the trace-based figures are withheld with a
problem saying so (and how to profile steps the job runs), never "0 % exposed communication"
followed by "nothing looks wrong". A window of real steps that mostly sleep is still measured.

Single-process cases: tests/unit/analyzers/test_profiled_window_rule.py."""

from __future__ import annotations

import json
import sys

import pytest

from helpers import run_cli

JOB = r"""
import os, time, torch
torch.set_num_threads(1)  # a 32x64 matmul on 2 intra-op threads waits ~100 ms for a preempted one on a loaded host
m = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
opt = torch.optim.SGD(m.parameters(), lr=0.01)
for step in range(int(os.environ["STEPS"])):
    loss = m(torch.randn(32, 64)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    time.sleep(float(os.environ.get("SLEEP_MS", "0")) / 1000)
"""


def _wrap(tmp_path, name: str, steps: int, sleep_ms: int = 0) -> tuple[str, dict]:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    out = tmp_path / name
    res = run_cli(["wrap", "--out", out, "--", sys.executable, script],
                  env={"STEPS": str(steps), "SLEEP_MS": str(sleep_ms)})
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stderr, json.loads((out / "summary.json").read_text())  # wrap prints on stderr


@pytest.mark.multiproc
def test_window_after_the_last_step_is_withheld_not_measured(tmp_path):
    stdout, s = _wrap(tmp_path, "short", steps=3)  # default window: steps 3-4
    assert (tmp_path / "short" / "profiler" / "rank-00000.pt.trace.json.gz").exists()
    cc = s["metrics"]["comm_compute"]
    assert "exposed_comm_fraction" not in cc and "job" not in cc
    why = cc["withheld"]
    assert "did not cover training steps" in why and "last recorded training step (2)" in why
    assert "--profile-steps 1-2" in why and why in s["problems"]
    for name in ("ops", "roofline", "launch"):  # the other window-only figures too
        assert s["metrics"].get(name, {"withheld": why}) == {"withheld": why}
    assert not [f for f in s["findings"] if f["analyzer"] in ("comm_compute", "ops", "launch")]
    cover = s["coverage"]
    assert "communication vs compute" in {m["analysis"] for m in cover["not_analyzed"]}
    assert "step time" in cover["analyzed"]
    assert "exposed communication" not in stdout and "nothing looks wrong" not in stdout
    assert "no findings in what was analyzed" in stdout or "coverage:" in stdout


@pytest.mark.multiproc
def test_window_of_sleeping_steps_is_still_measured(tmp_path):
    """Steps that sleep 20 ms around 1 ms of ops are training steps: measured as before."""
    _, s = _wrap(tmp_path, "sleepy", steps=7, sleep_ms=20)
    cc = s["metrics"]["comm_compute"]
    assert "withheld" not in cc and "coverage" not in s
    assert cc["job"]["idle_fraction"] > 0.5 and cc["job"]["compute_fraction"] > 0
    assert not [p for p in s["problems"] if "did not cover training steps" in p]


@pytest.mark.multiproc
def test_window_never_reached_is_said_and_a_lone_warmup_step_is_flagged(tmp_path):
    """A job of one step never reaches the default window (steps 3-4): no trace at all. That is
    said (what was not analyzed, and a --profile-steps the job runs), never "nothing looks
    wrong"; the step time shown comes from the warm-up step alone, which is said too."""
    stdout, s = _wrap(tmp_path, "one", steps=1)
    assert not (tmp_path / "one" / "profiler").exists()
    cover = s["coverage"]
    assert "was never reached: the job recorded 1 step" in cover["text"]
    assert "--profile-steps 0-0" in cover["text"] and cover["text"] in s["problems"]
    assert {"communication vs compute", "ops", "kernel launch"} <= {m["analysis"] for m in cover["not_analyzed"]}
    assert "nothing looks wrong" not in stdout and "no findings in what was analyzed" in stdout
    job = s["metrics"]["step_time"]["job"]
    assert job["from_excluded_steps"] is True and job["steps"] == 1
    assert [p for p in s["problems"] if p.startswith("step_time: the job recorded 1 step,")]
