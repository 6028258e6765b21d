"""Bare H100 and MI300X traces (tests/fixtures/tracelens) against AMD TraceLens' own
gpu_timeline numbers: gpu_overview's kernel and memcpy time equal TraceLens' computation and
memcpy time; the device peak comes from the trace (bf16 datasheet figures); the MI300X run's
hipDeviceSynchronize calls count as syncs as the H100 run's cudaDeviceSynchronize do."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from trainprof.analyzers import _comm_breakdown, gpu_overview, roofline
from trainprof.trace import parse_trace

FIX = Path(__file__).resolve().parents[2] / "fixtures" / "tracelens"
MODEL = "gaunernst_bert-small-uncased__1016001"
DEVICES = {"h100": ("H100 SXM", 989e12), "mi300": ("MI300X", 1307e12)}


def _tracelens(dev) -> dict:
    with open(FIX / dev / f"{MODEL}.gpu_timeline.csv") as f:
        return {r[0].lower(): float(r[1]) for r in csv.reader(f) if r and r[0] != "type"}


@pytest.mark.parametrize("dev", sorted(DEVICES))
def test_overview_equals_tracelens(dev):
    tr = parse_trace(FIX / dev / MODEL / f"{MODEL}.json.gz")
    tl = _tracelens(dev)
    job = gpu_overview.trace_digest(None, 0, tr)["job"]
    assert job["steps"] == 1
    assert job["kernel_ms"] + job["communication_ms"] == pytest.approx(tl["computation_time"], rel=1e-3)
    assert job["memcpy_ms"] == pytest.approx(tl["total_memcpy_time"], rel=2e-3, abs=1e-4)
    name, flops = DEVICES[dev]
    _, facts = roofline.op_classes(tr)
    p = roofline.trace_peaks({0: {"facts": facts}}, {}, None)[0]
    assert (p["dtype"], p["flops_per_s"]) == ("bf16", flops) and name in p["basis"]


def test_hip_synchronize_counts_like_cuda():
    calls = {}
    for dev in DEVICES:
        rows, _, _ = _comm_breakdown.rank_breakdown(parse_trace(FIX / dev / MODEL / f"{MODEL}.json.gz"))
        calls[dev] = sum(r["sync_calls"] for r in rows)
    assert calls["mi300"] == calls["h100"] == 2  # hipDeviceSynchronize x2, cudaDeviceSynchronize x2
