"""The trace parser on real GPU traces (HTA's test data) and on broken input."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pandas as pd
import pytest

from trainprof.trace import TraceError, load_trace, load_traces, parse_trace
from paths import FIXTURES

HTA = FIXTURES / "hta"
V100 = HTA / "df_index_resolver" / "df_index_resolver.json.gz"
A100 = HTA / "nccl_parser_config" / "nccl_data.json.gz"


def _kernels(tr):
    ev = tr.events
    k = ev[ev["cat"] == "kernel"]
    return len(k), int(k["name"].astype(str).str.contains("nccl", case=False).sum())


def test_counts_match_the_fixture_description():
    tr = load_trace(V100)
    assert tr.stats["events"] == 216092 and tr.rank == 1 and tr.world_size == 2
    assert _kernels(tr) == (19370, 2020)
    assert list(tr.steps["step"]) == [2, 3, 4, 5, 6]
    assert len(tr.memory) == 28010  # [memory] instant events
    a100 = load_trace(A100)
    assert a100.stats["events"] == 40573 and _kernels(a100) == (2700, 21) and len(a100.steps) == 3
    assert a100.meta["deviceProperties"][0]["name"].startswith("NVIDIA A100")


def test_timestamps_are_absolute_ns_and_events_sorted():
    tr = load_trace(A100)  # has baseTimeNanoseconds: ts are µs relative to it
    base = tr.meta["baseTimeNanoseconds"]
    ev = tr.events
    assert ev["ts_ns"].min() >= base and ev["ts_ns"].is_monotonic_increasing
    assert (ev["end_ns"] - ev["ts_ns"] == ev["dur_ns"]).all()
    # every kernel launched inside a profiled step carries that step (via its correlation id)
    k = ev[ev["cat"] == "kernel"]
    assert set(k["step"]) <= {4, 5, 6} and (k["stream"] >= 0).all()
    assert (ev.loc[~ev["is_gpu"], "stream"] == -1).all()


def test_collective_args_are_columnar():
    tr = load_trace(A100)
    comm = tr.comm
    # the 21 NCCL kernels carry their collective args, and so do their record_param_comms ops
    on = tr.events.loc[comm["row"]]
    kernels = comm[on["cat"].eq("kernel").to_numpy()]
    assert len(kernels) == 21
    assert set(kernels["collective"]) == {"allreduce", "broadcast"}
    named = comm[comm["pg_name"].notna()]  # (record_param_comms "wait" ops carry no group)
    assert len(named) == 42 and set(named["collective"]) == {"allreduce", "broadcast"}
    assert all(r == [0, 1] for r in named["pg_ranks"])  # the trace's "[0, 1]" string, parsed
    assert set(named["pg_desc"]) == {"default_pg"} and set(named["group_size"]) == {2}
    first = comm.iloc[0]
    assert on.iloc[0]["name"] == "record_param_comms" and first["in_nelems"] == 53120


def test_msgspec_and_orjson_paths_agree():
    fast, slow = parse_trace(A100, fast=True), parse_trace(A100, fast=False)
    assert {fast.stats["decoder"], slow.stats["decoder"]} == {"msgspec", "orjson"} or \
        fast.stats["decoder"] == "orjson"  # msgspec is optional
    pd.testing.assert_frame_equal(fast.events, slow.events)
    pd.testing.assert_frame_equal(fast.memory, slow.memory)
    pd.testing.assert_frame_equal(fast.comm, slow.comm)
    assert fast.meta["distributedInfo"] == slow.meta["distributedInfo"]


def test_nanoseconds_survive_large_absolute_microseconds(tmp_path):
    # 1.7e15 µs has no room for ns digits in a float64 multiplied by 1000: we keep them
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"traceEvents": [
        {"ph": "X", "name": "a", "cat": "cpu_op", "ts": 1700000000000001.5, "dur": 2.25,
         "pid": 1, "tid": 1},
        {"ph": "i", "name": "[memory]", "ts": 1700000000000003, "pid": 1, "tid": 1,
         "args": {"Bytes": -64, "Total Allocated": 10, "Total Reserved": 20, "Device Type": 0,
                  "Device Id": -1, "Addr": 140000000000000}}]}))
    tr = load_trace(p)
    assert tr.events["ts_ns"].tolist() == [1700000000000001500]
    assert tr.events["dur_ns"].tolist() == [2250]
    assert tr.memory.iloc[0].tolist() == [1700000000000003000, -64, 10, 20, 0, -1, 140000000000000]
    assert tr.meta["span_ns"] == [1700000000000001500, 1700000000000003750]


def test_rank_comes_from_distributed_info_not_the_name():
    tr = load_trace(HTA / "cpu_only" / "rank-34.Jul_15_10_52_41.1074.pt.trace.json.gz")
    assert tr.rank == 34


def test_broken_files_name_the_file_and_keep_other_ranks(tmp_path):
    truncated = tmp_path / "rank-00001.pt.trace.json.gz"
    truncated.write_bytes(A100.read_bytes()[:5000])
    not_json = tmp_path / "rank-00002.pt.trace.json.gz"
    not_json.write_bytes(gzip.compress(b"{\"traceEvents\": [ {\"ph\": "))
    not_trace = tmp_path / "rank-00003.json"
    not_trace.write_text('{"hello": 1}')
    with pytest.raises(TraceError, match="rank-00001.*truncated"):
        load_trace(truncated)
    flipped = bytearray(A100.read_bytes())
    flipped[2000:2010] = b"0123456789"
    (tmp_path / "flip.json.gz").write_bytes(bytes(flipped))
    with pytest.raises(TraceError, match="flip.json.gz.*corrupt"):
        load_trace(tmp_path / "flip.json.gz")
    (tmp_path / "empty.json").write_bytes(b"")
    with pytest.raises(TraceError, match="empty.json.*empty"):
        load_trace(tmp_path / "empty.json")
    traces, errors = load_traces({0: HTA / "trace_filter" / "sampled_rank-0.json.gz",
                                  1: truncated, 2: not_json, 3: not_trace, 4: tmp_path / "missing.json"})
    assert list(traces) == [0]
    assert len(errors) == 4
    assert any("rank-00002" in e and "JSON" in e for e in errors)
    assert any("rank-00003" in e and "traceEvents" in e for e in errors)
    assert any("missing.json" in e for e in errors)


def test_parallel_load_matches_serial():
    paths = {0: HTA / "trace_filter" / "sampled_rank-0.json.gz",
             1: HTA / "trace_filter" / "sampled_rank-1.json.gz"}
    par, _ = load_traces(paths, workers=2)
    ser, _ = load_traces(paths, workers=1)
    for r in paths:
        assert par[r].events["dur_ns"].sum() == ser[r].events["dur_ns"].sum()
        assert par[r].rank == r


def test_int_columns_tolerate_strings_none_floats_and_huge_values():
    from trainprof.trace import _ints
    from trainprof.trace._table import Cat

    got = _ints([7, None, "Spans", 3.0, float("nan"), 2**70, -5])
    assert got.tolist() == [7, -1, -1, 3, -1, -1, -5] and got.dtype.name == "int64"
    assert _ints([1, 2]).tolist() == [1, 2] and _ints([]).tolist() == []
    import pandas as pd
    names = ["mm", "add", "mm", "all_reduce"]
    ref = pd.Categorical(names)
    for c in (Cat.from_strings(names), Cat.from_factorized(np.array([0, 1, 0, 2]), ["mm", "add", "all_reduce"])):
        assert c.values == list(ref.categories) and c.codes.tolist() == ref.codes.tolist()
        assert c.tolist() == names and c.to_pandas().equals(ref)


def _same(a, b):
    pd.testing.assert_frame_equal(a.events, b.events)
    pd.testing.assert_frame_equal(a.memory, b.memory)
    pd.testing.assert_frame_equal(a.comm, b.comm)
    pd.testing.assert_frame_equal(a.steps, b.steps)
    assert dict(a.meta, path=None) == dict(b.meta, path=None)
    assert a.stats == b.stats


def test_pieces_decoded_in_parallel_give_the_same_frames(monkeypatch, tmp_path):
    from trainprof.trace import _decode

    if _decode.msgspec is None:
        pytest.skip("piecewise decoding is a msgspec path")
    monkeypatch.setattr(_decode, "PIECE_MIN_BYTES", 1 << 16)  # the A100 trace is 9.8 MB
    whole = parse_trace(A100, pieces=1)
    # a gzip trace: decoded while it inflates, children taking its first parts
    got = []
    real_stream = _decode.decode_stream
    monkeypatch.setattr(_decode, "decode_stream", lambda *a: got.append(real_stream(*a)) or got[-1])
    _same(whole, parse_trace(A100, pieces=3))
    assert len(got) == 1 and isinstance(got[0][0], _decode.Columns)  # not the fallback
    # the same JSON uncompressed: cut in memory
    plain = tmp_path / "a100.json"
    plain.write_bytes(gzip.decompress(A100.read_bytes()))
    got = []
    real_pieces = _decode._decode_pieces
    monkeypatch.setattr(_decode, "_decode_pieces", lambda *a: got.append(real_pieces(*a)) or got[-1])
    _same(whole, parse_trace(plain, pieces=3))
    assert len(got) == 1 and isinstance(got[0], _decode.Columns)
    assert len(_decode._cuts(plain.read_bytes(), 5)) == 4
    monkeypatch.setattr(_decode, "_decode_pieces", real_pieces)
    # a piece whose events surprise the typed decoder (a string "dur"): the child fails, the
    # whole document is decoded here and ends on the tolerant path, as it would unsplit
    small = HTA / "cpu_only" / "rank-34.Jul_15_10_52_41.1074.pt.trace.json.gz"
    monkeypatch.setattr(_decode, "PIECE_MIN_BYTES", 1 << 10)
    doc = json.loads(gzip.decompress(small.read_bytes()))
    xs = [i for i, e in enumerate(doc["traceEvents"]) if e.get("ph") == "X"]
    for i in (xs[0], xs[-1]):
        doc["traceEvents"][i]["dur"] = "12"  # in the first piece (a child's) and the last
    text = (json.dumps(doc, indent=2).replace('\n    {\n      "', '\n  {\n    "')
            .replace("\n    },\n", "\n  },\n"))
    odd = tmp_path / "odd.json"
    odd.write_text(text)
    assert _decode._cuts(odd.read_bytes(), 2)  # Kineto's event layout, so it is cut
    serial = parse_trace(odd, pieces=1)
    got = []
    real_pieces, real_dicts = _decode._decode_pieces, _decode._from_dicts
    monkeypatch.setattr(_decode, "_decode_pieces", lambda *a: got.append(real_pieces(*a)) or got[-1])
    monkeypatch.setattr(_decode, "_from_dicts", lambda *a: got.append("dicts") or real_dicts(*a))
    _same(serial, parse_trace(odd, pieces=2))
    assert got == [None, "dicts"]
    odd_gz = tmp_path / "odd.json.gz"
    odd_gz.write_bytes(gzip.compress(text.encode()))
    got = []
    monkeypatch.setattr(_decode, "decode_stream", lambda *a: got.append(real_stream(*a)) or got[-1])
    _same(serial, parse_trace(odd_gz, pieces=2))
    assert got[0][0] is None and got[0][3] is True and got[1:] == ["dicts"]  # tried, then whole
    # compact JSON (no Kineto layout) is never cut: one decode
    assert _decode._cuts(gzip.decompress((HTA / "trace_filter" / "sampled_rank-0.json.gz").read_bytes()), 2) == []


def test_stream_decoding_stops_its_children_on_a_corrupt_or_oversized_gzip(monkeypatch, tmp_path):
    import os

    from trainprof.trace import TraceError, _decode

    if _decode.msgspec is None:
        pytest.skip("piecewise decoding is a msgspec path")
    monkeypatch.setattr(_decode, "PIECE_MIN_BYTES", 1 << 16)
    data = A100.read_bytes()
    cut = tmp_path / "truncated.json.gz"
    cut.write_bytes(data[: len(data) * 3 // 4] + data[-8:])  # the trailer kept: a size hint
    forks = []
    real_fork = _decode._fork_decoder
    monkeypatch.setattr(_decode, "_fork_decoder", lambda mk: forks.append(real_fork(mk)) or forks[-1])
    with pytest.raises(TraceError, match="truncated.json.gz: (corrupt|truncated) gzip"):
        parse_trace(cut, pieces=2)
    assert forks  # a child had started on the first part
    for pid, _ in forks:
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)  # reaped
    monkeypatch.setenv("TRAINPROF_MAX_INPUT_MB", "5")  # the 9.8 MB JSON inflates past it
    forks.clear()
    with pytest.raises(TraceError, match="inflates past"):
        parse_trace(A100, pieces=2)
    for pid, _ in forks:
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)


def test_odd_step_names_thread_ids_and_run_facts(tmp_path):
    """ProfilerStep#N with N beyond int64, with underscores or non-ASCII digits: no step (the
    trace is still read); a tid written as a string of digits is that thread; a distributedInfo
    or pg_config of the wrong type is ignored, not an error."""
    from trainprof.analyzers import _comm_groups

    ev = [{"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{n}", "pid": 1, "tid": 1,
           "ts": i * 100, "dur": 100} for i, n in enumerate(
               ["99999999999999999999", "1_0", "\u0661", "2", "3.0", "1e1"])]
    ev += [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": "1", "ts": 310,
            "dur": 50}, {"ph": "X", "cat": "cpu_op", "name": "aten::add", "pid": 1,
                         "tid": True, "ts": 320, "dur": 5}]
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"traceEvents": ev, "distributedInfo": 7.5}))
    tr = parse_trace(p)
    assert tr.tables.steps["step"].tolist() == [2, 3, 10]
    ev_t = tr.tables.events
    tid = dict(zip(ev_t["name"].tolist(), ev_t["tid"].tolist()))
    assert tid["aten::mm"] == 1 and tid["aten::add"] == -1
    assert tr.world_size is None and _comm_groups.trace_groups(tr)["configs"] == []
    p.write_text(json.dumps({"traceEvents": ev, "distributedInfo": {"rank": 0, "pg_config": 1.5}}))
    assert _comm_groups.trace_groups(parse_trace(p))["configs"] == []
