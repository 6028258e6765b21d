"""A pipeline micro-batch's time at half its size, from the ops of a profiled window.

Every micro-batch of a run has one size, so its F/B spans give one point of time against
micro-batch size; a fixed cost and a per-sample cost need two. The profiled window's ops give
more: each op's time against its work, and ops of one kind run at several sizes (the QKV, MLP
and head projections are matmuls of different shapes). Per op kind a line

    time = fixed + per_unit × work

is fitted (work: the op's FLOPs from its shapes where _opcost knows it, else the numel of its
tensor inputs), and each F/B span is predicted with its ops' batch dimension halved; ops whose
work does not carry the batch (a gradient accumulated into a weight) keep theirs.

Definitions:
* the ops of a span: the host ``cpu_op`` events on the rank's training thread inside a F/B/W
  span (pipeline.jsonl and the trace share the wall clock); its *leaves*: those with no op inside
  them (the work is done there; a wrapper's own time, dispatch and Python between ops, is kept).
* the micro-batch size ``b``: the most common leading dimension of the ≥3-D tensor inputs of
  the F spans' leaves (activations are [b, seq, ...]); the batch dims: b and b·d1 of those
  tensors (flattened [b·seq, hidden] activations). A leaf carries the batch when the first or
  last dimension of one of its tensor inputs is a batch dim (the weight-gradient matmul has
  b·seq as its inner dimension); its work at half size is half its work.
* the fit of a kind (op name, work unit): over its distinct work values, each at its median
  duration (preempted ops are outliers), weighted by count; a least-squares line with
  fixed ≥ 0 and per_unit ≥ 0. A kind seen at one size only cannot be split: it is taken as
  proportional to its work (the upper bound on what halving saves), and its time is reported
  (``single_size_ms``).
* per span kind (stage, F/B/W): the measured span (median over the window), the leaves' fitted
  time at full and at half size; the span at half size = measured − (fitted full − fitted half).
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from statistics import median

import numpy as np

from trainprof.analyzers._opcost import input_numel, select_ops

MIN_SPREAD = 1.5   # a kind's work values must span this ratio to split fixed from per-unit cost
TOP_KINDS = 12     # fits kept in the digest, by time


def _tensor_dims(dims, types) -> list[list]:
    out = []
    for d, t in zip(dims or [], types or []):
        if isinstance(d, list) and d and all(isinstance(x, int) for x in d) and t not in ("Scalar", "ScalarList"):
            out.append(d)
    return out


def _batch_dims(shapes: list[list[list]]) -> set[int]:
    """b and b·d1 from the ≥3-D tensor inputs of the F leaves (empty when there are none)."""
    lead = Counter(d[0] for ds in shapes for d in ds if len(d) >= 3)
    if not lead:
        return set()
    b = lead.most_common(1)[0][0]
    return {b} | {b * d[1] for ds in shapes for d in ds if len(d) >= 3 and d[0] == b}


def _carries(ds: list[list], bdims: set[int]) -> bool:
    return any(d[0] in bdims or d[-1] in bdims for d in ds)


def _top_level(ev, rows: np.ndarray) -> list[np.ndarray]:
    """rows (one thread, sorted by start, longest first) grouped by top-level op: each group
    starts with the op and holds the ops inside it."""
    ts = ev["ts_ns"][rows].tolist()
    end = ev["end_ns"][rows].tolist()
    groups, start, top_end = [], 0, None
    for i in range(len(ts)):
        if top_end is not None and ts[i] >= top_end:
            groups.append(rows[start:i])
            start = i
            top_end = None
        if top_end is None:
            top_end = end[i]
    if len(ts):
        groups.append(rows[start:])
    return groups


def _unit(ev, group: np.ndarray, counted: dict) -> tuple | None:
    """(name, unit, [(work, tensor dims)], dur_ns) of a top-level op: its work is the FLOPs
    of the costed ops inside it (select_ops: each counted once), else the numel of its own
    tensor inputs, else of the ops' inside it; None without shapes."""
    dims, types = ev["input_dims"], ev["input_types"]
    top = int(group[0])
    name, dur = str(ev["name"][top]), int(ev["dur_ns"][top])
    parts = [(float(counted[r].flops), _tensor_dims(dims[r], types[r]))
             for r in group.tolist() if r in counted and counted[r].flops > 0]
    if parts:
        return name, "flop", parts, dur
    for rows in ([top], group[1:].tolist()):
        parts = [(float(input_numel(dims[r], types[r])), _tensor_dims(dims[r], types[r]))
                 for r in rows if dims[r] is not None and types[r] is not None]
        parts = [p for p in parts if p[0] > 0]
        if parts:
            return name, "el", parts, dur
    return None


def fit_line(points: list[tuple[float, float, int]]) -> tuple[float, float] | None:
    """(fixed, per_unit) of time = fixed + per_unit × work over (work, time, weight) points,
    both ≥ 0; None when the works span less than MIN_SPREAD (one size: no split)."""
    ws = [w for w, _, _ in points if w > 0]
    if len(ws) < 2 or max(ws) < MIN_SPREAD * min(ws):
        return None
    x = np.array([p[0] for p in points], float)
    y = np.array([p[1] for p in points], float)
    k = np.array([p[2] for p in points], float)
    xm, ym = np.average(x, weights=k), np.average(y, weights=k)
    var = float(np.sum(k * (x - xm) ** 2))
    slope = float(np.sum(k * (x - xm) * (y - ym)) / var) if var > 0 else 0.0
    if slope <= 0:
        return float(ym), 0.0
    fixed = ym - slope * xm
    if fixed < 0:  # through the origin
        return 0.0, float(np.sum(k * x * y) / np.sum(k * x * x))
    return float(fixed), slope


def window_digest(ev, spans: list[dict], steps: set[int] | None = None) -> dict | None:
    """One rank's micro-batch model from its trace's events Table and its pipeline spans
    ({step, stage, kind, start_ns, end_ns}) in the profiled window: per span kind the measured
    span, the leaves' fitted time at full and half size, and the fits. None when no span lies
    in the window or the trace holds no shapes."""
    if ev is None or not len(ev) or "input_dims" not in ev or "input_types" not in ev:
        return None
    cpu = np.flatnonzero(ev["cat"].eq("cpu_op") & ~ev["is_gpu"])
    if not len(cpu):
        return None
    lo, hi = int(ev["ts_ns"][cpu].min()), int(ev["end_ns"][cpu].max())
    inside = [s for s in spans if lo <= s["start_ns"] and s["end_ns"] <= hi
              and (steps is None or s["step"] in steps)]
    if not inside:
        return None
    order = cpu[np.lexsort((-ev["dur_ns"][cpu], ev["ts_ns"][cpu]))]
    ts = ev["ts_ns"][order]
    counted = {r: c for r, c in select_ops(ev)}
    per_span = []  # (span, rows in it)
    tid_count: Counter = Counter()
    for s in inside:
        a, z = np.searchsorted(ts, s["start_ns"], "left"), np.searchsorted(ts, s["end_ns"], "right")
        rows = order[a:z]
        rows = rows[ev["end_ns"][rows] <= s["end_ns"]]
        per_span.append((s, rows))
        tid_count.update(ev["tid"][rows].tolist())
    if not tid_count:
        return None
    tid = tid_count.most_common(1)[0][0]
    units = []  # (span index, name, unit, [(work, tensor dims)], dur_ns)
    for i, (s, rows) in enumerate(per_span):
        for top in _top_level(ev, rows[ev["tid"][rows] == tid]):
            u = _unit(ev, top, counted)
            if u is not None:
                units.append((i, *u))
    if not units:
        return None
    bdims = _batch_dims([ds for u in units if per_span[u[0]][0]["kind"] == "F" for _, ds in u[3]])
    if not bdims:
        return None
    # fit per kind over its distinct works, each at its median duration
    by: dict = defaultdict(lambda: defaultdict(list))
    for _, nm, unit, parts, dur in units:
        by[(nm, unit)][sum(w for w, _ in parts)].append(dur)
    fits, single_ms = {}, 0.0
    for key, works in by.items():
        pts = [(w, float(median(v)), len(v)) for w, v in works.items()]
        f = fit_line(pts)
        if f is None:  # one size: proportional
            w_all = sum(w * n for w, _, n in pts)
            t_all = sum(t * n for _, t, n in pts)
            f = (0.0, t_all / w_all if w_all > 0 else 0.0)
            single_ms += t_all / 1e6
            fits[key] = {"fixed_ns": 0.0, "per_unit_ns": f[1], "single_size": True}
        else:
            fits[key] = {"fixed_ns": f[0], "per_unit_ns": f[1], "single_size": False}
        fits[key]["time_ns"] = sum(t * n for _, t, n in pts)
        fits[key]["n"] = sum(n for _, _, n in pts)
        fits[key]["sizes"] = len(pts)
    # per span: fitted leaves at full and half size
    full = [0.0] * len(per_span)
    half = [0.0] * len(per_span)
    ops = [0.0] * len(per_span)
    for i, nm, unit, parts, dur in units:
        ops[i] += dur
        f = fits[(nm, unit)]
        w = sum(x for x, _ in parts)
        w_half = sum(x / 2 if _carries(ds, bdims) else x for x, ds in parts)
        full[i] += f["fixed_ns"] + f["per_unit_ns"] * w
        half[i] += f["fixed_ns"] + f["per_unit_ns"] * w_half
    kinds: dict = defaultdict(lambda: {"span": [], "full": [], "half": [], "gap": []})
    for i, (s, _) in enumerate(per_span):
        k = kinds[(int(s["stage"]), str(s["kind"]))]
        span = s["end_ns"] - s["start_ns"]
        k["span"].append(span / 1e6)
        k["gap"].append(max(span - ops[i], 0) / 1e6)
        k["full"].append(full[i] / 1e6)
        k["half"].append(half[i] / 1e6)
    top = sorted(fits.items(), key=lambda kv: -kv[1]["time_ns"])[:TOP_KINDS]
    return {
        "batch_dims": sorted(bdims),
        "spans": [{"stage": st, "kind": kd, "n": len(v["span"]),
                   "span_ms": median(v["span"]), "between_ops_ms": median(v["gap"]),
                   "fitted_ms": median(v["full"]),
                   "fitted_half_ms": median(v["half"])} for (st, kd), v in sorted(kinds.items())],
        "leaf_ms": sum(f["time_ns"] for f in fits.values()) / 1e6,
        "single_size_ms": single_ms,
        "fits": [{"op": nm, "unit": unit, "fixed_us": f["fixed_ns"] / 1e3,
                  "per_unit_ns": f["per_unit_ns"], "count": f["n"], "sizes": f["sizes"],
                  "time_ms": f["time_ns"] / 1e6, "single_size": f["single_size"]}
                 for (nm, unit), f in top],
    }


def combine(digests: dict) -> dict | None:
    """Job figures from the ranks' window digests: per (stage, kind) the median over ranks of
    the measured span and its prediction at half size, and ``ratio``: a micro-batch's time at
    half size ÷ its time now, summed over the stages' F/B/W spans."""
    rows = defaultdict(list)
    for d in digests.values():
        for s in (d or {}).get("spans") or []:
            rows[(s["stage"], s["kind"])].append(s)
    if not rows:
        return None
    spans, now, after = [], 0.0, 0.0
    for (st, kd), v in sorted(rows.items()):
        span = median(x["span_ms"] for x in v)
        gap = median(x["between_ops_ms"] for x in v)
        full = median(x["fitted_ms"] for x in v)
        half = median(x["fitted_half_ms"] for x in v)
        pred = span * (gap + half) / (gap + full) if gap + full > 0 else span
        spans.append({"stage": st, "kind": kd, "span_ms": round(span, 4),
                      "span_half_ms": round(pred, 4),
                      "between_ops_ms": round(gap, 4), "fitted_ms": round(full, 4),
                      "fitted_half_ms": round(half, 4)})
        now += span
        after += pred
    if now <= 0 or not math.isfinite(after):
        return None
    leaf = sum((d or {}).get("leaf_ms") or 0.0 for d in digests.values())
    single = sum((d or {}).get("single_size_ms") or 0.0 for d in digests.values())
    fits = [f for d in digests.values() for f in (d or {}).get("fits") or []]
    return {"ratio": after / now, "spans": spans,
            "single_size_share": single / leaf if leaf else None,
            "fits": sorted(fits, key=lambda f: -f["time_ms"])[:TOP_KINDS]}
