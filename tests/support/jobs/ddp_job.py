"""A plain DDP training script written the way torch's DDP tutorial shows, with knobs the tests
turn: world size, gradient_as_bucket_view, static_graph, no_sync accumulation, a comm hook, a
slow rank. Prints/writes a hash of the trained parameters so tests can compare runs bit for bit."""

import argparse
import hashlib
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=10)
ap.add_argument("--bucket-view", action="store_true")
ap.add_argument("--static", action="store_true")
ap.add_argument("--unused", action="store_true")
ap.add_argument("--accum", type=int, default=1)
ap.add_argument("--hook", default="none", choices=["none", "fp16", "builtin"])
ap.add_argument("--hash-out", default=None)
ap.add_argument("--slow-rank", type=int, default=-1)
ap.add_argument("--slow-ms", type=float, default=60.0)
ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda: NCCL, one GPU per rank")
a = ap.parse_args()

dev = torch.device(a.device)
if a.device == "cuda":
    import os

    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(dev)
dist.init_process_group("nccl" if a.device == "cuda" else "gloo")
rank = dist.get_rank()
torch.manual_seed(0)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU())
        self.head = nn.Linear(256, 8)
        self.spare = nn.Linear(8, 8)  # used only with --unused off

    def forward(self, x):
        y = self.head(self.body(x))
        return y if a.unused else self.spare(y)


model = Net().to(dev)
ddp = DDP(model, bucket_cap_mb=0.1, gradient_as_bucket_view=a.bucket_view,
          static_graph=a.static, find_unused_parameters=a.unused)
if a.hook == "fp16":
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
elif a.hook == "builtin":
    ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
g = torch.Generator().manual_seed(rank)
for step in range(a.steps):
    if rank == a.slow_rank:
        time.sleep(a.slow_ms / 1e3)  # extra "compute" on one rank: the others wait for it
    for micro in range(a.accum):
        x, y = torch.randn(32, 64, generator=g).to(dev), torch.randn(32, 8, generator=g).to(dev)
        if micro < a.accum - 1:
            with ddp.no_sync():
                ((ddp(x) - y) ** 2).mean().backward()
        else:
            ((ddp(x) - y) ** 2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=not a.bucket_view)
digest = hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes() for p in model.parameters()))
if a.hash_out and rank == 0:
    with open(a.hash_out, "w") as f:
        f.write(digest.hexdigest())
import gc  # noqa: E402

gc.collect()  # gloo can abort at interpreter exit while Works are still alive (a torch bug)
dist.destroy_process_group()
