"""End to end on the reference workload: wrap → run directory → analyze → summary + report.

Uses the shared 8-rank dp2·pp2·tp2 run (tests/runs.py "clean8")."""

from __future__ import annotations

import itertools
import json

import pytest

from helpers import run_cli

pytestmark = pytest.mark.multiproc


def test_manifest_has_every_rank_with_mesh_coordinates(reference_run):
    run = reference_run("clean8")
    man = json.loads((run / "manifest.json").read_text())
    assert man["exit_code"] == 0 and man["status"] == "ok"
    assert man["world_size"] == 8
    assert man["mesh"]["dim_names"] == ["dp", "pp", "tp"] and man["mesh"]["shape"] == [2, 2, 2]
    ranks = sorted(man["ranks"], key=lambda r: r["rank"])
    assert [r["rank"] for r in ranks] == list(range(8))
    coords = [(r["coords"]["dp"], r["coords"]["pp"], r["coords"]["tp"]) for r in ranks]
    # DeviceMesh is row-major over (dp, pp, tp): rank = dp*4 + pp*2 + tp
    assert coords == list(itertools.product(range(2), range(2), range(2)))
    assert all(r["host"] for r in ranks)


def test_every_rank_records_steps_and_a_profiler_trace(reference_run):
    run = reference_run("clean8")
    for rank in range(8):
        lines = (run / "ranks" / f"rank-{rank:05d}" / "steps.jsonl").read_text().splitlines()
        steps = [json.loads(x)["step"] for x in lines]
        assert steps == list(range(8)), (rank, steps)
        assert (run / "profiler" / f"rank-{rank:05d}.pt.trace.json.gz").stat().st_size > 0


def test_analyze_writes_summary_and_report(reference_run, tmp_path):
    run = reference_run("clean8")
    proc = run_cli(["analyze", run, "--out", tmp_path])
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["run"]["world_size"] == 8
    assert summary["run"]["mesh"] == {"dp": 2, "pp": 2, "tp": 2}
    assert summary["errors"] == [], summary["errors"]
    for name in ("step_time", "comm_compute"):
        assert name in summary["metrics"], sorted(summary["metrics"])
    # a clean run: nothing is wrong with it
    faults = {"straggler", "nan_origin", "hang", "rank_failure", "desync", "stage_imbalance",
              "data_starvation"}
    assert [f for f in summary["findings"] if f["kind"] in faults] == []
    html = (tmp_path / "report.html").read_text()
    assert html.startswith("<!DOCTYPE html>") or html.lower().startswith("<!doctype html>")
    assert str(tmp_path / "report.html") in proc.stdout + proc.stderr


def test_demo_small_layout(tmp_path):
    """The README's main job, on a 2-rank layout to keep CI short (the README runs 8 ranks)."""
    out = tmp_path / "demo"
    proc = run_cli(["demo", "--out", out, "--steps", "6", "--nproc", "2", "--dp", "2", "--pp", "1",
                    "--tp", "1"], timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert (out / "summary.json").exists() and (out / "report.html").exists()
    assert "report" in (proc.stdout + proc.stderr).lower()
