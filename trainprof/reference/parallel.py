"""3D parallelism from PyTorch's native APIs: DeviceMesh (dp, pp, tp), tensor parallel plans,
pipeline stages and FSDP2 / replicate."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                               parallelize_module)

TP_PLAN = {  # Megatron-style: column-parallel in, row-parallel out, one all-reduce per sub-block
    "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
    "attn.o": RowwiseParallel(),
    "mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel(),
}


def make_mesh(device_type: str, dp: int, pp: int, tp: int):
    return init_device_mesh(device_type, (dp, pp, tp), mesh_dim_names=("dp", "pp", "tp"))


def layer_layout(n_layers: int, n_stages: int, extra: dict[int, int]) -> list[list[int]]:
    """Contiguous layer ids per pipeline stage; ``extra`` adds blocks to stages (imbalance)."""
    counts = [n_layers // n_stages + (1 if s < n_layers % n_stages else 0) for s in range(n_stages)]
    for s, n in extra.items():
        counts[s] += n
    out, start = [], 0
    for c in counts:
        out.append(list(range(start, start + c)))
        start += c
    return out


def stage_ids(pp_rank: int, pp: int, virtual: int) -> list[int]:
    """Looped placement: rank r holds stages r, r+pp, r+2pp, ..."""
    return [pp_rank + v * pp for v in range(virtual)]


def apply_tp(stage, tp_mesh) -> None:
    for block in stage.layers.values():
        parallelize_module(block, tp_mesh, TP_PLAN)


def apply_fsdp(stage, dp_mesh) -> None:
    from torch.distributed.fsdp import fully_shard

    for block in stage.layers.values():
        fully_shard(block, mesh=dp_mesh)
    fully_shard(stage, mesh=dp_mesh)


def allreduce_grads(params, dp_group, dp: int) -> None:
    """replicate mode: DDP-style averaging of gradients across DP replicas."""
    for p in params:
        if p.grad is None:
            continue
        g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        dist.all_reduce(g, group=dp_group)
        g.div_(dp)


def local_numel(p: torch.Tensor) -> int:
    return p.to_local().numel() if hasattr(p, "to_local") else p.numel()
