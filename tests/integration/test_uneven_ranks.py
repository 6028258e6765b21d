"""Ranks with uneven inputs: a rank that exits normally (code 0) while its peers still train is
the cause of their failing collective (hang analyzer, reason ``exited_early``), and ranks that
recorded different numbers of steps (Join) are said (``uneven_steps``).

Single-process cases: tests/unit/analyzers/test_uneven_steps.py."""

from __future__ import annotations

import json
import sys

import pytest

from helpers import run_cli, write_script


# --------------------------------------------------------------------------- early exit


# --------------------------------------------------------------------------- uneven steps


# --------------------------------------------------------------------------- a real job

NOJOIN = """\
import torch, torch.nn as nn, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(nn.Linear(16, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
batches = [torch.randn(8, 16) for _ in range(6 + 3 * rank)]  # rank 1 has more inputs
for x in batches:
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()
print(f"rank {rank} ran {len(batches)} batches", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.multiproc
def test_real_job_without_join_names_the_rank_that_left(tmp_path):
    script = write_script(tmp_path / "nojoin.py", NOJOIN)
    out = tmp_path / "run"
    res = run_cli(["wrap", "--out", out, "--profile-steps", "none", "--hang-timeout", "60",
                   "--on-hang", "kill", "--", sys.executable, "-m", "torch.distributed.run",
                   "--standalone", "--nproc-per-node", "2", script], timeout=300)
    assert res.returncode != 0, res.stderr
    exits = [json.loads(x) for x in (out / "worker-exits.jsonl").read_text().splitlines()]
    codes = {w["rank"]: w["exitcode"] for w in exits[0]["workers"]}
    assert codes[0] == 0 and codes[1] != 0, (codes, res.stderr)
    summary = json.loads((out / "summary.json").read_text())
    (f,) = [f for f in summary["findings"] if f["analyzer"] == "hang"]
    c = f["evidence"]["culprit"]
    assert f["ranks"] == [0] and c["reason"] == "exited_early", f["message"]
    assert f["message"].startswith("Rank failure: rank 0 left the job early: exited normally "
                                   "(exit code 0) after step 5 while rank 1 was still training "
                                   "(rank 0 ran 6 steps, 0-5; rank 1 went on to step 6)"), f["message"]
    assert [v["rank"] for v in c["victims"]] == [1]
    assert "rank 1 then failed in all_reduce" in f["message"] and "Join" in f["message"]
