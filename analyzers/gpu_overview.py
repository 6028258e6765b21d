"""GPU overview of a profiled run, per step and for the job, with the TensorBoard profiler plugin's
definitions (pytorch/kineto tb_plugin: event_parser.py, overall_parser.py,
gpu_metrics_parser.py, tensor_cores_parser.py); docs/gpu-overview.md states them in full.

- Step breakdown: each step's time split, in this order of precedence (a moment counts once, in
  the first role active then), into kernel, memcpy, memset, communication (NCCL/RCCL kernels;
  nccl:*/gloo:* host ops), runtime (cuda_runtime/cuda_driver calls), data loading
  (``enumerate(DataLoader)#...__next__`` / ``enumerate(DataPipe)#`` spans), CPU exec (other CPU
  ops and user annotations) and other (the rest of the step). A step is the ProfilerStep span
  extended to the device: from the end of the previous step (or its own start, if later) to the
  later of its own end and the end of the last GPU op it launched.
- ``gpu_utilization``: time with any kernel running ÷ step time.
- ``sm_efficiency`` (estimated): per kernel, blocks per SM (Kineto's "blocks per SM", else grid
  blocks ÷ the device's SMs); concurrent kernels' values add, capped at 1; time-weighted over the
  step time (so it is at most gpu_utilization).
- ``achieved_occupancy`` (estimated): Kineto's "est. achieved occupancy %", else computed from
  the kernel's block size, registers per thread and shared memory and the device's limits
  (_occupancy.py); weighted by kernel time.
- ``tensor_core_kernel_share``: kernel time in kernels whose name says they use tensor (matrix)
  cores ÷ kernel time; ``tc_eligible_op_share``: kernel time launched by ops that can use them
  (matmul, convolution, attention, RNN cells) ÷ kernel time launched by any op;
  ``tc_eligible_fp32_share``: the part of that launched by such ops on fp32 inputs (what AMP
  would move to tensor cores).

Each rank's trace is reduced by ``trace_digest``; ``analyze`` writes metrics.gpu_overview
(per rank: its job averages; per step: the mean over ranks; collectives summed over ranks;
job: the mean over ranks). No findings: the numbers feed the report's overview and the advice
of other analyzers.
"""

from __future__ import annotations

import re

import numpy as np

from trainprof.analyzers import _intervals as iv
from trainprof.analyzers import _coll_kernels, _occupancy
from trainprof.analyzers._kernel_ops import launch_op_rows

NAME = "gpu_overview"
MAX_STEPS = 64
MAX_COLLECTIVES = 32
ROLES = ("kernel", "memcpy", "memset", "communication", "runtime", "dataloader", "cpu_exec")
BREAKDOWN = ROLES + ("other",)
_COMM_OPS = ("nccl:", "gloo:")
_COMM_KERNEL = re.compile(r"nccl|rccl", re.IGNORECASE)
# the plugin's allowlist (after NVIDIA PyProf) plus today's names: CUTLASS tensorop, Hopper
# wgmma, flash attention, and AMD's MFMA Tensile kernels (..._MI32x32x8...)
_TC_KERNEL = re.compile(
    r"h884|s884|h1688|s1688|hmma|i8816|16816|dgrad_1x1_stride_2x2|first_layer_wgrad_kernel|"
    r"conv1x1|conv2d_c1_k1|direct_group|xmma_implicit_gemm|xmma_sparse_conv|"
    r"xmma_warp_specialized_implicit_gemm|xmma_gemm|xmma_sparse_gemm|c1688|tensorop|wgmma|gmma|"
    r"flash_fwd|flash_bwd|fmha|_MI\d+x\d+x\d+")
# ops that can run on tensor cores: the plugin's TC_OP_Allowlist's forward names plus today's
# attention and convolution-backward ops (backward GEMMs are aten::mm/addmm/bmm today)
TC_OPS = frozenset({
    "aten::_convolution", "aten::_convolution_nogroup", "aten::conv1d", "aten::conv2d",
    "aten::conv3d", "aten::conv_tbc", "aten::conv_transpose1d", "aten::conv_transpose2d",
    "aten::conv_transpose3d", "aten::convolution", "aten::cudnn_convolution",
    "aten::cudnn_convolution_transpose", "aten::convolution_backward", "aten::prelu",
    "aten::addmm", "aten::addmv", "aten::addr", "aten::matmul", "aten::mm", "aten::mv",
    "aten::linear", "aten::addbmm", "aten::baddbmm", "aten::bmm", "aten::chain_matmul",
    "aten::linalg_multi_dot", "aten::_thnn_fused_lstm_cell", "aten::_thnn_fused_gru_cell",
    "aten::lstm_cell", "aten::gru_cell", "aten::rnn_tanh_cell", "aten::rnn_relu_cell",
    "aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention", "aten::_flash_attention_forward",
    "aten::_flash_attention_backward", "aten::_efficient_attention_forward",
    "aten::_efficient_attention_backward", "aten::_scaled_mm", "aten::cudnn_convolution_backward",
    "aten::cudnn_convolution_backward_input", "aten::cudnn_convolution_backward_weight",
    "aten::miopen_convolution"})
_FP32 = ("float", "c10::Float")


def _ms(ns) -> float:
    return round(float(ns) / 1e6, 4)


# --------------------------------------------------------------------------- steps and roles
def device_steps(ev, steps) -> list[tuple[int, int, int]]:
    """(step, start_ns, end_ns) of each step extended to the device (the plugin's
    _update_steps_duration): start at the previous step's end when it is later, end at the last
    GPU op the step launched when that is later than the host end."""
    gpu = ev["is_gpu"] & ev["cat"].isin(("kernel", "gpu_memcpy", "gpu_memset"))
    st, end = ev["step"][gpu], ev["end_ns"][gpu]
    out, prev = [], None
    for n, s, e in zip(steps["step"].tolist(), steps["start_ns"].tolist(), steps["end_ns"].tolist()):
        m = st == n
        if m.any():
            e = max(e, int(end[m].max()))
        s = s if prev is None else max(prev, s)
        e = max(e, s)
        out.append((n, s, e))
        prev = e
    return out


def role_sets(ev) -> dict[str, iv.Set]:
    """Each role's time over the whole trace (before precedence)."""
    cat, name = ev["cat"], ev["name"]
    kernel = cat.eq("kernel")
    comm_k = kernel & name.mask(lambda n: _COMM_KERNEL.search(n) is not None)
    host_op = cat.isin(("cpu_op", "user_annotation"))
    data = host_op & name.mask(lambda n: (n.startswith("enumerate(DataLoader)#")
                                          and n.endswith(".__next__"))
                               or n.startswith("enumerate(DataPipe)#"))
    comm_op = host_op & name.mask(lambda n: n.startswith(_COMM_OPS))
    step = name.startswith("ProfilerStep#")
    masks = {"kernel": kernel & ~comm_k, "memcpy": cat.eq("gpu_memcpy"),
             "memset": cat.eq("gpu_memset"), "communication": comm_k | comm_op,
             "runtime": cat.isin(("cuda_runtime", "cuda_driver")), "dataloader": data,
             "cpu_exec": host_op & ~data & ~comm_op & ~step}
    return {k: iv.of(ev, m) for k, m in masks.items()}


def breakdown(roles: dict[str, iv.Set], lo: int, hi: int) -> dict[str, int]:
    """ns per role within [lo, hi), each moment in the first role active (ROLES order), the
    rest "other"."""
    free: iv.Set = (np.array([lo], np.int64), np.array([hi], np.int64))
    out = {}
    for role in ROLES:
        got = iv.intersect(free, iv.clip(roles[role], lo, hi))
        out[role] = iv.length(got)
        free = iv.subtract(free, got)
    out["other"] = iv.length(free)
    return out


# --------------------------------------------------------------------------- SM efficiency
def sm_efficiency_time(starts, ends, values, lo: int, hi: int) -> float:
    """∫ min(Σ value of the kernels running, 1) dt over [lo, hi) (the plugin's
    merge_ranges_with_value), in ns."""
    s, e = np.maximum(starts, lo), np.minimum(ends, hi)
    keep = (e > s) & (values > 0)
    s, e, v = s[keep], e[keep], values[keep]
    if not len(s):
        return 0.0
    pts = np.concatenate([s, e])
    dv = np.concatenate([v, -v])
    order = np.lexsort((-dv, pts))  # starts before ends at one time: adds, then removes
    pts, level = pts[order], np.cumsum(dv[order])
    seg = np.diff(pts).astype(np.float64)
    return float((seg * np.clip(level[:-1], 0.0, 1.0)).sum())


def _kernel_launch(trace, ev, kernel_rows, props: dict):
    """Per kernel row: blocks per SM and est. occupancy (0..1), NaN where unknown."""
    n = len(kernel_rows)
    bps, occ = np.full(n, np.nan), np.full(n, np.nan)
    lt = trace.tables.launch
    if not len(lt) or not n:
        return bps, occ
    pos = np.searchsorted(lt["row"], kernel_rows)
    pos = np.minimum(pos, len(lt) - 1)
    ok = lt["row"][pos] == kernel_rows
    at = pos[ok]
    bps[ok] = lt["blocks_per_sm"][at]
    occ[ok] = lt["est_occupancy_pct"][at] / 100.0
    sms = props.get("numSms")
    if isinstance(sms, (int, float)) and sms > 0:
        miss = ok.copy()
        miss[ok] = np.isnan(bps[ok])
        bps[miss] = lt["grid_blocks"][pos[miss]] / float(sms)
    miss = ok.copy()
    miss[ok] = np.isnan(occ[ok])
    if miss.any():
        occ[miss] = _occupancy.estimate(props, lt["grid_blocks"][pos[miss]],
                                        lt["block_threads"][pos[miss]],
                                        lt["regs_per_thread"][pos[miss]], lt["shared_mem"][pos[miss]])
    return bps, occ


def _device_props(trace) -> dict:
    props = trace.meta.get("deviceProperties")
    if isinstance(props, list) and props and isinstance(props[0], dict):
        dist = trace.meta.get("distributedInfo") or {}
        pid = None
        for p in props:  # the device this rank's kernels ran on, where the list names several
            if isinstance(dist, dict) and p.get("id") == dist.get("rank"):
                pid = p
        return pid or props[0]
    return {}


# --------------------------------------------------------------------------- tensor cores
def tensor_core_shares(ev, kernel_rows) -> dict:
    dur = ev["dur_ns"][kernel_rows].astype(np.float64)
    total = float(dur.sum())
    tc = ev["name"].mask(lambda n: _TC_KERNEL.search(n) is not None)[kernel_rows]
    op = launch_op_rows(ev)[kernel_rows]
    has = op >= 0
    launched = float(dur[has].sum())
    names = ev["name"]
    eligible = np.zeros(len(kernel_rows), bool)
    eligible[has] = names.isin(TC_OPS)[op[has]]
    types = ev["input_types"]
    fp32 = np.zeros(len(kernel_rows), bool)
    for i in np.flatnonzero(eligible):
        t = types[op[i]]
        fp32[i] = bool(t) and any(isinstance(x, str) and x in _FP32 for x in t)
    return {"tensor_core_kernel_share": round(float(dur[tc].sum()) / total, 4) if total else None,
            "tc_eligible_op_share": round(float(dur[eligible].sum()) / launched, 4) if launched else None,
            "tc_eligible_fp32_share": round(float(dur[fp32].sum()) / launched, 4) if launched else None,
            "kernel_ms_launched_by_ops": _ms(launched)}


# --------------------------------------------------------------------------- per rank
def _step_row(n, lo, hi, roles, kernels, bps, occ, k_s, k_e) -> dict:
    span = hi - lo
    parts = breakdown(roles, lo, hi)
    busy = iv.length(iv.clip(kernels, lo, hi))
    row = {"step": n, "step_ms": _ms(span), **{f"{k}_ms": _ms(v) for k, v in parts.items()},
           "gpu_utilization": round(busy / span, 4) if span else None}
    known = ~np.isnan(bps)
    row["sm_efficiency"] = (round(sm_efficiency_time(k_s[known], k_e[known], bps[known], lo, hi) / span, 4)
                            if span and known.any() else None)
    known = ~np.isnan(occ)
    s, e = np.maximum(k_s[known], lo), np.minimum(k_e[known], hi)
    w = np.clip(e - s, 0, None).astype(np.float64)
    row["achieved_occupancy"] = round(float((w * occ[known]).sum() / w.sum()), 4) if w.sum() > 0 else None
    return row, parts, busy, w, occ[known]


def trace_digest(run, rank, trace) -> dict:
    """One rank's overview: steps, job means, tensor-core shares (JSON-able, bounded)."""
    ev = trace.tables.events
    kernel_rows = np.flatnonzero(ev["cat"].eq("kernel"))
    props = _device_props(trace)
    device = props.get("name") if isinstance(props.get("name"), str) else None
    if not len(kernel_rows):
        return {"kind": "cpu", "device": device, "dialect": trace.meta.get("dialect") or {},
                "device_hint": device_hint(ev)}
    steps = device_steps(ev, trace.tables.steps)
    roles = role_sets(ev)
    kernels = iv.of(ev, ev["cat"].eq("kernel"))
    bps, occ = _kernel_launch(trace, ev, kernel_rows, props)
    k_s, k_e = ev["ts_ns"][kernel_rows], ev["end_ns"][kernel_rows]
    rows, tot = [], dict.fromkeys(BREAKDOWN, 0)
    span_sum = busy_sum = sm_sum = 0.0
    occ_w = occ_v = 0.0
    for n, lo, hi in steps:
        row, parts, busy, w, o = _step_row(n, lo, hi, roles, kernels, bps, occ, k_s, k_e)
        rows.append(row)
        for k, v in parts.items():
            tot[k] += v
        span_sum += hi - lo
        busy_sum += busy
        if row["sm_efficiency"] is not None:
            sm_sum += row["sm_efficiency"] * (hi - lo)
        occ_w += float(w.sum())
        occ_v += float((w * o).sum())
    n_steps = max(len(steps), 1)
    job = {"steps": len(steps), "step_ms": _ms(span_sum / n_steps),
           **{f"{k}_ms": _ms(v / n_steps) for k, v in tot.items()},
           **{f"{k}_pct": round(100.0 * v / span_sum, 2) if span_sum else None for k, v in tot.items()},
           "gpu_utilization": round(busy_sum / span_sum, 4) if span_sum else None,
           "sm_efficiency": (round(sm_sum / span_sum, 4)
                             if span_sum and any(r["sm_efficiency"] is not None for r in rows) else None),
           "achieved_occupancy": round(occ_v / occ_w, 4) if occ_w else None,
           **tensor_core_shares(ev, kernel_rows)}
    comm = kernel_rows[ev["name"].mask(lambda n: _COMM_KERNEL.search(n) is not None)[kernel_rows]]
    return {"kind": "gpu", "device": device, "dialect": trace.meta.get("dialect") or {},
            "sm_count": props.get("numSms"), "job": job, "per_step": rows[:MAX_STEPS],
            "collectives": _coll_kernels.summary(trace, comm)[:MAX_COLLECTIVES] if len(comm) else []}


_READ_CATS = frozenset({"cpu_op", "user_annotation", "python_function", "cuda_runtime",
                        "cuda_driver", "kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation",
                        "Trace", "cpu_instant_event", "ac2g"})
_DEVICE_LIKE = re.compile(r"^(void |cuda|cu[A-Z]|hip|nccl|rccl|mtia|Memcpy|Memset)|kernel|Kernel|gemm")


def device_hint(ev) -> list[str]:
    """Event categories trainprof does not read whose event names look like device work
    (kernels, runtime calls, copies): a device trace of a dialect it does not know."""
    cat, name = ev["cat"], ev["name"]
    other = ~cat.isin(_READ_CATS)
    if not other.any():
        return []
    like = other & name.mask(lambda n: _DEVICE_LIKE.search(n) is not None)
    return sorted({cat.values[c] or "(none)" for c in np.unique(cat.codes[like]).tolist()})[:5]


# --------------------------------------------------------------------------- job
def _mean(vals):
    vals = [v for v in vals if v is not None]
    return round(sum(vals) / len(vals), 4) if vals else None


def analyze(run):
    from trainprof.findings import AnalyzerResult

    digests = run.trace_digests(NAME)
    if not digests:
        return AnalyzerResult()
    gpu = {r: d for r, d in sorted(digests.items()) if d.get("kind") == "gpu"}
    if not gpu:
        hints = {r: d["device_hint"] for r, d in digests.items() if d.get("device_hint")}
        if hints:  # never a clean bill of health for a device trace read as a CPU one
            cats = sorted({c for h in hints.values() for c in h})
            run.problems.append(
                f"profiler trace(s) of rank(s) {', '.join(map(str, sorted(hints)))}: no device "
                f"events trainprof can read, yet events of categor{'y' if len(cats) == 1 else 'ies'} "
                f"{', '.join(repr(c) for c in cats)} look like device work (kernels, runtime "
                f"calls, copies): a trace format trainprof does not know; it was analyzed as a "
                f"CPU trace, so nothing about the device was checked")
            return AnalyzerResult(metrics={
                "job": {"trace_kind": "cpu", "ranks": len(digests), "unread_device_categories": cats},
                "withheld": "no device events read"})
        return AnalyzerResult()  # a CPU run: nothing to overview
    keys = sorted({k for d in gpu.values() for k in d["job"]} - {"steps"})
    job = {"trace_kind": "gpu", "ranks": len(gpu), "cpu_only_ranks": len(digests) - len(gpu),
           "devices": sorted({d["device"] for d in gpu.values() if d.get("device")}),
           **{k: _mean([d["job"].get(k) for d in gpu.values()]) for k in keys}}
    dialects = {k: v for d in gpu.values() for k, v in (d.get("dialect") or {}).items()}
    if dialects:
        job["dialect"] = dialects
    per_rank = [{"rank": r, "device": d.get("device"), **d["job"]} for r, d in gpu.items()]
    return AnalyzerResult(metrics={"job": job, "per_rank": per_rank,
                                   "per_step": _steps_over_ranks(gpu), "collectives": _collectives(gpu),
                                   "definitions": "docs/gpu-overview.md"})


def _steps_over_ranks(gpu: dict) -> list[dict]:
    """One row per step number: each number the mean over the ranks that have the step (bounded
    by MAX_STEPS whatever the number of ranks)."""
    by: dict = {}
    for d in gpu.values():
        for s in d["per_step"]:
            by.setdefault(s["step"], []).append(s)
    out = []
    for step in sorted(by)[:MAX_STEPS]:
        rows = by[step]
        keys = [k for k in rows[0] if k != "step"]
        out.append({"step": step, "ranks": len(rows), **{k: _mean([r.get(k) for r in rows]) for k in keys}})
    return out


def _collectives(gpu: dict) -> list[dict]:
    """The ranks' collective groups summed: (collective, bytes, process group) -> kernels, kernel
    ms, ranks (largest kernel time first, MAX_COLLECTIVES rows)."""
    agg: dict = {}
    for d in gpu.values():
        for c in d.get("collectives") or []:
            k = (c["collective"], c["bytes"], c["pg_name"])
            g = agg.setdefault(k, {"collective": k[0], "bytes": k[1], "pg_name": k[2], "ranks": 0,
                                   "count": 0, "kernel_ms": 0.0, "seqs": c.get("seqs") or []})
            g["ranks"] += 1
            g["count"] += c["count"]
            g["kernel_ms"] = round(g["kernel_ms"] + c["kernel_ms"], 4)
    return sorted(agg.values(), key=lambda g: -g["kernel_ms"])[:MAX_COLLECTIVES]
