"""torch.distributed.pipelining's interleaved schedules on 2 gloo ranks × 2 virtual stages,
wrapped unmodified: asynchronous p2p is communication only where a rank waits for it (the split
equals the collective log's waits in the profiled steps, computed here from the raw files), the
zero-bubble schedule gets its theory, and the Gantt spans carry each rank's virtual stages."""

from __future__ import annotations

import gzip
import json
import os
import sys

import pytest

from helpers import TRAINPROF, write_script

JOB = """
import os, sys, torch, torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
import torch.distributed.pipelining as P
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
V, M, D, B = 2, 4, 256, 64
torch.manual_seed(0)
stages = [PipelineStage(torch.nn.Sequential(torch.nn.Linear(D, D), torch.nn.ReLU(), torch.nn.Linear(D, D)),
                        rank + i * world, world * V, torch.device("cpu")) for i in range(V)]
sched = getattr(P, os.environ["SCHED"])(stages, n_microbatches=M, loss_fn=lambda o, t: ((o - t) ** 2).mean())
opt = torch.optim.SGD([p for s in stages for p in s.submod.parameters()], lr=1e-3)
g = torch.Generator().manual_seed(1)
for step in range(5):
    x, t = torch.randn(M * B, D, generator=g), torch.randn(M * B, D, generator=g)
    opt.zero_grad()
    sched.step(x, target=t) if rank == 0 else sched.step(target=t)
    opt.step()
dist.destroy_process_group()
"""
SCHEDULES = ("ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble")
_done: dict = {}


def _job(tmp_path_factory, sched):
    if sched not in _done:
        import subprocess

        d = tmp_path_factory.mktemp(sched)
        script = write_script(d / "pp.py", JOB)
        env = {**os.environ, "SCHED": sched, "PYTHONWARNINGS": "ignore"}
        env.pop("MASTER_PORT", None)
        proc = subprocess.run([*TRAINPROF, "wrap", "--out", str(d / "run"), "--", sys.executable, "-m",
                               "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                               str(script)], env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        _done[sched] = (d / "run", json.loads((d / "run" / "summary.json").read_text()))
    return _done[sched]


def _union(iv):
    out, end = 0, None
    for a, b in sorted(iv):
        if end is None or a > end:
            out, end = out + (b - a), b
        elif b > end:
            out, end = out + (b - end), b
    return out


def _log_waits_in_steps(run, rank):
    """ms per profiled step of this rank's p2p waits ([end - blocked, end] of its log), clipped
    to the trace's ProfilerStep windows: independent of the analyzer's code."""
    trace = json.load(gzip.open(run / "profiler" / f"rank-{rank:05d}.pt.trace.json.gz"))
    base = trace.get("baseTimeNanoseconds", 0)  # ts: µs after it
    steps = [(base + e["ts"] * 1e3, base + (e["ts"] + e["dur"]) * 1e3) for e in trace["traceEvents"]
             if e.get("ph") == "X" and e["name"].startswith("ProfilerStep#")]
    log = [json.loads(x) for x in (run / f"ranks/rank-{rank:05d}/collectives.jsonl").read_text().splitlines()]
    waits = [(c["end_ns"] - c["blocked_ms"] * 1e6, c["end_ns"]) for c in log
             if c["op"] in ("send", "recv") and c.get("async") and c.get("blocked_ms")]
    per = [_union([(max(a, lo), min(b, hi)) for a, b in waits if b > lo and a < hi]) / 1e6
           for lo, hi in steps]
    return per, [(hi - lo) / 1e6 for lo, hi in steps]


@pytest.mark.multiproc
def test_async_p2p_is_communication_only_where_a_rank_waits(tmp_path_factory):
    run, summary = _job(tmp_path_factory, "ScheduleInterleaved1F1B")
    per_rank = summary["metrics"]["comm_compute"]["per_rank"]
    for r in per_rank:
        waits, windows = _log_waits_in_steps(run, r["rank"])
        p2p = sum(v for k, v in r["comm_by_type_ms_per_step"].items() if k in ("send", "recv"))
        expect = sum(waits) / len(waits)
        assert p2p == pytest.approx(expect, abs=2 + 0.1 * expect), r
        # gloo's send span covers most of the step; the rank never waits that long for a send
        assert r["comm_by_type_ms_per_step"].get("send", 0) < 0.25 * r["step_window_ms"], r
        assert r["compute_fraction"] + r["overlapped_fraction"] > 0.05, r


@pytest.mark.multiproc
@pytest.mark.parametrize("sched", SCHEDULES)
def test_interleaved_schedules_theory_and_virtual_stages(tmp_path_factory, sched):
    run, summary = _job(tmp_path_factory, sched)
    m = summary["metrics"]["pipeline"]
    assert m["config"]["schedule"] == sched
    assert (m["config"]["pp"], m["config"]["virtual_stages"], m["config"]["micro_batches"]) == (2, 2, 4)
    th = m["theory"]
    if sched == "ScheduleInterleaved1F1B":
        assert th["ratio"] == pytest.approx(1 / 8)
    else:  # the schedule's own order replayed with balanced stages; the paper's ZB-H1 beside it
        b = th["span_ms"]["B"]
        assert th["formula"].startswith("replay of the schedule's action order")
        assert th["paper"]["formula"] == "(p-1)(F+B-W)/(v*m*(F+B+W))"
        # the first stage has no input gradient to compute: its B spans are a fraction of the others'
        assert th["span_ms"]["B_first_stage"] < 0.3 * b
        assert 0 < th["share"] < 0.5
        # the order replayed is torch's own pipeline_order for this schedule, on every rank
        from torch.distributed.pipelining import schedules as S

        o = S.ScheduleInterleavedZeroBubble.__new__(S.ScheduleInterleavedZeroBubble)
        o.pp_group_size, o.n_local_stages, o._n_microbatches = 2, 2, 4
        o.number_of_rounds, o.microbatches_per_round = 2, 2
        want = {r: [(a.stage_index, a.computation_type.name[:10], a.microbatch_index)
                    for a in o._calculate_single_rank_operations(r) if a] for r in (0, 1)}
        kinds = {"F": "FORWARD", "B": "BACKWARD_I", "W": "BACKWARD_W"}
        for r in (0, 1):
            recs = [json.loads(x) for x in (run / f"ranks/rank-{r:05d}/pipeline.jsonl").read_text().splitlines()]
            got = [(x["stage"], kinds[x["kind"]], x["microbatch"])
                   for x in sorted(recs, key=lambda x: x["start_ns"]) if x["step"] == 1]
            assert got == want[r]
    # the Gantt chart's spans: each rank's two virtual stages
    stages = {}
    for s in m["gantt"]["spans"]:
        stages.setdefault(s["rank"], set()).add(s["stage"])
    assert stages == {0: {0, 2}, 1: {1, 3}}
    bubble = [f for f in summary["findings"] if f["kind"] == "pipeline_bubble"]
    # CPU stages: judged on the replay with free hand-overs and typical spans, 15-point margin
    j = m["judged_bubble"]
    assert (j["as"], j["margin"]) == ("replayed_typical_compute", 0.15)
    assert bool(bubble) == (j["share"] > th["share"] + 0.15)
