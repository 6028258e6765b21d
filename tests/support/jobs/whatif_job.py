"""A small gloo DDP job with one problem switched on or off, for checking trainprof's estimates
against the run with the fix made (tests/integration/test_estimates_measured.py).

Each step: draw a batch from a DataLoader, "compute" for --compute-ms (a sleep plus a small MLP's
forward/backward: the step's time does not depend on how busy the shared CI cores are), DDP's
gradient all-reduce, optimizer step. Problems:
  --slow-rank R --slow-ms X       rank R computes X ms longer every step (a straggler)
  --data-ms D [--data-rank R]     the dataset's __getitem__ takes D ms (on rank R only; all
                                  ranks when R = -1); --workers W loads it in W worker processes
  --grad-sync manual              no DDP: each gradient all-reduced by hand after backward (the
                                  communication cannot overlap the backward); the fix is the
                                  default, DDP, which all-reduces buckets while backward runs;
  --grad-sync hooks               the same all-reduce per gradient as manual, issued with
                                  async_op=True from each parameter's post-accumulate-grad hook
                                  while backward runs (only the overlap differs from manual).
                                  --backward-ms B: backward "computes" B ms (a sleep) after
                                  every layer's gradient, at the input's end, so there is
                                  backward work left to hide the all-reduces under;
                                  --comm-mb M: M MB more of parameters in 8 tensors that cost
                                  almost no compute (the gradients to all-reduce)
"""

import argparse
import os
import subprocess
import sys
import time

if "RANK" not in os.environ:  # started bare: launch the 2 ranks here (no torchrun agent to start)
    import socket

    with socket.socket() as _s:
        _s.bind(("127.0.0.1", 0))
        _port = _s.getsockname()[1]
    _env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_port), WORLD_SIZE="2")
    _procs = [subprocess.Popen([sys.executable, *sys.argv], env=dict(_env, RANK=str(r), LOCAL_RANK=str(r)))
              for r in range(2)]
    sys.exit(max(p.wait() for p in _procs))

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=10)
ap.add_argument("--compute-ms", type=float, default=60.0)
ap.add_argument("--slow-rank", type=int, default=-1)
ap.add_argument("--slow-ms", type=float, default=0.0)
ap.add_argument("--data-ms", type=float, default=0.0)
ap.add_argument("--data-rank", type=int, default=-1)
ap.add_argument("--workers", type=int, default=0)
ap.add_argument("--bucket-mb", type=float, default=25.0)
ap.add_argument("--layers", type=int, default=1)
ap.add_argument("--width", type=int, default=64)
ap.add_argument("--grad-sync", choices=("ddp", "manual", "hooks"), default="ddp")
ap.add_argument("--backward-ms", type=float, default=0.0)
ap.add_argument("--comm-mb", type=float, default=0.0)
a = ap.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
torch.set_num_threads(1)


class Batches(Dataset):
    def __init__(self, n, delay_s):
        self.n, self.delay_s = n, delay_s

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.delay_s:
            time.sleep(self.delay_s)
        g = torch.Generator().manual_seed(i)
        return torch.randn(16, 32, generator=g), torch.randn(16, 4, generator=g)


delay = a.data_ms / 1e3 if a.data_rank in (-1, rank) else 0.0
loader = DataLoader(Batches(a.steps, delay), batch_size=None, num_workers=a.workers,
                    **({"prefetch_factor": 2} if a.workers else {}))


class SlowBackward(torch.autograd.Function):
    """Identity forward; backward sleeps --backward-ms (the last backward work: at the input)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        time.sleep(a.backward_ms / 1e3)
        return g


hidden = [m for _ in range(a.layers - 1) for m in (nn.Linear(a.width, a.width), nn.ReLU())]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        n = int(a.comm_mb * 2**20 / 4 / 8)
        self.wide = nn.ParameterList([nn.Parameter(torch.zeros(n)) for _ in range(8 if n else 0)])
        self.mlp = nn.Sequential(nn.Linear(32, a.width), nn.ReLU(), *hidden, nn.Linear(a.width, 4))

    def forward(self, x):
        out = self.mlp(x)
        for p in self.wide:  # in the loss, so their gradients are ready first in backward
            out = out + 0.0 * p.sum()
        return out


net = Net() if a.comm_mb else nn.Sequential(nn.Linear(32, a.width), nn.ReLU(), *hidden,
                                             nn.Linear(a.width, 4))
model = DDP(net, bucket_cap_mb=a.bucket_mb) if a.grad_sync == "ddp" else net
opt = torch.optim.SGD(model.parameters(), lr=0.01)
works = []  # --grad-sync hooks: each gradient all-reduced (async) as soon as backward made it
if a.grad_sync == "hooks":
    for p in net.parameters():
        p.register_post_accumulate_grad_hook(
            lambda p: works.append(dist.all_reduce(p.grad, async_op=True)))
extra = a.slow_ms / 1e3 if rank == a.slow_rank else 0.0
for x, y in loader:
    time.sleep(a.compute_ms / 1e3 + extra)
    if a.backward_ms:
        x = SlowBackward.apply(x.requires_grad_())
    ((model(x) - y) ** 2).mean().backward()
    if a.grad_sync == "manual":
        for p in net.parameters():
            dist.all_reduce(p.grad)
    for w in works:
        w.wait()
    works.clear()
    opt.step()
    opt.zero_grad()
import gc  # noqa: E402

gc.collect()  # gloo can abort at interpreter exit while Works are still alive (a torch bug)
dist.destroy_process_group()
