"""Asynchronous point-to-point on CPU traces: gloo's isend/irecv spans run from the issue to the
transfer's end, often over the whole step with the rank's matmuls inside. Communication is only
where the rank waited (the collective log's wait: [end_ns - blocked_ms, end_ns]); compute under
the span is compute. Hand-built traces, numbers by hand."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from trainprof.analyzers import _comm_breakdown
from trainprof.rundir.files import profiler_trace_path, rank_dir, write_json_atomic
from trainprof.analysis.run import RunDir
from trainprof.trace import load_trace


def X(name, cat, ts, dur, tid=1):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 1, "tid": tid, "args": {}}


# one 1000 µs step: an isend issued at 10 whose span lasts to 990 with 600 µs of matmuls under
# it; an irecv issued at 700 waited for from 800 to 900 (blocked 100 µs)
EVENTS = [X("ProfilerStep#1", "user_annotation", 0, 1000),
          X("c10d::send", "cpu_op", 10, 5), X("gloo:send", "user_annotation", 15, 975),
          X("aten::mm", "cpu_op", 100, 300), X("aten::mm", "cpu_op", 400, 300),
          X("c10d::recv_", "cpu_op", 700, 5), X("gloo:recv", "user_annotation", 705, 195),
          X("aten::add", "cpu_op", 920, 50)]
LOG = [{"step": 1, "pg": "0", "seq": 0, "op": "send", "bytes": 64, "enqueue_ns": 9_000,
        "end_ns": 995_000, "blocked_ms": 0.0, "async": True, "api": "c10d.isend", "peer": 1},
       {"step": 1, "pg": "0", "seq": 1, "op": "recv", "bytes": 64, "enqueue_ns": 699_000,
        "end_ns": 900_000, "blocked_ms": 0.1, "async": True, "api": "c10d.irecv", "peer": 1}]


def _run(root: Path, events, log=None) -> RunDir:
    p = profiler_trace_path(root, 0)
    p.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(p, "wt") as fh:
        json.dump({"distributedInfo": {"rank": 0, "world_size": 2, "backend": "gloo"},
                   "traceEvents": events}, fh)
    write_json_atomic(rank_dir(root, 0) / "meta.json", {"rank": 0, "world_size": 2})
    if log is not None:
        (rank_dir(root, 0) / "collectives.jsonl").write_text("".join(json.dumps(c) + "\n" for c in log))
    return RunDir(root)


def _row(run):
    trace = load_trace(profiler_trace_path(run.path, 0))
    rows, _, kind = _comm_breakdown.rank_breakdown(trace, log=_comm_breakdown.rank_log(run, 0))
    assert kind == "cpu" and len(rows) == 1
    return rows[0]


def test_async_send_span_is_not_communication_the_wait_is(tmp_path):
    r = _row(_run(tmp_path, EVENTS, LOG))
    # compute: the matmuls (600) and the add (50); communication: the recv's wait, 800-900 —
    # never the send's 975 µs span; the two issuing calls (5 + 5) return without waiting (the
    # log's ops are all async): host work, not communication
    assert r["compute_ms"] == pytest.approx(0.65)
    assert r["exposed_comm_ms"] == pytest.approx(0.1)
    assert r["other_ms"] == pytest.approx(0.01)
    assert r["comm_by_type_ms"] == {"recv": pytest.approx(0.1)}  # what the log says it blocked
    assert r["overlapped_ms"] == 0


def test_without_a_log_the_thread_gaps_under_an_async_span_are_its_waits(tmp_path):
    r = _row(_run(tmp_path, EVENTS))
    # the send span (15-990) ran ops (the matmuls): async; its gaps 15-100, 700-920 (the recv's
    # issue is a wait, not work), 970-990 are where the thread could have waited for it. The recv
    # span (705-900) ran nothing: a synchronous wait, whole
    assert r["compute_ms"] == pytest.approx(0.65)
    assert r["comm_by_type_ms"]["recv"] == pytest.approx(0.195)
    assert r["comm_by_type_ms"]["send"] == pytest.approx(0.085 + 0.22 + 0.02)


def test_a_synchronous_send_stays_a_wait(tmp_path):
    ev = [X("ProfilerStep#1", "user_annotation", 0, 1000), X("aten::mm", "cpu_op", 0, 400),
          X("c10d::send", "cpu_op", 400, 5), X("gloo:send", "user_annotation", 405, 300)]
    log = [dict(LOG[0], enqueue_ns=399_000, end_ns=705_000, blocked_ms=0.306, **{"async": False})]
    r = _row(_run(tmp_path, ev, log))
    assert r["exposed_comm_ms"] == pytest.approx(0.305) and r["compute_ms"] == pytest.approx(0.4)
