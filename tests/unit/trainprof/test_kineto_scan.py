"""The C scan (trainprof/trace/_kineto.c) against the typed msgspec decoder it stands in for: on
every real trace at hand and on documents built to probe each rule, it gives the same columns,
or None where the typed decoder must decide — never other columns, never a document the typed
decoder refuses. Byte mutations and truncations of a real trace check that it never crashes and
never accepts what the typed decoder rejects."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from trainprof.trace import _document
from trainprof.trace._frames import _read_bytes
from paths import FIXTURES

pytestmark = pytest.mark.skipif(_document._kineto is None or _document.msgspec is None,
                                reason="the C scan is not built in this install")

ROOT = FIXTURES
TRACES = sorted(p for p in ROOT.rglob("*.json*") if ".pt.trace." in p.name or "hta" in p.parts)


def typed(data: bytes):
    """The typed decoder's columns, or the exception it raises."""
    try:
        return _document._from_structs(_document._DECODER.decode(data))
    except (_document.msgspec.ValidationError, _document.msgspec.DecodeError, ValueError,
            RecursionError) as e:
        return e


def differences(a, b) -> list[str]:
    out = [k for k in ("ts", "dur", "pid", "tid", "stream", "corr", "ext")
           if not np.array_equal(getattr(a, k), getattr(b, k))]
    out += [k for k in ("name", "cat") if not (np.array_equal(getattr(a, k)[0], getattr(b, k)[0])
                                               and getattr(a, k)[1] == getattr(b, k)[1])]
    out += [k for k in ("dims", "types", "concrete", "comm", "mem", "meta", "n_events", "n_bad")
            if getattr(a, k) != getattr(b, k)]
    if set(a.launch) != set(b.launch) or not all(
            np.array_equal(v, b.launch[k], equal_nan=True) for k, v in a.launch.items()):
        out.append("launch")
    return out


def agrees(data: bytes) -> str:
    """'same' (the scan's columns equal the typed decoder's), 'deferred' (the scan left it to
    the typed decoder), or an AssertionError."""
    scanned = _document._from_scan(data)
    ref = typed(data)
    if scanned is None:
        return "deferred"
    assert not isinstance(ref, Exception), f"the scan took a document the typed decoder refuses: {ref}"
    diff = differences(scanned, ref)
    assert not diff, diff
    return "same"


def doc(events, **top) -> bytes:
    return json.dumps({"schemaVersion": 1, **top, "traceEvents": events}, indent=1).encode()


def X(**kw):
    return {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 2, "ts": 10.5,
            "dur": 3.25, **kw}


@pytest.mark.parametrize("path", TRACES, ids=lambda p: p.name)
def test_real_traces_scan_to_the_typed_decoders_columns(path):
    assert agrees(_read_bytes(path)) == "same"


def test_trace_reads_the_same_through_either_path(monkeypatch):
    """parse_trace's tables are the same with the C scan and with the typed decoder alone."""
    from trainprof.trace._frames import parse_trace

    path = ROOT / "hta" / "nccl_parser_config" / "nccl_data.json.gz"
    fast = parse_trace(path)
    monkeypatch.setattr(_document, "_kineto", None)
    slow = parse_trace(path)
    for name in ("events", "comm", "memory", "steps", "launch"):
        a, b = getattr(fast.tables, name), getattr(slow.tables, name)
        assert list(a.columns) == list(b.columns), name
        for col in a.columns:
            x, y = a[col], b[col]
            x = x.values() if hasattr(x, "values") and callable(x.values) else x
            y = y.values() if hasattr(y, "values") and callable(y.values) else y
            assert list(np.asarray(x, dtype=object)) == list(np.asarray(y, dtype=object)), (name, col)


@pytest.mark.parametrize("events", [
    [X(name='say "hi" \\ /\u00e9\U0001F600', cat="c\\u0061t")],               # escapes
    [X(name="aten::mm"), X(name="aten::\u006dm"), X(name="aten::\\u006dm")],    # one value, three spellings
    [X(pid="Spans", tid="PyTorch Profiler"), X(pid="7", tid=" 12 "), X(pid=None, tid="x")],
    [X(pid=-2**63, tid=2**63 - 1)],
    [X(ts=1695835535123.456, dur=0.001), X(ts=-0.0, dur=1e-7), X(ts=12345678901234567890, dur=2.5e3),
     X(ts=0.1234567890123456789, dur=123456789012345678.9), X(ts=9007199254740993, dur=1e22)],
    [X(args={"External id": 5, "correlation": 9, "stream": 7, "Input Dims": [[2, 3], []],
             "Input type": ["float", ""], "Concrete Inputs": ["", "1"], "grid": [1, 2, 3]}),
     X(args={"Input Dims": [[2, 3], []], "Input type": ["float", ""]}), X(args=None), X(args={})],
    [X(args={"Collective name": "allreduce", "In msg nelems": 10, "Process Group Name": "0",
             "Process Group Ranks": "[0, 1]", "dtype": "Float", "Seq": "3"}),
     X(args={"Collective name": None, "Process Group Name": None}),
     X(args={"Process Group Name": "1", "Group size": 2, "Rank": None})],
    [{"ph": "i", "name": "[memory]", "ts": 5, "s": "t",
      "args": {"Device Type": 1, "Device Id": 0, "Addr": 123, "Bytes": -64, "Total Allocated": 9}},
     {"ph": "i", "name": "[memory]", "ts": 6.5, "args": {}}, {"ph": "i", "name": "other", "args": {"x": [1]}},
     {"ph": "i", "name": "[memory]"}, {"ph": "i", "name": "[memory]", "args": None}],
    # PyTorch 1.8-1.10 names and kernels' launch figures, of every type the columns meet
    [X(args={"external id": 4}), X(args={"External id": 5, "external id": 4}),
     X(args={"External id": -3, "external id": 4}), X(args={"Input dims": [[1]], "Input Dims": None}),
     X(args={"Input dims": [[1]], "Input Dims": [[2]]}), X(args={"Input dims": [[1]]})],
    [X(args={"grid": [2, 3, 4], "block": [128, 1, 1], "registers per thread": 32, "shared memory": 0,
             "blocks per SM": 0.5, "warps per SM": 2.0, "est. achieved occupancy %": 6}),
     X(args={"grid": [2.0, 3, 4], "block": [0, 1, 1], "registers per thread": 1.5,
             "shared memory": -1, "blocks per SM": True, "est. achieved occupancy %": "6"}),
     X(args={"grid": [2, 3], "block": "x", "registers per thread": None, "warps per SM": [1]}),
     X(args={"grid": [[1], 2, 3], "block": [2**40, 1, 1], "shared memory": 2**70})],
    [{"ph": "f", "id": 1, "pid": 0}, {"ph": "s", "cat": 5}, {"ph": "M", "name": "process_name", "args": {}},
     X(), {"ph": "C", "args": {"a": 1}}],
    [],
])
def test_documents_probing_each_rule_scan_the_same(events):
    assert agrees(doc(events, distributedInfo={"rank": 3, "world_size": 8}, deviceProperties=None,
                      other={"deep": [[[[1]]]]})) == "same"


@pytest.mark.parametrize("data", [
    doc([{"ph": "Q"}]),                                   # an unknown phase
    doc([{"cat": "cpu_op", "name": "x"}]),                # no phase
    doc([X(args=[1, 2])]),                                # args not an object
    doc([X(args={"stream": 1.0})]),                       # a float for an int field
    doc([X(args={"stream": True})]),
    doc([X(args={"correlation": 2**63})]),                # beyond int64: the typed decoder's rule
    doc([X(args={"external id": 1.5})]),                  # the older id name: an int, too
    doc([X(pid=1.5)]), doc([X(pid=True)]), doc([X(cat=None)]), doc([X(ts="1")]), doc([X(dur=None)]),
    b'{"traceEvents": [{"ph": "X", "ph": "X"}]}',          # a repeated key
    b'{"traceEvents": [{"ph": "X", "n\\u0061me": "x"}]}',  # an escaped key
    b'{"traceEvents": [], "traceEvents": []}',
    b'{"traceEvents": [{"ph": "X", "name": "\\ud800"}]}',  # a lone surrogate
    b'{"traceEvents": [{"ph": "X", "name": "\xff\xfe"}]}',  # not UTF-8
    b'{"traceEvents": [{"ph": "X"}]} x', b'{"traceEvents": [{"ph": "X"},]}', b'[{"ph": "X"}]',
    b'{"traceEvents": [{"ph": "X", "args": {"x": ' + b"[" * 300 + b"]" * 300 + b"}}]}",
    b'{"traceEvents": [{"ph": "X", "ts": 1e999}]}', b'{"traceEvents": [{"ph": "X", "ts": 01}]}',
    b'{"traceEvents": [{"ph": "X", "name": "a\nb"}]}', b'{}', b'',
], ids=lambda d: f"{len(d)}-bytes")
def test_what_the_scan_does_not_take_is_left_to_the_typed_decoder(data):
    assert _document._from_scan(data) is None
    assert agrees(data) == "deferred"


def test_truncations_and_mutations_never_disagree():
    full = json.loads(_read_bytes(ROOT / "hta" / "trace_filter" / "sampled_rank-0.json.gz"))
    data = doc(full["traceEvents"][:120], distributedInfo=full.get("distributedInfo"))
    assert agrees(data) == "same"
    rng = random.Random(5)
    for cut in sorted(rng.sample(range(len(data)), 300)):
        agrees(data[:cut])
    alphabet = b'{}[]",:\\/0123456789.eE+-tfnulXi \n\x00\xff'
    outcomes = set()
    for _ in range(1500):
        b = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(b))
            op = rng.random()
            if op < 0.5:
                b[i] = rng.choice(alphabet)
            elif op < 0.75:
                del b[i]
            else:
                b.insert(i, rng.choice(alphabet))
        outcomes.add(agrees(bytes(b)))
    assert outcomes == {"same", "deferred"}  # both outcomes were exercised
