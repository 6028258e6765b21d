"""The Chrome trace writer: lanes keep a thread's slices nested, flows bind to their slices,
the checker catches malformed events, and trainprof's own trace reader opens the file."""

from __future__ import annotations

import gzip
import json

from trainprof.reports import chrome_trace

MS = 1_000_000


def _model():
    return {
        "processes": [{"rank": 0, "name": "rank 0 (dp0, h)", "sort": 1, "label": "clock ±0 µs"},
                      {"rank": 1, "name": "rank 1 (dp1, h)", "sort": 0, "label": "clock ±50 µs"}],
        "slices": [
            (0, "steps", "step 3", "step", 1000 * MS, 100 * MS, {"step": 3}),
            (0, "pg 0", "all_reduce", "collective", 1010 * MS, 30 * MS, {"group": "0:0-1", "seq": 4}),
            (0, "pg 0", "all_gather", "collective", 1020 * MS, 30 * MS, {"group": "0:0-1", "seq": 5}),  # overlaps
            (1, "pg 0", "all_reduce (last to arrive)", "collective", 1035 * MS, 5 * MS,
             {"group": "0:0-1", "seq": 4, "last_to_arrive": True}),
            (1, "critical path", "compute", "critical_path", 1000 * MS, 35 * MS, {"kind": "compute"}),
        ],
        "flows": [(1, 3)],
        "counters": [(0, "memory allocated (MB)", 1001 * MS, {"allocated": 12.5})],
        "instants": [(1, "steps", "straggler: rank 1", 1000 * MS, {"kind": "straggler"})],
        "meta": {"ranks": [0, 1]},
    }


def test_render_is_well_formed_with_lanes_flows_and_order(tmp_path):
    out = chrome_trace.write(_model(), tmp_path / "t.json.gz", gz=True)
    doc = json.loads(gzip.decompress((tmp_path / "t.json.gz").read_bytes()))
    assert chrome_trace.problems(doc) == []
    ev = doc["traceEvents"]
    assert out["events"] == len(ev)
    threads = {(e["pid"], e["args"]["name"]) for e in ev if e["name"] == "thread_name"}
    assert (0, "pg 0") in threads and (0, "pg 0 #2") in threads  # the overlap got its own lane
    sort = {e["pid"]: e["args"]["sort_index"] for e in ev if e["name"] == "process_sort_index"}
    assert sort == {0: 1, 1: 0}
    s = next(e for e in ev if e["ph"] == "s")
    f = next(e for e in ev if e["ph"] == "f")
    assert (s["pid"], f["pid"], f["bp"]) == (0, 1, "e") and s["id"] == f["id"]
    assert min(e["ts"] for e in ev if e["ph"] == "X") == 0.0
    assert doc["otherData"]["base_epoch_ns"] == 1000 * MS
    # trainprof's own Chrome-trace reader opens it: every slice, on its clock
    from trainprof.trace import load_trace

    t = load_trace(tmp_path / "t.json.gz")
    assert len(t.tables.events) == sum(1 for e in ev if e["ph"] == "X")


def test_problems_names_what_is_wrong():
    doc = chrome_trace.render(_model())
    assert chrome_trace.problems(doc) == []
    bad = json.loads(json.dumps(doc))
    x = next(e for e in bad["traceEvents"] if e["ph"] == "X")
    del x["dur"]
    bad["traceEvents"].append({"ph": "X", "name": "a", "pid": 0, "tid": 99, "ts": 0, "dur": 10})
    bad["traceEvents"].append({"ph": "X", "name": "b", "pid": 0, "tid": 99, "ts": 5, "dur": 10})
    bad["traceEvents"].append({"ph": "s", "name": "c", "id": 777, "pid": 0, "tid": 99, "ts": 1})
    p = chrome_trace.problems(bad)
    assert any("bad dur" in x for x in p)
    assert any("without nesting" in x for x in p)
    assert any("flow 777" in x for x in p)
