"""The always-on collective log: every collective and p2p op of a real FSDP2 + TP + PP job on
gloo is recorded once, on the right group, with gap-free sequence numbers."""

from __future__ import annotations

from collective_job import NPROC, PATHS, STEPS, _collective_job, _fast_built, collective_run  # noqa: F401
import json
import os
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

import pytest

# A small real job: block A is sharded with FSDP2 and block B is tensor-parallel (DTensor funcol
# all_reduce), both over the mesh's "tp" dim (4 ranks cannot hold dp×pp×tp all > 1), stages are
# pipelined with torch.distributed.pipelining (GPipe, 2 micro-batches); after each step every
# other c10d API runs once on the world group. STEPS optimizer steps.


# the C hot path (probes/_fastlog.c, where built) and the pure-Python reference path


def _load(run_dir: Path):
    from trainprof.analysis.run import RunDir

    run = RunDir(run_dir)
    recs = {r: run.stream(r, "collectives") for r in run.ranks}
    groups = {r: {g["pg"]: g for g in run.stream(r, "groups")} for r in run.ranks}
    return run, recs, groups


@pytest.mark.multiproc
def test_every_api_is_logged_once(collective_run):
    run, recs, groups = _load(collective_run)
    assert run.ranks == list(range(NPROC))
    assert not run.problems
    for r in run.ranks:
        seen = Counter((groups[r][x["pg"]]["mesh_dim"], x["op"], x["api"]) for x in recs[r])
        world = Counter({k: v for k, v in seen.items() if k[0] is None})
        # once per step on the world group (ops of every API, one record per wire op)
        for api, op in [("c10d.all_reduce", "all_reduce"), ("c10d.all_gather", "all_gather"),
                        ("c10d.all_gather_single", "all_gather"),
                        ("c10d.reduce_scatter_single", "reduce_scatter"),
                        ("c10d.broadcast", "broadcast"), ("c10d.all_to_all_single", "all_to_all"),
                        ("c10d.all_to_all", "all_to_all"), ("c10d.barrier", "barrier"),
                        ("funcol.all_reduce", "all_reduce")]:
            assert world[(None, op, api)] == STEPS * (2 if api == "c10d.all_reduce" else 1), \
                (r, api, world)
        # send/recv: dist.send/recv (implemented with isend/irecv) + batch_isend_irecv
        assert world[(None, "send", "c10d.isend")] == 2 * STEPS
        assert world[(None, "recv", "c10d.irecv")] == 2 * STEPS
        # FSDP2 on the tp dim, DTensor TP funcol, pipelining p2p on the pp dim
        assert seen[("tp", "all_gather", "c10d.all_gather_single")] >= STEPS
        assert seen[("tp", "reduce_scatter", "c10d.reduce_scatter_single")] >= STEPS
        assert seen[("tp", "all_reduce", "funcol.all_reduce")] >= STEPS
        pp_send = sum(v for k, v in seen.items() if k[0] == "pp" and k[1] == "send")
        pp_recv = sum(v for k, v in seen.items() if k[0] == "pp" and k[1] == "recv")
        assert pp_send >= 2 * STEPS and pp_recv >= 2 * STEPS


@pytest.mark.multiproc
def test_counts_agree_and_seq_gap_free(collective_run):
    run, recs, groups = _load(collective_run)
    per_group: dict[tuple, dict[int, Counter]] = defaultdict(dict)
    for r in run.ranks:
        by_pg = defaultdict(list)
        for x in recs[r]:
            by_pg[x["pg"]].append(x)
        for pg, xs in by_pg.items():
            seqs = sorted(x["seq"] for x in xs)
            assert seqs == list(range(len(seqs))), (r, pg)  # gap-free, no duplicates
            g = groups[r][pg]
            assert r in g["ranks"] and g["size"] == len(g["ranks"])
            per_group[(pg, tuple(g["ranks"]))][r] = Counter(
                x["op"] if x["op"] not in ("send", "recv") else "p2p" for x in xs)
    assert len({k[1] for k in per_group}) == 5  # world, 2 pp groups, 2 tp groups
    for (pg, ranks), counts in per_group.items():
        assert set(counts) == set(ranks), (pg, ranks)  # every member logged the group
        first = counts[ranks[0]]
        for r in ranks:
            assert counts[r] == first, (pg, r, counts[r], first)


@pytest.mark.multiproc
def test_record_fields(collective_run):
    run, recs, groups = _load(collective_run)
    steps = {s["step"] for s in run.stream(0, "steps")}
    for r in run.ranks:
        for x in recs[r]:
            assert x["end_ns"] is not None and x["end_ns"] >= x["enqueue_ns"], x
            assert x["step"] in steps | {max(steps) + 1}
            assert x["device_ms"] is None  # CPU
            assert x["blocked_ms"] >= 0
            if x["op"] in ("send", "recv"):
                assert x["peer"] in groups[r][x["pg"]]["ranks"] and x["peer"] != r
            if x["op"] == "barrier":
                assert x["bytes"] == 0
        ar = [x for x in recs[r] if x["api"] == "c10d.all_reduce" and x["step"] > 0]
        assert {x["bytes"] for x in ar} == {32} and {x["dtype"] for x in ar} == {"float32"}
        ag = [x for x in recs[r] if x["api"] == "c10d.all_gather_single" and x["pg"] == "0"]
        assert {x["bytes"] for x in ag} == {32 * NPROC}  # all_gather: output size
        rs = [x for x in recs[r] if x["api"] == "c10d.reduce_scatter_single" and x["pg"] == "0"]
        assert {x["bytes"] for x in rs} == {32 * NPROC}  # reduce_scatter: input size
        sync = [x for x in ar if not x["async"]]
        assert sync and all(abs(x["blocked_ms"] - (x["end_ns"] - x["enqueue_ns"]) / 1e6) < 1e-6
                            for x in sync)
        assert any(x["async"] for x in ar)
        # async_op as the job passed it (seen at the wait: a c10d function that waits on its
        # own Work was called with async_op=False): one sync and one async all_reduce a step
        assert sum(not x["async"] for x in ar) == sum(x["async"] for x in ar) == STEPS - 1
        world = [x for x in recs[r] if x["pg"] == "0" and x["step"] > 0]
        for api in ("c10d.all_gather", "c10d.all_gather_single", "c10d.all_to_all",
                    "c10d.all_to_all_single", "c10d.broadcast", "c10d.reduce_scatter_single",
                    "c10d.barrier"):
            got = [x["async"] for x in world if x["api"] == api]
            assert got and not any(got), (api, sorted({(x["api"], x["async"]) for x in world}))
        # send/recv and batch_isend_irecv hand out (or wait on) isend/irecv Works: async
        assert all(x["async"] for x in world if x["op"] in ("send", "recv"))
    # nothing left in flight at a clean exit, and the mesh dims are labelled
    labels = {g["mesh_dim"] for r in run.ranks for g in groups[r].values()}
    assert labels == {None, "pp", "tp"}


@pytest.mark.multiproc
@pytest.mark.skipif(not _fast_built(), reason="_fastlog not built")
def test_c_and_python_paths_log_the_same_records(reference_run, tmp_path_factory):
    """The C paths (functional proxies, ProcessGroup methods, Work.wait) write what the Python
    reference writes: the same records, in the same order, with the same fields and values
    but the times (the same job, run once on each path)."""
    runs = {p: _load(_collective_job(reference_run, tmp_path_factory, p))[1] for p in ("c", "python")}
    timed = ("enqueue_ns", "end_ns", "blocked_ms")
    for r in range(NPROC):
        got = [{k: v for k, v in x.items() if k not in timed} for x in runs["c"][r]]
        want = [{k: v for k, v in x.items() if k not in timed} for x in runs["python"][r]]
        assert len(got) == len(want) > 0, r
        assert got == want, next((g, w) for g, w in zip(got, want) if g != w)
        assert {k for x in runs["c"][r] for k in x} == {k for x in runs["python"][r] for k in x}


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


KILLED_AFTER_STEPS = r'''
import os, signal, sys, time, torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
m = torch.nn.Linear(8, 8); opt = torch.optim.SGD(m.parameters(), lr=0.1)
for step in range(5):
    loss = m(torch.randn(4, 8)).pow(2).mean()
    loss.backward()
    for p in m.parameters():
        dist.all_reduce(p.grad)
    opt.step(); opt.zero_grad()
time.sleep(0.2)  # the step's records are written by the probes' thread right after its end
os.kill(os.getpid(), signal.SIGKILL)  # no atexit, no flush: what is on disk is all there is
'''


def test_records_reach_disk_at_every_step_boundary(tmp_path):
    """A job killed shortly after a step keeps the collective, memory and NaN-watch records of
    every step it finished, whatever the background flush interval (set here far beyond the
    job's life): each step boundary has the probes' thread write them."""
    from helpers import run_cli, write_script

    script = write_script(tmp_path / "job.py", KILLED_AFTER_STEPS)
    out = tmp_path / "run"
    res = run_cli(["wrap", "--out", out, "--profile-steps", "none", "--no-analyze", "--",
                   sys.executable, script, str(tmp_path / "store")],
                  env={"TRAINPROF_FLUSH_S": "600", "TRAINPROF_HEARTBEAT_S": "600"}, timeout=300)
    assert res.returncode == -9, res.stderr  # wrap dies as its job did

    def stream(name):
        return [json.loads(x) for x in (out / f"ranks/rank-00000/{name}.jsonl").read_text().splitlines()]

    assert [s["step"] for s in stream("steps")] == list(range(5))
    coll = stream("collectives")
    assert [(c["step"], c["seq"], c["op"]) for c in coll] == \
        [(s, 2 * s + i, "all_reduce") for s in range(5) for i in range(2)]
    assert all(c["end_ns"] is not None for c in coll)
    assert [g["size"] for g in stream("groups")] == [1]
    assert [r["step"] for r in stream("memory")] == list(range(5))
    assert [r["step"] for r in stream("nan") if r.get("kind") == "step"] == list(range(5))
