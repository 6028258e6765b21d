"""A plain DDP job (no trainprof in it) of many short steps in which one rank starts doing extra
compute part-way through the run and (optionally) stops again: a node that degrades mid-run.

    python -m torch.distributed.run --nproc-per-node 2 midrun_job.py --steps 2000 \
        --slow-rank 1 --slow-from 1000 --slow-ms 6
"""

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=2000)
ap.add_argument("--slow-rank", type=int, default=-1)
ap.add_argument("--slow-from", type=int, default=0)
ap.add_argument("--slow-until", type=int, default=1 << 60)
ap.add_argument("--slow-ms", type=float, default=6.0)
ap.add_argument("--width", type=int, default=256)
ap.add_argument("--step-sleep-ms", type=float, default=0.0)
a = ap.parse_args()

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, a.width), nn.ReLU(), nn.Linear(a.width, 8))
ddp = DDP(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
g = torch.Generator().manual_seed(rank)
busy = torch.randn(128, 128)


def extra_compute(ms: float) -> None:
    """Burn ``ms`` of CPU in matmuls (not a sleep: compute, as a slower node does)."""
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        busy @ busy


for step in range(a.steps):
    if rank == a.slow_rank and a.slow_from <= step < a.slow_until:
        extra_compute(a.slow_ms)
    if a.step_sleep_ms:
        time.sleep(a.step_sleep_ms / 1e3)
    x, y = torch.randn(32, 64, generator=g), torch.randn(32, 8, generator=g)
    ((ddp(x) - y) ** 2).mean().backward()
    opt.step()
    opt.zero_grad()
import gc  # noqa: E402

gc.collect()  # gloo can abort at interpreter exit while Works are still alive (a torch bug)
dist.destroy_process_group()
