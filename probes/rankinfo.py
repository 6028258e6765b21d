"""Who this rank is: identity, device and DeviceMesh coordinates (meta.json content)."""

from __future__ import annotations

import os
import platform
import socket
import sys
import time

# DeviceMesh dimension names users give, mapped onto the canonical 3D-parallel axes
from trainprof.meshinfo import MESH_ALIASES

ENV_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
            "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
            "CUDA_VISIBLE_DEVICES", "NCCL_DEBUG", "NCCL_ALGO", "NCCL_PROTO", "OMP_NUM_THREADS",
            "PYTORCH_CUDA_ALLOC_CONF", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "SLURM_JOB_ID",
            "SLURM_PROCID", "SLURM_NODEID")


def identity() -> dict:
    import torch
    import torch.distributed as dist

    from trainprof import __version__

    initialized = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if initialized else int(os.environ.get("RANK", 0))
    world = dist.get_world_size() if initialized else int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    info = {
        "rank": rank,
        "world_size": world,
        "local_rank": local_rank,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "backend": str(dist.get_backend()) if initialized else None,
        "torch_version": torch.__version__,
        "trainprof_version": __version__,
        "python": sys.version.split()[0],
        "argv": list(sys.argv),
        "started_ns": time.time_ns(),
        "env": {k: os.environ[k] for k in ENV_KEYS if k in os.environ},
    }
    info.update(device_info(local_rank))
    return info


def device_info(local_rank: int) -> dict:
    import torch

    # Only ask CUDA when the job already uses it: initializing CUDA here would cost start-up
    # time and memory on every GPU of a job that runs on CPU.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        idx = torch.cuda.current_device()
        props = torch.cuda.get_device_properties(idx)
        return {"device": f"cuda:{idx}", "device_name": props.name,
                "device_memory_bytes": int(props.total_memory),
                "device_count": torch.cuda.device_count()}
    return {"device": "cpu", "device_name": platform.processor() or platform.machine() or "cpu",
            "cpu_count": os.cpu_count()}


def process_group_at_exit() -> dict | None:
    """The default process group as the job leaves it, read at the probes' close (an atexit hook
    registered before the job's own, so it runs after them): ``{"live": bool, "backend": str}``
    (and ``frameworks``: those of TEARDOWN_FRAMEWORKS the job imported, when the group is live),
    or None when the job never imported torch.distributed. A group still live at exit is torch's
    to tear down during interpreter finalization, where gloo can abort the process (SIGABRT,
    "terminate called without an active exception"; docs/hangs.md)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available():
        return None
    try:
        live = bool(dist.is_initialized())
        out = {"live": live, "backend": str(dist.get_backend()) if live else None}
    except Exception:  # noqa: BLE001 - a half-torn-down group: say nothing
        return None
    loaded = [m for m in TEARDOWN_FRAMEWORKS if m in sys.modules]
    if live and loaded:  # whose teardown call the fix names (analyzers/teardown.py)
        out["frameworks"] = loaded
    return out


# frameworks with their own way to destroy the group, looked up (never imported) at exit
TEARDOWN_FRAMEWORKS = ("accelerate", "deepspeed", "lightning", "pytorch_lightning", "transformers")


def mesh_info(mesh) -> dict:
    """Shape, names and this rank's coordinate in a DeviceMesh, plus canonical dp/pp/tp coords."""
    names = list(mesh.mesh_dim_names or [f"dim{i}" for i in range(mesh.mesh.ndim)])
    shape = [int(s) for s in mesh.mesh.shape]
    coord = mesh.get_coordinate()
    coord = [int(c) for c in coord] if coord is not None else None
    return {"dim_names": names, "shape": shape, "coord": coord,
            "device_type": getattr(mesh, "device_type", None),
            "coords": canonical_coords(names, shape, coord) if coord is not None else {}}


def canonical_coords(names: list[str], shape: list[int], coord: list[int]) -> dict:
    """{"dp": i, "pp": j, "tp": k} (plus any other named dims as they are). Several dims that
    all mean data parallel (e.g. dp_replicate × dp_shard) combine row-major into one dp index."""
    out: dict = {}
    for canon, aliases in MESH_ALIASES.items():
        idx, size = 0, 1
        for n, s, c in zip(names, shape, coord):
            if n.lower() in aliases:
                idx, size = idx * s + c, size * s
        if size > 1 or any(n.lower() in aliases for n in names):
            out[canon] = idx
    for n, c in zip(names, coord):
        if not any(n.lower() in a for a in MESH_ALIASES.values()):
            out[n] = c
    return out
