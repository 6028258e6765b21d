"""DDP corner cases for the recording comm hook (probes/ddp.py), one per mode; rank 0 writes a
hash of the trained parameters so tests compare runs with and without trainprof bit for bit."""

import argparse
import hashlib

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

ap = argparse.ArgumentParser()
ap.add_argument("mode", choices=["late_join_false", "hook_then_builtin", "cpp_hook", "compile"])
ap.add_argument("--hash-out", required=True)
a = ap.parse_args()
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))

# under compile, DDPOptimizer refuses a first bucket larger than the others: default buckets
ddp = DDP(model, bucket_cap_mb=25 if a.mode == "compile" else 0.001)
run = torch.compile(ddp, backend="eager") if a.mode == "compile" else ddp
opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
g = torch.Generator().manual_seed(rank)
outcome = "trained"


def batch():
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def step():
    x, y = batch()
    ((run(x) - y) ** 2).mean().backward()
    opt.step()
    opt.zero_grad()


if a.mode == "late_join_false":
    from torch.distributed.algorithms.join import Join

    with torch.no_grad():
        ddp(batch()[0])  # an eval forward before training installs trainprof's hook
    with Join([ddp], divide_by_initial_world_size=False):
        for _ in range(6 if rank == 0 else 3):  # uneven inputs: the divisor changes
            step()
else:
    if a.mode == "hook_then_builtin":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        try:
            ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
        except RuntimeError:
            outcome = "raised"  # DDP allows one hook: the second registration must fail
    elif a.mode == "cpp_hook":
        def reducer_hook(state, bucket):  # what DDP's mixed-precision hook does
            return ddp.reducer._run_allreduce_hook(bucket).then(lambda f: f.value()[0])

        ddp.register_comm_hook(None, reducer_hook)
    for _ in range(6):
        step()
digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
if rank == 0:
    with open(a.hash_out, "w") as f:
        f.write(f"{outcome} {digest.hexdigest()}")
import gc  # noqa: E402

gc.collect()  # gloo can abort at interpreter exit while Works are still alive (a torch bug)
dist.destroy_process_group()
