"""Fragmentation from allocator snapshots (known layouts, numbers by hand) and statistics."""

from __future__ import annotations

import json
import pickle

import pytest
from helpers import run_cli

from trainprof.analyzers import fragmentation
from trainprof.rundir.files import JsonlWriter, rank_dir, write_json_atomic
from trainprof.analysis.run import RunDir
from trainprof.formats.snapshot import from_dict
from paths import FIXTURES

MiB = 1 << 20


def _seg(total, blocks, kind="large", stream=0, addr=0):
    out, a = [], addr
    for state, size, req in blocks:
        b = {"address": a, "size": size, "state": state, "frames": []}
        if req is not None:
            b["requested_size"] = req
        out.append(b)
        a += size
    assert a - addr == total
    return {"device": 0, "address": addr, "total_size": total, "stream": stream,
            "segment_type": kind, "segment_pool_id": (0, 0), "is_expandable": False, "blocks": out}


def layout(u: int, traces=()) -> dict:
    """Three segments, unit u bytes:
    large seg 20u: [active 8u (requested 7u) | free 4u | active 2u (exact) | free 6u]
    large seg 10u: [free 10u]                       (unsplit)
    small seg 2 MiB: [active 512 KiB (requested 500 KiB) | free 1.5 MiB]"""
    return {
        "segments": [
            _seg(20 * u, [("active_allocated", 8 * u, 7 * u), ("inactive", 4 * u, None),
                          ("active_allocated", 2 * u, 2 * u), ("inactive", 6 * u, None)]),
            _seg(10 * u, [("inactive", 10 * u, None)], addr=1 << 40),
            _seg(2 * MiB, [("active_allocated", 512 << 10, 500 << 10), ("inactive", 1536 << 10, None)],
                 kind="small", addr=1 << 41),
        ],
        "device_traces": [list(traces)],
    }


def test_snapshot_numbers_by_hand():
    u = 64 * MiB
    m = fragmentation.snapshot_metrics(from_dict(layout(u)))
    assert m["reserved_bytes"] == 30 * u + 2 * MiB
    assert m["allocated_bytes"] == 10 * u + (512 << 10)
    assert m["reserved_minus_allocated_bytes"] == 20 * u + (1536 << 10)
    assert m["inactive_split_bytes"] == 10 * u + (1536 << 10)        # the unsplit 10u is not split
    large, small = m["pools"]
    assert (large["free_bytes"], large["largest_free_bytes"]) == (20 * u, 10 * u)
    assert large["external_fragmentation"] == 0.5                    # 1 - 10u / 20u
    assert small["external_fragmentation"] == 0.0                    # one free block
    assert m["external_waste_bytes"] == 10 * u
    assert m["internal_waste_bytes"] == u + (12 << 10)               # 8u-7u and 512-500 KiB
    # score: (inactive split + internal) / reserved = (10u + 1.5 MiB + u + 12 KiB) / (30u + 2 MiB)
    assert m["score"] == pytest.approx((11 * u + (1536 << 10) + (12 << 10)) / (30 * u + 2 * MiB))


def test_finding_needs_a_score_and_real_waste(tmp_path):
    for u, expect in ((64 * MiB, True), (1 * MiB, False)):  # same shape; 11 MiB of waste is noise
        d = tmp_path / str(u)
        d.mkdir()
        (d / "rank3_snapshot.pickle").write_bytes(pickle.dumps(layout(u)))
        res = fragmentation.analyze(RunDir(d))
        assert bool(res.findings) is expect
    f = fragmentation.analyze(RunDir(tmp_path / str(64 * MiB))).findings[0]
    assert f.kind == "fragmentation" and f.ranks == [3]
    assert "37%" in f.message  # 11u / 30u and "expandable_segments:True" in f.message


def test_oom_explained_as_fragmentation_or_exhaustion(tmp_path):
    u = 64 * MiB
    frag = [{"action": "oom", "addr": 0, "size": 16 * u, "stream": 0, "device_free": 2 * u}]
    snap = from_dict(layout(u, frag))
    m = fragmentation.snapshot_metrics(snap)
    o = fragmentation.explain_oom(snap, 0, snap.ooms()[0][1], m)
    # largest hole 10u < 16u, yet 20u + 1.5 MiB cached free + 2u free on the device
    assert o["cause"] == "fragmentation" and o["largest_free_block_bytes"] == 10 * u
    assert o["cached_free_bytes"] == 20 * u + (1536 << 10)
    big = [{"action": "oom", "addr": 0, "size": 40 * u, "stream": 0, "device_free": 2 * u}]
    snap = from_dict(layout(u, big))
    o = fragmentation.explain_oom(snap, 0, snap.ooms()[0][1], m)
    assert o["cause"] == "exhausted" and "genuinely exhausted" in o["explanation"]
    (tmp_path / "oom.pickle").write_bytes(pickle.dumps(layout(u, frag)))
    res = fragmentation.analyze(RunDir(tmp_path / "oom.pickle"))
    (f,) = res.findings
    assert f.severity == "error" and f.kind == "fragmentation"
    assert "largest free block was 640 MiB" in f.message


def test_statistics_per_rank(tmp_path):
    d = rank_dir(tmp_path, 1)
    write_json_atomic(d / "meta.json", {"rank": 1})
    w = JsonlWriter(d / "memory.jsonl")
    G = 1 << 30
    w.write({"step": 0, "reserved_bytes": 4 * G, "allocated_bytes": 3 * G, "requested_bytes": 3 * G,
             "inactive_split_bytes": 0, "num_alloc_retries": 0})
    w.write({"step": 1, "reserved_bytes": 8 * G, "allocated_bytes": 4 * G,
             "requested_bytes": 4 * G - 256 * MiB, "inactive_split_bytes": 3 * G,
             "num_alloc_retries": 2})
    w.write({"step": 2, "rss_bytes": 1})  # a CPU-style record is ignored
    w.close()
    res = fragmentation.analyze(RunDir(tmp_path))
    (m,) = res.metrics["per_rank"]
    assert m["step"] == 1 and m["reserved_minus_allocated_bytes"] == 4 * G
    assert m["internal_waste_bytes"] == 256 * MiB and m["num_alloc_retries"] == 2
    assert m["score"] == pytest.approx((3 * G + 256 * MiB) / (8 * G))
    (f,) = res.findings
    assert f.ranks == [1] and "2 allocation retries" in f.message
    assert any("garbage_collection_threshold" in a for a in f.evidence["advice"])


def test_cpu_run_is_silent(tmp_path):
    d = rank_dir(tmp_path, 0)
    w = JsonlWriter(d / "memory.jsonl")
    w.write({"step": 0, "rss_bytes": 100, "peak_rss_bytes": 100})
    w.close()
    res = fragmentation.analyze(RunDir(tmp_path))
    assert res.metrics == {} and res.findings == []


def test_bare_snapshot_through_cli(tmp_path):
    u = 64 * MiB
    snap = tmp_path / "snaps" / "rank0.pickle"
    snap.parent.mkdir()
    snap.write_bytes(pickle.dumps(layout(u)))
    proc = run_cli(["analyze", snap], timeout=300)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((snap.parent / "rank0.pickle.summary.json").read_text())
    assert (snap.parent / "rank0.pickle.report.html").exists()
    assert set(summary["metrics"]) <= {"memory", "fragmentation"} and not summary["errors"]
    assert summary["metrics"]["fragmentation"]["snapshots"][0]["external_waste_bytes"] == 10 * u
    assert [f["kind"] for f in summary["findings"]] == ["fragmentation"]
    # a folder of snapshots, output elsewhere; a malicious one is reported, not executed
    (snap.parent / "evil.pickle").write_bytes(b"\x80\x04cos\nsystem\n.")
    proc = run_cli(["analyze", snap.parent, "--out", tmp_path / "out", "--no-report"], timeout=300)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert any("evil.pickle" in p and "refusing" in p for p in summary["problems"])
    assert len(summary["metrics"]["fragmentation"]["snapshots"]) == 1


def test_real_h100_oom_snapshot(tmp_path):
    """tests/fixtures/gpu/make_snapshot.py on an H100: 78 segments of 1 GiB, each split into
    [600 MiB held | 424 MiB free], then a 1 GiB request fails."""

    path = FIXTURES / "gpu" / "h100_oom_snapshot.pickle"
    res = fragmentation.analyze(RunDir(path))
    (s,) = res.metrics["snapshots"]
    assert s["segments"] == 78 and s["reserved_bytes"] == 78 * 1024 * MiB
    assert s["allocated_bytes"] == 78 * 600 * MiB
    assert s["inactive_split_bytes"] == 78 * 424 * MiB
    assert s["pools"][0]["largest_free_bytes"] == 424 * MiB
    assert s["earlier_ooms"] == 1  # the fill loop's own OOM, when nothing was cached
    (o,) = s["ooms"]
    assert o["requested_bytes"] == 1024 * MiB and o["cause"] == "fragmentation"
    assert "make_snapshot.py" in o["top_sites"][0]["site"]
    (f,) = res.findings
    assert f.kind == "fragmentation" and f.severity == "error"
