"""Collective log records in one process: mesh-dimension mapping, byte sizes as nccl-tests count
them, functional collectives (async wrapper, torch.compile)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from collective_paths import PATHS, _fast_built  # noqa: F401


def test_mesh_dim_mapping():
    from trainprof.probes.collectives import mesh_dim

    mesh = {"dim_names": ["dp", "pp", "tp"], "shape": [2, 2, 2]}
    # rank 5 = coords (1, 0, 1)
    assert mesh_dim(mesh, [4, 5], 5) == "tp"
    assert mesh_dim(mesh, [5, 7], 5) == "pp"
    assert mesh_dim(mesh, [1, 5], 5) == "dp"
    assert mesh_dim(mesh, list(range(8)), 5) is None
    assert mesh_dim(None, [4, 5], 5) is None
    hsdp = {"dim_names": ["dp_replicate", "dp_shard", "tp"], "shape": [2, 2, 2]}
    assert mesh_dim(hsdp, [1, 3, 5, 7], 7) == "dp"  # both data-parallel dims together
    assert mesh_dim(hsdp, [5, 7], 7) == "dp"


def test_byte_sizes_follow_nccl_tests():
    import torch

    from trainprof.probes.collectives import _nbytes

    assert _nbytes(torch.ones(3, 4)) == (48, 12, "float32")
    assert _nbytes([torch.ones(2, dtype=torch.float16), [torch.ones(3, dtype=torch.float16)]]) \
        == (10, 5, "float16")
    assert _nbytes(None) == (0, 0, None)


def _port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("path", PATHS)
def test_funcol_wait_found_on_the_async_wrapper(tmp_path, path):
    """fc.wait_tensor(AsyncCollectiveTensor) must match the op at the wrapper (asking a wrapper
    subclass for its storage raises a C++ error, which cost ~40 us per op before the unwrap),
    a view with an offset must find its op through the storage, and no key may be left behind
    once every output was waited. Both the C and the Python path."""
    code = r'''
import os, sys, torch, torch.distributed as dist, trainprof
import torch.distributed._functional_collectives as fc
from trainprof.probes import collectives as C
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
with trainprof.session("run", profile_steps="none"):
    dist.init_process_group("gloo", rank=0, world_size=1)
    want = "Proxy" if sys.argv[2] == "c" else "_FuncolProxy"
    assert type(torch.ops._c10d_functional.all_reduce).__name__ == want
    assert type(torch.ops._c10d_functional.wait_tensor).__name__ == ("Proxy" if want == "Proxy" else "_Wait")
    assert torch.ops._c10d_functional.all_reduce.default is not None  # attributes: torch's packet
    from torch._C._distributed_c10d import ProcessGroup, Work
    for m in (ProcessGroup.allreduce, ProcessGroup.send, Work.wait):  # the c10d wrappers
        assert type(m).__name__ == ("Method" if want == "Proxy" else "function"), m
        assert m._trainprof_original is not None and m.__name__ in ("allreduce", "send", "wait")
    a = fc.all_reduce(torch.ones(4), "sum", dist.group.WORLD)
    assert type(a).__name__ == "AsyncCollectiveTensor"
    assert C._storage_key(a) == C._storage_key(a.elem) == C._storage_key(a.elem.view(2, 2))
    fc.wait_tensor(a)
    v = fc.all_reduce(torch.ones(4), "sum", dist.group.WORLD).view(2, 2)  # a view of the ACT
    fc.wait_tensor(v)
    b = fc.all_reduce(torch.ones(8), "sum", dist.group.WORLD)
    fc.wait_tensor(b.elem[4:])  # a view with an offset: found through its storage
    assert not C._LOG._funcol, C._LOG._funcol
    d = fc.all_reduce(torch.ones(2, dtype=torch.float64), "sum", dist.group.WORLD)  # a new dtype
    fc.wait_tensor(d)
    assert not C._LOG._funcol and not C._LOG.inflight, (C._LOG._funcol, C._LOG.inflight)
    # stale keys (outputs freed unwaited) are pruned in place: the C side holds this very dict
    funcol = C._LOG._funcol
    class Gone:
        rid = -1
    funcol.update({-k: [Gone()] for k in range(1, 5000)})
    C._LOG.flush()
    assert C._LOG._funcol is funcol and not funcol
    w = dist.all_reduce(torch.ones(2), async_op=True)  # c10d: the Work is let go once waited
    assert any(o.work is w for o in C._LOG._ops.values())
    w.wait()
    assert all(o.work is None for o in C._LOG._ops.values() if o.done), "a waited Work is kept"
    e = fc.all_reduce(torch.ones(3), "sum", dist.group.WORLD)  # still found after the prune
    fc.wait_tensor(e)
    assert not C._LOG._funcol and not C._LOG.inflight, (C._LOG._funcol, C._LOG.inflight)
    r, w = os.pipe()  # a forked child (a DataLoader worker) logs nothing into this session
    pid = os.fork()
    if pid == 0:
        os.write(w, b"1" if C._active() is None else b"0")
        os._exit(0)
    os.waitpid(pid, 0)
    assert os.read(r, 1) == b"1" and C._active() is C._LOG
    trainprof.step()
    dist.destroy_process_group()
'''
    env = dict(os.environ, TRAINPROF_COLLECTIVES_PY="1" if path == "python" else "0")
    res = subprocess.run([sys.executable, "-c", code, str(_port()), path], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    recs = [json.loads(x) for x in (tmp_path / "run/ranks/rank-00000/collectives.jsonl").read_text().splitlines()]
    fc = [x for x in recs if x["api"] == "funcol.all_reduce"]
    assert len(fc) == 5 and all(x["end_ns"] >= x["enqueue_ns"] and x["blocked_ms"] > 0 for x in fc)
    assert [x["seq"] for x in fc] == [0, 1, 2, 3, 5]  # seq 4: the c10d all_reduce, same group
    assert [(x["bytes"], x["numel"], x["dtype"]) for x in fc] == [
        (16, 4, "float32"), (16, 4, "float32"), (32, 8, "float32"), (16, 2, "float64"),
        (12, 3, "float32")]
    assert all(x["step"] == 0 and x["pg"] == fc[0]["pg"] and x["op"] == "all_reduce" and x["async"]
               and x["device_ms"] is None and x["peer"] is None for x in fc)


@pytest.mark.skipif(not _fast_built(), reason="_fastlog not built")
def test_funcol_under_torch_compile_is_logged(tmp_path):
    """A compiled function calling a functional collective still runs, and its op is logged:
    dynamo cannot trace the C proxy, so it breaks the graph there and runs the op eagerly."""
    code = r'''
import os, sys, torch, torch.distributed as dist, trainprof
import torch.distributed._functional_collectives as fc
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
with trainprof.session("run", profile_steps="none"):
    dist.init_process_group("gloo", rank=0, world_size=1)
    f = torch.compile(lambda x: fc.all_reduce(x * 2, "sum", dist.group.WORLD) + 1, backend="eager")
    assert f(torch.ones(4)).tolist() == [3.0] * 4
    dist.destroy_process_group()
'''
    res = subprocess.run([sys.executable, "-c", code, str(_port())], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    recs = [json.loads(x) for x in (tmp_path / "run/ranks/rank-00000/collectives.jsonl").read_text().splitlines()]
    assert [(x["api"], x["bytes"]) for x in recs] == [("funcol.all_reduce", 16)]
    assert recs[0]["end_ns"] >= recs[0]["enqueue_ns"]
