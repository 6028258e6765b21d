"""A long run's summary (125,000 analysed steps of 8 ranks, a straggler slow in most of them)
and a wide one's (1,024 ranks) stay under 3 MB once bounded, say the resolution of each part,
and `trainprof compare` still gates them: a 30 % slower candidate is a regression, the same
level passes."""

from __future__ import annotations

import json

import numpy as np
import orjson
import paths  # noqa: F401 - tests/support on sys.path
from helpers import run_cli

from trainprof.analysis.summary_bound import bound_findings, bound_metrics, bounded, named_ranks

LIMIT = 3 * 2**20


def _long(median: float, seed: int, n: int = 125_000, ranks: int = 8) -> dict:
    rng = np.random.default_rng(seed)
    steps = list(range(1_000_000 - n, 1_000_000))
    base = median * (1 + 0.02 * rng.standard_normal((ranks, n)))
    base[4, n // 4:] += 40.0  # rank 4 slow from a quarter of the way on
    job = base.max(axis=0)
    slow = steps[n // 4:]
    findings = [{"kind": "straggler", "severity": "warning", "ranks": [4], "message": "rank 4",
                 "evidence": {"straggling_steps": slow}}]
    metrics = {
        "step_time": {"job": {"median_ms": float(np.median(job)), "tokens_per_step": 2048},
                      "per_step": [{"step": s, "max_ms": float(a), "median_ms": float(b),
                                    "min_ms": float(c), "ranks": ranks}
                                   for s, a, b, c in zip(steps, job, np.median(base, axis=0),
                                                         base.min(axis=0))],
                      "step_ms_by_rank": {str(r): base[r].tolist() for r in range(ranks)},
                      "steps": steps, "first_step": steps[0]},
        "stragglers": {"steps": steps, "busy_ms_by_rank": {str(r): (base[r] * 0.6).tolist()
                                                           for r in range(ranks)},
                       "per_rank": [{"rank": r, "straggling_steps": slow if r == 4 else []}
                                    for r in range(ranks)]}}
    return _summary(metrics, findings, ranks)


def _wide(median: float, seed: int, ranks: int = 1024, n: int = 976) -> dict:
    rng = np.random.default_rng(seed)
    steps = list(range(99_024, 99_024 + n))
    base = median * (1 + 0.02 * rng.standard_normal((ranks, n)))
    base[512] += 40.0
    tables = {k: {str(r): (base[r] * f).tolist() for r in range(ranks)}
              for k, f in (("busy_ms_by_rank", 0.6), ("wait_ms_by_rank", 0.3),
                           ("data_ms_by_rank", 0.01))}
    metrics = {"step_time": {"job": {"median_ms": float(np.median(base.max(axis=0))),
                                     "tokens_per_step": 2048},
                             "per_step": [{"step": s, "max_ms": float(v), "ranks": ranks}
                                          for s, v in zip(steps, base.max(axis=0))],
                             "step_ms_by_rank": {str(r): base[r].tolist() for r in range(ranks)},
                             "steps": steps, "first_step": steps[0]},
               "stragglers": {"steps": steps, **tables}}
    findings = [{"kind": "straggler", "severity": "warning", "ranks": [512], "message": "rank 512"}]
    return _summary(metrics, findings, ranks)


def _summary(metrics, findings, ranks) -> dict:
    bound_findings(findings, digits=bound_metrics(metrics, named=named_ranks(findings)))
    return {"schema_version": 1,
            "run": {"world_size": ranks, "mesh": {"dp": ranks, "pp": 1, "tp": 1}, "device": "cpu",
                    "torch_version": "2.13.0+cpu", "exit_code": 0},
            "metrics": metrics, "findings": findings}


def _write(tmp_path, name, s) -> tuple:
    p = tmp_path / name
    assert bounded(s)  # written compact (runner.analyze_and_write)
    b = orjson.dumps(s)
    p.write_bytes(b)
    return p, len(b)


def test_a_long_run_summary_is_bounded_and_says_its_resolution(tmp_path):
    s = _long(100.0, 0)
    _, size = _write(tmp_path, "long.json", s)
    assert size < LIMIT, size
    st = s["metrics"]["step_time"]
    (res,) = st["series_resolution"]
    assert res["length"] == 125_000 and res["kept"] == len(st["per_step"]) == len(st["steps"])
    assert res["axis"] == "steps" and res["steps"] == [875_000, 999_999]
    assert res["every"] == -(-(125_000 - 500) // (2000 - 500)) and res["kept"] <= 2000
    assert st["steps"][-res["recent_full"]:] == list(range(1_000_000 - res["recent_full"], 1_000_000))
    assert [p["step"] for p in st["per_step"]] == st["steps"]  # one axis for every series
    p4 = s["metrics"]["stragglers"]["per_rank"][4]
    assert p4["straggling_steps_total"] == 125_000 - 125_000 // 4
    assert p4["straggling_steps_ranges"] == [[875_000 + 125_000 // 4, 999_999]]
    ev = s["findings"][0]["evidence"]
    assert ev["straggling_steps_ranges"] == p4["straggling_steps_ranges"]


def test_a_wide_run_summary_is_bounded_keeping_the_named_rank(tmp_path):
    s = _wide(100.0, 0)
    _, size = _write(tmp_path, "wide.json", s)
    assert size < LIMIT, size
    sg = s["metrics"]["stragglers"]
    assert "512" in sg["busy_ms_by_rank"] and sg["rank_series"]["omitted"] == 1024 - 8
    assert max(sg["busy_ms_by_rank_all_ranks"]["max"]) == max(sg["busy_ms_by_rank"]["512"])
    assert "512" in s["metrics"]["step_time"]["step_ms_by_rank"]


def test_compare_gates_bounded_long_summaries(tmp_path):
    base = [_write(tmp_path, f"b{i}.json", _long(100.0, i, n=20_000))[0] for i in range(2)]
    slow = [_write(tmp_path, f"c{i}.json", _long(130.0, 10 + i, n=20_000))[0] for i in range(2)]
    same = [_write(tmp_path, f"s{i}.json", _long(100.0, 20 + i, n=20_000))[0] for i in range(2)]
    proc = run_cli(["compare", *map(str, base), "--", *map(str, slow), "--json"], timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    st = {m["metric"]: m for m in json.loads(proc.stdout)["metrics"]}["step_time"]
    assert st["verdict"] == "regression"
    proc = run_cli(["compare", *map(str, base), "--", *map(str, same), "--json"], timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
