"""Framework facts in one process: batch facts, job-declared run info and step markers winning over
the framework tracker."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def test_batch_facts_counts_token_ids_only():
    torch = pytest.importorskip("torch")
    from trainprof.probes.fw_tracker import batch_facts

    ids = torch.zeros(4, 32, dtype=torch.long)
    assert batch_facts({"input_ids": ids, "labels": ids}) == (4, 128, 32)
    assert batch_facts(({"attention_mask": ids, "input_ids": ids[:, :8]}, ())) == (4, 32, 8)
    assert batch_facts([ids]) == (4, 128, 32)                                  # TensorDataset
    assert batch_facts((torch.zeros(8, 3, 5, 5), torch.zeros(8, dtype=torch.long))) == (8, 0, None)
    assert batch_facts((torch.zeros(2, 5, 5, dtype=torch.long),)) == (2, 0, None)  # a mask, not tokens
    assert batch_facts("text") == (0, 0, None)


def _run_py(code, cwd):
    env = {**os.environ, "TRAINPROF_CALIBRATION": "0", "TRAINPROF_TELEMETRY": "0"}
    res = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    return res


def test_job_declared_run_info_wins_and_silent_framework_hands_steps_back(tmp_path):
    res = _run_py("""
import torch, trainprof
from trainprof.probes import fw_tracker
m = torch.nn.Linear(8, 8); opt = torch.optim.SGD(m.parameters(), lr=0.1)
trainprof.set_run_info(tokens_per_step=999)
with trainprof.session("run", profile_steps="none"):
    t = fw_tracker.Tracker("fake", "1.0", "test")
    t.facts.update(tokens_per_step=512, global_batch=16)
    t.begin()
    for i in range(3):           # the framework reports its boundaries
        opt.step(); t.end_step()
    for i in range(6):           # then stops while the optimizer keeps stepping
        opt.step()
""", tmp_path)
    assert "fake: no step boundary for 4 optimizer updates" in res.stderr
    from trainprof.analysis.run import RunDir

    run = RunDir(tmp_path / "run")
    # 3 marked steps; then the optimizer hook again: the 4 silent updates and the 5th close one
    # step (the probe cannot know where the framework's missing boundaries were), the 6th another
    assert list(run.steps()["source"]) == ["marker"] * 3 + ["optimizer"] * 2
    info = run.rank_meta(0)["run_info"]
    assert info["tokens_per_step"] == 999 and info["global_batch"] == 16 and info["framework"] == "fake"


def test_job_markers_win_over_the_framework(tmp_path):
    res = _run_py("""
import torch, trainprof
from trainprof.probes import fw_tracker
m = torch.nn.Linear(8, 8); opt = torch.optim.SGD(m.parameters(), lr=0.1)
with trainprof.session("run", profile_steps="none"):
    t = fw_tracker.Tracker("fake", "1.0", "test")
    t.begin()
    for i in range(5):           # the job's own callback marks, then the framework's step ends
        opt.step(); trainprof.step(); t.end_step()
""", tmp_path)
    assert "fake: the job marks its steps with trainprof.step()" in res.stderr
    from trainprof.analysis.run import RunDir

    steps = RunDir(tmp_path / "run").steps()
    assert list(steps["step"]) == [0, 1, 2, 3, 4] and set(steps["source"]) == {"marker"}
