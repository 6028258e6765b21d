"""Bare traces know their device peak (analyzers/roofline.py trace_peaks): the device from the
trace's deviceProperties, the dtype from the matmul-class ops' input types — an H100 bf16 trace
gets the datasheet's 989 TFLOP/s and % of peak per op class, never "missing device peak"."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from trainprof import devices as _devices
from trainprof.analysis.run import RunDir
from trainprof.analysis.runner import analyze
from trainprof.analyzers import roofline
from trainprof.trace import parse_trace

H100 = Path(__file__).resolve().parents[2] / "fixtures" / "gpu" / "h100_item_sync.pt.trace.json.gz"


def _variant(tmp_path, dtype=None, device=None) -> Path:
    doc = json.loads(gzip.open(H100).read())
    for e in doc["traceEvents"]:
        a = e.get("args")
        if dtype and isinstance(a, dict) and isinstance(a.get("Input type"), list):
            a["Input type"] = [dtype if t == "float" else t for t in a["Input type"]]
    if device:
        doc["deviceProperties"][0]["name"] = device
    p = tmp_path / "rank-0.pt.trace.json"
    p.write_text(json.dumps(doc))
    return p


def _peak(path, declared=None):
    _, facts = roofline.op_classes(parse_trace(path))
    return facts, roofline.trace_peaks({0: {"facts": facts}}, {}, declared).get(0)


@pytest.mark.parametrize("dtype,device,name,want", [
    (None, None, "H100 SXM", ("fp32", 67e12)),                       # the fixture: fp32 GEMMs
    ("c10::BFloat16", None, "H100 SXM", ("bf16", 989e12)),
    ("c10::Half", "AMD Instinct MI300X VF", "MI300X", ("fp16", 1307e12)),
])
def test_device_and_dtype_from_the_trace(tmp_path, dtype, device, name, want):
    facts, p = _peak(_variant(tmp_path, dtype, device))
    assert facts["device"] == (device or "NVIDIA H100 80GB HBM3")
    assert max(facts["dtype_time_ns"], key=facts["dtype_time_ns"].get) == want[0]
    assert (p["dtype"], p["flops_per_s"]) == want
    assert p["basis"].startswith(f"datasheet {name} dense {want[0]} (device named in the trace")
    assert p["bytes_per_s"] == _devices.lookup(device or "H100")["bytes_per_s"]


def test_declared_dtype_wins(tmp_path):
    _, p = _peak(_variant(tmp_path, "c10::BFloat16"), declared="tf32")
    assert (p["dtype"], p["flops_per_s"]) == ("tf32", 494e12)


def test_bare_h100_trace_gets_percent_of_peak(tmp_path):
    path = _variant(tmp_path, "c10::BFloat16")
    s = analyze(RunDir(path))
    r = s["metrics"]["roofline"]
    assert r["peak"]["flops_per_s"] == 989e12 and r["compute_dtype"] == "bf16"
    assert any(c.get("pct_of_bound") is not None for c in r["classes"])
    mm = next(c for c in r["classes"] if c["op_class"] == "matmul")
    assert mm["pct_of_peak_flops"] == pytest.approx(mm["achieved_flops_per_s"] / 989e12)
    assert not any("device peak" in p for p in s["problems"])
    ov = s["metrics"]["gpu_overview"]["job"]
    assert ov["devices"] == ["NVIDIA H100 80GB HBM3"] and ov["gpu_utilization"] > 0
