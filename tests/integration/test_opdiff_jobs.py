"""The op diff of two real runs of the reference job names the injected matmuls."""

from __future__ import annotations

import json
import shutil
import sys

import pytest

from helpers import run_cli


JOB = """
import os, torch, torch.distributed as dist, torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo")
torch.manual_seed(0)
torch.set_num_threads(1)
extra = int(os.environ.get("OPDIFF_EXTRA_MATMULS", "0"))
model = DDP(nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 8)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
w = torch.randn(256, 256)
for step in range(7):
    x, y = torch.randn(32, 64), torch.randn(32, 8)
    ((model(x) - y) ** 2).mean().backward()
    for _ in range(extra):
        w = torch.mm(w, w) / 256.0
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
"""


@pytest.mark.multiproc
@pytest.mark.long  # the op diff's unit tests stay in the suite; this real pair: benchmarks/long_tests.py
def test_real_runs_name_the_injected_matmuls(tmp_path):
    """Two 2-rank gloo jobs, the candidate doing 4 small extra matmuls every step: the op diff
    names aten::mm, on the step's thread, as the top contributor to the change of the step;
    gloo's all-reduce threads and the c10d calls are listed apart as waits, whatever they did."""
    job = tmp_path / "job.py"
    job.write_text(JOB)
    runs = {}
    for tag, extra in (("base", "0"), ("cand", "4")):
        out = tmp_path / tag
        r = run_cli(["wrap", "--out", out, "--no-analyze", "--profile-steps", "2-5", "--",
                     sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                     "2", job], env={"OPDIFF_EXTRA_MATMULS": extra}, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        runs[tag] = out
    r = run_cli(["compare", runs["base"], runs["cand"], "--json"], timeout=300)
    assert r.returncode in (0, 1, 3), r.stderr[-2000:]
    d = json.loads(r.stdout)["op_diff"]
    assert d["available"] and "kernels" not in d
    t = d["cpu_ops"]
    top = t["top"][0]
    assert (top["name"], top["role"]) == ("aten::mm", "compute") and top["delta_ms"] > 0, \
        (t["top"][:3], t["waiting"][:3])
    assert d["top_contributor"]["name"] == "aten::mm"
    mm = top["candidate_calls"] - top["baseline_calls"]
    assert mm == pytest.approx(4, abs=0.01)  # the 4 injected matmuls per step, on every rank
    roles = {(r["name"], r["role"]) for r in t["rows"]}
    assert ("gloo:all_reduce", "communication") in roles and ("c10d::allreduce_", "wait") in roles
    assert {r["role"] for r in t["top"]} == {"compute"}
    assert {r["role"] for r in t["waiting"]} <= {"wait", "communication"}
    shutil.rmtree(tmp_path / "base", ignore_errors=True)
