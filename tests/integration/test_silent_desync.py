"""A silent desynchronization in a real 2-rank DDP job: rank 0 alone runs the DDP model for a
print, its next (no_sync) backward all-reduces, and gloo pairs that all-reduce with rank 1's
next one (same op and size) without an error, until rank 1 runs out of steps and exits while
rank 0 still has collectives to issue. The post-mortem names the desync (rank 0, step 0), not
rank 1's exit. Synthesized cases: tests/unit/analyzers/test_hang_step_desync.py."""

from __future__ import annotations

import json
import sys

import pytest

from helpers import run_cli, write_script

PRINT_JOB = """\
import torch, torch.distributed as dist, torch.nn as nn
from contextlib import nullcontext

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Linear(16, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
ACCUM = 4
for micro in range(ACCUM * 8):
    x = torch.randn(8, 16)
    last = micro % ACCUM == ACCUM - 1
    with nullcontext() if last else model.no_sync():
        model(x).pow(2).mean().backward()
    if last:
        opt.step()
        opt.zero_grad()
    if rank == 0 and micro % 12 == 0:  # a print that runs the DDP model on rank 0 only
        print(f"micro {micro} out {model(x).sum().item():.3f}", flush=True)
print(f"rank {rank} done", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.multiproc
def test_rank_only_ddp_forward_is_named_as_the_desync_not_the_peer_that_exited(tmp_path):
    script = write_script(tmp_path / "print_job.py", PRINT_JOB)
    out = tmp_path / "run"
    res = run_cli(["wrap", "--out", out, "--profile-steps", "none", "--hang-timeout", "60",
                   "--on-hang", "kill", "--", sys.executable, "-m", "torch.distributed.run",
                   "--standalone", "--nproc-per-node", "2", script], timeout=300)
    assert res.returncode != 0, res.stderr  # rank 0 fails once rank 1 has left
    summary = json.loads((out / "summary.json").read_text())
    (f,) = [f for f in summary["findings"] if f["analyzer"] == "hang"]
    c = f["evidence"]["culprit"]
    assert f["kind"] == "desync" and f["ranks"] == [0] and c["reason"] == "desync", f["message"]
    d = f["evidence"]["desync"][0]
    # step 0 (DDP's parameter broadcast, then the gradient all-reduce): rank 0's print after
    # micro-step 0 made micro-step 1's backward all-reduce too, 3 collectives against 2; the
    # same in steps 3 and 6 (micro-steps 12 and 24), 2 against 1
    assert (d["by"], d["step"], d["deviating"], d["extra"]) == ("steps", 0, [0], True)
    assert {v["step"]: v["ranks"] for v in d["variants"]} == {0: [0], 1: [1]}
    assert {v["api"] for v in d["variants"]} == {"ddp.bucket"}
    assert [x["step"] for x in d["steps_differ"]][:2] == [0, 3]  # 6: if rank 0 closed it
    assert f["message"].startswith("Collective desynchronization: rank 0 issued 1 more "
                                   "collective of group 0 in step 0 than rank 1 (3 against 2)")
    assert "rank 1 then exited normally (exit code 0) after step 7" in f["message"]
    assert "a consequence of the desynchronization" in f["message"]
    assert "Join" not in f["message"] and "no_sync()" in f["fix"]
