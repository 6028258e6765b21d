"""NCCL/RCCL kernels named on GPU traces (analyzers/_coll_kernels.py): ncclDevKernel_Generic
attributed to its collective, size, process group and sequence number through the
record_param_comms op that launched it — on CUDA and HIP launch calls alike — as TraceLens
reports them for an 8-rank MI300 ResNet (all_reduce 16.8 MB x3, broadcast); hipDeviceSynchronize
counted as a sync."""

from __future__ import annotations

import json

import pytest

from trainprof.analyzers import _coll_kernels, _comm_breakdown, gpu_overview
from trainprof.trace import parse_trace

GENERIC = "ncclDevKernel_Generic(ncclDevKernelArgsStorage<4096ul>)"


def X(cat, name, ts, dur, pid=1, tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur,
            "args": args}


def trace(launch="cudaLaunchKernel", sync="cudaDeviceSynchronize"):
    ev = [X("user_annotation", "ProfilerStep#1", 0, 1000)]
    calls = [("allreduce", 4194304, "Float", 10), ("allreduce", 4194304, "Float", 110),
             ("allreduce", 4194304, "Float", 210), ("broadcast", 1000, "Long", 310)]
    for i, (coll, n, dt, t) in enumerate(calls):
        ev.append(X("cpu_op", "record_param_comms", t, 20, **{
            "External id": 10 + i, "Collective name": coll, "In msg nelems": n, "Out msg nelems": n,
            "dtype": dt, "Process Group Name": "0", "Process Group Description": "default_pg",
            "Seq": i + 1, "Group size": 8}))
        ev.append(X("cuda_runtime", launch, t + 5, 3, correlation=100 + i, **{"External id": 10 + i}))
        ev.append(X("kernel", GENERIC, t + 30, 50, pid=0, tid=7, stream=20, correlation=100 + i,
                    **{"External id": 10 + i}))
    ev.append(X("cuda_runtime", sync, 400, 300, correlation=200))
    return {"traceEvents": ev}


@pytest.mark.parametrize("launch", ["cudaLaunchKernel", "hipLaunchKernel"])
def test_generic_kernels_named(launch, tmp_path):
    p = tmp_path / "t.json"
    p.write_text(json.dumps(trace(launch)))
    tr = parse_trace(p)
    ev = tr.tables.events
    rows = ev["cat"].eq("kernel").nonzero()[0]
    att = _coll_kernels.attribute(tr, rows)
    assert [a["collective"] for a in att] == ["all_reduce"] * 3 + ["broadcast"]
    assert [a["bytes"] for a in att] == [16777216] * 3 + [8000]  # 16.8 MB as TraceLens says
    assert [a["seq"] for a in att] == [1, 2, 3, 4] and {a["pg_name"] for a in att} == {"0"}
    assert {(a["pg_desc"], a["group_size"]) for a in att} == {("default_pg", 8)}
    summ = gpu_overview.trace_digest(None, 0, tr)["collectives"]  # one rank's digest
    assert summ[0]["collective"] == "all_reduce" and summ[0]["count"] == 3
    assert summ[0]["kernel_ms"] == 0.15 and summ[0]["seqs"] == [1, 2, 3]
    # the communication breakdown names them too (not "other")
    rows_, _, kind = _comm_breakdown.rank_breakdown(tr)
    assert kind == "gpu"
    assert set(rows_[0]["comm_by_type_ms"]) == {"all_reduce", "broadcast"}


@pytest.mark.parametrize("sync", ["cudaDeviceSynchronize", "hipDeviceSynchronize"])
def test_device_synchronize_is_a_sync(sync, tmp_path):
    p = tmp_path / "t.json"
    p.write_text(json.dumps(trace(sync=sync)))
    rows_, _, _ = _comm_breakdown.rank_breakdown(parse_trace(p))
    assert rows_[0]["sync_calls"] == 1 and rows_[0]["sync_ms"] == 0.3


def test_job_metrics_bounded_over_ranks(tmp_path):
    p = tmp_path / "t.json"
    p.write_text(json.dumps(trace()))
    d = gpu_overview.trace_digest(None, 0, parse_trace(p))

    class Run:
        problems: list = []

        def trace_digests(self, name):
            return {r: d for r in range(3)}
    m = gpu_overview.analyze(Run()).metrics
    assert len(m["per_rank"]) == 3 and [s["ranks"] for s in m["per_step"]] == [3]
    assert m["per_step"][0]["gpu_utilization"] == d["per_step"][0]["gpu_utilization"]
    top = m["collectives"][0]
    assert (top["collective"], top["bytes"], top["ranks"], top["count"]) == ("all_reduce", 16777216, 3, 9)
