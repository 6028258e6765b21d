"""Many tiny training steps on gloo (the bounded-capture test): a linear model, two all_reduces,
a broadcast and a barrier a step (3 kinds), an optimizer step as the boundary."""

import argparse

import torch
import torch.distributed as dist

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=20000)
a = ap.parse_args()

dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Linear(8, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(4, 8)
flat = torch.zeros(sum(p.numel() for p in model.parameters()))
loss_t = torch.zeros(1)
for step in range(a.steps):
    loss = model(x).square().mean()
    loss.backward()
    dist.all_reduce(flat)
    loss_t.fill_(float(loss))
    dist.all_reduce(loss_t)
    dist.broadcast(loss_t, src=0)
    dist.barrier()
    opt.step()
    opt.zero_grad(set_to_none=False)
if dist.get_rank() == 0:
    print(f"done {a.steps} steps", flush=True)
dist.destroy_process_group()
