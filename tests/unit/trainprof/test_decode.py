"""The trace decoder's columns (trainprof/trace/_decode.py, _document.py, _columns.py): typed fast
path and tolerant path agree on odd values, out-of-range integers never crash, and piece cuts
fall on event bounds."""

import json

import numpy as np
import pytest

from trainprof.trace import _columns, _decode, _document


def _doc(*events, **top) -> bytes:
    return json.dumps({"traceEvents": list(events), **top}).encode()


def _x(**kw):
    e = {"ph": "X", "cat": "cpu_op", "name": "mm", "pid": 1, "tid": 2, "ts": 10, "dur": 5}
    e.update(kw)
    return e


def _both(data: bytes):
    out = [_decode.decode(data, fast=False)]
    if _document.msgspec is not None:
        out.append(_decode.decode(data, fast=True))
    return out


def test_factorize_keeps_first_seen_order_from_a_sequence_or_an_iterator():
    codes, uniq = _columns.factorize(["b", "a", "b", "c", "a"])
    assert codes.tolist() == [0, 1, 0, 2, 1] and uniq == ["b", "a", "c"]
    codes, uniq = _columns.factorize(iter("xyx"), 3)
    assert codes.tolist() == [0, 1, 0] and uniq == ["x", "y"]
    codes, uniq = _columns.factorize([])
    assert codes.dtype == np.int64 and len(codes) == 0 and uniq == []


def test_ints_take_only_integers_integral_floats_and_digit_strings():
    got = _columns.ints([7, None, "Spans", "7", 3.0, 3.5, float("nan"), 1e300, True, 2**70, -5,
                        "99999999999999999999", "1_0", "\u0661"])
    assert got.tolist() == [7, -1, -1, 7, 3, 3, -1, -1, -1, -1, -5, -1, -1, -1]
    assert _columns.ints([True, 1]).tolist() == [-1, 1]  # a bool is no id, whatever its company


def test_string_pid_and_integers_beyond_int64_on_both_paths():
    big = 2**64 - 1  # valid JSON; int64 cannot hold it
    data = _doc(_x(args={"correlation": big, "External id": 4, "stream": 7}),
                _x(pid="Spans", tid="PyTorch Profiler", cat="Trace", args={"correlation": 3}),
                _x(pid=None, args={"External id": big}))
    for c in _both(data):
        assert c.pid.tolist() == [1, -1, -1] and c.tid.tolist() == [2, -1, 2]
        assert c.corr.tolist() == [-1, 3, -1] and c.ext.tolist() == [4, -1, -1]
        assert c.stream.tolist() == [7, -1, -1]


def test_typed_and_tolerant_paths_give_the_same_columns():
    mem = {"ph": "i", "cat": "cpu_instant_event", "name": "[memory]", "ts": 11,
           "args": {"Device Type": 1, "Device Id": 0, "Addr": 99, "Bytes": 512,
                    "Total Allocated": 1024, "Total Reserved": 2048}}
    data = _doc(_x(args={"Input Dims": [[2, 3]], "Input type": ["float"], "Concrete Inputs": [""]}),
                _x(name="record_param_comms", args={
                    "Collective name": "allreduce", "Process Group Name": "0", "Seq": 4,
                    "Process Group Ranks": "[0, 1]", "dtype": "Float", "In msg nelems": 8}),
                _x(cat="kernel", name="nccl", pid=0, tid=7, args={"stream": 7, "correlation": 5}),
                {"ph": "f", "id": 5, "ts": 1}, mem, {"ph": "i", "name": "mark", "ts": 3},
                _x(args=None), schemaVersion=1, distributedInfo={"rank": 1})
    cols = _both(data)
    if len(cols) < 2:
        pytest.skip("msgspec not installed")
    slow, fast = cols
    for col in ("ts", "dur", "pid", "tid", "stream", "corr", "ext"):
        assert np.array_equal(getattr(slow, col), getattr(fast, col)), col
    for col in ("name", "cat"):
        assert getattr(slow, col)[1] == getattr(fast, col)[1]
        assert np.array_equal(getattr(slow, col)[0], getattr(fast, col)[0])
    for col in ("dims", "types", "concrete", "comm", "mem", "meta", "n_events", "n_bad"):
        assert getattr(slow, col) == getattr(fast, col), col
    assert fast.comm == [{"row": 1, "collective": "allreduce", "in_nelems": 8, "dtype": "Float",
                          "pg_name": "0", "pg_ranks": "[0, 1]", "seq": 4}]
    assert fast.mem == [(11.0, 512, 1024, 2048, 1, 0, 99)]


def test_cuts_fall_between_events_and_give_this_process_the_smaller_first_piece():
    events = [_x(ts=i, args={"External id": i}) for i in range(400)]
    data = json.dumps({"schemaVersion": 1, "traceEvents": events}, indent=2).encode()
    data = data.replace(b'\n    {\n      "', b'\n  {\n    "').replace(b"\n    },\n", b"\n  },\n")
    cuts = _decode._cuts(data, 3)
    assert len(cuts) == 2
    sizes = np.diff([0, *cuts, len(data)])
    assert sizes[0] < sizes[1] and abs(sizes[1] - sizes[2]) < len(data) // 50
    parts = [json.loads(_decode._piece(data, cuts, i)) for i in range(3)]
    assert [e["ts"] for p in parts for e in p["traceEvents"]] == list(range(400))
