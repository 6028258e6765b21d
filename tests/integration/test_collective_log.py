"""The always-on collective log: every collective and p2p op of a real FSDP2 + TP + PP job on
gloo is recorded once, on the right group, with gap-free sequence numbers.

Single-process cases: tests/unit/probes/test_collective_records.py."""

from __future__ import annotations

from collective_job import NPROC, STEPS, _collective_job, _fast_built, collective_run  # noqa: F401
import json
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
