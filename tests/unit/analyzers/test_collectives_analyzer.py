"""The collectives analyzer on hand-built run directories (numbers computed by hand), and on the
real multi-rank job of test_collective_log.

Cases that run multi-process jobs: tests/integration/test_collectives_analyzer_jobs.py."""

from __future__ import annotations

import json

import pytest

from trainprof.analyzers import collectives as C
from trainprof.analysis.run import RunDir

MS = 1_000_000
T0 = 1_700_000_000_000 * MS  # an epoch in ns


def _write(tmp_path, ranks: dict, hosts=None, clock=None, steps_ms=100.0, nsteps=3):
    """ranks: {rank: (groups, records)}; times in the records are ms after T0 (local clock)."""
    for r, (groups, recs) in ranks.items():
        d = tmp_path / "ranks" / f"rank-{r:05d}"
        d.mkdir(parents=True)
        (d / "meta.json").write_text(json.dumps({"rank": r, "world_size": len(ranks),
                                                 "host": (hosts or {}).get(r, "h")}))
        (d / "groups.jsonl").write_text("".join(json.dumps(g) + "\n" for g in groups))
        lines = []
        for x in recs:
            x = dict(x)
            x["enqueue_ns"] = T0 + round(x["enqueue_ns"] * MS)
            x["end_ns"] = None if x.get("end_ns") is None else T0 + round(x["end_ns"] * MS)
            lines.append(json.dumps(x) + "\n")
        (d / "collectives.jsonl").write_text("".join(lines))
        (d / "steps.jsonl").write_text("".join(
            json.dumps({"step": s, "start_ns": T0 + round(s * steps_ms * MS),
                        "end_ns": T0 + round((s + 1) * steps_ms * MS), "dur_ms": steps_ms}) + "\n"
            for s in range(nsteps)))
        if clock and r in clock:
            (d / "clock.jsonl").write_text(json.dumps(clock[r]) + "\n")
    return RunDir(tmp_path)


def rec(step, pg, seq, op, nbytes, enq, end, blocked=0.0, peer=None, is_async=False, dev=None):
    return {"step": step, "pg": pg, "seq": seq, "op": op, "bytes": nbytes, "dtype": "float32",
            "numel": nbytes // 4, "enqueue_ns": enq, "end_ns": end, "blocked_ms": blocked,
            "device_ms": dev, "peer": peer, "async": is_async, "api": "c10d.test"}


G2 = {"pg": "0", "ranks": [0, 1], "mesh_dim": "dp", "backend": "gloo", "size": 2}


def test_bus_factors_match_nccl_tests():
    assert C.bus_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)
    assert C.bus_factor("all_gather", 4) == pytest.approx(3 / 4)
    assert C.bus_factor("reduce_scatter", 2) == pytest.approx(1 / 2)
    assert C.bus_factor("all_to_all", 8) == pytest.approx(7 / 8)
    assert C.bus_factor("broadcast", 8) == 1.0
    assert C.bus_factor("send", 2) == 1.0
    assert C.size_bucket(1000) == 1024 and C.size_bucket(1024) == 1024 and C.size_bucket(0) == 0


def test_bandwidth_lateness_and_alignment_by_hand(tmp_path):
    # rank 1 is on another host and its clock is 1 ms behind rank 0's (offset +1 ms).
    # step 1: all_reduce of 8 MB; rank 0 arrives at 1000 ms, rank 1 at local 1002 = ref 1003;
    # both done at ref 1007 (rank 1 local 1006) -> arrival-to-completion 4 ms.
    # step 2: all_gather, output 4 MB, both arrive at 1100, end at 1102 -> 2 ms.
    clock = {1: {"phase": "start", "ref_rank": 0, "offset_ns": 1 * MS, "uncertainty_ns": 1000,
                 "t_ns": T0}}
    r0 = [rec(1, "0", 0, "all_reduce", 8_000_000, 1000, 1007, blocked=7.0),
          rec(2, "0", 1, "all_gather", 4_000_000, 1100, 1102, blocked=2.0)]
    r1 = [rec(1, "0", 0, "all_reduce", 8_000_000, 1002, 1006, blocked=4.0),
          rec(2, "0", 1, "all_gather", 4_000_000, 1099, 1101, blocked=2.0)]
    run = _write(tmp_path, {0: ([G2], r0), 1: ([G2], r1)}, hosts={0: "a", 1: "b"}, clock=clock)
    res = C.analyze(run)
    m = res.metrics
    rows = {r["op"]: r for r in m["bandwidth"]}
    ar = rows["all_reduce"]
    assert ar["median_ms"] == pytest.approx(4.0)
    assert ar["algbw_GBps"] == pytest.approx(8e6 / 4e-3 / 1e9)       # 2.0 GB/s
    assert ar["busbw_GBps"] == pytest.approx(2.0 * 2 * (2 - 1) / 2)  # all_reduce factor 1 at n=2
    assert ar["size_bucket"] == 2 ** 23 and ar["mesh_dim"] == "dp" and ar["ranks"] == 2
    ag = rows["all_gather"]
    assert ag["median_ms"] == pytest.approx(2.0)
    assert ag["algbw_GBps"] == pytest.approx(2.0) and ag["busbw_GBps"] == pytest.approx(1.0)
    late = {p["rank"]: p for p in m["lateness"]["per_rank"]}
    assert late[1]["max_ms"] == pytest.approx(3.0) and late[0]["max_ms"] == pytest.approx(0.0)
    assert late[1]["mean_ms"] == pytest.approx(1.5)  # 3 ms at step 1, 0 at step 2 (aligned)
    assert late[1]["last_frac"] == pytest.approx(0.5) and late[0]["last_frac"] == 0
    assert late[1]["by_dim_mean_ms"] == {"dp": pytest.approx(1.5)}
    assert m["consistency"]["ok"] is True
    assert m["per_dim"][0]["mesh_dim"] == "dp" and m["per_dim"][0]["total_ms"] == pytest.approx(6.0)
    assert res.findings == []  # 11 ms blocked of 200 ms: nothing exposed
    json.dumps(m, allow_nan=False)  # summary.json stays plain JSON


def test_device_time_wins_and_p2p_pairs(tmp_path):
    g = {"pg": "5", "ranks": [0, 1], "mesh_dim": "pp", "backend": "nccl", "size": 2}
    # send 0->1 of 1 MB: device times 0.5 ms (recv side); a collective with device_ms 2 ms
    r0 = [rec(1, "5", 0, "send", 1_000_000, 1000, 1001, peer=1, is_async=True, dev=0.4),
          rec(1, "5", 1, "all_reduce", 4_000_000, 1010, 1020, dev=2.0)]
    r1 = [rec(1, "5", 0, "recv", 1_000_000, 1000, 1003, peer=0, is_async=True, dev=0.5),
          rec(1, "5", 1, "all_reduce", 4_000_000, 1010, 1020, dev=2.0)]
    m = C.analyze(_write(tmp_path, {0: ([g], r0), 1: ([g], r1)})).metrics
    rows = {r["op"]: r for r in m["bandwidth"]}
    assert rows["send_recv"]["median_ms"] == pytest.approx(0.5)
    assert rows["send_recv"]["algbw_GBps"] == pytest.approx(1e6 / 0.5e-3 / 1e9)
    assert rows["send_recv"]["busbw_GBps"] == pytest.approx(2.0)
    assert rows["all_reduce"]["median_ms"] == pytest.approx(2.0)
    assert m["device_timed"] is True


def test_consistency_problems_are_reported(tmp_path):
    r0 = [rec(1, "0", 0, "all_reduce", 8, 1000, 1001), rec(1, "0", 2, "all_reduce", 8, 1002, 1003)]
    r1 = [rec(1, "0", 0, "all_reduce", 8, 1000, 1001), rec(1, "0", 1, "all_reduce", 8, 1002, 1003),
          rec(1, "0", 2, "all_reduce", 8, 1004, 1005)]
    m = C.analyze(_write(tmp_path, {0: ([G2], r0), 1: ([G2], r1)})).metrics
    c = m["consistency"]
    assert c["ok"] is False
    assert c["seq_gaps"] == [{"rank": 0, "pg": "0", "missing_seq": [1], "duplicates": 0}]
    assert c["count_mismatches"][0]["ranks"] == {"0": {"all_reduce": 2, "p2p": 0}}


def test_exposed_comm_when_blocked_dominates(tmp_path):
    g = {"pg": "3", "ranks": [0, 1], "mesh_dim": "tp", "backend": "gloo", "size": 2}
    recs = [rec(s, "3", s, "all_reduce", 1024, 100 * s + 1, 100 * s + 81, blocked=80.0)
            for s in range(3)]
    res = C.analyze(_write(tmp_path, {0: ([g], recs), 1: ([g], recs)}))
    (f,) = res.findings
    assert f.kind == "exposed_comm"
    assert f.evidence["median_blocked_fraction"] == pytest.approx(0.8)
    assert f.evidence["top_groups"][0]["group"] == "3:0,1"
    assert f.evidence["top_groups"][0]["mesh_dim"] == "tp"
    assert "3:0,1" in f.message


def test_no_log_no_metrics(tmp_path):
    (tmp_path / "ranks" / "rank-00000").mkdir(parents=True)
    assert C.analyze(RunDir(tmp_path)).metrics == {}


def test_records_without_a_group_do_not_break_the_analysis(tmp_path):
    """A log whose broadcast has no pg (null) beside records of group "0": analyzed, the
    group-less record in a group of its own."""
    recs = [{**rec(0, None, 0, "broadcast", 4096, 1.0, 2.0), "pg": None}] + [
        rec(s, "0", s, "all_reduce", 4096, 100.0 * s + 10, 100.0 * s + 12, blocked=1.0)
        for s in range(1, 3)]
    run = _write(tmp_path, {0: ([G2], recs), 1: ([G2], recs)})
    m = C.analyze(run).metrics  # raised IndexError: the missing group fell out of a groupby
    assert m["records"] == 6 and m["groups"] == 2
