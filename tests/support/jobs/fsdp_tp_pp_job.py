"""A small real FSDP2 + TP + PP job on gloo (CPU): a two-stage pipeline (GPipe) over a
(pp, tp) DeviceMesh, each stage an FSDP2-sharded MLP and a tensor-parallel one.

    python fsdp_tp_pp_job.py STEPS [--hidden H] [--microbatches N] [--batch B] [--lr LR]
                                   [--collectives every|loss]

Defaults: the tests' job (tests/support/collective_job.py runs it under `trainprof wrap`):
hidden 16, every kind of collective the collective log records, once per step (all_reduce,
all_gather, reduce_scatter, broadcast, all_to_all, async ops, send/recv, batched P2P, functional
collectives, barrier). `--collectives loss`: one all_reduce of the loss per step instead, as in
benchmarks/bench_probes_ab.py --whole-runs (with --hidden 256 --microbatches 4 --batch 64
--lr 1e-3), where the pipeline's and the shards' own communication is the load.
"""

import argparse

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

ap = argparse.ArgumentParser()
ap.add_argument("steps", type=int, nargs="?", default=30)
ap.add_argument("--hidden", type=int, default=16)
ap.add_argument("--microbatches", type=int, default=2)
ap.add_argument("--batch", type=int, default=4)
ap.add_argument("--lr", type=float, default=0.01)
ap.add_argument("--collectives", choices=("every", "loss"), default="every")
a = ap.parse_args()

H = a.hidden
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("pp", "tp"))
torch.manual_seed(0)


class MLP(nn.Module):
    def __init__(self, h=H):
        super().__init__()
        self.up, self.down = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Stage(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = MLP(), MLP()

    def forward(self, x):
        return self.b(self.a(x))


def every_collective():
    """One of each collective the collective log records."""
    t = torch.ones(8)
    dist.all_reduce(t)
    dist.all_gather([torch.empty(8) for _ in range(world)], t)
    dist.all_gather_into_tensor(torch.empty(8 * world), t)
    dist.reduce_scatter_tensor(torch.empty(8), torch.ones(8 * world))
    dist.broadcast(t, src=0)
    dist.all_to_all_single(torch.empty(world * 2), torch.ones(world * 2))
    dist.all_to_all([torch.empty(2) for _ in range(world)], [torch.ones(2) for _ in range(world)])
    dist.all_reduce(t, async_op=True).wait()
    peer = rank ^ 1
    if rank % 2 == 0:
        dist.send(t, peer)
        dist.recv(t, peer)
    else:
        dist.recv(t, peer)
        dist.send(t, peer)
    for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, t, peer),
                                     dist.P2POp(dist.irecv, torch.empty(8), peer)]):
        w.wait()
    funcol.all_reduce(torch.ones(4), "sum", dist.group.WORLD) + 1
    dist.barrier()


def loss_only():
    dist.all_reduce(torch.ones(1))


model = Stage()
fully_shard(model.a, mesh=mesh["tp"])
parallelize_module(model.b, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
stage_idx = mesh.get_coordinate()[0]
stage = PipelineStage(model, stage_idx, 2, torch.device("cpu"), group=mesh["pp"].get_group())
sched = ScheduleGPipe(stage, n_microbatches=a.microbatches, loss_fn=lambda o, t: ((o - t) ** 2).mean())
opt = torch.optim.SGD(model.parameters(), lr=a.lr)
x = torch.randn(a.batch, H)
communicate = every_collective if a.collectives == "every" else loss_only
for step in range(a.steps):
    opt.zero_grad()
    sched.step(x) if stage_idx == 0 else sched.step(target=x)
    communicate()
    opt.step()
dist.destroy_process_group()
