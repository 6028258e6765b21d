"""Memory: per-rank timeline and peaks, and the measured model-state breakdown set beside what
the model and the parallel layout predict.

Expected bytes per parameter (weights + gradients + Adam state): 4 + 4 + 8 = 16 for fp32
training (autocast keeps fp32 weights), 2 + 2 + 12 = 16 for mixed precision with bf16/fp16
weights (fp32 master copy and two fp32 moments in the optimizer). Parameters per rank: the
rank's pipeline stage(s), tensor-parallel weights divided by tp, everything divided by the
FSDP degree (replicate mode keeps a full copy per DP replica). The job declares the stage
layout with ``trainprof.set_run_info(stage_params=[{stage, params, tp_sharded_params}], ...)``;
without it the parameters are assumed evenly split over pp·tp(·dp).

Also: the peak inside the profiled window from the trace's [memory] events, and for allocator
snapshots (a rank's *.pickle, or bare snapshot files) the allocated/reserved timeline replayed
from the trace. Fragmentation and OOM explanations are analyzers/fragmentation.py's. docs/memory.md.
"""

from __future__ import annotations

import numpy as np

from trainprof.analyzers._stats import median
from trainprof.findings import AnalyzerResult, Finding

NAME = "memory"
MARGIN = 0.10  # measured vs expected model-state bytes: a finding beyond ±10 %
BYTES = {  # (weights, grads, optimizer state) per parameter
    "fp32": (4, 4, 8),
    "mixed": (2, 2, 12),
}


def expected_state(info: dict, coords: dict, my_stages: list[int] | None = None) -> dict | None:
    """Expected local weights / grads / optimizer bytes of one rank (None without run_info)."""
    n = info.get("n_params")
    if not n:
        return None
    dp, pp, tp = (int(info.get(k) or 1) for k in ("dp", "pp", "tp"))
    shard_dp = dp if (info.get("dp_mode") or "fsdp") == "fsdp" else 1
    stages = info.get("stage_params")
    mine = my_stages if my_stages is not None else info.get("my_stages")
    if stages and mine is not None:
        by_stage = {int(s["stage"]): s for s in stages}
        params = 0.0
        for s in mine:
            st = by_stage.get(int(s), {})
            sharded = st.get("tp_sharded_params", 0)
            params += (st.get("params", 0) - sharded) + sharded / tp
        basis = "declared stage layout"
    else:
        params = n / (pp * tp)
        basis = "even split over pp·tp (no stage layout declared)"
    params /= shard_dp
    kind = "mixed" if str(info.get("param_dtype", "fp32")) in ("bf16", "fp16") else "fp32"
    w, g, o = BYTES[kind]
    return {"params": round(params), "params_bytes": round(params * w), "grads_bytes": round(params * g),
            "optimizer_state_bytes": round(params * o), "bytes_per_param": w + g + o,
            "precision": kind, "sharding": {"dp": shard_dp, "tp": tp, "pp": pp}, "basis": basis}


def _timeline(recs: list[dict]) -> dict:
    steps = [r for r in recs if "step" in r and r.get("event") is None]
    keys = ("allocated_bytes", "reserved_bytes", "rss_bytes")
    out = {"step": [r["step"] for r in steps]}
    for k in keys:
        vals = [r.get(k) for r in steps]
        if any(v is not None for v in vals):
            out[k] = vals
    return out


MAX_POINTS = 400  # timeline points kept per series (the report plots them)


def _downsample(xs: list, ys: list) -> tuple[list, list]:
    """Keep at most MAX_POINTS, always including the maximum (peaks must survive)."""
    if len(xs) <= MAX_POINTS:
        return xs, ys
    idx = _kept(len(xs), int(np.argmax(ys)))
    return [xs[i] for i in idx], [ys[i] for i in idx]


def _kept(n: int, peak: int) -> list[int]:
    """Sorted indices of MAX_POINTS of n points spread evenly, plus ``peak``."""
    step = n / MAX_POINTS
    return sorted({int(i * step) for i in range(MAX_POINTS)} | {peak})


def profiled_window(trace, device: str | None) -> dict | None:
    """The profiler's [memory] events over the profiled steps: allocator totals after every
    allocation. On CUDA the counters are the device allocator's (absolute); on CPU the
    profiler counts from its own start, so the peak is what the profiled steps allocated on
    top of what already existed (activations, temporaries, re-allocated gradients)."""
    tables = getattr(trace, "tables", None)
    m = tables.memory if tables is not None else None
    if m is None or m.empty:
        return None
    cuda = str(device or "").startswith("cuda")
    m = m[m["device_type"] == (1 if cuda else 0)]
    if m.empty:
        return None
    # by time; events of one timestamp in quicksort's order (not necessarily recorded order)
    order = np.argsort(m["ts_ns"], kind="quicksort")
    ts, alloc = m["ts_ns"][order], m["total_allocated"][order]
    keep = np.asarray(_kept(len(ts), int(np.argmax(alloc)))) if len(ts) > MAX_POINTS else slice(None)
    xs = ((ts[keep] - ts[0]) / 1e6).tolist()
    ys = alloc[keep].tolist()
    return {"device": "cuda" if cuda else "cpu", "absolute": cuda,
            "peak_allocated_bytes": int(alloc.max()),
            "peak_reserved_bytes": int(m["total_reserved"].max()) if cuda else None,
            "t_ms": xs, "allocated_bytes": ys}


def trace_digest(run, rank, trace) -> dict:
    """The profiled window of one rank's trace, read for the rank's device (meta.json)."""
    device = run.rank_meta(rank).get("device")
    return {"device": device, "window": profiled_window(trace, device)}


def snapshot_timeline(snap) -> dict:
    """Allocated / reserved bytes over a snapshot's trace, replayed backwards from the state at
    the dump (the trace ring buffer may have dropped older entries; the end state is exact)."""
    alloc = sum(b.size for s in snap.segments for b in s.blocks if b.active)
    reserved = sum(s.total_size for s in snap.segments)
    entries = sorted((e for es in snap.traces.values() for e in es if e.time_us is not None),
                     key=lambda e: e.time_us)
    d_alloc = {"alloc": 1, "free_completed": -1}
    d_res = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}
    pts = []
    a, r = alloc, reserved
    for e in reversed(entries):
        pts.append((e.time_us, a, r))
        a -= d_alloc.get(e.action, 0) * e.size
        r -= d_res.get(e.action, 0) * e.size
    pts.reverse()
    if not pts:
        return {"allocated_bytes_now": alloc, "reserved_bytes_now": reserved}
    t0 = pts[0][0]
    xs, ys = _downsample([(t - t0) / 1e3 for t, _, _ in pts], [x for _, x, _ in pts])
    return {"allocated_bytes_now": alloc, "reserved_bytes_now": reserved,
            "peak_allocated_bytes_traced": max(x for _, x, _ in pts),
            "peak_reserved_bytes_traced": max(x for _, _, x in pts), "t_ms": xs, "allocated_bytes": ys}


def _snapshots(run) -> list[dict]:
    out = []
    for rank, path in run.snapshot_files():
        snap = run.snapshot(path)
        if snap is not None:
            out.append({"file": path.name, "rank": rank, **snapshot_timeline(snap)})
    return out


def analyze(run) -> AnalyzerResult:
    per_rank, findings, timeline, window_timeline = [], [], {}, {}
    ooms = []
    windows = run.trace_digests(NAME) if run.ranks and run.profiler_traces() else {}
    for rank in run.ranks:
        meta = run.rank_meta(rank)
        recs = run.stream(rank, "memory")
        ooms += [dict(r, rank=rank) for r in recs if r.get("event") == "oom"]
        if not recs and not meta.get("memory_breakdown"):
            continue
        samples = [r for r in recs if r.get("event") is None]
        row: dict = {"rank": rank, "coords": run.coords(rank), "device": meta.get("device")}
        for k in ("peak_allocated_bytes", "peak_reserved_bytes", "peak_rss_bytes"):
            vals = [r[k] for r in samples if isinstance(r.get(k), (int, float))]
            if vals:
                row[k] = int(max(vals))
        frag = [r["reserved_bytes"] - r["allocated_bytes"] for r in samples
                if isinstance(r.get("reserved_bytes"), int) and isinstance(r.get("allocated_bytes"), int)]
        if frag:
            row["max_reserved_minus_allocated_bytes"] = int(max(frag))
        measured = meta.get("memory_breakdown")
        if measured:
            row["measured"] = {k: measured.get(k) for k in
                               ("params_bytes", "grads_bytes", "optimizer_state_bytes", "n_params_local")}
        info = meta.get("run_info") or {}
        exp = expected_state(info, run.coords(rank))
        if exp:
            row["expected"] = exp
        if measured and exp:
            dev = {}
            for k in ("params_bytes", "grads_bytes", "optimizer_state_bytes"):
                m, e = measured.get(k), exp.get(k)
                if m and e:
                    dev[k] = round(m / e - 1, 4)
            row["measured_vs_expected"] = dev
            bad = {k: v for k, v in dev.items() if abs(v) > MARGIN}
            if bad:
                findings.append(Finding(
                    kind="memory", severity="warning", ranks=[rank],
                    message=(f"rank {rank}: model-state memory differs from what the layout predicts: "
                             + ", ".join(f"{k.replace('_bytes', '')} {v:+.0%}" for k, v in bad.items())
                             + f" (expected {exp['bytes_per_param']} B/param, {exp['basis']})"),
                    evidence={"measured": row["measured"], "expected": exp, "margin": MARGIN}))
        window = windows[rank]["window"] if rank in windows else None
        if window:
            row["profiled_window_peak_bytes"] = window["peak_allocated_bytes"]
            row["profiled_window_absolute"] = window["absolute"]
            window_timeline[str(rank)] = {
                k: window[k] for k in ("t_ms", "allocated_bytes", "absolute")}
        peak = row.get("peak_allocated_bytes")
        if peak and measured:
            state = sum(measured.get(k) or 0 for k in ("params_bytes", "grads_bytes", "optimizer_state_bytes"))
            row["activations_and_temporaries_bytes"] = int(max(peak - state, 0))
        timeline[str(rank)] = _timeline(recs)
        per_rank.append(row)
    snaps = _snapshots(run)
    if not per_rank:
        return AnalyzerResult(metrics={"snapshots": snaps} if snaps else {}, findings=[])
    for o in ooms:
        findings.append(Finding(
            kind="memory", severity="error", ranks=[o["rank"]],
            message=(f"rank {o['rank']} ran out of device memory at step {o.get('step')}: asked for "
                     f"{o.get('alloc_bytes', 0) / 2**20:.0f} MiB with {o.get('device_allocated_bytes', 0) / 2**30:.2f} "
                     f"GiB allocated and {o.get('device_free_bytes', 0) / 2**20:.0f} MiB free"
                     + (f"; snapshot {o['snapshot']}" if o.get("snapshot") else "")),
            evidence=o))
    key = next((k for k in ("peak_allocated_bytes", "peak_rss_bytes") if any(k in r for r in per_rank)), None)
    job = {}
    if key:
        vals = [r[key] for r in per_rank if key in r]
        worst = max(per_rank, key=lambda r: r.get(key, 0))
        job = {"peak_metric": key, "max_peak_bytes": int(max(vals)), "median_peak_bytes": int(median(vals)),
               "worst_rank": worst["rank"]}
    return AnalyzerResult(metrics={"job": job, "per_rank": per_rank, "timeline": timeline,
                                   "window_timeline": window_timeline, "ooms": len(ooms), "margin": MARGIN,
                                   **({"snapshots": snaps} if snaps else {})}, findings=findings)
