"""summary.json's per-step series are thinned past a few thousand points, aligned, said so."""

from trainprof.analysis.summary_bound import MAX_POINTS, bound_metrics


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
    assert st["steps"][-1000:] == list(range(n - 1000, n))  # the recent steps, every one
    res = st["series_resolution"][0]
    assert res["length"] == n and res["kept"] == len(st["steps"]) and res["recent_full"] == 1000
    assert st["steps"][:3] == [0, res["every"], 2 * res["every"]]
    assert st["short"] == [1, 2, 3] and st["median_ms"] == 5.0
    assert len(m["step_time"]["per_step"]) == 100 and "series_resolution" not in m["step_time"]


def test_many_ranks_share_a_total():
    m = {"a": {"steps": list(range(5000)), "by_rank": {str(r): list(range(5000)) for r in range(1024)}}}
    bound_metrics(m)
    total = sum(len(v) for v in m["a"]["by_rank"].values())
    assert total <= 320_000 and len(m["a"]["by_rank"]["7"]) == len(m["a"]["steps"]) >= 50
