"""Stragglers on real multi-process runs of the reference job (injected straggler named, clean run
silent, stage imbalance vs slow data)."""

from __future__ import annotations

import json

import pytest

from helpers import run_cli
from runs import straggler_delay_ms, straggler_run


NO_PROFILE = ["--profile-steps", "none"]


def _analyze(run, tmp_path):
    proc = run_cli(["analyze", run, "--out", tmp_path, "--no-report"])
    assert proc.returncode == 0, proc.stderr
    return json.loads((tmp_path / "summary.json").read_text())


def _kinds(summary, *kinds):
    return [f for f in summary["findings"] if f["kind"] in kinds]


@pytest.mark.multiproc
# long (benchmarks/long_tests.py): the 8-rank reference job with a straggler, 41 s on 2 cores;
# the suite proves the straggler analysis on real jobs with a known slow rank
# (test_stragglers_real.py, test_live_and_onsets.py, test_trace_stragglers.py) and the
# reference job's injected faults on test_stage_imbalance_and_slow_data_told_apart
@pytest.mark.parametrize("rank", [pytest.param(5, marks=pytest.mark.long),
                                  pytest.param(2, marks=pytest.mark.long)])
def test_injected_straggler_found(reference_run, tmp_path, rank):
    delay = straggler_delay_ms(reference_run)
    run = straggler_run(reference_run, rank)
    injected = json.loads((run / "injected.json").read_text())["injections"][0]
    s = _analyze(run, tmp_path)
    found = _kinds(s, "straggler")
    per = {p["rank"]: p for p in s["metrics"]["stragglers"]["per_rank"]}
    print(f"delay {delay} ms, step {s['metrics']['stragglers']['median_step_ms']:.0f} ms:",
          {r: (round(p["excess_ms"] or 0), round(p["score"] or 0, 2)) for r, p in per.items()})
    assert len(found) == 1, [f["message"] for f in found]
    assert found[0]["ranks"] == [rank]
    assert found[0]["evidence"]["coords"] == injected["coords"]
    assert str(injected["coords"]["dp"]) in found[0]["message"]
    assert not _kinds(s, "stage_imbalance", "data_starvation")


@pytest.mark.multiproc
def test_clean_run_is_silent(reference_run, tmp_path):
    s = _analyze(reference_run("clean8"), tmp_path)
    per = s["metrics"]["stragglers"]["per_rank"]
    print({p["rank"]: (round(p["excess_ms"] or 0), round(p["score"] or 0, 2)) for p in per})
    assert not _kinds(s, "straggler", "stage_imbalance", "data_starvation"), s["findings"]
    html = __import__("trainprof.reports.sections.stragglers", fromlist=["render"]).render(
        s["metrics"]["stragglers"], s)
    assert html.count("<svg") >= 2  # busy and wait heatmaps


@pytest.mark.multiproc
def test_stage_imbalance_and_slow_data_told_apart(reference_run, tmp_path):
    # one 4-rank run (dp1 · pp2 · tp2) with both faults: stage 1 holds 4 extra layers, and
    # rank 0's dataset sleeps 300 ms per batch
    run = reference_run("imbalance-slowdata", nproc=4,
                        args=["--dp", "1", "--pp", "2", "--tp", "2", "--steps", "6",
                              "--inject", "imbalance:stage=1,extra_layers=4",
                              "--inject", "slow_data:rank=0,delay_ms=300"],
                        wrap_args=NO_PROFILE)
    s = _analyze(run, tmp_path)
    imb = _kinds(s, "stage_imbalance")
    assert len(imb) == 1 and imb[0]["evidence"]["stage"] == 1 and imb[0]["ranks"] == [2, 3]
    starve = _kinds(s, "data_starvation")
    assert len(starve) == 1 and starve[0]["ranks"] == [0]
    assert not _kinds(s, "straggler")
