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

from trainprof.analyzers import _cp_batch, _cp_coarse, _cp_fine, _cp_graph
from trainprof.analyzers._align import align
from trainprof.analyzers._memo import once
from trainprof.findings import AnalyzerResult
from trainprof.analyzers.step_time import excluded_set, excluded_steps, overhead_spans

NAME = "critical_path"
KINDS = _cp_graph.KINDS
TOP_RANKS = 32  # job.by_rank lists at most this many ranks (the rest summed as "others")


def _ms(ns) -> float:
    return round(float(ns) / 1e6, 3)


def prepared(run) -> dict:
    """The step graphs' aligned inputs (cached per run)."""
    return once(run, "analyzers.critical_path.prep", lambda run: _cp_coarse.prepare(run, align(run)))


def data_placement(run) -> dict:
    """(rank, step) -> (start, end) aligned ns where the step graphs placed the data wait; in a
    step without logged ops (none of the ranks': one chain per rank) it is at the step's start
    and not listed."""
    paths(run)
    return prepared(run).get("data_at", {})


def paths(run) -> dict:
    """{step: {"length_ns", "path" (edge ids), "attr", "rows"}} (cached)."""
    return once(run, "analyzers.critical_path.paths", _paths)


def _paths(run) -> dict:
    prep = prepared(run)
    joined = _cp_coarse.op_steps(prep)
    chains = _cp_coarse.chain_paths(prep, joined)  # every other step, at once
    batched = _batched_paths(prep, joined)  # the steps with ops, many graphs at once
    out = {}
    for s in _cp_coarse.step_ids(prep):
        if s in chains:
            out[s] = _chain_path(*chains[s])
            continue
        if s in batched:
            out[s] = batched[s]
            continue
        g = _cp_coarse.step_graph(prep, s)
        if g is None:
            continue
        try:
            length, path = _cp_graph.longest_path(g)
        except ValueError:
            run.problems.append(f"{NAME}: step {s}: the logged ops of the ranks cannot be ordered "
                                "(inconsistent p2p pairs?); no path for this step")
            continue
        out[s] = {"length_ns": length, "path": path, "attr": _cp_graph.attribute(g, path),
                  "rows": _cp_graph.path_rows(g, [path])[0]}
    return out


def _batched_paths(prep, steps) -> dict:
    """paths()'s entries of ``steps`` from their graphs built and walked a chunk of steps at a
    time (analyzers/_cp_batch.py); a step left out (a cycle, a deep graph) is done on its own."""
    out: dict = {}
    for g, st, node_lo, edge_lo in _cp_batch.chunk_graphs(prep, steps):
        done = [(s, res, el) for s, res, el in zip(st.tolist(), _cp_batch.longest_paths(
            g, node_lo, edge_lo), edge_lo.tolist()) if res is not None]
        summ = _cp_batch.summaries(g, [res[1] + el for _, res, el in done])
        for (s, (length, path), _), (attr, rows) in zip(done, summ):
            out[s] = {"length_ns": length, "path": path, "attr": attr, "rows": rows}
    return out


def _chain_path(length, rank, start, end, data, edge) -> dict:
    """paths()'s entry of a step whose graph is one chain per rank (_cp_coarse.chain_paths):
    what longest_path, attribute and path_rows give on that graph."""
    if length <= 0:
        return {"length_ns": 0, "path": np.zeros(0, np.int64),
                "attr": {"by_rank": {}, "by_kind": {}, "by_rank_kind": {}}, "rows": []}
    parts = dict.fromkeys(KINDS, 0.0)
    parts["compute"], parts["data"] = float(length - data), float(data)
    return {"length_ns": length, "path": np.array([edge], np.int64),
            "attr": {"by_rank": {rank: float(length)}, "by_kind": parts,
                     "by_rank_kind": {(rank, k): v for k, v in parts.items() if v > 0}},
            "rows": [(rank, "compute" if length - data >= data else "data", start, end, None)]}


def _kept(run, steps) -> list[int]:
    st = run.steps()
    if st.empty:
        return sorted(steps)
    drop = excluded_set(excluded_steps(st, overhead_spans(run)))
    kept = [s for s in sorted(steps) if s not in drop]
    return kept or sorted(steps)


def _wall(run, al) -> dict:
    st = run.steps()
    out: dict = {}
    if st.empty:
        return out
    d = st[["rank", "step", "start_ns", "end_ns"]].dropna()
    if d.empty:
        return out
    r, k = d["rank"].to_numpy().astype(np.int64), d["step"].to_numpy().astype(np.int64)
    lo, hi = d["start_ns"].to_numpy().astype(np.int64), d["end_ns"].to_numpy().astype(np.int64)
    _cp_coarse.align_cols(al, r, lo, hi)  # the aligned step windows, rank by rank
    o = np.argsort(k, kind="stable")
    k, lo, hi = k[o], lo[o], hi[o]
    first = np.flatnonzero(np.r_[True, k[1:] != k[:-1]])
    return dict(zip(k[first].tolist(), zip(np.minimum.reduceat(lo, first).tolist(),
                                           np.maximum.reduceat(hi, first).tolist())))


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
    per = paths(run) if not run.trace_inputs else {}  # bare traces have no log
    metrics: dict = {}
    if per:
        al = align(run)
        wall = _wall(run, al)
        kept = _kept(run, per)
        metrics["source"] = "always-on log: steps, collectives (joined across their group), p2p pairs, data waits"
        metrics["job"] = _summarize(per, kept)
        metrics["job"]["steps_used"] = kept if len(kept) <= 64 else kept[:64]
        kept_set = set(kept)
        metrics["per_step"] = [_step_row(s, per[s], wall.get(s), s in kept_set) for s in sorted(per)]
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
# events of one rank's profiled steps whose single-rank path `analyze` computes (the graph is
# built in Python: ~1 s for a 25k-event GPU step on 2 cores); steps past it are said, not analysed
FINE_EVENTS_BUDGET = 20_000
FINE_STEP_MAX = 50_000  # the first step of a rank is analysed up to this size


def trace_digest(run, rank, trace) -> dict:
    """Per profiled step of this rank's trace: the single-rank critical path (ops, kernels,
    launches, stream order, synchronizations)."""
    st = trace.tables.steps
    out = []
    ts = trace.tables.events["ts_ns"]
    budget = FINE_EVENTS_BUDGET
    for i in range(len(st)):
        lo, hi = int(st["start_ns"][i]), int(st["end_ns"][i])
        n = int(((ts >= lo) & (ts < hi)).sum())
        first = not any("length_ms" in x for x in out)
        if n > (FINE_STEP_MAX if first else budget):  # bounded cost: ~40 µs an event in Python
            out.append({"step": int(st["step"][i]), "span_ms": _ms(hi - lo), "events": n,
                        "skipped": f"{n:,} events in the step, over the profiled path's budget "
                                   f"({FINE_EVENTS_BUDGET:,} events a rank after its first step "
                                   f"of up to {FINE_STEP_MAX:,})"})
            continue
        budget = max(0, budget - n)
        chain = _cp_fine.single_chain(trace, lo, hi)
        if chain is not None:  # CPU-only, one driving thread: the path is its chain
            length, kinds, tops = chain
        else:
            g = _cp_fine.rank_graph(trace, lo, hi, rank)
            length, path = _cp_graph.longest_path(g)
            kinds = _cp_graph.attribute(g, path)["by_kind"]
            tops = {}
            for e in path:
                if g.label[e] and g.weight[e]:
                    tops[g.label[e]] = tops.get(g.label[e], 0) + g.weight[e]
        out.append({"step": int(st["step"][i]), "length_ms": _ms(length), "span_ms": _ms(hi - lo),
                    "by_kind_ms": {k: _ms(v) for k, v in kinds.items() if v},
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
        steps = [x for x in d.get("steps") or [] if "skipped" not in x]
        skipped = [x for x in d.get("steps") or [] if "skipped" in x]
        if skipped:
            run.problems.append(f"{NAME}: rank {r}: {len(skipped)} profiled step(s) not analysed: "
                                f"{skipped[0]['skipped']}")
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
    - ``{"scale": {"rank": R | [R, ...] | None, "kind": K | None, "factor": f}}``: work of
      those ranks / kind times f (0 removes it);
    - ``{"hide_collective": {"group": G | None, "op": OP | None}}``: those collectives' transfer
      (join -> end) costs nothing, as if fully overlapped with compute.

    Returns {"steps": [{"step", "before_ms", "after_ms"}], "before_ms", "after_ms" (means over
    the steps), "saving_ms", "saving_share"}.

    A step whose graph is one chain per rank (no logged op: _cp_coarse.chain_paths) is replayed
    at once with the others of its kind (_cp_coarse.chain_replay: what _changed and longest_path
    give on its graph); the graphs of the other steps are built and replayed a chunk of steps
    at a time (analyzers/_cp_batch.py; a graph per step of a long run held at once is GBs)."""
    if not {"remove_excess", "scale", "hide_collective"} & set(change):
        raise ValueError(f"unknown change {sorted(change)}; known: remove_excess, scale, "
                         "hide_collective")
    per = paths(run)
    prep = prepared(run)
    use = sorted(steps) if steps is not None else _kept(run, per)
    joined = _cp_coarse.op_steps(prep)
    chained = _cp_coarse.chain_replay(prep, [s for s in use if s in per and s not in joined],
                                      change)
    batched = _batched_replay(prep, [s for s in use if s in per and s in joined], change)
    rows = []
    for s in use:
        if s not in per:
            continue
        if s in chained:
            after = chained[s]
        elif s in batched:
            after = batched[s]
        else:
            g = _cp_coarse.step_graph(prep, s)
            if g is None:
                continue
            after, _ = _cp_graph.longest_path(g, _changed(g, change))
        rows.append({"step": s, "before_ms": _ms(per[s]["length_ns"]), "after_ms": _ms(after)})
    if not rows:
        return {"steps": [], "before_ms": None, "after_ms": None, "saving_ms": None,
                "saving_share": None}
    b = float(np.mean([x["before_ms"] for x in rows]))
    a = float(np.mean([x["after_ms"] for x in rows]))
    return {"steps": rows, "before_ms": round(b, 3), "after_ms": round(a, 3),
            "saving_ms": round(b - a, 3), "saving_share": round((b - a) / b, 4) if b else None}


def _batched_replay(prep, steps, change: dict) -> dict:
    """{step: longest path ns with ``change`` applied} of ``steps`` (with logged ops), a chunk
    of their graphs at a time; a step left out is replayed on its own graph."""
    out: dict = {}
    for g, st, node_lo, edge_lo in _cp_batch.chunk_graphs(prep, steps):
        w = _changed_blocks(g, edge_lo, change)
        for s, res in zip(st.tolist(), _cp_batch.longest_paths(g, node_lo, edge_lo, w)):
            if res is not None:
                out[s] = res[0]
    return out


def _changed_blocks(g, edge_lo, change: dict) -> np.ndarray:
    """_changed on each block (step) of a union of step graphs (analyzers/_cp_batch.py): the
    edge-wise changes on the whole union, ``remove_excess`` (a median over each step's ranks)
    block by block, with the same float arithmetic."""
    if "remove_excess" not in change:
        return _changed(g, change)
    r = int(change["remove_excess"])
    w = g.weight.astype(np.float64).copy()
    nb = len(edge_lo) - 1
    eblk = np.repeat(np.arange(nb), np.diff(edge_lo))
    work = np.flatnonzero(g.etype == _cp_graph.WORK)
    if not len(work):
        return w.astype(np.int64)
    rk = g.rank[work]
    lo = int(rk.min())
    width = int(rk.max()) - lo + 1
    keys, inv = np.unique(eblk[work] * width + (rk - lo), return_inverse=True)
    tot = np.bincount(inv.reshape(-1), weights=g.weight[work], minlength=len(keys))
    kb, kr = keys // width, keys % width + lo
    mine = np.zeros(nb)
    mine[kb[kr == r]] = tot[kr == r]
    oth = kr != r
    n_oth = np.bincount(kb[oth], minlength=nb)
    med = _cp_coarse._grouped_median(kb[oth], tot[oth], nb)
    ok = (mine > 0) & (n_oth > 0)
    f = np.ones(nb)
    f[ok] = np.minimum(1.0, med[ok] / mine[ok])
    sel = work[(rk == r) & ok[eblk[work]]]
    w[sel] *= f[eblk[sel]]
    return w.astype(np.int64)


def finding_change(f: dict) -> dict | None:
    """The replay change a finding's fix amounts to, where the graph can express it: a
    straggler (from the log) running as its peers do, starving ranks' data waits removed."""
    ev = f.get("evidence") or {}
    if f.get("kind") == "straggler" and ev.get("source") != "profiler traces":
        k = ev.get("rank", (f.get("ranks") or [None])[0])
        return {"remove_excess": int(k)} if isinstance(k, int) else None
    if f.get("kind") == "data_starvation":
        ranks = sorted(int(r) for r in (ev.get("ranks") or {})) or [int(r) for r in f.get("ranks") or []]
        return {"scale": {"rank": ranks or None, "kind": "data", "factor": 0.0}}
    return None


def replay_findings(run, findings: list[dict]) -> list[dict]:
    """Each finding whose estimate (analyzers/estimates.py) has a change the graph can replay
    gets ``estimate["replay"]``: that change replayed on every analysed step's graph, its saving
    next to the estimate's. Returns the comparison rows (``metrics.critical_path.what_if``)."""
    rows = []
    for f in findings:
        e = f.get("estimate")
        change = finding_change(f) if isinstance(e, dict) else None
        if change is None:
            continue
        r = replay(run, change)
        if r["saving_ms"] is None:
            continue
        e["replay"] = {"change": change, "saving_ms": r["saving_ms"], "path_before_ms": r["before_ms"],
                       "path_after_ms": r["after_ms"], "steps": len(r["steps"]),
                       "minus_estimate_ms": round(r["saving_ms"] - e["saving_ms"], 3)}
        rows.append({"kind": f.get("kind"), "ranks": f.get("ranks"), "change": change,
                     "estimate_saving_ms": e["saving_ms"], "replay_saving_ms": r["saving_ms"]})
    return rows


def _changed(g, change: dict) -> np.ndarray:
    """The edge weights with ``change`` applied (see replay)."""
    w = g.weight.astype(np.float64).copy()
    work = g.etype == _cp_graph.WORK
    if "remove_excess" in change:
        r = int(change["remove_excess"])
        tot = np.bincount(g.rank[work] - g.rank[work].min(), weights=g.weight[work]) \
            if work.any() else np.zeros(0)
        lo = int(g.rank[work].min()) if work.any() else 0
        mine = tot[r - lo] if 0 <= r - lo < len(tot) else 0.0
        present = np.unique(g.rank[work])
        others = [tot[x - lo] for x in present if x != r]
        if mine > 0 and others:
            f = min(1.0, float(np.median(others)) / mine)
            sel = work & (g.rank == r)
            w[sel] *= f
        return w.astype(np.int64)
    if "scale" in change:
        c = change["scale"]
        r, kind, f = c.get("rank"), c.get("kind"), float(c.get("factor", 0.0))
        on = (np.isin(g.rank, [int(x) for x in r]) if isinstance(r, (list, tuple)) else g.rank == int(r)) \
            if r is not None else True
        sel = (g.etype != _cp_graph.DEP) & on
        if kind is None:
            w[sel & work] *= f
        else:
            part = g.parts[:, _cp_graph.KIND_INDEX[kind]].astype(np.float64)
            w[sel] -= part[sel] * (1 - f)
        return np.maximum(w, 0).astype(np.int64)
    if "hide_collective" in change:
        c = change["hide_collective"]
        grp, op = c.get("group"), c.get("op")
        sel = g.etype == _cp_graph.COLL
        if op is not None:
            sel &= np.array([x == op for x in g.label], bool)
        if grp is not None:
            names = g.inst_names
            ok = np.array([bool(names) and 0 <= i < len(names) and
                           (str(names[i][1]) == str(grp) or str(names[i][1]).startswith(f"{grp}:"))
                           for i in g.inst], bool)
            sel &= ok
        w[sel] = 0
        return w.astype(np.int64)
    raise ValueError(f"unknown change {sorted(change)}; known: remove_excess, scale, hide_collective")


# ----------------------------------------------------------------------- across ranks, profiled
MATCH_SLACK_NS = 500_000  # a trace's collective op inside its log record, on one host's clock


def _trace_comm_keys(trace, rows, rank, ops, shift) -> dict:
    """Event row -> instance key of the collectives of ``rows`` that join across ranks: the
    traces' own (process group, sequence number) on GPU collective kernels (NCCL), else the
    host's c10d ops matched to this rank's log records (gloo) by time."""
    comm = trace.tables.comm
    ev = trace.tables.events
    out: dict = {}
    rowset = set(int(r) for r in rows)
    if not comm.empty and "seq" in comm and "pg_name" in comm:
        gpu = ev["is_gpu"]
        for i in range(len(comm)):
            row, s = int(comm["row"][i]), comm["seq"][i]
            if row in rowset and gpu[row] and s is not None and int(s) >= 0:
                out[row] = ("t", str(comm["pg_name"][i]), int(s))
        if out:
            return out
    if ops is None:
        return out
    names = ev["name"]
    m = ops["rank"] == rank
    enq, end, inst, wait = ops["enq"][m], ops["end"][m], ops["inst"][m], ops["wait"][m]
    if not len(enq):
        return out
    o = np.argsort(enq)
    enq, end, inst, wait = enq[o], end[o], inst[o], wait[o]
    used = np.zeros(len(enq), bool)
    cand_rows = [int(x) for x in rows if not ev["is_gpu"][int(x)] and str(names[int(x)]).startswith("c10d::")]
    cand_rows.sort(key=lambda x: int(ev["ts_ns"][x]))
    for row in cand_rows:
        a = int(shift(np.int64(ev["ts_ns"][row])))
        b = int(shift(np.int64(ev["end_ns"][row])))
        lo = np.searchsorted(enq, a - MATCH_SLACK_NS, "left")
        hi = np.searchsorted(enq, a + MATCH_SLACK_NS, "right")
        best, best_ov = -1, -1
        for j in range(lo, hi):  # one log record per op, the one it overlaps most
            if used[j]:
                continue
            ov = min(b, end[j]) - max(a, enq[j])
            if ov > best_ov:
                best, best_ov = j, ov
        if best >= 0:
            used[best] = True
            out[row] = (("l", int(inst[best])), int(wait[best]), int(end[best]))
    return out


def _step_of_trace(run, al, rank, lo, hi, trace_inputs) -> int | None:
    """The run's step a ProfilerStep window [lo, hi] (local ns) lies in (its midpoint)."""
    if trace_inputs:
        return None
    mid = (lo + hi) // 2
    for rec in run.stream(rank, "steps"):
        a, b = rec.get("start_ns"), rec.get("end_ns")
        if isinstance(a, int) and isinstance(b, int) and a <= mid <= b:
            return rec.get("step")
    return None


def profiled_paths(run, traces: dict, steps, shifts: dict | None = None) -> dict:
    """{step: {"length_ns", "rows", "attr", "ranks"}}: the profiled steps' path across the ranks
    of ``traces`` ({rank: Trace}) at the grain of ops and kernels, collectives joined. Bare
    traces: ``steps`` are ProfilerStep numbers, ``shifts`` {rank: ns to subtract}."""
    al = align(run)
    prep = prepared(run) if not run.trace_inputs else {"ops": None}
    out = {}
    for s in steps:
        g = _cp_graph.Graph()
        arrivals: dict = {}
        leaves: list = []
        used = []
        for r, t in sorted(traces.items()):
            st = t.tables.steps
            hit = [i for i in range(len(st)) if (
                _step_of_trace(run, al, r, int(st["start_ns"][i]), int(st["end_ns"][i]), run.trace_inputs)
                if not run.trace_inputs else int(st["step"][i])) == s]
            if not hit:
                continue
            lo, hi = int(st["start_ns"][hit[0]]), int(st["end_ns"][hit[0]])
            rows = _cp_fine.window_rows(t, lo, hi)
            shift = (lambda ns, r=r: np.asarray(al(r, np.asarray(ns, np.int64)), np.int64)) \
                if not run.trace_inputs else \
                (lambda ns, d=(shifts or {}).get(r, 0): np.asarray(ns, np.int64) - d)
            keys = _trace_comm_keys(t, rows, r, prep.get("ops"), shift)
            _cp_fine.add_rank(g, r, t, rows, shift, keys, arrivals, leaves, clip=hi)
            used.append(r)
        if not used:
            continue
        base_edges = len(g.src)
        _cp_fine.join(g, {k: v for k, v in arrivals.items() if len(v) > 1},
                      [x for x in leaves if len(arrivals.get(x[0], ())) > 1])
        _unjoined(g, arrivals, leaves)
        a = g.arrays()
        try:
            length, path = _cp_graph.longest_path(a)
        except ValueError:  # ops matched to the wrong records: each rank on its own
            run.problems.append(f"{NAME}: step {s}: the traces' collectives could not be ordered "
                                "across ranks; the profiled path is each rank's own")
            for lst in (g.src, g.dst, g.weight, g.rank, g.parts, g.etype, g.inst, g.label):
                del lst[base_edges:]
            _unjoined(g, arrivals, leaves, force=True)
            a = g.arrays()
            length, path = _cp_graph.longest_path(a)
        out[s] = {"length_ns": length, "rows": _cp_graph.path_rows(a, [path])[0],
                  "attr": _cp_graph.attribute(a, path), "ranks": used}
    return out


def _unjoined(g, arrivals, leaves, force: bool = False) -> None:
    """A collective only one rank of the window shows: its op stays that rank's own work."""
    for key, rank, nb, a, b, name in leaves:
        if force or len(arrivals.get(key, ())) <= 1:
            n = next(x[1] for x in arrivals[key] if x[0] == rank) if len(arrivals[key]) else None
            if n is None:
                continue
            g.edge(n, nb, b - a, rank, {"communication": b - a}, etype=_cp_graph.WORK, label=name)
