"""The memory probe: per-step records and the measured model-state breakdown."""

from __future__ import annotations

import subprocess
import sys

from trainprof.analysis.run import RunDir


def test_breakdown_matches_hand_count_and_stream_per_step(tmp_path):
    res = subprocess.run([sys.executable, "-c", """
import torch, trainprof
m = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 64, bias=False))
opt = torch.optim.AdamW(m.parameters())
with trainprof.session("run", profile_steps="none"):
    for _ in range(4):
        m(torch.randn(2, 64)).sum().backward(); opt.step()
"""], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    run = RunDir(tmp_path / "run")
    n = 64 * 128 + 128 + 128 * 64
    b = run.rank_meta(0)["memory_breakdown"]
    assert b["n_params_local"] == n
    assert b["params_bytes"] == 4 * n and b["grads_bytes"] == 4 * n
    assert b["optimizer_state_bytes"] == 8 * n  # AdamW: exp_avg + exp_avg_sq in fp32
    recs = run.stream(0, "memory")
    assert [r["step"] for r in recs] == [0, 1, 2, 3]
    assert all(r["device"] == "cpu" and r["rss_bytes"] > 10 << 20 for r in recs)
