"""The collectives analyzer on a real FSDP2 + TP + PP gloo job (tests/support/collective_job.py)."""

from __future__ import annotations

import json

import pytest

from collective_job import collective_run  # noqa: F401 - shared session fixture


@pytest.mark.multiproc
def test_real_run_is_consistent_and_renders(collective_run, tmp_path):
    from helpers import run_cli

    proc = run_cli(["analyze", collective_run, "--out", tmp_path])
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    m = summary["metrics"]["collectives"]
    assert m["consistency"]["ok"], m["consistency"]
    assert m["in_flight_at_end"] == 0
    dims = {d["mesh_dim"] for d in m["per_dim"]}
    assert {"tp", "pp"} <= dims
    ops = {r["op"] for r in m["bandwidth"]}
    assert {"all_reduce", "all_gather", "reduce_scatter", "send_recv"} <= ops
    assert all(r["algbw_GBps"] is None or r["algbw_GBps"] > 0 for r in m["bandwidth"])
    assert {p["rank"] for p in m["lateness"]["per_rank"]} == {0, 1, 2, 3}
    assert not [e for e in summary["errors"] if e["analyzer"] == "collectives"]
    html = (tmp_path / "report.html").read_text()
    assert "Collectives" in html and "busbw" in html
