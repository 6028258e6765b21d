"""The step graph from the always-on log, for every step: each rank's step as a chain of work
between its collectives, collectives as joins across their group, p2p send -> recv as a join
of the two sides.

Per rank and step: nodes at the step's start and end, at the end of its data wait, at each
logged op's enqueue, at the start of its wait (sync ops: the enqueue; async ops: end −
blocked_ms) and at its end. Consecutive nodes are joined by a work edge unless the interval lies
inside a wait (there the rank did nothing but wait for the others); its kinds: ``data`` for the
data loader's wait (data.jsonl gives its length only: it is placed at the start of the first
stretch of the rank's own work long enough to hold it, else at the step's start), ``compute``
for the rest (the log cannot tell host work from compute: the
profiled steps' path, from the traces, can). A collective instance (group, ordinal) is a join
node at its last member's arrival: each member's enqueue -> join (no weight), join -> each
member's end (``communication``: the time after the last arrival, or after the member started
waiting, whichever is later). The k-th send a->b and the k-th recv on b from a are one join of
two. Built with numpy, many steps at once as one disjoint union (``graphs``; step_graph: one
step; analyzers/_cp_batch.py walks the union's paths).
"""

from __future__ import annotations

import numpy as np

from trainprof.analyzers._cp_graph import COLL, DEP, KIND_INDEX, KINDS, WORK, Arrays
from trainprof.analyzers import _align, collectives as coll


def prepare(run, al) -> dict:
    """Aligned inputs of the step graphs: per-(rank, step) step windows and data waits, and the
    log's ops as arrays sorted by step."""
    out = {"win": {}, "ops": None, "inst_names": []}
    steps = run.steps()
    if steps.empty:
        return out
    s = steps.drop_duplicates(["rank", "step"], keep="last").dropna(subset=["start_ns", "end_ns"])
    r_ = s["rank"].to_numpy(np.int64)
    k_ = s["step"].to_numpy(np.int64)
    a_ = s["start_ns"].to_numpy(np.int64).copy()
    b_ = s["end_ns"].to_numpy(np.int64).copy()
    align_cols(al, r_, a_, b_)
    dw = np.zeros(len(s))
    d = run.frame("data")
    if not d.empty and {"rank", "step", "wait_ms"} <= set(d.columns):
        w = d[["rank", "step", "wait_ms"]].dropna().groupby(["rank", "step"])["wait_ms"].sum()
        dw = _lookup(w, r_, k_)
    o = np.argsort(k_, kind="stable")  # by step: a step's windows are one slice
    r_, k_, a_, b_, dw = r_[o], k_[o], a_[o], b_[o], dw[o]
    out["win"] = {"rank": r_, "step": k_, "start": a_, "end": np.maximum(b_, a_),
                  "dend": np.minimum(np.maximum(b_, a_), a_ + (dw * 1e6).astype(np.int64))}
    df = coll._frame(run)
    if df.empty:
        return out
    df = df[df["end_ns"].notna().to_numpy() & df["step"].notna().to_numpy()]
    if df.empty:
        return out
    ranks = df["rank"].to_numpy(np.int64)
    enq = df["enqueue_ns"].astype(np.int64).to_numpy().copy()
    end = df["end_ns"].astype(np.int64).to_numpy().copy()
    align_cols(al, ranks, enq, end)
    blocked = (np.nan_to_num(df["blocked_ms"].astype(float).to_numpy()) * 1e6).astype(np.int64)
    wait = np.maximum(enq, end - blocked)
    inst, names = _instances(df, ranks)
    step = df["step"].astype(np.int64).to_numpy()
    keep = inst >= 0
    o = np.argsort(step[keep], kind="stable")
    out["ops"] = {"rank": ranks[keep][o], "step": step[keep][o], "enq": enq[keep][o],
                  "wait": wait[keep][o], "end": end[keep][o], "inst": inst[keep][o],
                  "op": strs(df["op"])[keep][o]}
    out["inst_names"] = names
    return out


def _lookup(w, ranks, steps) -> np.ndarray:
    """w[(rank, step)] (a Series on a sorted (rank, step) index) per (rank, step), 0 where absent."""
    if not len(w) or not len(ranks):
        return np.zeros(len(ranks))
    kr = w.index.get_level_values(0).to_numpy(np.int64)
    ks = w.index.get_level_values(1).to_numpy(np.int64)
    lo = int(min(ks.min(), steps.min()))
    width = int(max(ks.max(), steps.max())) - lo + 1
    key, want = (kr * width + (ks - lo)), (ranks * width + (steps - lo))
    o = np.argsort(key, kind="stable")
    key, vals = key[o], w.to_numpy(float)[o]
    i = np.clip(np.searchsorted(key, want), 0, len(key) - 1)
    return np.where(key[i] == want, vals[i], 0.0)


def align_cols(al, ranks, *cols) -> None:
    """Each column aligned in place, a rank's rows at a time (al: analyzers._align)."""
    _align.align_cols(al, ranks, *cols)


def strs(col) -> np.ndarray:
    """A string column as an object array (categorical: through its codes, never astype(str),
    which costs seconds on a million rows)."""
    if hasattr(col, "cat"):
        cats = np.asarray(col.cat.categories.astype(object))
        codes = col.cat.codes.to_numpy()
        out = cats[np.clip(codes, 0, None)] if len(cats) else np.full(len(codes), None, object)
        return np.where(codes >= 0, out, None)
    return col.to_numpy(object)


def _instances(df, ranks) -> tuple[np.ndarray, list]:
    """An instance code per record (-1: not joinable) and each code's name."""
    p2p = df["p2p"].to_numpy(bool)
    gcol = df["group"]
    gcode = gcol.cat.codes.to_numpy().astype(np.int64) if hasattr(gcol, "cat") else \
        np.unique(gcol.to_numpy(object).astype(str), return_inverse=True)[1]
    gnames = strs(gcol)
    ordinal = df["ordinal"].to_numpy().astype(np.int64)
    inst = np.full(len(df), -1, np.int64)
    names: list = []
    c = ~p2p & (ordinal >= 0) & (gcode >= 0)
    if c.any():
        combo = gcode[c] * (int(ordinal.max()) + 1) + ordinal[c]
        uniq, first, codes = np.unique(combo, return_index=True, return_inverse=True)
        inst[c] = codes
        gn, od = gnames[c][first], ordinal[c][first]
        names.extend(("c", str(a), int(b)) for a, b in zip(gn, od))
    rows_p = np.flatnonzero(p2p)
    if len(rows_p):
        peer = df["peer"].to_numpy(object)
        op = strs(df["op"])
        keys, rows, count = [], [], {}
        for i in rows_p:
            pv = peer[i]
            if pv is None or (isinstance(pv, float) and np.isnan(pv)):
                continue
            src, dst = (int(ranks[i]), int(pv)) if op[i] == "send" else (int(pv), int(ranks[i]))
            ck = (gnames[i], op[i], src, dst)
            k = count.get(ck, 0)
            count[ck] = k + 1
            keys.append((str(gnames[i]), src, dst, k))
            rows.append(i)
        if rows:
            codes, uniq = _codes(keys)
            inst[np.asarray(rows)] = codes + len(names)
            names.extend(("p",) + u for u in uniq)
    return inst, names


def _codes(keys: list) -> tuple[np.ndarray, list]:
    index: dict = {}
    codes = np.fromiter((index.setdefault(k, len(index)) for k in keys), np.int64, len(keys))
    return codes, list(index)


def step_ids(prep: dict) -> list[int]:
    w = prep.get("win") or {}
    return [int(x) for x in np.unique(w["step"])] if w else []


def op_steps(prep: dict) -> set[int]:
    """The steps in which some rank with a step window logged an op: their graphs join ranks;
    every other step's graph is one chain per rank (chain_paths)."""
    w, ops = prep.get("win") or {}, prep.get("ops")
    if not w or ops is None or not len(ops["step"]):
        return set()
    lo = int(min(w["step"].min(), ops["step"].min()))
    width = int(max(w["step"].max(), ops["step"].max())) - lo + 1
    have = np.isin(ops["rank"] * width + (ops["step"] - lo), w["rank"] * width + (w["step"] - lo))
    return {int(x) for x in np.unique(ops["step"][have])}


def chain_paths(prep: dict, skip: set) -> dict:
    """{step: (length ns, rank, start, end, data ns, work edges before the path's)} of every
    step but ``skip`` at once: each rank's step is one work edge from its start to its end
    (its data wait at the start: nothing logged in it to place it after), so the longest path
    is the longest window, the lowest rank's on a tie (step_graph's node order), and its
    edge id counts the ranks before it with a window longer than 0 (one edge each)."""
    rows = _chain_rows(prep, skip, keep=False)
    if rows is None:
        return {}
    k, r, a, b, dur, data, starts, grp = rows
    longest = np.maximum.reduceat(dur, starts)
    # the first row of each step with its longest window; edges before it: windows > 0
    hit = dur == longest[grp]
    pos = np.arange(len(k))
    best = np.full(len(starts), len(k))
    np.minimum.at(best, grp[hit], pos[hit])
    nonzero = np.cumsum(dur > 0) - (dur > 0)  # windows > 0 before each row, over all steps
    before = nonzero[best] - nonzero[starts]
    return {int(k[s]): (int(longest[i]), int(r[j]), int(a[j]), int(b[j]), int(data[j]),
                        int(before[i]))
            for i, (s, j) in enumerate(zip(starts, best))}


def _chain_rows(prep: dict, steps, keep: bool):
    """The step windows of ``steps`` (``keep``) or of every other step, by step then rank, as
    (step, rank, start, end, length, data ns, the first row of each step, each row's step
    index), or None where there are none."""
    w = prep.get("win") or {}
    if not w or not len(w["step"]):
        return None
    sel = np.isin(w["step"], np.fromiter(steps, np.int64, len(steps)))
    if not keep:
        sel = ~sel
    k, r = w["step"][sel], w["rank"][sel]
    if not len(k):
        return None
    a, b, d = w["start"][sel], w["end"][sel], w["dend"][sel]
    o = np.lexsort((r, k))
    k, r, a, b, d = k[o], r[o], a[o], b[o], d[o]
    first = np.r_[True, k[1:] != k[:-1]]
    return (k, r, a, b, b - a, np.clip(np.minimum(b, d) - a, 0, None), np.flatnonzero(first),
            np.cumsum(first) - 1)


def chain_replay(prep: dict, steps, change: dict) -> dict:
    """{step: longest path ns with ``change`` applied} of chain steps (no logged op: each rank's
    step one work edge, its window, its data wait at the start) at once: what
    critical_path._changed and longest_path give on those steps' graphs, the same float
    arithmetic per edge (a rank's work scaled, its data or compute part taken off, truncated
    to ns), the longest path the longest changed edge."""
    rows = _chain_rows(prep, steps, keep=True)
    if rows is None:
        return {}
    k, r, _, _, dur, data, starts, grp = rows
    edge = dur > 0  # a rank whose window is 0 long has no edge
    new = dur.astype(np.float64)
    if "remove_excess" in change:
        me = int(change["remove_excess"])
        mine_row, oth = edge & (r == me), edge & (r != me)
        n_oth = np.bincount(grp[oth], minlength=len(starts))
        med = _grouped_median(grp[oth], new[oth], len(starts))
        mine = np.zeros(len(starts))
        mine[grp[mine_row]] = new[mine_row]
        ok = (mine > 0) & (n_oth > 0)
        f = np.ones(len(starts))
        f[ok] = np.minimum(1.0, med[ok] / mine[ok])
        rows = mine_row & ok[grp]
        new[rows] *= f[grp[rows]]
        out = new.astype(np.int64)
    elif "scale" in change:
        c = change["scale"]
        rk, kind, fac = c.get("rank"), c.get("kind"), float(c.get("factor", 0.0))
        on = (np.isin(r, [int(x) for x in rk]) if isinstance(rk, (list, tuple)) else r == int(rk)) \
            if rk is not None else np.ones(len(r), bool)
        on &= edge
        if kind is None:
            new[on] *= fac
        else:
            KIND_INDEX[kind]  # (an unknown kind is an error, as on a graph)
            part = {"data": data, "compute": dur - data}.get(kind, np.zeros(len(r), np.int64))
            new[on] -= part[on].astype(np.float64) * (1 - fac)
        out = np.maximum(new, 0).astype(np.int64)
    elif "hide_collective" in change:  # no collective in a chain step
        out = dur
    else:
        raise ValueError(f"unknown change {sorted(change)}")
    length = np.maximum(np.maximum.reduceat(np.where(edge, out, 0), starts), 0)
    return dict(zip(k[starts].tolist(), length.tolist()))


def _grouped_median(g, v, n_groups: int) -> np.ndarray:
    """np.median of ``v`` within each group code of ``g`` (NaN for a group without values)."""
    out = np.full(n_groups, np.nan)
    if not len(v):
        return out
    o = np.lexsort((v, g))
    g, v = g[o], v[o]
    cnt = np.bincount(g, minlength=n_groups)
    st = np.concatenate([[0], np.cumsum(cnt)[:-1]])
    has = cnt > 0
    lo, hi = st[has] + (cnt[has] - 1) // 2, st[has] + cnt[has] // 2
    out[has] = (v[lo] + v[hi]) / 2.0
    return out


def step_graph(prep: dict, step: int, ranks=None) -> Arrays | None:
    """The graph of one step (over ``ranks``, default every rank with a step record)."""
    w = prep["win"]
    if not w:
        return None
    lo, hi = np.searchsorted(w["step"], [step, step + 1])
    sel = np.arange(lo, hi)
    if ranks is not None:
        sel = sel[np.isin(w["rank"][sel], list(ranks))]
    if not len(sel):
        return None
    sel = sel[np.argsort(w["rank"][sel], kind="stable")]
    ops = prep["ops"]
    if ops is not None:
        lo, hi = np.searchsorted(ops["step"], [step, step + 1])
        o = {k: v[lo:hi] for k, v in ops.items()}
    else:
        o = {k: np.zeros(0, np.int64) for k in ("rank", "step", "enq", "wait", "end", "inst")}
        o["op"] = np.zeros(0, object)
    return graphs(prep, np.array([step], np.int64), {k: v[sel] for k, v in w.items()}, o)[0]


def graphs(prep: dict, steps: np.ndarray, win: dict, ops: dict, limit: int | None = None):
    """(Arrays, node_lo, edge_lo): the disjoint union of the graphs of ``steps`` (sorted, each
    with a window), from ``win``, their step windows by step then rank, and ``ops``, their ops
    by step (an op of a rank without a window that step is left out). Block i holds step
    steps[i]'s nodes from node_lo[i] (its ranks' points by rank then time, then its joins by
    instance code) and edges from edge_lo[i] (work, then each op's arrival -> join, then join
    -> end); both end with a final end entry. None when a point's key (window index × the
    longest step's span) would reach ``limit``."""
    wk, wr, ws, we, wd = win["step"], win["rank"], win["start"], win["end"], win["dend"]
    n_steps, nw = len(steps), len(wk)
    wsi = np.searchsorted(steps, wk)  # each window's step index
    # each op's window: the one of its step and rank
    osi = np.searchsorted(steps, ops["step"])
    rmin, rmax = int(wr.min()), int(wr.max())
    wkey = wsi * (rmax - rmin + 1) + (wr - rmin)  # sorted: windows by step, then rank
    okey = osi * (rmax - rmin + 1) + np.clip(ops["rank"] - rmin, 0, None)
    pos = np.clip(np.searchsorted(wkey, okey), 0, nw - 1)
    m = (wkey[pos] == okey) & (ops["rank"] >= rmin) & (ops["rank"] <= rmax)
    oo = {k: v[m] for k, v in ops.items()}
    pos, osi = pos[m], osi[m]
    # clip each op into its rank's step window
    lo_, hi_ = ws[pos], we[pos]
    enq, wait, fin = (np.clip(oo[k], lo_, hi_) for k in ("enq", "wait", "end"))
    wait = np.maximum(wait, enq)
    fin = np.maximum(fin, wait)
    # per step: base (earliest time) and span
    first_w = np.searchsorted(wsi, np.arange(n_steps))
    base = np.minimum.reduceat(ws, first_w)
    top = np.maximum.reduceat(we, first_w)
    if len(enq):
        np.minimum.at(base, osi, enq)
        np.maximum.at(top, osi, fin)
    span = int((top - base).max()) + 1
    if limit is not None and nw * span >= limit:
        return None
    wbase = base[wsi]

    def key(wi, ts):
        return wi.astype(np.int64) * span + (ts - wbase[wi])

    widx = np.arange(nw)
    pts = _sorted_unique(np.concatenate([key(widx, ws), key(widx, we), key(pos, enq),
                                         key(pos, wait), key(pos, fin)]))
    n_pts = len(pts)
    pwin = pts // span
    pts_ts = pts % span + wbase[pwin]
    node_rank = wr[pwin]
    # chain edges between consecutive points of a window, unless inside a wait
    a_i = np.flatnonzero(pwin[1:] == pwin[:-1])
    wk_, fk_ = np.sort(key(pos, wait)), np.sort(key(pos, fin))
    open_at = np.searchsorted(wk_, pts, "right") - np.searchsorted(fk_, pts, "right")
    a_i = a_i[open_at[a_i] <= 0]
    b_i = a_i + 1
    ta, tb = pts_ts[a_i], pts_ts[b_i]
    dstart, dend = _place_data(prep, wk, wr, ws, wd - ws, pwin[a_i], ta, tb)
    data = np.clip(np.minimum(tb, dend) - np.maximum(ta, dstart), 0, None)
    parts_w = np.zeros((len(a_i), len(KINDS)), np.int64)
    parts_w[:, KIND_INDEX["data"]] = data
    parts_w[:, KIND_INDEX["compute"]] = (tb - ta) - data
    # joins: per step, one per instance code (ascending)
    n_ops = len(enq)
    arr_node = np.searchsorted(pts, key(pos, enq))
    fin_node = np.searchsorted(pts, key(pos, fin))
    inst = oo["inst"]
    combo = osi * (int(inst.max()) + 1 if n_ops else 1) + inst
    ucombo, inv = np.unique(combo, return_inverse=True)
    inv = inv.reshape(-1)
    t_j = np.full(len(ucombo), np.iinfo(np.int64).min)
    np.maximum.at(t_j, inv, enq)
    jstep = ucombo // (int(inst.max()) + 1) if n_ops else np.zeros(0, np.int64)
    comm = np.clip(fin - np.maximum(t_j[inv], wait), 0, None)
    # nodes by step: its points, then its joins
    nstep = np.concatenate([wsi[pwin], jstep])
    nperm = np.argsort(nstep, kind="stable")
    newid = np.empty(len(nstep), np.int64)
    newid[nperm] = np.arange(len(nstep))
    j_node = n_pts + np.arange(len(ucombo))
    src = newid[np.concatenate([a_i, arr_node, j_node[inv]])]
    dst = newid[np.concatenate([b_i, j_node[inv], fin_node])]
    # edges by step: work, arrivals, transfers
    estep = np.concatenate([wsi[pwin[a_i]], osi, osi])
    eperm = np.argsort(estep, kind="stable")
    parts_c = np.zeros((n_ops, len(KINDS)), np.int64)
    parts_c[:, KIND_INDEX["communication"]] = comm
    label = np.concatenate([np.full(len(a_i), None, object), np.full(n_ops, None, object),
                            np.asarray(oo["op"], object)])
    g = Arrays(np.concatenate([pts_ts, t_j])[nperm],
               np.concatenate([node_rank, np.full(len(ucombo), -1)])[nperm],
               src[eperm], dst[eperm],
               np.concatenate([tb - ta, np.zeros(n_ops, np.int64), comm])[eperm],
               np.concatenate([node_rank[a_i], oo["rank"], oo["rank"]])[eperm],
               np.concatenate([parts_w, np.zeros((n_ops, len(KINDS)), np.int64), parts_c])[eperm],
               np.concatenate([np.full(len(a_i), WORK), np.full(n_ops, DEP), np.full(n_ops, COLL)])[eperm],
               np.concatenate([np.full(len(a_i), -1), np.full(n_ops, -1), inst])[eperm],
               label[eperm])
    g.inst_names = prep.get("inst_names", [])
    node_lo = np.searchsorted(nstep[nperm], np.arange(n_steps + 1))
    edge_lo = np.searchsorted(estep[eperm], np.arange(n_steps + 1))
    return g, node_lo, edge_lo


def _sorted_unique(a: np.ndarray) -> np.ndarray:
    """np.unique of an int array by sorting (numpy's hash table for values only costs several
    times more on millions of distinct keys)."""
    a = np.sort(a)
    return a[np.r_[True, a[1:] != a[:-1]]] if len(a) else a


def _place_data(prep, wk, wr, ws, dw, epos, ta, tb):
    """Where each window's data wait lies (the log gives its length only): at the start of the
    first stretch of the rank's own work long enough to hold it (the batch is drawn between
    the ops around it: after the previous step's closing collectives, before the first
    forward), else at the step's start. Per work edge (``epos``: its window): (data start,
    data end); also kept in ``prep["data_at"][(rank, step)]``."""
    start = ws.copy()
    has = dw > 0
    if has.any() and len(epos):
        fits = (tb - ta) >= 0.9 * dw[epos]
        fits &= has[epos]
        idx = np.flatnonzero(fits)
        if len(idx):
            first_pos, first = np.unique(epos[idx], return_index=True)
            start[first_pos] = ta[idx[first]]
    at = prep.setdefault("data_at", {})
    for i in np.flatnonzero(has).tolist():
        at[(int(wr[i]), int(wk[i]))] = (int(start[i]), int(start[i] + dw[i]))
    return start[epos], (start + dw)[epos]
