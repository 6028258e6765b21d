"""A job of several ranks whose ranks never communicate (no DDP / FSDP wrapping, or a launcher
that started independent processes) trains one model per rank: the collectives analyzer says so
(`no_communication`), and only where the collective log was on and every rank's probes ran.

Single-process cases: tests/unit/analyzers/test_no_communication_rule.py."""

from __future__ import annotations

import json
import sys

import pytest

from helpers import run_cli, write_script


JOB = r"""
import torch, torch.distributed as dist
dist.init_process_group("gloo")
torch.manual_seed(dist.get_rank())
model = torch.nn.Linear(16, 16)   # forgot DDP(model): every rank trains its own copy
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(6):
    loss = model(torch.randn(8, 16)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
dist.destroy_process_group()
"""


@pytest.mark.multiproc
def test_a_real_job_without_ddp_is_named(tmp_path):
    script = write_script(tmp_path / "job.py", JOB)
    out = tmp_path / "run"
    res = run_cli(["wrap", "--out", out, "--profile-steps", "none", "--", sys.executable, "-m",
                   "torch.distributed.run", "--standalone", "--nproc-per-node", "2", script],
                  timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    (f,) = [f for f in s["findings"] if f["kind"] == "no_communication"]
    assert f["ranks"] == [0, 1] and "init_process_group, but no collective followed" in f["message"]
    assert "no_communication" in res.stderr  # printed with the findings
