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
from trainprof.analyzers._tensor_cores import tensor_core_shares
from trainprof.findings import AnalyzerResult

NAME = "gpu_overview"
MAX_STEPS = 64
MAX_COLLECTIVES = 32
ROLES = ("kernel", "memcpy", "memset", "communication", "runtime", "dataloader", "cpu_exec")
BREAKDOWN = ROLES + ("other",)
_COMM_OPS = ("nccl:", "gloo:")
_COMM_KERNEL = re.compile(r"nccl|rccl", re.IGNORECASE)


def _ms(ns) -> float:
    return round(float(ns) / 1e6, 4)


# --------------------------------------------------------------------------- steps and roles
def device_steps(ev, steps) -> list[tuple[int, int, int]]:
    """(step, start_ns, end_ns) of each step extended to the device (the plugin's
    _update_steps_duration): start at the previous step's end when it is later, end at the last
    GPU op the step launched when that is later than the host end."""
    gpu = ev["is_gpu"] & ev["cat"].isin(("kernel", "gpu_memcpy", "gpu_memset"))
    st, end = ev["step"][gpu], ev["end_ns"][gpu]
    order = np.argsort(st, kind="stable")
    st, end = st[order], end[order]
    first = np.flatnonzero(np.r_[True, st[1:] != st[:-1]]) if len(st) else np.empty(0, np.int64)
    last_end = dict(zip(st[first].tolist(), np.maximum.reduceat(end, first).tolist())) if len(st) else {}
    out, prev = [], None
    for n, s, e in zip(steps["step"].tolist(), steps["start_ns"].tolist(), steps["end_ns"].tolist()):
        e = max(e, last_end.get(n, e))
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


def exclusive(roles: dict[str, iv.Set]) -> dict[str, iv.Set]:
    """Each role's time less the time of the roles before it (ROLES order): a moment counts once,
    in the first role active then."""
    out, taken = {}, iv.EMPTY
    for role in ROLES:
        got = iv.subtract(roles[role], taken)
        out[role] = got
        taken = iv.union(np.concatenate([taken[0], got[0]]), np.concatenate([taken[1], got[1]]))
    return out


# --------------------------------------------------------------------------- integrals
def level(starts, ends, values, cap: float | None = None):
    """The function t -> Σ values of the intervals holding t (capped at ``cap``), as its
    breakpoints, its value after each and its integral up to each: integrals over any window are
    then two binary searches (every step of a long trace at once)."""
    s, e = np.asarray(starts, np.int64), np.asarray(ends, np.int64)
    v = np.asarray(values, np.float64)
    keep = e > s
    s, e, v = s[keep], e[keep], v[keep]
    pts = np.concatenate([s, e])
    order = np.argsort(pts, kind="stable")
    pts = pts[order]
    lev = np.cumsum(np.concatenate([v, -v])[order])
    if cap is not None:
        lev = np.clip(lev, 0.0, cap)
    area = np.diff(pts).astype(np.float64) * lev[:-1] if len(pts) else np.empty(0)
    return pts, lev, np.concatenate([[0.0], np.cumsum(area)])


def integral(f, lo, hi) -> np.ndarray:
    """∫ f over each [lo, hi) (arrays of ns)."""
    pts, lev, cum = f
    lo, hi = np.asarray(lo, np.int64), np.asarray(hi, np.int64)
    if not len(pts):
        return np.zeros(len(lo))

    def upto(x):
        j = np.searchsorted(pts, x, side="right") - 1
        ok = j >= 0
        out = np.zeros(len(x))
        jj = j[ok]
        out[ok] = cum[jj] + (x[ok] - pts[jj]) * lev[jj]
        return out
    return upto(hi) - upto(lo)


def of_set(a: iv.Set):
    """level() of a disjoint set: its length over a window."""
    return level(a[0], a[1], np.ones(len(a[0])))


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


# --------------------------------------------------------------------------- per rank
def step_figures(ev, steps, trace, kernel_rows, props) -> dict[str, np.ndarray]:
    """Per step (arrays over ``steps``): ns per breakdown role, kernel-busy ns, SM-efficiency ns
    (∫ min(Σ blocks per SM, 1)), and occupancy sums (∫ Σ occupancy and ∫ kernels with one)."""
    lo = np.array([s[1] for s in steps], np.int64)
    hi = np.array([s[2] for s in steps], np.int64)
    out = {role: integral(of_set(r), lo, hi) for role, r in exclusive(role_sets(ev)).items()}
    out["other"] = (hi - lo) - sum(out[r] for r in ROLES)
    out["span"] = (hi - lo).astype(np.float64)
    k_s, k_e = ev["ts_ns"][kernel_rows], ev["end_ns"][kernel_rows]
    out["busy"] = integral(of_set(iv.union(k_s, k_e)), lo, hi)
    bps, occ = _kernel_launch(trace, ev, kernel_rows, props)
    known = ~np.isnan(bps) & (np.nan_to_num(bps) > 0)
    out["sm"] = integral(level(k_s[known], k_e[known], bps[known], cap=1.0), lo, hi) \
        if known.any() else None
    known = ~np.isnan(occ)
    out["occ_num"] = integral(level(k_s[known], k_e[known], occ[known]), lo, hi)
    out["occ_den"] = integral(level(k_s[known], k_e[known], np.ones(int(known.sum()))), lo, hi)
    return out


def _ratio(a, b, digits=4):
    return round(float(a) / float(b), digits) if b else None


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
    f = step_figures(ev, steps, trace, kernel_rows, props)
    rows = []
    for i, (n, _, _) in enumerate(steps[:MAX_STEPS]):
        rows.append({"step": n, "step_ms": _ms(f["span"][i]),
                     **{f"{k}_ms": _ms(f[k][i]) for k in BREAKDOWN},
                     "gpu_utilization": _ratio(f["busy"][i], f["span"][i]),
                     "sm_efficiency": _ratio(f["sm"][i], f["span"][i]) if f["sm"] is not None else None,
                     "achieved_occupancy": _ratio(f["occ_num"][i], f["occ_den"][i])})
    span = float(f["span"].sum())
    n_steps = max(len(steps), 1)
    job = {"steps": len(steps), "step_ms": _ms(span / n_steps),
           **{f"{k}_ms": _ms(f[k].sum() / n_steps) for k in BREAKDOWN},
           **{f"{k}_pct": _ratio(100.0 * f[k].sum(), span, 2) for k in BREAKDOWN},
           "gpu_utilization": _ratio(f["busy"].sum(), span),
           "sm_efficiency": _ratio(f["sm"].sum(), span) if f["sm"] is not None else None,
           "achieved_occupancy": _ratio(f["occ_num"].sum(), f["occ_den"].sum()),
           **tensor_core_shares(ev, kernel_rows)}
    comm = kernel_rows[ev["name"].mask(lambda n: _COMM_KERNEL.search(n) is not None)[kernel_rows]]
    return {"kind": "gpu", "device": device, "dialect": trace.meta.get("dialect") or {},
            "sm_count": props.get("numSms"), "job": job, "per_step": rows,
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
    colls = _collectives(gpu)
    return AnalyzerResult(metrics={"job": job, "per_rank": per_rank, "per_step": _steps_over_ranks(gpu),
                                   **({"collectives": colls} if colls else {}),
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
            g = agg.setdefault(k, {"collective": k[0], "bytes": k[1], "pg_name": k[2],
                                   "pg_desc": c.get("pg_desc"), "group_size": c.get("group_size"),
                                   "ranks": 0, "count": 0, "kernel_ms": 0.0, "seqs": c.get("seqs") or []})
            g["ranks"] += 1
            g["count"] += c["count"]
            g["kernel_ms"] = round(g["kernel_ms"] + c["kernel_ms"], 4)
    return sorted(agg.values(), key=lambda g: -g["kernel_ms"])[:MAX_COLLECTIVES]
