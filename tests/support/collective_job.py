"""A small real FSDP2 + TP + PP job on gloo and the session fixture that runs it once under wrap (shared by the collective-log, clock and collectives-analyzer tests)."""
from __future__ import annotations

import os

import pytest

from collective_paths import PATHS, _fast_built  # noqa: F401 - the paths of the collective log


JOB = r'''
import sys
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

STEPS = int(sys.argv[1])
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("pp", "tp"))
torch.manual_seed(0)


class MLP(nn.Module):
    def __init__(self, h=16):
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


model = Stage()
fully_shard(model.a, mesh=mesh["tp"])
parallelize_module(model.b, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
stage_idx = mesh.get_coordinate()[0]
stage = PipelineStage(model, stage_idx, 2, torch.device("cpu"), group=mesh["pp"].get_group())
sched = ScheduleGPipe(stage, n_microbatches=2, loss_fn=lambda o, t: ((o - t) ** 2).mean())
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(4, 16)
for step in range(STEPS):
    opt.zero_grad()
    sched.step(x) if stage_idx == 0 else sched.step(target=x)
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
    y = funcol.all_reduce(torch.ones(4), "sum", dist.group.WORLD) + 1
    dist.barrier()
    opt.step()
dist.destroy_process_group()
'''


NPROC = 4


STEPS = 4


@pytest.fixture(scope="session", params=PATHS)
def collective_run(request, reference_run, tmp_path_factory):
    """The job above under `trainprof wrap`, run once per test session and per path of the
    collective log (C, pure Python) (shared by the collectives and clock tests)."""
    return _collective_job(reference_run, tmp_path_factory, request.param)


def _collective_job(reference_run, tmp_path_factory, path):
    d = tmp_path_factory.mktemp("collective-job")
    (d / "trainprof_collective_job.py").write_text(JOB)
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(d)] + ([old] if old else []))
    try:
        return reference_run(f"collective-job-{path}", nproc=NPROC, args=[str(STEPS)],
                             wrap_args=["--profile-steps", "none"],
                             module="trainprof_collective_job",
                             env={"TRAINPROF_COLLECTIVES_PY": "1" if path == "python" else "0"})
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old
