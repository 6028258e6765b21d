"""Roofline position per op class and MFU/HFU per step.

Per op class (from the profiled steps' recorded shapes, analyzers/_opcost.py): FLOPs, bytes,
time (GPU kernel time of the op's kernels on GPU traces, the op's host time on CPU traces),
arithmetic intensity AI = FLOPs / bytes, achieved FLOP/s and bytes/s, the bound at that AI —
memory when AI < ridge = peak FLOP/s ÷ peak bytes/s, else compute — and the share of that
bound reached: achieved FLOP/s ÷ min(peak FLOP/s, AI × peak bytes/s).

MFU (model FLOPs utilization), PaLM's formula, from run_info (set by the job):
    model FLOPs per token = 6·N + 12·L·H·Q·T
    N = n_params_non_embedding, L = layers, H = heads, Q = hidden/heads, T = seq_len;
    no causal halving of the attention term (as PaLM and most published MFU numbers; the
    halved variant 6·N + 6·L·H·Q·T is reported as ``mfu_causal``);
    MFU = model FLOPs per token × tokens_per_step ÷ (step time × Σ peak FLOP/s of the devices).
Step time is step_time's job median (slowest rank per step, warm-up and profiler steps
excluded). HFU (hardware FLOPs utilization) adds the recomputed forward under activation
checkpointing (run_info activation_checkpointing: full recompute = one more forward,
2·N + 4·L·H·Q·T per token); without checkpointing HFU = MFU.
Peaks: trainprof/devices.py (datasheet by device name, dense, in the job's compute dtype;
calibration for CPUs and unknown devices). CPU ranks sharing a host share its cores: the host's
peak is the calibrated per-thread matmul rate × min(threads of all its ranks, cores), its
bandwidth the calibrated copy rate; each rank gets an equal share.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from trainprof import devices as _devices
from trainprof.analyzers import _trace_device, step_time
from trainprof.analyzers._stats import median
from trainprof.analyzers._kernel_ops import kernel_external_ids
from trainprof.analyzers._opcost import select_ops
from trainprof.findings import AnalyzerResult, Finding

NAME = "roofline"
MEMORY_SHARE_WARN = 0.30     # memory-bound ops hold ≥ 30 % of op time ...
BANDWIDTH_LOW = 0.20         # ... while reaching < 20 % of peak bandwidth
DTYPE_MIN_AI = 8.0           # ops that say the matmul dtype: FLOP/byte ≥ this (GEMM, conv, attention)
COMPUTE_LOW = 0.30           # compute-bound ops below 30 % of peak FLOP/s


# --------------------------------------------------------------------------- peaks
def _calibration_by_host(run) -> dict:
    out = {}
    for r in run.ranks:
        c = run.rank_meta(r).get("calibration")
        if c:
            out.setdefault(c.get("host") or run.rank_meta(r).get("host"), c)
    return out


def device_peaks(run, dtype: str) -> dict[int, dict]:
    """rank -> {flops_per_s, bytes_per_s, basis, ...}: the peak available to that rank."""
    calib = _calibration_by_host(run)
    any_calib = next(iter(calib.values()), None)
    by_host = defaultdict(list)
    for r in run.ranks:
        by_host[run.rank_meta(r).get("host")].append(r)
    out = {}
    for host, ranks in by_host.items():
        c = calib.get(host) or any_calib
        for r in ranks:
            meta = run.rank_meta(r)
            is_cpu = str(meta.get("device") or "cpu") == "cpu"
            p = _devices.peak(None if is_cpu else meta.get("device_name"), dtype,
                              None if (c and is_cpu != (c.get("device") == "cpu")) else c)
            if p is None:
                continue
            if is_cpu:  # the host's cores are shared by its ranks
                threads = int(p.get("threads") or 1)
                cores = int((c or {}).get("cpu_count") or meta.get("cpu_count") or threads)
                host_flops = p["flops_per_s"] / threads * min(threads * len(ranks), cores)
                p = dict(p, flops_per_s=host_flops / len(ranks), bytes_per_s=p["bytes_per_s"] / len(ranks),
                         basis=p["basis"] + f"; host shared by {len(ranks)} rank(s) on {cores} core(s)")
            out[r] = p
    return out


def trace_peaks(digests: dict, known: dict, declared: str | None) -> dict[int, dict]:
    """rank -> peak for ranks whose trace names its device (deviceProperties) and that have no
    peak from the run's own metadata: the datasheet peak of the dtype the job declared, else of
    the dtype most of its matmul-class op time ran in (bare traces)."""
    out = {}
    for r, d in digests.items():
        facts = d.get("facts") or {}
        name = facts.get("device")
        if r in known or not name:
            continue
        by = facts.get("dtype_time_ns") or {}
        dtype = declared or (max(by, key=by.get) if by else "fp32")
        dtype = {"fp64": "fp32", "fp8": "bf16"}.get(dtype, dtype)
        p = _devices.peak(name, dtype)
        if p:
            src = "the job's dtype" if declared else (
                f"{dtype}: most matmul-class op time has {dtype} inputs" if by
                else "fp32: no matmul dtype recorded")
            out[r] = dict(p, basis=p["basis"] + f" (device named in the trace; {src})")
    return out


# --------------------------------------------------------------------------- MFU
def model_flops_per_token(info: dict) -> dict | None:
    n = info.get("n_params_non_embedding") or info.get("n_params")
    L, H, T, hidden = (info.get(k) for k in ("layers", "heads", "seq_len", "hidden"))
    if not n:
        return None
    attn = 12 * L * H * (hidden // H) * T if L and H and T and hidden else 0
    return {"dense": 6 * n, "attention": attn, "total": 6 * n + attn,
            "total_causal": 6 * n + attn / 2, "recompute": 2 * n + attn / 3,
            "n_params_non_embedding": n, "layers": L, "heads": H, "head_dim": (hidden // H) if H and hidden else None,
            "seq_len": T}


def mfu_metrics(run, peaks: dict[int, dict]) -> dict:
    info = (run.rank_meta(run.ranks[0]).get("run_info") or {}) if run.ranks else {}
    per_tok = model_flops_per_token(info)
    tokens = info.get("tokens_per_step")
    st = step_time.analyze(run).metrics
    med = (st.get("job") or {}).get("median_ms")
    total_peak = sum(p["flops_per_s"] for p in peaks.values())
    out = {"formula": "MFU = (6·N + 12·L·H·Q·T) · tokens_per_step / (step_time · Σ peak FLOP/s); "
                      "N = non-embedding parameters, no causal halving",
           "tokens_per_step": tokens, "step_ms": med, "devices": len(peaks),
           "peak_flops_per_s_total": total_peak or None}
    withheld = _withheld(run, peaks, st)
    if withheld:
        out["withheld"] = withheld
    if not per_tok or not tokens or not med or not total_peak or withheld:
        out["missing"] = [k for k, v in (("run_info n_params/layers/heads/seq_len", per_tok),
                                         ("run_info tokens_per_step", tokens), ("step times", med),
                                         ("device peak", total_peak),
                                         ("every rank of the job", not withheld)) if not v]
        return out
    flops_step = per_tok["total"] * tokens
    ckpt = bool(info.get("activation_checkpointing"))
    hw_step = (per_tok["total"] + (per_tok["recompute"] if ckpt else 0)) * tokens
    out.update({
        "model_flops_per_token": per_tok, "model_flops_per_step": flops_step,
        "mfu": flops_step / (med / 1e3 * total_peak),
        "mfu_causal": per_tok["total_causal"] * tokens / (med / 1e3 * total_peak),
        "hfu": hw_step / (med / 1e3 * total_peak), "activation_checkpointing": ckpt,
        "per_step": [{"step": s["step"], "ms": s["max_ms"],
                      "mfu": flops_step / (s["max_ms"] / 1e3 * total_peak)}
                     for s in st.get("per_step", []) if s.get("max_ms")],
    })
    return out


def _withheld(run, peaks: dict, st: dict) -> str | None:
    """Why MFU cannot be given for the job (None when it can): MFU divides the job's FLOPs by
    the peaks of all its devices, so a rank without files (or without a known peak) would
    inflate it; the figure is withheld rather than computed from part of the job."""
    partial = (st.get("job") or {}).get("partial")
    if partial:
        n = partial.get("ranks_reporting", partial.get("ranks_present"))
        return (f"only {n} of {partial.get('world_size')} ranks have step records "
                f"(missing: {', '.join(map(str, partial.get('missing_ranks', [])[:8])) or '?'})")
    world = run.world_size
    if peaks and len(peaks) < world:
        return f"device peak known for {len(peaks)} of {world} ranks"
    return None


# --------------------------------------------------------------------------- per op
def _device_time(ev, kept_rows) -> dict:
    """kept host-op row -> ns of GPU work launched inside it (through External id): a GPU op
    belongs to the kept op that encloses, on its thread, the CPU op that launched it."""
    if not len(kept_rows):
        return {}
    kx = kernel_external_ids(ev)  # the launching CPU op's External id, in any trace format
    gm = kx >= 0
    if not gm.any():
        return {}
    ext, owner = _owner_of_ext(ev, np.asarray(kept_rows, np.int64))
    if not len(ext):
        return {}
    want = kx[gm]
    j = np.minimum(np.searchsorted(ext, want), len(ext) - 1)
    hit = ext[j] == want
    rows, dur = owner[j[hit]], ev["dur_ns"][gm][hit]
    out: dict = defaultdict(int)
    for row, d in zip(rows.tolist(), dur.tolist()):
        out[row] += d
    return out


def _owner_of_ext(ev, kept: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(External ids, sorted; the kept row enclosing the cpu_op of each): per thread, the kept
    op that last started at or before the cpu_op and has not ended when it starts. An id met
    more than once keeps its last cpu_op (threads in ascending tid order, then row order)."""
    tid, ts, end, ext = ev["tid"], ev["ts_ns"], ev["end_ns"], ev["external_id"]
    host = np.flatnonzero(ev["cat"].eq("cpu_op"))
    exts, owners = [], []
    for t in np.unique(tid[kept], return_counts=True)[0].tolist():
        k = kept[tid[kept] == t]
        k = k[np.argsort(ts[k], kind="quicksort")]  # by start; among equal starts, quicksort's order
        h = host[tid[host] == t]
        i = np.searchsorted(ts[k], ts[h], side="right") - 1
        ok = i >= 0
        ok[ok] &= ts[h[ok]] < end[k[i[ok]]]
        ok &= ext[h] >= 0
        exts.append(ext[h[ok]])
        owners.append(k[i[ok]])
    ext_all, own_all = np.concatenate(exts), np.concatenate(owners)
    # last occurrence of each id: unique over the reversed arrays finds first occurrences
    uniq, first = np.unique(ext_all[::-1], return_index=True)
    return uniq, own_all[::-1][first]


def op_classes(trace) -> tuple[dict, dict]:
    """Per class totals over the trace's profiled steps: {class: {count, flops, bytes, time_ns}},
    and facts about the trace (steps, timing basis, notes)."""
    ev = trace.tables.events
    ops = select_ops(ev)
    gpu = bool(ev["is_gpu"].any()) if len(ev) else False
    rows = np.fromiter((r for r, _ in ops), np.int64, len(ops))
    dev_t = _device_time(ev, rows) if gpu else {}
    agg: dict = defaultdict(lambda: {"count": 0, "flops": 0.0, "bytes": 0.0, "time_ns": 0})
    notes = set()
    steps = ev["step"][rows] if "step" in ev else np.zeros(len(ops), dtype=int)
    durs = ev["dur_ns"][rows]
    types = ev["input_types"] if "input_types" in ev else None
    dtype_ns: dict = defaultdict(int)  # op time of the FLOP-heavy ops per input dtype
    for (row, c), st, dur in zip(ops, steps.tolist(), durs.tolist()):
        if st < 0:
            continue
        a = agg[c.op_class]
        a["count"] += 1
        a["flops"] += c.flops
        a["bytes"] += c.bytes
        t = dev_t.get(row, 0) if gpu else dur
        a["time_ns"] += t
        if c.flops and c.bytes and c.flops / c.bytes >= DTYPE_MIN_AI and types is not None:
            d = _trace_device.op_dtype(types[row])
            if d:
                dtype_ns[d] += t
        if c.note:
            notes.add(f"{c.op_class}: {c.note}")
    windows = trace.tables.steps
    n_steps = len(windows) if windows is not None else 0
    span = int((windows["end_ns"] - windows["start_ns"]).sum()) if n_steps else 0
    return dict(agg), {"steps": n_steps, "step_span_ns": span, "timing": "gpu kernels" if gpu else "host ops",
                       "notes": sorted(notes), "device": _trace_device.device_name(trace) if gpu else None,
                       "dtype_time_ns": dict(dtype_ns)}


def trace_digest(run, rank, trace) -> dict:
    """One rank's op classes over its profiled steps (op_classes: totals per class, facts)."""
    cls, facts = op_classes(trace)
    return {"classes": cls, "facts": facts}


def position(flops, by, time_ns, peak) -> dict:
    t = time_ns / 1e9
    ai = flops / by if by else None
    row = {"flops": flops, "bytes": by, "time_ms": time_ns / 1e6, "ai": ai,
           "achieved_flops_per_s": flops / t if t else None, "achieved_bytes_per_s": by / t if t else None}
    if peak and ai is not None and t:
        ridge = peak["flops_per_s"] / peak["bytes_per_s"]
        attainable = min(peak["flops_per_s"], ai * peak["bytes_per_s"])
        row.update(bound="compute" if ai >= ridge else "memory",
                   attainable_flops_per_s=attainable,
                   pct_of_bound=(flops / t) / attainable if attainable else (by / t) / peak["bytes_per_s"],
                   pct_of_peak_bandwidth=(by / t) / peak["bytes_per_s"],
                   pct_of_peak_flops=(flops / t) / peak["flops_per_s"])
    return row


def analyze(run) -> AnalyzerResult:
    if not run.ranks:
        return AnalyzerResult()
    info = run.rank_meta(run.ranks[0]).get("run_info") or {}
    dtype = _devices.compute_dtype(info)
    peaks = device_peaks(run, dtype)
    digests = run.trace_digests(NAME) if run.profiler_traces() else {}
    declared = bool(info.get("dtype") or info.get("param_dtype"))
    peaks.update(trace_peaks(digests, peaks, dtype if declared else None))
    if not declared and peaks:  # bare traces: the dtype their peaks are of
        dtype = next(iter(peaks.values())).get("dtype", dtype)
    mfu = mfu_metrics(run, peaks)
    job_cls: dict = defaultdict(lambda: {"count": 0, "flops": 0.0, "bytes": 0.0, "time_ns": 0})
    per_rank, notes, timing, steps_seen, span_total = [], set(), set(), 0, 0
    trace_flops = []
    for rank, d in sorted(digests.items()):
        cls, facts = d["classes"], d["facts"]
        if not cls:
            continue
        notes.update(facts["notes"])
        timing.add(facts["timing"])
        steps_seen = max(steps_seen, facts["steps"])
        span_total += facts["step_span_ns"]
        for k, a in cls.items():
            for f in ("count", "flops", "bytes", "time_ns"):
                job_cls[k][f] += a[f]
        tot = sum(a["flops"] for a in cls.values())
        if facts["steps"]:
            trace_flops.append(tot / facts["steps"])
        per_rank.append({"rank": rank, "steps": facts["steps"], "flops_per_step": tot / max(facts["steps"], 1),
                         "op_time_ms": sum(a["time_ns"] for a in cls.values()) / 1e6,
                         "step_span_ms": facts["step_span_ns"] / 1e6, "timing": facts["timing"]})
    peak_vals = list(peaks.values())
    ref_peak = None
    if peak_vals:
        ref_peak = {"flops_per_s": float(median([p["flops_per_s"] for p in peak_vals])),
                    "bytes_per_s": float(median([p["bytes_per_s"] for p in peak_vals])),
                    "basis": peak_vals[0]["basis"], "dtype": peak_vals[0].get("dtype")}
    total_time = sum(a["time_ns"] for a in job_cls.values())
    classes = []
    for k, a in sorted(job_cls.items(), key=lambda kv: -kv[1]["time_ns"]):
        row = {"op_class": k, "count": a["count"], **position(a["flops"], a["bytes"], a["time_ns"], ref_peak),
               "time_share": a["time_ns"] / total_time if total_time else None}
        classes.append(row)
        if (row.get("pct_of_bound") or 0) > 1.0:
            # above the roof: the peak is a measurement (calibration) or a datasheet figure,
            # and small operands run from the caches, faster than the memory the benchmark
            # streams past them
            notes.add(f"{k}: {row['pct_of_bound']:.0%} of its {row['bound']} bound, above the "
                      "roof: "
                      + ("its operands fit in the caches, faster than the memory bandwidth "
                         "measured past them" if row["bound"] == "memory" else
                         "the peak used is lower than what this device reaches"))
    if trace_flops and mfu.get("model_flops_per_step"):
        # what the trace counted (all ranks, per step) against the model formula
        mfu["trace_flops_per_step"] = float(sum(trace_flops))
        mfu["trace_over_model"] = mfu["trace_flops_per_step"] / mfu["model_flops_per_step"]
    if not classes and "mfu" not in mfu and "withheld" not in mfu:
        return AnalyzerResult()
    plot = None
    if ref_peak:
        plot = {"peak_flops_per_s": ref_peak["flops_per_s"], "peak_bytes_per_s": ref_peak["bytes_per_s"],
                "ridge_ai": ref_peak["flops_per_s"] / ref_peak["bytes_per_s"],
                "points": [{"label": c["op_class"], "ai": c["ai"], "flops_per_s": c["achieved_flops_per_s"],
                            "time_ms": c["time_ms"]} for c in classes if c["ai"] and c["achieved_flops_per_s"]]}
    metrics = {"job": mfu, "classes": classes, "per_rank": per_rank, "plot": plot,
               "peak": ref_peak, "peaks_by_rank": {str(r): p for r, p in peaks.items()},
               "compute_dtype": dtype, "timing": sorted(timing), "notes": sorted(notes),
               "op_time_over_step_time": total_time / span_total if span_total else None}
    return AnalyzerResult(metrics=metrics, findings=_findings(classes, timing, ref_peak, run, dtype))


MEMORY_FIX = ("fuse elementwise ops (torch.compile), use fused norms and, when training, fused "
              "optimizers (foreach/fused AdamW), or larger tensors per kernel")
LOW_PRECISION = ("bf16", "fp16")


def _compute_fix(dtype) -> tuple[str, str]:
    """(what the message says to check, the finding's fix) for compute-bound ops well under
    their peak: a matmul already in bf16/fp16 is not helped by autocast."""
    if dtype in LOW_PRECISION:
        return (f"they already run in {dtype}: check shapes that are multiples of 64, and the "
                f"batch per kernel",
                f"the ops already run in {dtype}: make their shapes multiples of 64 (hidden, "
                f"heads, vocabulary), give each kernel more work (a larger micro-batch, fused "
                f"QKV projections), or compile (torch.compile mode='max-autotune')")
    return ("check the dtype (bf16/tf32 tensor cores), shapes that are multiples of 64, and "
            "batch size",
            "run the matmuls in bf16/fp16 (torch.autocast) or allow TF32 "
            "(torch.backends.cuda.matmul.allow_tf32 = True); shapes that are multiples of 64")


def _findings(classes, timing, peak, run, dtype=None) -> list[Finding]:
    # Only where op times are device times: CPU op times of small ops are dominated by
    # dispatch overhead, and "x % of bandwidth" would say more about Python than hardware.
    if "gpu kernels" not in timing or not peak:
        return []
    out = []
    ranks = list(run.ranks)
    mem = [c for c in classes if c.get("bound") == "memory"]
    share = sum(c["time_share"] or 0 for c in mem)
    t = sum(c["time_ms"] for c in mem) / 1e3
    bw = (sum(c["bytes"] for c in mem) / t / peak["bytes_per_s"]) if t else None
    if mem and share >= MEMORY_SHARE_WARN and bw is not None and bw < BANDWIDTH_LOW:
        out.append(Finding(
            kind="roofline", severity="warning", ranks=ranks,
            message=(f"{share:.0%} of GPU op time is in memory-bound ops ("
                     + ", ".join(c["op_class"] for c in mem[:4])
                     + f") reaching {bw:.0%} of peak bandwidth ({peak['basis']}): {MEMORY_FIX}"),
            evidence={"memory_bound_time_share": share, "bandwidth_fraction": bw,
                      "classes": [c["op_class"] for c in mem], "peak": peak},
            fix=MEMORY_FIX))
    comp = [c for c in classes if c.get("bound") == "compute" and (c["time_share"] or 0) >= 0.2
            and c.get("pct_of_bound") is not None and c["pct_of_bound"] < COMPUTE_LOW]
    check, fix = _compute_fix(dtype)
    for c in comp:
        out.append(Finding(
            kind="roofline", severity="info", ranks=ranks,
            message=(f"{c['op_class']} ops take {c['time_share']:.0%} of GPU op time at "
                     f"{c['pct_of_bound']:.0%} of peak FLOP/s ({peak['basis']}): {check}"),
            evidence={"class": c, "peak": peak, "compute_dtype": dtype}, fix=fix))
    return out
