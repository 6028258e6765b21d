"""analyzers/gpu_overview: the TensorBoard plugin's overview on a small synthetic trace whose
numbers are computed by hand here, and on real traces (Kineto's own per-kernel figures)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from trainprof.analyzers import _occupancy, gpu_overview
from trainprof.trace import parse_trace

FIX = Path(__file__).resolve().parents[2] / "fixtures"
H100 = FIX / "gpu" / "h100_item_sync.pt.trace.json.gz"
PROPS = {"id": 0, "name": "NVIDIA H100 80GB HBM3", "maxThreadsPerMultiprocessor": 2048,
         "warpSize": 32, "numSms": 132, "regsPerMultiprocessor": 65536,
         "sharedMemPerMultiprocessor": 233472, "sharedMemPerBlock": 49152}


def X(cat, name, ts, dur, pid=1, tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur,
            "args": args}


def synthetic(cats=None):
    """Step 1 [0, 100) µs: DataLoader [0, 10); aten::mm [10, 30) (fp32) launches kernel A
    (gemm, tensor-core name, 66 blocks: 0.5 per SM; 128 threads, 64 registers) at [30, 60)
    through cudaLaunchKernel [20, 25); aten::add [30, 35) launches kernel B [40, 50) (Kineto's
    0.5 blocks/SM and 50 % occupancy) through [31, 33); a memcpy [60, 70).
    Step 2 [100, 200) launches kernel C (132 blocks) that runs [150, 230): the step ends at 230."""
    c = {"kernel": "kernel", "cuda_runtime": "cuda_runtime", "cpu_op": "cpu_op",
         "gpu_memcpy": "gpu_memcpy", **(cats or {})}
    gpu = dict(pid=0, tid=7)
    ev = [
        X("user_annotation", "ProfilerStep#1", 0, 100),
        X("user_annotation", "ProfilerStep#2", 100, 100),
        X("user_annotation", "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", 0, 10),
        X(c["cpu_op"], "aten::mm", 10, 20, **{"External id": 1, "Input type": ["float", "float"]}),
        X(c["cuda_runtime"], "cudaLaunchKernel", 20, 5, correlation=1, **{"External id": 1}),
        X(c["kernel"], "sm90_xmma_gemm_f32f32_tn", 30, 30, **gpu, stream=7, correlation=1,
          grid=[66, 1, 1], block=[128, 1, 1], **{"External id": 1, "registers per thread": 64,
                                                 "shared memory": 0}),
        X(c["cpu_op"], "aten::add", 30, 5, **{"External id": 2, "Input type": ["float", "float"]}),
        X(c["cuda_runtime"], "cudaLaunchKernel", 31, 2, correlation=2, **{"External id": 2}),
        X(c["kernel"], "void elementwise_kernel", 40, 10, **gpu, stream=7, correlation=2,
          **{"External id": 2, "blocks per SM": 0.5, "est. achieved occupancy %": 50}),
        X(c["cuda_runtime"], "cudaMemcpyAsync", 55, 1, correlation=3, **{"External id": 3}),
        X(c["gpu_memcpy"], "Memcpy HtoD", 60, 10, **gpu, stream=7, correlation=3),
        X(c["cpu_op"], "aten::relu", 110, 5, **{"External id": 4}),
        X(c["cuda_runtime"], "cudaLaunchKernel", 111, 2, correlation=4, **{"External id": 4}),
        X(c["kernel"], "void relu_kernel", 150, 80, **gpu, stream=7, correlation=4,
          grid=[132, 1, 1], block=[256, 1, 1], **{"External id": 4, "registers per thread": 16}),
    ]
    return {"deviceProperties": [PROPS], "traceEvents": ev}


def _digest(tmp_path, doc):
    p = tmp_path / "t.json"
    p.write_text(json.dumps(doc))
    return gpu_overview.trace_digest(None, 0, parse_trace(p))


def test_hand_computed_steps(tmp_path):
    d = _digest(tmp_path, synthetic())
    s1, s2 = d["per_step"]
    # step 1: kernels [30, 60) win over the runtime call [31, 33) and aten::add [30, 35);
    # cpu exec = aten::mm [10, 30) minus its launch call [20, 25)
    assert (s1["step_ms"], s1["kernel_ms"], s1["memcpy_ms"], s1["runtime_ms"], s1["dataloader_ms"],
            s1["cpu_exec_ms"], s1["other_ms"]) == (0.1, 0.03, 0.01, 0.005, 0.01, 0.015, 0.03)
    assert s1["gpu_utilization"] == 0.3
    # SM efficiency: A alone 0.5 on [30,40) and [50,60), A+B capped at 1 on [40,50): 20 / 100
    assert s1["sm_efficiency"] == 0.2
    # occupancy: A launches 66 x 4 warps over 132 SMs = 2 of 64 warps (theoretical 50 %):
    # 0.03125; B: Kineto's 0.5; weighted 30:10
    assert s1["achieved_occupancy"] == pytest.approx((30 * 0.03125 + 10 * 0.5) / 40, abs=1e-4)
    # step 2 is extended to the end of kernel C (230); aten::relu [110, 115) minus its launch
    # call [111, 113)
    assert (s2["step_ms"], s2["kernel_ms"], s2["runtime_ms"], s2["cpu_exec_ms"], s2["other_ms"]) == \
        (0.13, 0.08, 0.002, 0.003, 0.045)
    job = d["job"]
    assert job["gpu_utilization"] == round(110 / 230, 4)
    assert job["sm_efficiency"] == round((20 + 80) / 230, 4)
    # tensor cores: A (30 µs) of 120 µs of kernels; eligible ops (aten::mm, fp32) likewise
    assert job["tensor_core_kernel_share"] == 0.25
    assert job["tc_eligible_op_share"] == 0.25 and job["tc_eligible_fp32_share"] == 0.25
    assert job["kernel_pct"] == round(100 * 110 / 230, 2)


def test_old_dialect_gives_the_same_overview(tmp_path):
    old = synthetic({"kernel": "Kernel", "cuda_runtime": "Runtime", "cpu_op": "Operator",
                     "gpu_memcpy": "Memcpy"})
    assert _digest(tmp_path, old)["job"] == _digest(tmp_path, synthetic())["job"]


def test_occupancy_formula_matches_kineto_on_a_real_trace():
    """Kineto's "est. achieved occupancy %" (an integer; 0 where a kernel's shared memory is
    past the default per-block limit) against the formula, on the H100 trace's kernels."""
    tr = parse_trace(H100)
    lt = tr.tables.launch
    props = tr.meta["deviceProperties"][0]
    est = _occupancy.estimate(props, lt["grid_blocks"], lt["block_threads"],
                              lt["regs_per_thread"], lt["shared_mem"]) * 100
    k = ~np.isnan(lt["est_occupancy_pct"]) & (lt["shared_mem"] <= props["sharedMemPerBlock"])
    assert k.sum() >= 100
    assert np.abs(est[k] - lt["est_occupancy_pct"][k]).max() <= 1.0


def test_real_trace_overview():
    tr = parse_trace(H100)
    d = gpu_overview.trace_digest(None, 0, tr)
    job = d["job"]
    assert d["device"] == "NVIDIA H100 80GB HBM3" and job["steps"] == 4
    parts = [job[f"{k}_pct"] for k in gpu_overview.BREAKDOWN]
    assert sum(parts) == pytest.approx(100, abs=0.05)
    # the kernel share of the breakdown is kernel time outside communication kernels; with no
    # NCCL kernel here it equals GPU utilization
    assert job["kernel_pct"] / 100 == pytest.approx(job["gpu_utilization"], abs=1e-3)
    assert 0 < job["sm_efficiency"] <= job["gpu_utilization"]
    # occupancy: the kernel-time-weighted mean of Kineto's own figures, computed here directly
    ev = tr.tables.events
    lt = tr.tables.launch
    rows = lt["row"]
    inside = ev["step"][rows] >= 0
    w = ev["dur_ns"][rows][inside].astype(float)
    assert job["achieved_occupancy"] == pytest.approx(
        float((w * lt["est_occupancy_pct"][inside]).sum() / w.sum()) / 100, abs=0.01)
