"""Compute/communication split on a real multi-process CPU run of the reference job."""

from __future__ import annotations

import pytest

from comm_compute_shared import CATS
from trainprof.analysis.run import RunDir
from trainprof.analyzers import comm_compute


@pytest.mark.multiproc
def test_real_cpu_run_partitions_each_step(reference_run):
    res = comm_compute.analyze(RunDir(reference_run("clean8")))
    m = res.metrics
    assert m["job"]["trace_kind"] == "cpu" and len(m["per_rank"]) == 8
    for row in m["per_step"]:
        assert sum(row[k] for k in CATS) == pytest.approx(row["window_ms"], rel=1e-3)
        assert row["comm_ms"] > 0 and row["compute_ms"] > 0
    types = set().union(*(r["comm_by_type_ms_per_step"] for r in m["per_rank"]))
    assert {"all_reduce", "all_gather", "send", "recv"} <= types  # TP/loss, FSDP, pipeline
    # every gloo event of every rank was matched to its group through the collective log
    for r in m["per_rank"]:
        assert {"dp", "pp", "tp"} <= set(r["by_dim_ms_per_step"]) and "unknown" not in r["by_dim_ms_per_step"]
    for row in m["per_step"]:
        assert sum(v["comm_ms"] for v in row["by_dim"].values()) >= row["comm_ms"] * 0.5
