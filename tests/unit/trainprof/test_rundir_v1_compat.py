"""A run directory of schema version 1 (every step in JSONL, no compact tables; captured with
trainprof before the bounded format, tests/fixtures/rundir_v1) is still read, and analyzes to
the same metrics and findings as it did then (tests/fixtures/rundir_v1.expected.json: every
value it held is given again; fields analyzers added since are allowed)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "rundir_v1"
EXPECTED = FIXTURE.with_name("rundir_v1.expected.json")
VOLATILE = {"seconds", "analyzer_seconds", "generated_at"}


def _strip(x):
    if isinstance(x, dict):
        return {k: _strip(v) for k, v in x.items() if k not in VOLATILE}
    if isinstance(x, list):
        return [_strip(v) for v in x]
    if isinstance(x, float):
        return round(x, 6)
    return x


def _contains(got, want, where="metrics"):
    """Every value the old analysis gave is given again (analyzers may add fields since)."""
    if isinstance(want, dict):
        assert isinstance(got, dict), where
        for k, v in want.items():
            assert k in got, f"{where}.{k} missing"
            _contains(got[k], v, f"{where}.{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            _contains(g, w, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def test_v1_run_directory_analyzes_as_before(tmp_path):
    from trainprof.analysis.runner import analyze
    from trainprof.analysis.run import RunDir

    run_dir = tmp_path / "run"
    shutil.copytree(FIXTURE, run_dir)
    run = RunDir(run_dir)
    assert run.resolution() is None  # no compact tables: every step at full detail
    doc = analyze(run)
    want = json.loads(EXPECTED.read_text())
    _contains(_strip(doc["metrics"]), _strip(want["metrics"]))
    key = lambda f: (f["kind"], f["severity"], f["ranks"])  # noqa: E731
    assert [key(f) for f in doc["findings"]] == [key(f) for f in want["findings"]]
    for g, w in zip(doc["findings"], want["findings"]):
        _contains(_strip(g.get("evidence")), _strip(w.get("evidence")), f"{w['kind']}.evidence")
    assert doc["problems"] == want["problems"]
    # the per-step series of the old format, summed from its collective log
    series = run.step_series()
    assert sorted(series["rank"].unique()) == [0, 1] and len(series) == 80
    coll = run.collectives()
    by_hand = coll[coll["rank"] == 1].groupby("step")["blocked_ms"].sum()
    got = series[series["rank"] == 1].set_index("step")["blocked_ms"]
    common = by_hand.index.intersection(got.index)  # (the barrier after the last step has none)
    assert len(common) == 40
    assert abs(got.loc[common] - by_hand.loc[common]).max() < 1e-9
