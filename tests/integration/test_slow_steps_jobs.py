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


EXPORT_JOB = r"""
import time
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
torch.set_num_threads(1)
model = DDP(torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)]))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
gen = torch.Generator().manual_seed(rank)
for step in range(28):
    for micro in range(2):  # shapes recorded by the window: a trace of some size to export
        x = torch.randn(64, 256, generator=gen)
        model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    if step in (17, 22):
        if rank == 0:
            time.sleep(0.3)  # "saves a checkpoint"
        dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.multiproc
def test_trace_export_steps_left_out_and_real_slow_steps_found(tmp_path):
    """trainprof's default profiler window (steps 3-4); its trace export runs on a thread of
    its own beside the next steps, whose times the shared CPU inflates: those steps are left
    out (meta.json overhead_spans, step_time.excluded_steps.trace_export), and the job's two
    real slow steps (rank 0 sleeps 300 ms after steps 17 and 22: steps 18 and 23) are found."""
    script = tmp_path / "job.py"
    script.write_text(EXPORT_JOB)
    out = tmp_path / "run"
    proc = run_cli(["wrap", "--out", out, "--no-analyze", "--", sys.executable, "-m",
                    "torch.distributed.run", "--standalone", "--nproc-per-node", "2", script],
                   timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = run_cli(["analyze", out, "--out", tmp_path / "analysis", "--no-report"])
    assert res.returncode == 0, res.stderr[-3000:]
    s = json.loads((tmp_path / "analysis" / "summary.json").read_text())
    # the spans, and the steps any rank's record of which overlaps one, worked out here
    spans, records = [], []
    for r in (0, 1):
        meta = json.loads((out / "ranks" / f"rank-0000{r}" / "meta.json").read_text())
        ((kind, a, b),) = [(x["kind"], x["start_ns"], x["end_ns"]) for x in meta["overhead_spans"]]
        assert kind == "trace_export" and a < b
        spans.append((a, b))
        records += [json.loads(x) for x in (out / "ranks" / f"rank-0000{r}" / "steps.jsonl")
                    .read_text().splitlines()]
    overlapped = sorted({x["step"] for x in records for a, b in spans
                         if x["start_ns"] < b and x["end_ns"] > a})
    excluded = s["metrics"]["step_time"]["excluded_steps"]
    assert excluded["profiler"] == [2, 3, 4, 5] and excluded["trace_export"] == overlapped
    assert overlapped[0] == 5  # the export starts at the boundary that closes the window
    assert "trace" in s["metrics"]["step_time"]["excluded_reasons"]["trace_export"]
    (f,) = [f for f in s["findings"] if f["kind"] == "slow_steps"]
    slow = set(f["evidence"]["slow_steps"])
    assert {18, 23} <= slow and not slow & {x for v in excluded.values() for x in v}, f["message"]
