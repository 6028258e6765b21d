"""summary.json stays bounded at any length and rank count: per-step series thinned (aligned,
recent steps kept, the step axis and resolution said), rank x step tables of many ranks keep
the ranks that matter plus an all-ranks envelope, long lists inside records cut and counted."""

import json

import pytest

from trainprof.analysis import summary_bound as sb
from trainprof.analysis.summary_bound import MAX_POINTS, RECENT_POINTS, bound_metrics


def test_long_series_thinned_aligned_and_recent_steps_kept():
    n = 20_000
    m = {"stragglers": {"steps": list(range(n)), "by_rank": {"0": [2 * s for s in range(n)],
                                                            "1": [3 * s for s in range(n)]},
                        "median_ms": 5.0, "short": [1, 2, 3]},
         "step_time": {"per_step": [{"step": s} for s in range(100)]}}
    bound_metrics(m)
    st = m["stragglers"]
    assert len(st["steps"]) <= MAX_POINTS
    assert st["by_rank"]["0"] == [2 * s for s in st["steps"]]  # still aligned with the steps
    assert st["by_rank"]["1"] == [3 * s for s in st["steps"]]
    assert st["steps"][-RECENT_POINTS:] == list(range(n - RECENT_POINTS, n))  # every recent one
    res = st["series_resolution"][0]
    assert res["length"] == n and res["kept"] == len(st["steps"]) and res["recent_full"] == RECENT_POINTS
    assert res["axis"] == "steps" and res["steps"] == [0, n - 1]
    assert st["steps"][:3] == [0, res["every"], 2 * res["every"]]
    assert st["short"] == [1, 2, 3] and st["median_ms"] == 5.0
    assert len(m["step_time"]["per_step"]) == 100 and "series_resolution" not in m["step_time"]


def test_rank_tables_keep_the_named_and_worst_ranks_and_an_envelope():
    """1,024 ranks x 300 steps in two tables: rank 700 named by a finding, rank 3 the slowest
    in one table, rank 900 in the other; RANK_SERIES ranks kept in both (the same ones), the
    envelope per step over all 1,024, the rest counted."""
    n, R = 300, 1024

    def series(r, slow):
        return [10.0 + (r % 7) * 0.01 + (50.0 if r == slow else 0.0) + (s % 3) for s in range(n)]

    m = {"stragglers": {"steps": list(range(n)),
                        "busy_ms_by_rank": {str(r): series(r, 3) for r in range(R)},
                        "wait_ms_by_rank": {str(r): series(r, 900) for r in range(R)}}}
    bound_metrics(m, named=[700])
    st = m["stragglers"]
    rs = st["rank_series"]
    assert rs["ranks"] == R and rs["omitted"] == R - sb.RANK_SERIES
    assert len(rs["kept"]) == sb.RANK_SERIES and {700, 3, 900} <= set(rs["kept"])
    assert sorted(st["busy_ms_by_rank"]) == sorted(st["wait_ms_by_rank"]) == sorted(map(str, rs["kept"]))
    env = st["busy_ms_by_rank_all_ranks"]
    k = len(st["steps"])
    assert len(env["max"]) == len(env["min"]) == len(env["median"]) == k
    for j, s in enumerate(st["steps"]):  # over every rank, at the kept steps
        assert env["max"][j] == pytest.approx(60.03 + (s % 3)) and env["min"][j] == 10.0 + (s % 3)
        assert env["median"][j] == pytest.approx(10.03 + (s % 3))
    assert st["busy_ms_by_rank"]["3"] == [pytest.approx(60.03 + (s % 3)) for s in st["steps"]]
    assert len(json.dumps(m)) < 300_000


def test_long_lists_inside_records_are_cut_counted_and_ranged():
    steps = list(range(100, 60_100)) + list(range(70_000, 70_500))
    m = {"stragglers": {"per_rank": [{"rank": 4, "straggling_steps": steps}, {"rank": 5,
                                                                           "straggling_steps": [1, 2]}]}}
    bound_metrics(m)
    p = m["stragglers"]["per_rank"][0]
    assert p["straggling_steps"] == steps[:sb.LIST_KEEP] and p["straggling_steps_total"] == len(steps)
    assert p["straggling_steps_ranges"] == [[100, 60_099], [70_000, 70_499]]
    assert m["stragglers"]["per_rank"][1] == {"rank": 5, "straggling_steps": [1, 2]}
    f = [{"evidence": {"straggling_steps": steps}}]
    sb.bound_findings(f)
    assert f[0]["evidence"]["straggling_steps_total"] == len(steps)


def test_every_thinned_axis_is_named():
    n = 6000
    m = {"memory": {"timeline": {"0": {"step": list(range(n)), "rss_bytes": [7] * n}}},
         "nan_origin": {"loss": {"0": [[s, 1.5] for s in range(n)]}},
         "critical_path": {"per_step": [{"step": s + 10} for s in range(n)]}}
    bound_metrics(m)
    assert m["memory"]["series_resolution"][0]["axis"] == "timeline.0.step"
    assert m["nan_origin"]["series_resolution"][0]["axis"] == "loss.0[][0]"
    assert m["nan_origin"]["series_resolution"][0]["steps"] == [0, n - 1]
    assert m["critical_path"]["series_resolution"][0]["axis"] == "per_step[].step"
    assert m["critical_path"]["series_resolution"][0]["steps"] == [10, n + 9]


def test_small_runs_untouched():
    m = {"step_time": {"steps": list(range(40)), "step_ms_by_rank": {"0": [1.234567891] * 40,
                                                                     "1": [2.0] * 40}}}
    before = json.dumps(m)
    bound_metrics(m)
    assert json.dumps(m) == before


def test_a_wide_dict_of_pairs_is_no_rank_table():
    """{rank: [[step, value], ...]} over many ranks (a synthesized 1,024-rank run has one) is
    not a rank × step table of numbers: left to the other bounds, never stacked (it raised)."""
    pairs = {str(r): [[s, float(r + s)] for s in range(3)] for r in range(20)}
    m = {"x": {"waits": pairs}}
    bound_metrics(m)
    assert m["x"]["waits"] == pairs and "rank_series" not in m["x"]
