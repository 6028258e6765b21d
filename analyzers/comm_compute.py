"""Communication vs computation, per rank and profiled step: compute, communication, the part of
communication hidden under compute (overlap), exposed communication, data loading, other, idle.

GPU traces: kernels on all streams. comm = NCCL kernels, memory = memcpy/memset, compute = the
other kernels. CPU traces (gloo): the main thread (the one with ProfilerStep spans) computes in
aten ops; communication runs on gloo worker threads (``gloo:*``) and blocks the main thread in
waits (``_c10d_functional::wait_tensor``, ``c10d::*``, synchronous ``gloo:send/recv``). Exact
definitions and the differences from HTA are in docs/comm-compute.md.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from trainprof.analyzers import _intervals as iv
from trainprof.findings import AnalyzerResult, Finding

NAME = "comm_compute"
EXPOSED_COMM_FINDING = 0.40   # exposed communication above this share of the step → finding
HOST_STALL_FINDING = 0.05     # synchronizations above this share of the step → finding
WARMUP_FACTOR = 1.5           # a profiled step this much slower than the others' median is warm-up

_WAIT_PREFIXES = ("c10d::", "_c10d_functional::", "c10d_functional::", "gloo:", "nccl:",
                  "record_param_comms")
_SYNC_CALLS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize",
               "cudaStreamWaitEvent")
_CATEGORIES = ("compute_ms", "overlapped_ms", "exposed_comm_ms", "data_ms", "other_ms", "idle_ms")


def _ms(ns) -> float:
    return round(float(ns) / 1e6, 4)


def _coll_type(name: str) -> str:
    n = name.lower()
    for key in ("all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter",
                "reducescatter", "broadcast", "all_to_all", "alltoall", "send", "recv", "barrier"):
        if key in n:
            return {"allreduce": "all_reduce", "allgather": "all_gather",
                    "reducescatter": "reduce_scatter", "alltoall": "all_to_all"}.get(key, key)
    return "other"


# --------------------------------------------------------------------------- GPU
def _gpu_step(k: pd.DataFrame, runtime: pd.DataFrame) -> dict:
    names = k["name"].astype(str)
    comm_m = names.str.contains("nccl", case=False).to_numpy()
    mem_m = k["cat"].isin(["gpu_memcpy", "gpu_memset"]).to_numpy()
    comp_m = ~comm_m & ~mem_m
    lo, hi = int(k["ts_ns"].min()), int(k["end_ns"].max())
    window = hi - lo
    everything, comp = iv.of(k), iv.of(k, comp_m)
    comm, mem = iv.of(k, comm_m), iv.of(k, mem_m)
    overlapped = iv.length(iv.intersect(comm, comp))
    exposed = iv.length(iv.subtract(comm, comp))
    other = iv.length(iv.subtract(iv.subtract(mem, comp), comm))
    idle = window - iv.length(everything)
    by_type: dict[str, int] = {}
    for name, d in zip(names[comm_m], k["dur_ns"].to_numpy()[comm_m]):
        t = _coll_type(name)
        by_type[t] = by_type.get(t, 0) + int(d)
    stalls = runtime[runtime["name"].astype(str).isin(_SYNC_CALLS)] if len(runtime) else runtime
    d2h = runtime[runtime["name"].astype(str).eq("cudaMemcpy")] if len(runtime) else runtime
    return {"window_ms": _ms(window), "compute_ms": _ms(iv.length(comp) - overlapped),
            "overlapped_ms": _ms(overlapped), "exposed_comm_ms": _ms(exposed), "data_ms": 0.0,
            "other_ms": _ms(other), "idle_ms": _ms(idle), "comm_ms": _ms(iv.length(comm)),
            "comm_by_type_ms": {t: _ms(v) for t, v in sorted(by_type.items())},
            "sync_calls": int(len(stalls) + len(d2h)),
            "sync_ms": _ms(stalls["dur_ns"].sum() + d2h["dur_ns"].sum()) if len(runtime) else 0.0}


def hta_view(ev: pd.DataFrame, last_step: int) -> dict | None:
    """HTA's temporal breakdown and overlap, computed HTA's way (kernels, memcpy and memset of
    every profiled iteration but the last, window = first kernel start .. last kernel end)."""
    m = ev["cat"].isin(["kernel", "gpu_memcpy", "gpu_memset"]) & ev["step"].ge(0) & ev["step"].ne(last_step)
    k = ev[m]
    if k.empty:
        return None
    names = k["name"].astype(str)
    comm_m = names.str.contains("nccl", case=False).to_numpy()
    mem_m = names.str.contains("Memcpy|Memset", case=False).to_numpy()
    comp_m = ~comm_m & ~mem_m
    window = int(k["end_ns"].max() - k["ts_ns"].min())
    idle = window - iv.length(iv.of(k))
    comp, comm = iv.of(k, comp_m), iv.of(k, comm_m)
    pct = lambda x: round(100.0 * x / window, 2)  # noqa: E731
    return {"idle_pct": pct(idle), "compute_pct": pct(iv.length(comp)),
            "non_compute_pct": pct(window - idle - iv.length(comp)),
            "overlap_pct": round(100.0 * iv.length(iv.intersect(comm, comp)) / iv.length(comm), 2)
            if iv.length(comm) else 0.0}


# --------------------------------------------------------------------------- CPU
def _main_tid(ev: pd.DataFrame) -> int | None:
    steps = ev[ev["name"].astype(str).str.startswith("ProfilerStep#")]
    if steps.empty:
        return None
    return int(steps["tid"].mode().iloc[0])


def _cpu_step(ev: pd.DataFrame, main: int, lo: int, hi: int) -> dict:
    names = ev["name"].astype(str)
    on_main = ev["tid"].to_numpy() == main
    is_wait = names.str.startswith(_WAIT_PREFIXES).to_numpy()
    is_gloo = names.str.startswith(("gloo:", "nccl:")).to_numpy()
    is_aten = names.str.startswith("aten::").to_numpy()
    is_data = names.str.startswith("enumerate(DataLoader)").to_numpy()
    is_step = names.str.startswith("ProfilerStep#").to_numpy()
    waits = iv.clip(iv.of(ev, on_main & is_wait), lo, hi)
    comm = iv.clip(iv.union(np.concatenate([waits[0], ev["ts_ns"].to_numpy()[is_gloo]]),
                            np.concatenate([waits[1], ev["end_ns"].to_numpy()[is_gloo]])), lo, hi)
    compute = iv.subtract(iv.clip(iv.of(ev, on_main & is_aten & ~is_wait), lo, hi), waits)
    data = iv.subtract(iv.clip(iv.of(ev, on_main & is_data), lo, hi), compute)
    busy_main = iv.clip(iv.of(ev, on_main & ~is_step), lo, hi)
    overlapped = iv.intersect(comm, compute)
    exposed = iv.subtract(iv.subtract(comm, compute), data)
    accounted = iv.union(np.concatenate([compute[0], comm[0], data[0]]),
                         np.concatenate([compute[1], comm[1], data[1]]))
    other = iv.subtract(busy_main, accounted)
    window = hi - lo
    idle = window - iv.length(accounted) - iv.length(other)
    by_type: dict[str, int] = {}
    g = ev[is_gloo]
    for name, s, e in zip(g["name"].astype(str), g["ts_ns"].to_numpy(), g["end_ns"].to_numpy()):
        d = max(0, min(int(e), hi) - max(int(s), lo))
        if d:
            t = _coll_type(name)
            by_type[t] = by_type.get(t, 0) + d
    return {"window_ms": _ms(window),
            "compute_ms": _ms(iv.length(compute) - iv.length(overlapped)),
            "overlapped_ms": _ms(iv.length(overlapped)), "exposed_comm_ms": _ms(iv.length(exposed)),
            "data_ms": _ms(iv.length(data)), "other_ms": _ms(iv.length(other)),
            "idle_ms": _ms(max(idle, 0)), "comm_ms": _ms(iv.length(comm)),
            "comm_by_type_ms": {t: _ms(v) for t, v in sorted(by_type.items())},
            "sync_calls": 0, "sync_ms": 0.0}


# --------------------------------------------------------------------------- per rank
def rank_breakdown(trace) -> tuple[list[dict], dict | None, str]:
    ev = trace.events
    gpu = ev[ev["is_gpu"] & ev["cat"].isin(["kernel", "gpu_memcpy", "gpu_memset"])]
    rows = []
    if len(gpu):
        runtime = ev[ev["cat"].astype(str).isin(["cuda_runtime", "cuda_driver"])]
        for step, k in gpu[gpu["step"].ge(0)].groupby("step", sort=True):
            rows.append({"step": int(step), **_gpu_step(k, runtime[runtime["step"].eq(step)])})
        last = int(trace.steps["step"].max()) if len(trace.steps) else -1
        return rows, hta_view(ev, last), "gpu"
    main = _main_tid(ev)
    if main is None:
        return rows, None, "cpu"
    for s in trace.steps.itertuples():
        inside = ev[(ev["end_ns"] > s.start_ns) & (ev["ts_ns"] < s.end_ns)]
        rows.append({"step": int(s.step), **_cpu_step(inside, main, int(s.start_ns), int(s.end_ns))})
    return rows, None, "cpu"


def _mesh_dim_split(run) -> list[dict]:
    """Blocked time in collectives per mesh dimension, from the always-on collective log."""
    try:
        coll = run.frame("collectives")
        groups = run.frame("groups")
    except Exception:  # noqa: BLE001 - the log is optional
        return []
    if coll.empty or "blocked_ms" not in coll:
        return []
    dims = {}
    if not groups.empty and "pg" in groups:
        for g in groups.itertuples():
            dims[(g.rank, g.pg)] = getattr(g, "mesh_dim", None) or "other"
    coll = coll.copy()
    coll["mesh_dim"] = [dims.get((r, pg), "other") for r, pg in zip(coll["rank"], coll["pg"])]
    coll = coll[coll["step"].ge(1)] if "step" in coll else coll
    agg = coll.groupby(["rank", "mesh_dim"])["blocked_ms"].sum().reset_index()
    steps = coll.groupby("rank")["step"].nunique() if "step" in coll else None
    out = []
    for r in agg.itertuples():
        n = int(steps.get(r.rank, 1)) if steps is not None else 1
        out.append({"rank": int(r.rank), "mesh_dim": r.mesh_dim,
                    "blocked_ms_per_step": round(float(r.blocked_ms) / max(n, 1), 3)})
    return out


def analyze(run) -> AnalyzerResult:
    traces = run.traces()
    per_step, per_rank, kinds = [], [], set()
    for rank, trace in sorted(traces.items()):
        rows, hta, kind = rank_breakdown(trace)
        if not rows:
            continue
        kinds.add(kind)
        windows = np.array([r["window_ms"] for r in rows])
        med = float(np.median(windows))
        warm = [r["step"] for r in rows if len(rows) > 2 and r["window_ms"] > WARMUP_FACTOR *
                float(np.median([x["window_ms"] for x in rows if x is not r]))]
        for r in rows:
            per_step.append({"rank": rank, **r, "warmup": r["step"] in warm})
        use = [r for r in rows if r["step"] not in warm] or rows
        tot = {k: sum(r[k] for r in use) for k in ("window_ms", "comm_ms", "sync_ms", *_CATEGORIES)}
        w = tot["window_ms"] or 1.0
        by_type: dict[str, float] = {}
        for r in use:
            for t, v in r["comm_by_type_ms"].items():
                by_type[t] = by_type.get(t, 0.0) + v
        per_rank.append({
            "rank": rank, "coords": run.coords(rank), "kind": kind, "steps": [r["step"] for r in use],
            "warmup_steps": warm, "step_window_ms": round(med, 3),
            **{k.replace("_ms", "_fraction"): round(tot[k] / w, 4) for k in _CATEGORIES},
            "comm_fraction": round(tot["comm_ms"] / w, 4),
            "overlap_of_comm": round(tot["overlapped_ms"] / tot["comm_ms"], 4) if tot["comm_ms"] else 0.0,
            "sync_fraction": round(tot["sync_ms"] / w, 4),
            "comm_by_type_ms_per_step": {t: round(v / len(use), 3) for t, v in sorted(by_type.items())},
            **({"hta_view": hta} if hta else {}),
        })
    if not per_rank:
        return AnalyzerResult(metrics={}, findings=[])
    exposed = float(np.median([r["exposed_comm_fraction"] for r in per_rank]))
    job = {"trace_kind": "/".join(sorted(kinds)), "ranks": len(per_rank),
           **{k.replace("_ms", "_fraction"): round(float(np.median(
               [r[k.replace("_ms", "_fraction")] for r in per_rank])), 4) for k in _CATEGORIES},
           "exposed_comm_fraction": round(exposed, 4),
           "comm_fraction": round(float(np.median([r["comm_fraction"] for r in per_rank])), 4)}
    metrics = {"job": job, "exposed_comm_fraction": round(exposed, 4), "per_rank": per_rank,
               "per_step": per_step, "by_mesh_dim": _mesh_dim_split(run),
               "definitions": "docs/comm-compute.md"}
    return AnalyzerResult(metrics=metrics, findings=_findings(per_rank, exposed))


def _findings(per_rank: list[dict], exposed: float) -> list[Finding]:
    out = []
    if exposed >= EXPOSED_COMM_FINDING:
        worst = sorted(per_rank, key=lambda r: -r["exposed_comm_fraction"])
        types: dict[str, float] = {}
        for r in per_rank:
            for t, v in r["comm_by_type_ms_per_step"].items():
                types[t] = types.get(t, 0.0) + v / len(per_rank)
        top = sorted(types.items(), key=lambda kv: -kv[1])[:3]
        out.append(Finding(
            kind="exposed_comm", severity="warning", ranks=[r["rank"] for r in worst[:4]],
            message=(f"communication not hidden by compute takes {exposed:.0%} of the profiled "
                     f"steps (median rank); largest: "
                     + ", ".join(f"{t} {v:.1f} ms/step" for t, v in top)),
            evidence={"exposed_comm_fraction": exposed, "threshold": EXPOSED_COMM_FINDING,
                      "per_rank": {str(r["rank"]): r["exposed_comm_fraction"] for r in per_rank},
                      "comm_by_type_ms_per_step": {t: round(v, 2) for t, v in top}}))
    stalls = [r for r in per_rank if r["sync_fraction"] >= HOST_STALL_FINDING]
    if stalls:
        out.append(Finding(
            kind="host_stall", severity="warning", ranks=[r["rank"] for r in stalls],
            message=(f"host-device synchronizations (cuda*Synchronize, blocking cudaMemcpy from "
                     f".item()/.cpu()) take up to {max(r['sync_fraction'] for r in stalls):.0%} of "
                     f"the step on {len(stalls)} rank(s)"),
            evidence={"sync_fraction": {str(r["rank"]): r["sync_fraction"] for r in stalls},
                      "threshold": HOST_STALL_FINDING}))
    return out
