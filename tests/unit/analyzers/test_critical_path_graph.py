"""The critical-path graph: longest path, joins, attribution and replay on hand-built graphs,
and single-rank agreement with HTA's critical path on HTA's own fixture (computed live)."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from trainprof.analyzers import _cp_fine, _cp_graph

MS = 1_000_000
ALEXNET = (Path(__file__).resolve().parents[2] / "fixtures" / "hta" / "critical_path" / "alexnet")


def _two_ranks_one_collective(straggle_ms: int):
    """Rank 0 computes 10 ms, rank 1 computes 10 + straggle ms, then an all-reduce (transfer
    2 ms after the last arrival), then both compute 5 ms."""
    g = _cp_graph.Graph()
    s0, s1 = g.node(0, 0), g.node(1, 0)
    a0, a1 = g.node(0, 10 * MS), g.node(1, (10 + straggle_ms) * MS)
    g.edge(s0, a0, 10 * MS, 0, {"compute": 10 * MS}, etype=_cp_graph.WORK)
    g.edge(s1, a1, (10 + straggle_ms) * MS, 1, {"compute": (10 + straggle_ms) * MS}, etype=_cp_graph.WORK)
    t_j = (10 + straggle_ms) * MS
    j = g.node(-1, t_j)
    g.edge(a0, j)
    g.edge(a1, j)
    e0, e1 = g.node(0, t_j + 2 * MS), g.node(1, t_j + 2 * MS)
    for r, e in ((0, e0), (1, e1)):
        g.edge(j, e, 2 * MS, r, {"communication": 2 * MS}, etype=_cp_graph.COLL, inst=("c", "g", 0),
               label="all_reduce")
    f0, f1 = g.node(0, t_j + 7 * MS), g.node(1, t_j + 7 * MS)
    g.edge(e0, f0, 5 * MS, 0, {"compute": 5 * MS}, etype=_cp_graph.WORK)
    g.edge(e1, f1, 5 * MS, 1, {"compute": 5 * MS}, etype=_cp_graph.WORK)
    return g


def test_path_runs_through_the_last_to_arrive_and_not_through_the_wait():
    g = _two_ranks_one_collective(30).arrays()
    length, path = _cp_graph.longest_path(g)
    assert length == (40 + 2 + 5) * MS  # the straggler's 40 ms, the transfer, the tail
    a = _cp_graph.attribute(g, path)
    assert a["by_rank_kind"][(1, "compute")] == 40 * MS  # its compute, none of rank 0's wait
    assert a["by_kind"]["communication"] == 2 * MS
    assert sum(a["by_kind"].values()) == length


def test_replay_removes_the_excess_and_hides_the_transfer():
    from trainprof.analyzers.critical_path import _changed

    g = _two_ranks_one_collective(30).arrays()
    g.inst_names = [("c", "g", 0)]
    # rank 1's work scaled to the other rank's total (15 of 45 ms, ×1/3): it arrives at 13.3 ms,
    # still after rank 0 (10 ms), then the transfer and rank 0's 5 ms tail (rank 1's is 1.7 ms)
    after, _ = _cp_graph.longest_path(g, _changed(g, {"remove_excess": 1}))
    assert after == 40 * MS // 3 + 2 * MS + 5 * MS
    hidden, _ = _cp_graph.longest_path(g, _changed(g, {"hide_collective": {"group": "g"}}))
    assert hidden == 45 * MS
    no_data, _ = _cp_graph.longest_path(g, _changed(g, {"scale": {"rank": 1, "kind": "compute", "factor": 0.5}}))
    assert no_data == (20 + 2 + 5) * MS  # rank 1 at half: 22.5 ms of work, rank 0 still waits


def test_a_cycle_is_refused():
    g = _cp_graph.Graph()
    a, b = g.node(0, 0), g.node(0, 1)
    g.edge(a, b, 1, 0, {"compute": 1})
    g.edge(b, a, 1, 0, {"compute": 1})
    with pytest.raises(ValueError):
        _cp_graph.longest_path(g)


def test_segments_take_the_innermost_event():
    starts = np.array([0, 10, 20])
    ends = np.array([100, 50, 30])
    segs = _cp_fine._segments(starts, ends, [0, 1, 2])
    assert segs == [(0, 10, 0), (10, 20, 1), (20, 30, 2), (30, 50, 1), (50, 100, 0)]


def test_single_rank_path_agrees_with_hta_on_its_alexnet_fixture():
    """HTA's critical_path_analysis on the trace (HTA run here) vs trainprof's fine graph of
    the same window: lengths within 1 %."""
    pytest.importorskip("hta")
    from hta.trace_analysis import TraceAnalysis

    from trainprof.trace import load_trace

    logging.disable(logging.WARNING)
    try:
        ta = TraceAnalysis(trace_dir=str(ALEXNET))
        rank = next(iter(ta.t.traces))
        cp, ok = ta.critical_path_analysis(rank=rank, annotation="", instance_id=0)
        assert ok
        hta_us = float(cp.get_critical_path_breakdown().duration.sum())
    finally:
        logging.disable(logging.NOTSET)
    t = load_trace(next(ALEXNET.glob("*.json.gz")))
    lo, hi = int(t.tables.steps["start_ns"][0]), int(t.tables.steps["end_ns"][0])
    length, path = _cp_graph.longest_path(_cp_fine.rank_graph(t, lo, hi))
    ours_us = length / 1e3
    assert abs(ours_us - hta_us) / hta_us < 0.01, (ours_us, hta_us)
    # HTA: 99.9 % CPU-bound; the same here (host), the GPU's part small
    a = _cp_graph.attribute(_cp_fine.rank_graph(t, lo, hi), path)
    assert a["by_kind"]["host"] / length > 0.95
