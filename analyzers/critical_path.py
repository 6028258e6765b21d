"""The critical path across ranks: which rank's work, of which kind, the step time is made of.

Every step, from the always-on log (analyzers/_cp_coarse.py: each rank's work between its
collectives, collectives joined across their group, p2p send -> recv), on one clock
(analyzers/_align.py); the profiled steps also per rank from the profiler trace at the grain of
ops and kernels (analyzers/_cp_fine.py, in each rank's trace digest). The longest path of a
step's graph is its critical path; its time is attributed to (rank, kind) with kind one of
compute / host / data / communication / idle.

``replay(run, change)`` recomputes every step's path with a change applied (a rank's excess
work removed, a collective hidden, a kind of work removed): what the step time would be.
"""

from __future__ import annotations

import numpy as np

from trainprof.analyzers import _cp_coarse, _cp_fine, _cp_graph
from trainprof.analyzers._align import align
from trainprof.analyzers._memo import once
from trainprof.findings import AnalyzerResult

NAME = "critical_path"
KINDS = _cp_graph.KINDS
TOP_RANKS = 32  # job.by_rank lists at most this many ranks (the rest summed as "others")
MAX_STEP_RECORDS = 3_000_000  # ranks × ops over all steps above which only every k-th step is built


def _ms(ns) -> float:
    return round(float(ns) / 1e6, 3)


def step_graphs(run) -> dict:
    """{step: Graph} of every step of the log (cached per run)."""
    return once(run, "analyzers.critical_path.graphs", _step_graphs)


def _step_graphs(run) -> dict:
    al = align(run)
    prep = _cp_coarse.prepare(run, al)
    steps = sorted({k for _, k in prep["steps"]})
    ranks = list(run.ranks)
    n_recs = sum(len(v) for v in prep["recs"].values())
    every = max(1, int(np.ceil(n_recs / MAX_STEP_RECORDS)))
    out = {}
    for i, s in enumerate(steps):
        if every > 1 and i % every and s != steps[-1]:
            continue
        g = _cp_coarse.step_graph(prep, s, ranks)
        if g is not None:
            out[s] = g
    if every > 1:
        run.problems.append(f"{NAME}: {n_recs} logged ops; the path was computed for every "
                            f"{every}th step only")
    return out


def _path_rows(g, path, weights=None) -> list[tuple]:
    """(rank, kind, start ns, end ns) of the path's edges with weight (for the timeline)."""
    w = g.weight if weights is None else weights
    rows = []
    for e in path:
        if not w[e]:
            continue
        b = g.node_ts[g.dst[e]]
        rows.append((g.rank[e], max(g.parts[e] or {"idle": 1}, key=(g.parts[e] or {"idle": 1}).get),
                     b - w[e], b, g.label[e]))
    return rows


def paths(run) -> dict:
    """{step: {"length_ns", "path" (edge ids), "attr", "rows"}} (cached)."""
    return once(run, "analyzers.critical_path.paths", _paths)


def _paths(run) -> dict:
    out = {}
    for s, g in step_graphs(run).items():
        try:
            length, path = _cp_graph.longest_path(g)
        except ValueError:
            run.problems.append(f"{NAME}: step {s}: the logged ops of the ranks cannot be ordered "
                                "(inconsistent p2p pairs?); no path for this step")
            continue
        out[s] = {"length_ns": length, "path": path, "attr": _cp_graph.attribute(g, path),
                  "rows": _path_rows(g, path)}
    return out


def _kept(run, steps) -> list[int]:
    from trainprof.analyzers.step_time import excluded_steps

    st = run.steps()
    if st.empty:
        return sorted(steps)
    ex = excluded_steps(st)
    drop = set(ex["warmup"]) | set(ex["profiler"])
    kept = [s for s in sorted(steps) if s not in drop]
    return kept or sorted(steps)


def _wall(run, al) -> dict:
    st = run.steps()
    out: dict = {}
    if st.empty:
        return out
    for r, k, a, b in st[["rank", "step", "start_ns", "end_ns"]].dropna().itertuples(index=False):
        lo, hi = al(int(r), int(a)), al(int(r), int(b))
        cur = out.get(int(k))
        out[int(k)] = (min(lo, cur[0]), max(hi, cur[1])) if cur else (lo, hi)
    return out


def _summarize(per: dict, steps: list[int]) -> dict:
    total = sum(per[s]["length_ns"] for s in steps)
    by_rank: dict = {}
    by_kind = dict.fromkeys(KINDS, 0.0)
    for s in steps:
        for r, ns in per[s]["attr"]["by_rank"].items():
            by_rank[r] = by_rank.get(r, 0.0) + ns
        for k, ns in per[s]["attr"]["by_kind"].items():
            by_kind[k] = by_kind.get(k, 0.0) + ns
    ranked = sorted(by_rank.items(), key=lambda x: (-x[1], x[0]))
    rows = [{"rank": int(r), "ms": _ms(ns / len(steps)), "share": round(ns / total, 4) if total else 0.0}
            for r, ns in ranked[:TOP_RANKS] if r >= 0]
    rest = sum(ns for _, ns in ranked[TOP_RANKS:])
    out = {"steps": len(steps), "length_ms": _ms(total / len(steps)) if steps else None,
           "by_rank": rows,
           "by_kind": {k: round(ns / total, 4) if total else 0.0 for k, ns in by_kind.items()},
           "by_kind_ms": {k: _ms(ns / len(steps)) for k, ns in by_kind.items()}}
    if rest:
        out["by_rank_others"] = {"ranks": len(ranked) - TOP_RANKS, "ms": _ms(rest / len(steps)),
                                 "share": round(rest / total, 4)}
    return out


def analyze(run) -> AnalyzerResult:
    per = paths(run)
    metrics: dict = {}
    if per:
        al = align(run)
        wall = _wall(run, al)
        kept = _kept(run, per)
        metrics["source"] = "always-on log: steps, collectives, data waits, pipeline spans"
        metrics["job"] = _summarize(per, kept)
        metrics["job"]["steps_used"] = kept if len(kept) <= 64 else kept[:64]
        metrics["per_step"] = [_step_row(s, per[s], wall.get(s), s in kept) for s in sorted(per)]
        unc = al.uncertainty_us()
        metrics["alignment"] = {"how": al.how,
                                "max_uncertainty_us": max(unc.values(), default=0.0)}
    prof = _profiled(run)
    if prof:
        metrics["profiled"] = prof
    return AnalyzerResult(metrics=metrics)


def _step_row(s, p, wall, kept) -> dict:
    a = p["attr"]
    top = sorted(a["by_rank"].items(), key=lambda x: -x[1])[:8]
    return {"step": int(s), "length_ms": _ms(p["length_ns"]),
            "wall_ms": _ms(wall[1] - wall[0]) if wall else None, "analysed": bool(kept),
            "by_kind_ms": {k: _ms(v) for k, v in a["by_kind"].items() if v},
            "by_rank_ms": {str(int(r)): _ms(v) for r, v in top if r >= 0}}


# ----------------------------------------------------------------------- profiled window
def trace_digest(run, rank, trace) -> dict:
    """Per profiled step of this rank's trace: the single-rank critical path (ops, kernels,
    launches, stream order, synchronizations)."""
    st = trace.tables.steps
    out = []
    for i in range(len(st)):
        lo, hi = int(st["start_ns"][i]), int(st["end_ns"][i])
        g = _cp_fine.rank_graph(trace, lo, hi, rank)
        length, path = _cp_graph.longest_path(g)
        a = _cp_graph.attribute(g, path)
        tops: dict = {}
        for e in path:
            if g.label[e] and g.weight[e]:
                tops[g.label[e]] = tops.get(g.label[e], 0) + g.weight[e]
        out.append({"step": int(st["step"][i]), "length_ms": _ms(length), "span_ms": _ms(hi - lo),
                    "by_kind_ms": {k: _ms(v) for k, v in a["by_kind"].items() if v},
                    "top": [{"name": n[:120], "ms": _ms(v)}
                            for n, v in sorted(tops.items(), key=lambda x: -x[1])[:5]]})
    return {"steps": out}


def _profiled(run) -> dict | None:
    try:
        if not run.profiler_traces():
            return None
        docs = run.trace_digests(NAME)
    except Exception as e:  # noqa: BLE001 - a trace that cannot be read is said by the reader
        run.problems.append(f"{NAME}: profiled steps not analysed: {e}")
        return None
    ranks = []
    for r, d in sorted(docs.items()):
        steps = d.get("steps") or []
        if not steps:
            continue
        ranks.append({"rank": int(r), "steps": steps})
    if not ranks:
        return None
    return {"source": "profiler traces, each rank on its own (ops, kernels, launches, stream "
                      "order, synchronizations)", "ranks": ranks[:TOP_RANKS]}


# ----------------------------------------------------------------------- what-if
def replay(run, change: dict, steps=None) -> dict:
    """The step time with ``change`` applied to every (analysed) step's graph.

    change (one key):
    - ``{"remove_excess": R}``: rank R's work (compute, host, data) in each step scaled down to
      the median of the other ranks' work that step (no change where R is not above it);
    - ``{"scale": {"rank": R | None, "kind": K | None, "factor": f}}``: work of that rank / kind
      times f (0 removes it);
    - ``{"hide_collective": {"group": G | None, "op": OP | None}}``: those collectives' transfer
      (join -> end) costs nothing, as if fully overlapped with compute.

    Returns {"steps": [{"step", "before_ms", "after_ms"}], "before_ms", "after_ms" (means over
    the steps), "saving_ms", "saving_share"}."""
    graphs = step_graphs(run)
    per = paths(run)
    use = sorted(steps) if steps is not None else _kept(run, per)
    rows = []
    for s in use:
        if s not in graphs or s not in per:
            continue
        g = graphs[s]
        fn = _change_fn(g, change)
        after, _ = _cp_graph.replay(g, fn)
        rows.append({"step": s, "before_ms": _ms(per[s]["length_ns"]), "after_ms": _ms(after)})
    if not rows:
        return {"steps": [], "before_ms": None, "after_ms": None, "saving_ms": None,
                "saving_share": None}
    b = float(np.mean([x["before_ms"] for x in rows]))
    a = float(np.mean([x["after_ms"] for x in rows]))
    return {"steps": rows, "before_ms": round(b, 3), "after_ms": round(a, 3),
            "saving_ms": round(b - a, 3), "saving_share": round((b - a) / b, 4) if b else None}


def _work_by_rank(g) -> dict:
    tot: dict = {}
    for e, k in enumerate(g.key):
        if k and k[0] == "work":
            tot[g.rank[e]] = tot.get(g.rank[e], 0) + g.weight[e]
    return tot


def _change_fn(g, change: dict):
    if "remove_excess" in change:
        r = int(change["remove_excess"])
        tot = _work_by_rank(g)
        others = [v for k, v in tot.items() if k != r]
        if r not in tot or not others or tot[r] <= 0:
            return lambda e, g: None
        f = min(1.0, float(np.median(others)) / tot[r])
        return lambda e, g: g.weight[e] * f if g.rank[e] == r and g.key[e] and g.key[e][0] == "work" else None
    if "scale" in change:
        c = change["scale"]
        r, kind, f = c.get("rank"), c.get("kind"), float(c.get("factor", 0.0))

        def fn(e, g):
            if not g.parts[e] or (r is not None and g.rank[e] != int(r)):
                return None
            if g.key[e] and g.key[e][0] == "coll" and kind != "communication":
                return None
            if kind is None:
                return g.weight[e] * f
            part = g.parts[e].get(kind, 0)
            return g.weight[e] - part * (1 - f) if part else None
        return fn
    if "hide_collective" in change:
        c = change["hide_collective"]
        grp, op = c.get("group"), c.get("op")

        def hide(e, g):
            k = g.key[e]
            if not k or k[0] != "coll":
                return None
            inst = k[1]
            if grp is not None and str(inst[1]) != str(grp) and not str(inst[1]).startswith(f"{grp}:"):
                return None
            if op is not None and g.label[e] != op:
                return None
            return 0
        return hide
    raise ValueError(f"unknown change {sorted(change)}; known: remove_excess, scale, hide_collective")
