"""Roofline per op class, device peaks, calibration, and MFU recomputed by hand.

Cases that run multi-process jobs: tests/integration/test_roofline_jobs.py."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest
import torch
from torch.profiler import profile

from trainprof import devices as _devices
from trainprof.analyzers import roofline
from trainprof.probes.calibration import measure
from trainprof.rundir.files import profiler_trace_path, rank_dir, write_json_atomic
from trainprof.analysis.run import RunDir
from paths import FIXTURES

FIXTURE = FIXTURES / "gpu" / "h100_item_sync.pt.trace.json.gz"


def test_device_table_by_name():
    assert _devices.lookup("NVIDIA H100 80GB HBM3")["name"] == "H100 SXM"
    assert _devices.lookup("NVIDIA H100 PCIe")["name"] == "H100 PCIe"
    assert _devices.lookup("NVIDIA A100-SXM4-80GB")["flops_per_s"]["bf16"] == 312e12
    assert _devices.lookup("NVIDIA A100-SXM4-80GB")["bytes_per_s"] == 2.039e12
    assert _devices.lookup("NVIDIA H200")["bytes_per_s"] == 4.8e12
    assert _devices.lookup("NVIDIA L40S")["name"] == "L40S" and _devices.lookup("NVIDIA L4")["name"] == "L4"
    assert _devices.lookup("AMD Instinct MI300X")["name"] == "MI300X"
    assert _devices.lookup("x86_64") is None and _devices.lookup(None) is None
    p = _devices.peak("NVIDIA H100 80GB HBM3", "bf16")
    assert p["flops_per_s"] == 989e12 and "datasheet" in p["basis"]
    calib = {"device": "cpu", "threads": 2, "matmul": {"flops_per_s": 5e10, "n": 512}, "copy": {"bytes_per_s": 1e10}}
    assert _devices.peak("x86_64", "fp32", calib)["flops_per_s"] == 5e10
    assert _devices.compute_dtype({"dtype": "bf16"}) == "bf16" and _devices.compute_dtype({}) == "fp32"


def test_calibration_measures_matmul_and_copy():
    c = measure("cpu", budget_s=0.05)
    assert c["matmul"]["flops_per_s"] > 1e8 and c["copy"]["bytes_per_s"] > 1e8
    assert c["threads"] == torch.get_num_threads() and c["ms"] < 2000


def _fake_run(tmp_path, trace_src, meta: dict) -> RunDir:
    d = rank_dir(tmp_path, 0)
    write_json_atomic(d / "meta.json", {"rank": 0, "host": "h", "local_rank": 0, **meta})
    dst = profiler_trace_path(tmp_path, 0)
    dst.parent.mkdir(parents=True, exist_ok=True)
    if str(trace_src).endswith(".gz"):
        shutil.copy(trace_src, dst)
    else:
        dst.write_bytes(gzip.compress(Path(trace_src).read_bytes()))
    return RunDir(tmp_path)


def test_roofline_position_by_hand_on_cpu(tmp_path):
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    x = torch.randn(1 << 20)
    with profile(record_shapes=True) as p, torch.profiler.record_function("ProfilerStep#1"):
        for _ in range(3):
            torch.mm(a, b)
        x.add(x)
    p.export_chrome_trace(str(tmp_path / "t.json"))
    calib = {"device": "cpu", "host": "h", "threads": 1, "cpu_count": 1,
             "matmul": {"flops_per_s": 1e11, "n": 512}, "copy": {"bytes_per_s": 1e10, "bytes": 1 << 25}}
    run = _fake_run(tmp_path / "run", tmp_path / "t.json", {"device": "cpu", "calibration": calib})
    res = roofline.analyze(run)
    cls = {c["op_class"]: c for c in res.metrics["classes"]}
    mm, ew = cls["matmul"], cls["elementwise"]
    assert mm["count"] == 3 and mm["flops"] == 3 * 2 * 256 ** 3
    assert mm["bytes"] == 3 * 3 * 256 * 256 * 4                  # read A, B; write C
    assert mm["ai"] == pytest.approx(2 * 256 / 12)                # 42.7 FLOP/B > ridge 10
    assert mm["bound"] == "compute"
    assert mm["pct_of_bound"] == pytest.approx(mm["flops"] / (mm["time_ms"] / 1e3) / 1e11)
    assert ew["ai"] == pytest.approx(1 / 12) and ew["bound"] == "memory"  # 1 FLOP per 3×4 bytes
    assert ew["pct_of_bound"] == pytest.approx(ew["bytes"] / (ew["time_ms"] / 1e3) / 1e10)
    assert res.metrics["plot"]["ridge_ai"] == 10
    assert not res.findings                                       # CPU host timings: no verdicts
    # a class above its roof is said to be (operands in cache): a peak of 1 byte/s
    calib["copy"]["bytes_per_s"] = 1.0
    run = _fake_run(tmp_path / "run2", tmp_path / "t.json", {"device": "cpu", "calibration": calib})
    res = roofline.analyze(run)
    ew = {c["op_class"]: c for c in res.metrics["classes"]}["elementwise"]
    assert ew["pct_of_bound"] > 1
    assert any(n.startswith(f"elementwise: {ew['pct_of_bound']:.0%} of its memory bound, above the roof")
               and "caches" in n for n in res.metrics["notes"])


def test_gpu_trace_uses_kernel_time(tmp_path):
    run = _fake_run(tmp_path, FIXTURE, {"device": "cuda:0", "device_name": "NVIDIA H100 80GB HBM3",
                                        "run_info": {"dtype": "fp32"}})
    res = roofline.analyze(run)
    mm = next(c for c in res.metrics["classes"] if c["op_class"] == "matmul")
    # independently: the gemm kernels launched by aten::addmm / aten::mm inside ProfilerSteps
    raw = json.loads(gzip.decompress(FIXTURE.read_bytes()))["traceEvents"]
    mms = ("aten::addmm", "aten::mm")
    addmm = {e["args"]["External id"] for e in raw if e.get("name") in mms}
    steps = [(e["ts"], e["ts"] + e["dur"]) for e in raw if str(e.get("name", "")).startswith("ProfilerStep#")
             and e.get("cat") == "user_annotation"]
    in_step = {e["args"]["External id"] for e in raw if e.get("name") in mms
               and any(s <= e["ts"] < t for s, t in steps)}
    kern = sum(e["dur"] for e in raw if e.get("cat") == "kernel"
               and e.get("args", {}).get("External id") in (addmm & in_step))
    assert mm["time_ms"] == pytest.approx(kern / 1e3, rel=1e-6)
    # per step: 6 Linear(2048, 2048) on 256 rows forward, 6 weight grads, 5 input grads
    # (the first layer's input needs none): 17 products of 2·256·2048·2048
    assert mm["count"] == 17 * len(steps) and mm["flops"] == 17 * len(steps) * 2 * 256 * 2048 * 2048
    assert res.metrics["peak"]["flops_per_s"] == 67e12                # H100 SXM fp32, no tf32
    assert res.metrics["timing"] == ["gpu kernels"]


def test_older_trace_format_maps_kernels_through_their_launch(tmp_path):
    """Older traces give a kernel's correlation id as its External id; roofline must still find
    the launching op (kernel -> runtime call by correlation -> enclosing op on its thread)."""
    src = FIXTURES / "hta" / "trace_filter" / "sampled_rank-0.json.gz"
    run = _fake_run(tmp_path, src, {"device": "cuda:0", "device_name": "NVIDIA A100-SXM4-80GB",
                                    "run_info": {"dtype": "bf16"}})
    res = roofline.analyze(run)
    mm = next(c for c in res.metrics["classes"] if c["op_class"] == "matmul")
    # independently: kernels whose launch lies inside an aten::mm/addmm/bmm on the launching
    # thread, that op inside a ProfilerStep (all but none: every step is analysed here)
    raw = json.loads(gzip.decompress(src.read_bytes()))["traceEvents"]
    steps = [(e["ts"], e["ts"] + e["dur"]) for e in raw if str(e.get("name", "")).startswith("ProfilerStep#")
             and e.get("cat") == "user_annotation"]
    mms = [e for e in raw if e.get("cat") == "cpu_op" and e["name"] in ("aten::mm", "aten::addmm", "aten::bmm")
           and any(s <= e["ts"] < t for s, t in steps)]
    launch = {e["args"]["correlation"]: e for e in raw if e.get("cat") == "cuda_runtime"
              and "correlation" in e.get("args", {})}
    kern = 0.0
    for k in (e for e in raw if e.get("cat") == "kernel"):
        rt = launch.get(k["args"].get("correlation"))
        if rt is not None and any(m["tid"] == rt["tid"] and m["ts"] <= rt["ts"] < m["ts"] + m["dur"]
                                  for m in mms):
            kern += k["dur"]
    assert kern > 0 and mm["time_ms"] == pytest.approx(kern / 1e3, rel=1e-3)
    assert res.metrics["timing"] == ["gpu kernels"]


def test_trace_digests_never_import_pandas():
    """roofline's and memory's trace paths read the numpy tables only (trace.tables)."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from trainprof.trace import load_trace\n"
        "from trainprof.analyzers import memory, roofline\n"
        "class Run:\n"
        "    def rank_meta(self, rank): return {'device': 'cuda:0'}\n"
        f"tr = load_trace({str(FIXTURE)!r})\n"
        "assert roofline.trace_digest(Run(), 0, tr)['classes']\n"
        "assert memory.trace_digest(Run(), 0, tr)['window']\n"
        "print('pandas' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_compute_bound_advice_follows_the_dtype_the_ops_run_in():
    """Matmuls at 11 % of the bf16 peak that already run in bf16 (a TraceLens MI300X trace):
    autocast would change nothing; fp32 matmuls get it."""
    from types import SimpleNamespace

    from trainprof.analyzers.roofline import _findings

    mm = {"op_class": "matmul", "bound": "compute", "time_share": 0.55, "pct_of_bound": 0.11}
    peak = {"basis": "datasheet MI300X dense bf16", "flops_per_s": 1.3e15, "bytes_per_s": 5.3e12}
    run = SimpleNamespace(ranks=[0])
    (bf,) = _findings([mm], {"gpu kernels"}, peak, run, "bf16")
    assert "already run in bf16" in bf.message and "autocast" not in bf.fix
    assert "multiples of 64" in bf.fix and bf.evidence["compute_dtype"] == "bf16"
    (fp,) = _findings([mm], {"gpu kernels"}, peak, run, "fp32")
    assert "check the dtype" in fp.message and "autocast" in fp.fix
