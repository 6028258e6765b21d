"""gloo runs reduce_scatter as an allreduce (its thread records gloo:all_reduce): the exposed
communication is labelled with the op the collective log recorded; a logged all_reduce keeps
its name."""

from __future__ import annotations

import gzip
import json

import pytest

from trainprof.analyzers import _comm_breakdown
from trainprof.rundir.files import profiler_trace_path, rank_dir, write_json_atomic
from trainprof.analysis.run import RunDir
from trainprof.trace import load_trace


def X(name, cat, ts, dur, tid=1):  # ts, dur in ms here (the trace's µs × 1000)
    return {"ph": "X", "name": name, "cat": cat, "ts": ts * 1000, "dur": dur * 1000, "pid": 1, "tid": tid, "args": {}}


def _row(root, log):
    ev = [X("ProfilerStep#1", "user_annotation", 0, 1000), X("aten::mm", "cpu_op", 0, 300),
          X("c10d::_reduce_scatter_base_", "cpu_op", 300, 200),
          X("gloo:all_reduce", "user_annotation", 310, 180, tid=2),
          X("c10d::allreduce_", "cpu_op", 600, 100), X("gloo:all_reduce", "user_annotation", 610, 80, tid=2)]
    p = profiler_trace_path(root, 0)
    p.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(p, "wt") as fh:
        json.dump({"distributedInfo": {"rank": 0, "world_size": 2, "backend": "gloo"}, "traceEvents": ev}, fh)
    write_json_atomic(rank_dir(root, 0) / "meta.json", {"rank": 0, "world_size": 2})
    (rank_dir(root, 0) / "collectives.jsonl").write_text("".join(json.dumps(c) + "\n" for c in log))
    rows, _, _ = _comm_breakdown.rank_breakdown(load_trace(p), log=_comm_breakdown.rank_log(RunDir(root), 0))
    return rows[0]


def test_reduce_scatter_run_as_gloo_all_reduce_keeps_the_logs_name(tmp_path):
    rec = {"step": 1, "pg": "0", "bytes": 64, "async": False}
    log = [dict(rec, seq=0, op="reduce_scatter", enqueue_ns=299_000_000, end_ns=501_000_000, blocked_ms=0.2),
           dict(rec, seq=1, op="all_reduce", enqueue_ns=599_000_000, end_ns=701_000_000, blocked_ms=0.1)]
    r = _row(tmp_path, log)
    assert r["comm_by_type_ms"] == {"reduce_scatter": pytest.approx(180), "all_reduce": pytest.approx(80)}


def test_without_a_log_the_trace_name_stays(tmp_path):
    r = _row(tmp_path, [])
    assert r["comm_by_type_ms"] == {"all_reduce": pytest.approx(260)}
