"""The whole job on one clock: the model `trainprof timeline` renders (reports/chrome_trace.py).

``build(run, ...)`` returns a plain dict (ns on rank 0's clock, analyzers/_align.py):

- ``processes``: [{rank, name "rank N (dp0 pp1 tp0, host)", sort (mesh order), label}]
- ``slices``: [(rank, track, name, cat, ts_ns, dur_ns, args | None)]
- ``flows``: [(slice index, slice index)]: one arrow per member of a collective to its last
  arriving member (the log's collectives; the traces' GPU collective kernels that carry their
  process group and sequence number)
- ``counters``: [(rank, name, ts_ns, {series: value})]
- ``instants``: [(rank | None, track, name, ts_ns, args)]: findings at their step
- ``meta``: selection, alignment and each rank's residual uncertainty, limits applied

Tracks: ``steps``, ``data``, ``pg <group> (<dim>)`` per process group, ``pipeline``,
``critical path``, and for profiled ranks ``cpu <tid>``, ``gpu stream <n>``.
"""

from __future__ import annotations

import numpy as np

from trainprof.analyzers import _timeline_select as sel, collectives as coll, critical_path as cp
from trainprof.analyzers._align import align, align_traces
from trainprof.analyzers.critical_path import _kept, _step_of_trace, data_placement
from trainprof.analyzers._cp_coarse import strs
from trainprof.rankranges import ranges
from trainprof.trace import TraceError, load_trace

EVENT_BYTES = 220  # JSON bytes per event, as written (measured: 100-210; the writer checks)
HOST_CATS = ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver", "python_function")
DIM_ORDER = ("dp", "pp", "cp", "ep", "tp")
MAX_MEMORY_SAMPLES = 2000  # per rank: the allocator's counter, evenly thinned


def _name(rank: int, coords: dict, host) -> str:
    c = " ".join(f"{k}{v}" for k, v in sorted((coords or {}).items(),
                                                key=lambda kv: (DIM_ORDER.index(kv[0]) if kv[0] in DIM_ORDER else 9, kv[0])))
    inner = ", ".join(x for x in (c, str(host) if host else "") if x)
    return f"rank {rank} ({inner})" if inner else f"rank {rank}"


def _sort_key(rank: int, coords: dict):
    dims = sorted((coords or {}).items(),
                  key=lambda kv: (DIM_ORDER.index(kv[0]) if kv[0] in DIM_ORDER else 9, kv[0]))
    return tuple(v if isinstance(v, int) else 0 for _, v in dims) + (rank,)


class _Budget:
    def __init__(self, max_bytes: int):
        self.left = max_bytes // EVENT_BYTES
        self.dropped: dict[str, int] = {}

    def take(self, n: int, what: str) -> int:
        k = max(0, min(n, self.left))
        self.left -= k
        if k < n:
            self.dropped[what] = self.dropped.get(what, 0) + n - k
        return k


def build(run, steps: list[int] | None = None, ranks: list[int] | None = None,
          findings: list[dict] | None = None, max_bytes: int = 100 << 20,
          profiler: bool = True, critical: bool = True) -> dict:
    findings = findings or []
    if run.trace_inputs:
        return _build_bare(run, steps, ranks, findings, max_bytes)
    al = align(run)
    st = run.steps()
    all_steps = sorted({int(s) for s in st["step"].dropna().unique()}) if not st.empty else []
    profiled = sorted({int(s) for s in st.loc[st["profiled"].fillna(False).astype(bool), "step"]}) \
        if "profiled" in st.columns and not st.empty else []

    if ranks is None:
        ranks, rank_why = sel.select_ranks(run, findings)
    else:
        ranks, rank_why = [r for r in ranks if r in set(run.ranks)], "chosen with --ranks"
    if steps is None:
        res = run.resolution() or {}
        win = res.get("windows") or {}
        held = win.get("steps") or []
        anomalies = sorted({a["step"] for a in win.get("anomalies") or []
                            if any(x <= a["step"] <= y for x, y in held)})
        steps, step_why = sel.select_steps(all_steps, findings, profiled, _kept(run, all_steps),
                                           anomalies)
    else:
        steps, step_why = [s for s in steps if s in set(all_steps)], "chosen with --steps"
    for _ in range(3):  # the log's events of too many steps: fewer steps, said
        m, windows = _core(run, al, ranks, steps, findings, critical)
        n_core = len(m["slices"]) + len(m["flows"]) * 2 + len(m["instants"])
        fit = max_bytes // EVENT_BYTES
        if n_core <= fit or len(steps) <= 1:
            break
        keep = max(1, int(len(steps) * fit / n_core * 0.9))
        step_why += f"; cut to {keep} steps by the size limit ({max_bytes / 2 ** 20:g} MB)"
        steps = steps[:keep]
    budget = _Budget(max_bytes)
    rset, sset = set(ranks), set(steps)
    budget.take(n_core, "log events")
    if profiler:
        traces = _profiler(m, run, al, rset, sset, budget)
        kernel_flows(m, budget)
        if critical and traces:
            _critical_profiled(m, run, traces, sorted(sset & set(profiled)))
    m["meta"] = {
        "ranks": ranks, "ranks_selection": rank_why, "steps": steps, "steps_selection": step_why,
        "world_size": run.world_size, "steps_in_run": len(all_steps), "groups": m.pop("groups", []),
        "clock": {"how": al.how, "per_rank": {str(r): al.info.get(r, {}) for r in ranks}},
        "limit": {"max_bytes": max_bytes, "dropped": budget.dropped},
    }
    return m


def _core(run, al, ranks, steps, findings, critical) -> tuple[dict, dict]:
    """The always-on log's events of the chosen ranks and steps."""
    m = {"slices": [], "flows": [], "counters": [], "instants": [], "processes": []}
    rset, sset = set(ranks), set(steps)
    windows = _windows(run, al, rset, sset)
    _processes(m, run, ranks, al.info)
    _steps_and_data(m, run, al, rset, sset)
    groups = _collectives(m, run, al, rset, sset)
    m["groups"] = groups
    _pipeline(m, run, al, rset, sset)
    if critical:
        _critical(m, run, rset, sset)
    _findings(m, findings, windows, rset)
    return m, windows


def _windows(run, al, rset, sset) -> dict:
    out: dict = {}
    st = run.steps()
    if st.empty:
        return out
    for r, k, a, b in st[["rank", "step", "start_ns", "end_ns"]].dropna().itertuples(index=False):
        if int(k) in sset:
            lo, hi = al(int(r), int(a)), al(int(r), int(b))
            out.setdefault(int(k), {})[int(r)] = (lo, hi)
    return out


def _processes(m, run, ranks, info) -> None:
    keys = sorted(ranks, key=lambda r: _sort_key(r, run.coords(r)))
    for i, r in enumerate(keys):
        meta = run.rank_meta(r)
        u = (info.get(r) or {}).get("uncertainty_us")
        m["processes"].append({"rank": r, "name": _name(r, run.coords(r), meta.get("host")),
                               "sort": i, "label": f"clock ±{u:g} µs" if isinstance(u, (int, float)) else
                               "clock: unaligned"})


def _steps_and_data(m, run, al, rset, sset) -> None:
    try:
        placed = data_placement(run)
    except Exception:  # noqa: BLE001 - at the step's start then
        placed = {}
    st = run.steps()
    data = {}
    d = run.frame("data")
    if not d.empty and {"rank", "step", "wait_ms"} <= set(d.columns):
        for r, k, w in d[["rank", "step", "wait_ms"]].dropna().itertuples(index=False):
            data[(int(r), int(k))] = float(w)
    if st.empty:
        return
    for r, k, a, b in st[["rank", "step", "start_ns", "end_ns"]].dropna().itertuples(index=False):
        r, k = int(r), int(k)
        if r not in rset or k not in sset:
            continue
        lo, hi = al(r, int(a)), al(r, int(b))
        m["slices"].append((r, "steps", f"step {k}", "step", lo, max(0, hi - lo),
                            {"step": k, "dur_ms": round((hi - lo) / 1e6, 3)}))
        w = data.get((r, k))
        if w:
            a = placed.get((r, k), (lo,))[0]
            m["slices"].append((r, "data", "data wait", "data", a, int(w * 1e6),
                                {"step": k, "wait_ms": round(w, 3),
                                 "placed": "the log records its length only: at the first "
                                           "stretch of the rank's own work that holds it"}))


def _collectives(m, run, al, rset, sset) -> None:
    df = coll._frame(run)
    if df.empty:
        return []
    df = df[df["rank"].isin(list(rset)) & df["step"].isin(list(sset)) & df["end_ns"].notna()]
    if df.empty:
        return []
    ranks = df["rank"].to_numpy(int)
    enq = df["enqueue_ns"].astype(np.int64).to_numpy().copy()
    end = df["end_ns"].astype(np.int64).to_numpy().copy()
    for r in np.unique(ranks):
        sl = ranks == r
        enq[sl] = al(int(r), enq[sl])
        end[sl] = al(int(r), end[sl])

    cols = {c: df[c].to_numpy() for c in ("seq", "bytes", "blocked_ms", "step", "p2p",
                                          "peer", "ordinal", "mesh_dim")}
    for c in ("pg", "op", "group"):
        cols[c] = strs(df[c])
    short: dict = {}
    inst: dict = {}
    p2p: dict = {}
    p2p_count: dict = {}
    for i in range(len(df)):
        r = int(ranks[i])
        dim = cols["mesh_dim"][i]
        track = f"pg {cols['pg'][i]}" + (f" ({dim})" if isinstance(dim, str) else "")
        op = str(cols["op"][i])
        name = op if not cols["p2p"][i] else f"{op} {'→' if op == 'send' else '←'} {cols['peer'][i]}"
        gk = str(cols["group"][i])
        if gk not in short:  # "pg:0,1,...,1023" -> "pg:0-1023"
            pg, _, members = gk.partition(":")
            try:
                short[gk] = f"{pg}:{ranges(int(x) for x in members.split(','))}"
            except ValueError:
                short[gk] = gk
        args = {"group": short[gk], "seq": int(cols["seq"][i]), "op": op,
                "bytes": int(cols["bytes"][i] or 0),
                "blocked_ms": round(float(cols["blocked_ms"][i] or 0.0), 3),
                "step": int(cols["step"][i])}
        m["slices"].append((r, track, name, "collective", int(enq[i]), max(0, int(end[i] - enq[i])), args))
        if not cols["p2p"][i] and int(cols["ordinal"][i]) >= 0:
            inst.setdefault((str(cols["group"][i]), int(cols["ordinal"][i])), []).append(
                (int(enq[i]), len(m["slices"]) - 1))
        elif cols["p2p"][i] and cols["peer"][i] is not None and cols["peer"][i] == cols["peer"][i]:
            # the k-th send a->b and the k-th recv on b from a: an arrow send -> recv
            peer = int(cols["peer"][i])
            src, dst = (r, peer) if op == "send" else (peer, r)
            c = (gk, op, src, dst)
            k = p2p_count.get(c, 0)
            p2p_count[c] = k + 1
            p2p.setdefault((gk, src, dst, k), {})[op] = len(m["slices"]) - 1
    for members in inst.values():
        if len(members) < 2:
            continue
        _join_at_last(m, members)
    for pair in p2p.values():
        if "send" in pair and "recv" in pair:
            m["flows"].append((pair["send"], pair["recv"]))
    return sorted(set(short.values()))


def _pipeline(m, run, al, rset, sset) -> None:
    for r in sorted(rset):
        for rec in run.stream(r, "pipeline"):
            k = rec.get("step")
            if k not in sset or not isinstance(rec.get("start_ns"), int) or not isinstance(rec.get("end_ns"), int):
                continue
            a, b = al(r, rec["start_ns"]), al(r, rec["end_ns"])
            m["slices"].append((r, "pipeline", f"{rec.get('kind')} s{rec.get('stage')} mb{rec.get('microbatch')}",
                                "pipeline", a, max(0, b - a), {"step": k, "stage": rec.get("stage"),
                                                               "microbatch": rec.get("microbatch")}))


def _critical(m, run, rset, sset) -> None:
    try:
        per = cp.paths(run)
    except Exception as e:  # noqa: BLE001 - the timeline stands without the path
        run.problems.append(f"timeline: critical path not drawn: {type(e).__name__}: {e}")
        return
    for s in sorted(sset):
        p = per.get(s)
        if not p:
            continue
        for r, kind, a, b, label in p["rows"]:
            if r in rset and b > a:
                m["slices"].append((r, "critical path", kind, "critical_path", a, b - a,
                                    {"step": s, "kind": kind, **({"op": label} if label else {})}))


def _findings(m, findings, windows, rset) -> None:
    first = min(windows) if windows else None
    for f in findings:
        s = sel.finding_step(f)
        s = s if s in windows else first
        if s is None:
            continue
        fr = [r for r in (f.get("ranks") or []) if r in rset] or [None]
        for r in fr[:8]:
            w = windows[s].get(r) if r is not None else None
            ts = w[0] if w else min(x[0] for x in windows[s].values())
            m["instants"].append((r, "steps", f"{f.get('kind')}: {str(f.get('message', ''))[:80]}", ts,
                                  {"kind": f.get("kind"), "severity": f.get("severity"),
                                   "step": s, "message": str(f.get("message", ""))[:2000]}))


MAX_PATH_TRACES = 16  # ranks whose traces join in the profiled steps' path across ranks


def _profiler(m, run, al, rset, sset, budget) -> dict:
    """Each chosen rank's trace, one at a time; returns the first MAX_PATH_TRACES (for the path)."""
    try:
        paths = run.profiler_traces()
    except Exception:  # noqa: BLE001
        return {}
    wanted = {r: p for r, p in paths.items() if r in rset}

    kept = {}
    for r, p in sorted(wanted.items()):
        try:
            t = load_trace(p, rank=r)
        except TraceError as e:
            run.problems.append(str(e))
            continue
        # the trace numbers its own ProfilerSteps: those lying in the chosen steps of the run
        st = t.tables.steps
        tsteps = {int(st["step"][i]) for i in range(len(st))
                  if _step_of_trace(run, al, r, int(st["start_ns"][i]), int(st["end_ns"][i]), False) in sset}
        add_trace(m, r, t, lambda ns, r=r: al(r, ns), tsteps, budget)
        if len(kept) < MAX_PATH_TRACES:
            kept[r] = t
    return kept


def _critical_profiled(m, run, traces, steps, shifts=None) -> None:
    try:
        per = cp.profiled_paths(run, traces, steps, shifts)
    except Exception as e:  # noqa: BLE001 - the timeline stands without it
        run.problems.append(f"timeline: profiled critical path not drawn: {type(e).__name__}: {e}")
        return
    for s, p in per.items():
        for r, kind, a, b, label, n in _merged(p["rows"]):
            m["slices"].append((r, "critical path (ops)", kind, "critical_path", a, b - a,
                                {"step": s, "kind": kind, "ops": n, **({"op": label} if label else {})}))


def _merged(rows) -> list:
    """Consecutive path pieces of one rank and kind as one slice (the longest piece's op named,
    the count of pieces kept): a profiled step's path has thousands of tiny ops."""
    out: list = []
    for r, kind, a, b, label in rows:
        if b <= a:
            continue
        if out and out[-1][0] == r and out[-1][1] == kind and a - out[-1][3] <= 1000:
            pr, pk, pa, pb, pl, pn, pw = out[-1]
            out[-1] = (pr, pk, pa, b, label if (b - a) > pw else pl, pn + 1, max(pw, b - a))
        else:
            out.append((r, kind, a, b, label, 1, b - a))
    return [x[:6] for x in out]


def add_trace(m, r, t, shift, sset, budget, clip_steps: bool = True) -> None:
    """One rank's profiled steps: host ops per thread, GPU ops per stream, memory counters."""
    ev = t.tables.events
    stp = t.tables.steps
    keep = np.zeros(len(ev), bool)
    for i in range(len(stp)):
        if sset is None or int(stp["step"][i]) in sset:
            keep |= np.asarray(ev["step"]) == int(stp["step"][i])
    if not keep.any():
        return
    cat = ev["cat"]
    ok = keep & (cat.isin(list(HOST_CATS)) | np.asarray(ev["is_gpu"]))
    rows = np.flatnonzero(ok)
    # longest first within the budget: the shortest ops are what a limit drops
    n = budget.take(len(rows), f"profiler events (rank {r})")
    if n < len(rows):
        rows = rows[np.argsort(-np.asarray(ev["dur_ns"])[rows], kind="stable")[:n]]
    ts = np.asarray(shift(np.asarray(ev["ts_ns"])[rows]), np.int64)
    dur = np.asarray(ev["dur_ns"])[rows]
    gpu = np.asarray(ev["is_gpu"])[rows]
    tid = np.asarray(ev["tid"])[rows]
    stream = np.asarray(ev["stream"])[rows]
    coll = _kernel_collectives(t)
    insts = m.setdefault("kernel_insts", {})
    for k, row in enumerate(rows):
        track = f"gpu stream {stream[k]}" if gpu[k] else f"cpu {tid[k]}"
        args = coll.get(int(row)) if gpu[k] else None
        m["slices"].append((r, track, str(ev["name"][int(row)]), str(cat[int(row)]), int(ts[k]),
                            int(max(0, dur[k])), dict(args) if args else None))
        if args:
            insts.setdefault((args["group"], args["seq"]), []).append((int(ts[k]), len(m["slices"]) - 1))
    mem = t.tables.memory
    if len(mem):
        mts = np.asarray(shift(np.asarray(mem["ts_ns"])), np.int64)
        tot = np.asarray(mem["total_allocated"])
        lo, hi = int(ts.min()) if len(ts) else 0, int((ts + dur).max()) if len(ts) else 0
        idx = np.flatnonzero((mts >= lo) & (mts <= hi))
        n = budget.take(min(len(idx), MAX_MEMORY_SAMPLES), f"memory samples (rank {r})")
        for i in idx[:: max(1, len(idx) // max(1, n))][:n]:
            m["counters"].append((r, "memory allocated (MB)", int(mts[i]),
                                  {"allocated": round(float(tot[i]) / 2 ** 20, 3)}))


def _kernel_collectives(t) -> dict:
    """Event row -> args of the GPU collective kernels that carry the trace's own process group
    and sequence number (NCCL / RCCL kernels of PyTorch 2.x traces)."""
    comm = t.tables.comm
    if comm.empty or "seq" not in comm or "pg_name" not in comm:
        return {}
    gpu = t.tables.events["is_gpu"]
    cols = {c: comm[c] for c in ("collective", "in_nelems", "group_size") if c in comm}
    out = {}
    for i in range(len(comm)):
        row, seq = int(comm["row"][i]), comm["seq"][i]
        if not gpu[row] or seq is None or int(seq) < 0 or comm["pg_name"][i] is None:
            continue
        a = {"group": str(comm["pg_name"][i]), "seq": int(seq)}
        for c, col in cols.items():
            if col[i] is not None:
                a[c] = col[i] if isinstance(col[i], str) else int(col[i])
        out[row] = a
    return out


def kernel_flows(m, budget) -> None:
    """The same collective's kernels across ranks (process group, sequence number): an arrow
    from each member's kernel to the one that started last, marked ``last_to_arrive``."""
    insts = m.pop("kernel_insts", {})
    for members in insts.values():
        if len(members) < 2:
            continue
        if budget.take(2 * (len(members) - 1), "collective kernel flows") < 2 * (len(members) - 1):
            continue
        _join_at_last(m, members)


def _build_bare(run, steps, ranks, findings, max_bytes) -> dict:
    """A folder of plain torch.profiler traces: every rank's ops and kernels, on one clock as
    far as the traces allow (their wall clocks, shifted by matched collective ends)."""
    traces = run.traces()
    ranks = sorted(traces) if ranks is None else [r for r in ranks if r in traces]
    shift, info, how = align_traces({r: traces[r] for r in ranks})
    m = {"slices": [], "flows": [], "counters": [], "instants": [], "processes": []}
    budget = _Budget(max_bytes)
    for i, r in enumerate(ranks):
        u = info.get(r, {}).get("uncertainty_us")
        m["processes"].append({"rank": r, "name": f"rank {r}", "sort": i,
                               "label": f"clock ±{u:g} µs" if isinstance(u, (int, float)) else
                               "clock: host wall clock"})
        t = traces[r]
        sset = set(steps) if steps is not None else None
        st = t.tables.steps
        for j in range(len(st)):
            k = int(st["step"][j])
            if sset is None or k in sset:
                a = int(st["start_ns"][j]) - shift.get(r, 0)
                m["slices"].append((r, "steps", f"ProfilerStep#{k}", "step", a,
                                    int(st["end_ns"][j]) - int(st["start_ns"][j]), {"step": k}))
        add_trace(m, r, t, lambda ns, s=shift.get(r, 0): np.asarray(ns, np.int64) - s, sset, budget)
    kernel_flows(m, budget)
    chosen = {r: traces[r] for r in ranks[:MAX_PATH_TRACES]}
    all_steps = sorted({int(x) for t in chosen.values() for x in t.tables.steps["step"]})
    _critical_profiled(m, run, chosen, [s for s in all_steps if steps is None or s in set(steps)],
                       shift)
    m["meta"] = {"ranks": ranks, "ranks_selection": f"every trace of the folder ({len(ranks)})",
                 "steps": steps, "steps_selection": "all" if steps is None else "chosen with --steps",
                 "world_size": run.world_size,
                 "clock": {"how": how, "per_rank": {str(r): info.get(r, {}) for r in ranks}},
                 "limit": {"max_bytes": max_bytes, "dropped": budget.dropped}}
    return m


def _join_at_last(m: dict, members: list) -> None:
    """One collective's slices on its ranks, (start, slice index) each: the last to start is
    marked "last to arrive" and every other one gets a flow arrow to it."""
    members.sort()
    last = members[-1][1]
    sl = m["slices"][last]
    m["slices"][last] = sl[:2] + (sl[2] + " (last to arrive)",) + sl[3:6] + (
        {**sl[6], "last_to_arrive": True},)
    for _, idx in members[:-1]:
        m["flows"].append((idx, last))
