"""Slow steps on a real torchrun job that checkpoints on rank 0 every 5 steps."""

from __future__ import annotations

import json
import sys

import pytest

from helpers import run_cli


JOB = r"""
import time
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
torch.set_num_threads(1)
model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
gen = torch.Generator().manual_seed(rank)
for step in range(22):
    x = torch.randn(32, 64, generator=gen)
    loss = torch.nn.functional.mse_loss(model(x), x)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step % 5 == 4:
        if rank == 0:
            time.sleep(0.25)  # "saves a checkpoint"
        dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.multiproc
def test_real_job_checkpoint_on_rank0_every_5_steps(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    out = tmp_path / "run"
    proc = run_cli(["wrap", "--out", out, "--no-analyze", "--profile-steps", "none", "--",
                    sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node", "2", script], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = run_cli(["analyze", out, "--out", tmp_path / "analysis", "--no-report"])
    assert res.returncode == 0, res.stderr[-3000:]
    s = json.loads((tmp_path / "analysis" / "summary.json").read_text())
    fs = [f for f in s["findings"] if f["kind"] == "slow_steps"]
    assert len(fs) == 1, s["findings"]
    (f,) = fs
    ev = f["evidence"]
    # the sleep after the optimizer step of loop iteration 4, 9, ... falls in steps 5, 10, ...
    assert f["ranks"] == [0] and ev["period"] == 5, f["message"]
    assert set(ev["slow_steps"]) >= {10, 15, 20} and set(ev["slow_steps"]) <= {5, 10, 15, 20}
    assert ev["waiting_ranks"] == [1] and "barrier" in ev["wait_ops"], f["message"]
    assert "slow on rank 0 only" in f["message"] and "(every 5 steps)" in f["message"]
    assert ev["own_extra_ms"]["0"] >= 200 and ev["wait_extra_ms"]["1"] >= 150
