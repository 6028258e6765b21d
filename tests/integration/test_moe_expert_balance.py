"""Mixture of experts with expert parallelism (all_to_all_single, top-1 routing, one expert per
rank, 2 gloo ranks), wrapped unmodified: ~93 % of the tokens routed to rank 1's expert gives an
expert_imbalance finding naming routing, with what each expert received (compared with the
counts the job itself printed), the imbalance factor and the saving of balanced routing; the
same job with balanced routing is silent about it."""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys

import pytest

from helpers import TRAINPROF, write_script

T, H, STEPS = 512, 256, 6
JOB = f"""
import os, torch, torch.distributed as dist
from torch.distributed.nn.functional import all_to_all_single
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
T, H, SKEW = {T}, {H}, float(os.environ["SKEW"])
torch.manual_seed(0)
router = torch.nn.Linear(H, world)
torch.manual_seed(1 + rank)
expert = torch.nn.Sequential(torch.nn.Linear(H, 4 * H), torch.nn.ReLU(), torch.nn.Linear(4 * H, H))
opt = torch.optim.SGD(list(router.parameters()) + list(expert.parameters()), lr=1e-3)
bias = torch.tensor([0.0] * (world - 1) + [SKEW])
g = torch.Generator().manual_seed(rank)
for step in range({STEPS}):
    x = torch.randn(T, H, generator=g)
    dest = (router(x) + bias).argmax(-1)                      # top-1 routing
    order = dest.argsort()
    send_counts = torch.bincount(dest, minlength=world)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts)
    sc, rc = send_counts.tolist(), recv_counts.tolist()
    print(f"received {{rank}} {{step}} {{sum(rc)}}", flush=True)
    gate = torch.softmax(router(x), -1).gather(1, dest[:, None])
    inp = all_to_all_single(torch.empty(sum(rc), H), x[order] * gate[order], rc, sc)  # dispatch
    out = all_to_all_single(torch.empty(T, H), expert(inp), sc, rc)                     # combine
    y = torch.empty_like(out).index_copy_(0, order, out)
    loss = ((y - x) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    for p in router.parameters():
        dist.all_reduce(p.grad)
    opt.step()
dist.destroy_process_group()
"""
_done: dict = {}


def _job(tmp_path_factory, skew: str):
    if skew not in _done:
        d = tmp_path_factory.mktemp(f"moe-{skew}")
        script = write_script(d / "moe.py", JOB)
        env = {**os.environ, "SKEW": skew, "PYTHONWARNINGS": "ignore"}
        env.pop("MASTER_PORT", None)
        proc = subprocess.run([*TRAINPROF, "wrap", "--out", str(d / "run"), "--profile-steps", "none",
                               "--", sys.executable, "-m", "torch.distributed.run", "--standalone",
                               "--nproc-per-node", "2", str(script)],
                              env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        received = {}
        # the two ranks print to one pipe: their lines can run together
        for r, _s, n in re.findall(r"received (\d+) (\d+) (\d+)", proc.stdout):
            received.setdefault(int(r), []).append(int(n))
        _done[skew] = (json.loads((d / "run" / "summary.json").read_text()), received)
    return _done[skew]


@pytest.mark.multiproc
def test_skewed_routing_is_an_expert_imbalance(tmp_path_factory):
    summary, received = _job(tmp_path_factory, "1.3")
    tokens = {r: statistics.median(v) for r, v in received.items()}
    assert tokens[1] > 0.85 * T * 2  # the job's own counts: ~93 % of both ranks' tokens
    (f,) = [f for f in summary["findings"] if f["kind"] == "expert_imbalance"]
    ev = f["evidence"]
    assert f["ranks"] == [1] and "router" in f["message"] and "load-balancing loss" in f["message"]
    # what each expert received per routed all_to_all: its tokens × hidden × 4 B (fp32)
    assert ev["bytes_per_call"] == {str(r): pytest.approx(tokens[r] * H * 4, rel=0.05) for r in (0, 1)}
    mean = (tokens[0] + tokens[1]) / 2
    assert ev["imbalance_factor"] == pytest.approx(tokens[1] / mean, rel=0.05)
    assert ev["busiest_share_cut"] == pytest.approx(1 - mean / tokens[1], abs=0.03)
    # rank 0 waits for rank 1's expert in the all_to_all: the saving's bound, from the log
    assert ev["estimate"]["saving_ms_per_step_up_to"] == ev["all_to_all_wait_ms_per_step"]["0"] > 0


@pytest.mark.multiproc
def test_balanced_routing_is_silent(tmp_path_factory):
    summary, received = _job(tmp_path_factory, "0")
    assert not [f for f in summary["findings"] if f["kind"] == "expert_imbalance"]
    for g in summary["metrics"]["expert_balance"].get("groups", {}).values():
        assert g["imbalance_factor"] < 1.2
