"""The step graphs of many steps at once and their longest paths: what _cp_coarse.step_graph and
_cp_graph.longest_path give step by step, computed over the disjoint union of the steps' graphs
with numpy (a run whose ring keeps every step's ops has tens of thousands of small graphs; one
at a time they cost ~1 ms each in Python and numpy calls).

The union keeps each step's nodes and edges in one contiguous block, in the order step_graph
gives them (nodes: the ranks' points by rank then time, then the joins by instance code;
edges: work, then each op's arrival -> join, then join -> end), so edge and node ids within a
block are step_graph's plus the block's start. The frontier pass of longest_path visits each
node in the same round and breaks ties among its in-edges by the same (block-shifted) edge
order, so every step's distances, predecessors and path are the ones longest_path returns on
its own graph.
"""

from __future__ import annotations

import numpy as np

from trainprof.analyzers._cp_graph import COLL, DEEP, DEP, KIND_INDEX, KINDS, WORK, Arrays, uniq

CHUNK_ITEMS = 250_000  # windows + ops per union graph (bounds its memory)


def chunks(prep: dict, steps) -> list[np.ndarray]:
    """``steps`` (sorted) cut into runs of at most CHUNK_ITEMS windows + ops (one step at least)."""
    steps = np.asarray(sorted(steps), np.int64)
    if not len(steps):
        return []
    w, ops = prep["win"], prep["ops"]
    n = np.searchsorted(w["step"], steps, "right") - np.searchsorted(w["step"], steps, "left")
    if ops is not None:
        n = n + np.searchsorted(ops["step"], steps, "right") - np.searchsorted(ops["step"], steps, "left")
    out, lo, acc = [], 0, 0
    for i, c in enumerate(n.tolist()):
        if acc and acc + c > CHUNK_ITEMS:
            out.append(steps[lo:i])
            lo, acc = i, 0
        acc += c
    out.append(steps[lo:])
    return out


def chunk_graphs(prep, steps):
    """step_graphs() of ``steps`` a chunk at a time (chunks()), the chunks that have one."""
    if not steps:
        return
    for chunk in chunks(prep, steps):
        b = step_graphs(prep, chunk)
        if b is not None:
            yield b


def step_graphs(prep: dict, steps: np.ndarray):
    """(union Arrays, steps, node_lo, edge_lo) of the graphs of ``steps`` (sorted, each with a
    step window and an op); block i of the union is step_graph(prep, steps[i]) shifted by
    node_lo[i] / edge_lo[i] (both with a final end entry). None when a key would overflow."""
    w, ops = prep["win"], prep["ops"]
    sel = np.isin(w["step"], steps)
    wk, wr = w["step"][sel], w["rank"][sel]
    o = np.lexsort((wr, wk))
    wk, wr = wk[o], wr[o]
    ws, we = w["start"][sel][o], w["end"][sel][o]
    wd = w["dend"][sel][o]
    n_steps = len(steps)
    wsi = np.searchsorted(steps, wk)  # each window's step index
    nw = len(wk)
    # ops of those steps on a rank with a window there, in their order (by step, stable)
    osel = np.isin(ops["step"], steps)
    oo = {k: v[osel] for k, v in ops.items()}
    osi = np.searchsorted(steps, oo["step"])
    rmin, rmax = int(wr.min()), int(wr.max())
    wkey = wsi * (rmax - rmin + 1) + (wr - rmin)  # sorted: windows by step, then rank
    okey = osi * (rmax - rmin + 1) + np.clip(oo["rank"] - rmin, 0, None)
    pos = np.clip(np.searchsorted(wkey, okey), 0, nw - 1)
    m = (wkey[pos] == okey) & (oo["rank"] >= rmin) & (oo["rank"] <= rmax)
    oo = {k: v[m] for k, v in oo.items()}
    pos, osi = pos[m], osi[m]
    lo_, hi_ = ws[pos], we[pos]
    enq, wait, fin = (np.clip(oo[k], lo_, hi_) for k in ("enq", "wait", "end"))
    wait = np.maximum(wait, enq)
    fin = np.maximum(fin, wait)
    # per step: base (earliest time) and span, as step_graph's
    first_w = np.searchsorted(wsi, np.arange(n_steps))
    base = np.minimum.reduceat(ws, first_w)
    top = np.maximum.reduceat(we, first_w)
    if len(enq):
        np.minimum.at(base, osi, enq)
        np.maximum.at(top, osi, fin)
    span = int((top - base).max()) + 1
    if nw * span >= (1 << 62):
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
    same = pwin[1:] == pwin[:-1]
    a_i = np.flatnonzero(same)
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
    return g, steps, node_lo, edge_lo


def _sorted_unique(a: np.ndarray) -> np.ndarray:
    """np.unique of an int array by sorting (numpy's hash table for values only costs several
    times more on millions of distinct keys)."""
    a = np.sort(a)
    return a[np.r_[True, a[1:] != a[:-1]]] if len(a) else a


def _place_data(prep, wk, wr, ws, dw, epos, ta, tb):
    """_cp_coarse._place_data over every window at once (``epos``: each work edge's window)."""
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


def longest_paths(g: Arrays, node_lo, edge_lo, weights=None) -> list:
    """Per block of the union: (length ns, path as the block's own edge ids) as
    _cp_graph.longest_path gives on that block's graph alone (with ``weights``, one per edge of
    the union, when given), or None where it raises (a cycle) or takes its one-edge-at-a-time
    way (DEEP: that block is to be done on its own)."""
    n = len(g.node_ts)
    nb = len(node_lo) - 1
    if n == 0:
        return [(0, np.zeros(0, np.int64))] * nb
    nblk = np.repeat(np.arange(nb), np.diff(node_lo))
    # ranks per block (longest_path's DEEP test counts the distinct node ranks)
    rk = _sorted_unique(nblk * (int(g.node_rank.max()) + 2) + (g.node_rank + 1))
    nranks = np.bincount(rk // (int(g.node_rank.max()) + 2), minlength=nb)
    deep = np.diff(node_lo) / np.maximum(1, nranks) > DEEP
    w = g.weight if weights is None else np.maximum(np.asarray(weights, np.int64), 0)
    order = np.argsort(g.src, kind="stable")
    starts = np.searchsorted(g.src[order], np.arange(n + 1))
    indeg = np.bincount(g.dst, minlength=n).astype(np.int64)
    dist = np.zeros(n, np.int64)
    pred = np.full(n, -1, np.int64)
    seen = np.zeros(n, bool)
    frontier = np.flatnonzero(indeg == 0)
    while len(frontier):
        seen[frontier] = True
        lo, hi = starts[frontier], starts[frontier + 1]
        cnt = hi - lo
        if not cnt.sum():
            break
        idx = np.repeat(lo - np.cumsum(np.r_[0, cnt[:-1]]), cnt) + np.arange(cnt.sum())
        es = order[idx]
        dst = g.dst[es]
        cand = dist[g.src[es]] + w[es]
        srt = np.lexsort((es, cand, dst))
        last = np.r_[dst[srt][1:] != dst[srt][:-1], True]
        bd, bc, be = dst[srt][last], cand[srt][last], es[srt][last]
        better = (bc > dist[bd]) | ((bc == dist[bd]) & (pred[bd] < 0))
        dist[bd[better]] = bc[better]
        pred[bd[better]] = be[better]
        np.subtract.at(indeg, dst, 1)
        touched = uniq(dst)
        frontier = touched[indeg[touched] == 0]
    cyc = np.bincount(nblk[~seen], minlength=nb) > 0
    length = np.maximum.reduceat(dist, node_lo[:-1])
    hit = np.flatnonzero(dist == length[nblk])
    end = hit[np.r_[True, nblk[hit][1:] != nblk[hit][:-1]]]  # the first node at the max per block
    # walk the predecessors back, every block at once
    steps_e, blk_e = [], []
    cur, blk = end.copy(), np.arange(nb)
    act = pred[cur] >= 0
    cur, blk = cur[act], blk[act]
    while len(cur):
        e = pred[cur]
        steps_e.append(e)
        blk_e.append(blk)
        cur = g.src[e]
        act = pred[cur] >= 0
        cur, blk = cur[act], blk[act]
    out: list = [None] * nb
    if steps_e:
        e_all, b_all = np.concatenate(steps_e), np.concatenate(blk_e)
        o = np.argsort(b_all, kind="stable")
        e_all, b_all = e_all[o], b_all[o]
        cut = np.searchsorted(b_all, np.arange(nb + 1))
    else:
        e_all, cut = np.zeros(0, np.int64), np.zeros(nb + 1, np.int64)
    for i, (ln, a, b, el, bad) in enumerate(zip(length.tolist(), cut[:-1].tolist(), cut[1:].tolist(),
                                               edge_lo[:-1].tolist(), (cyc | deep).tolist())):
        if not bad:
            out[i] = (int(ln), e_all[a:b][::-1] - el)
    return out


def summaries(g: Arrays, paths: list) -> list[tuple[dict, list]]:
    """Per path (edge ids of the union ``g``): (_cp_graph.attribute(g, path),
    critical_path._path_rows(g, path)), for every path at once (the sums are of whole ns: the
    same floats in any order)."""
    n = len(paths)
    lens = np.fromiter((len(p) for p in paths), np.int64, n)
    e = np.concatenate(paths).astype(np.int64) if n else np.zeros(0, np.int64)
    blk = np.repeat(np.arange(n), lens)
    parts = g.parts[e].astype(float)
    rk = g.rank[e]
    tot = np.zeros((n, len(KINDS)))
    np.add.at(tot, blk, parts)
    # by (path, rank), ranks ascending
    rows_by = [[] for _ in range(n)]
    if len(e):
        lo = int(rk.min())
        key = blk * (int(rk.max()) - lo + 1) + (rk - lo)
        o = np.argsort(key, kind="stable")
        ks = key[o]
        st = np.flatnonzero(np.r_[True, ks[1:] != ks[:-1]])
        sub = np.add.reduceat(parts[o], st, axis=0)
        ssum = sub.sum(axis=1)
        for b, r, s_, v in zip(blk[o][st].tolist(), rk[o][st].tolist(), ssum.tolist(), sub.tolist()):
            if s_ > 0:
                rows_by[b].append((r, s_, v))
    # the path's rows: edges with weight
    w = g.weight[e]
    kind = np.where(g.parts[e].any(axis=1), np.argmax(g.parts[e], axis=1), -1) if len(e) else \
        np.zeros(0, np.int64)
    end = g.node_ts[g.dst[e]]
    labels = g.label[e].tolist() if g.label is not None else [None] * len(e)
    prow = [[] for _ in range(n)]
    for b, r, k, ts, ww, lab in zip(blk.tolist(), rk.tolist(), kind.tolist(), end.tolist(),
                                    w.tolist(), labels):
        if ww:
            prow[b].append((r, KINDS[k] if k >= 0 else "idle", ts - ww, ts, lab))
    out = []
    for i in range(n):
        if not lens[i]:
            out.append(({"by_rank": {}, "by_kind": {}, "by_rank_kind": {}}, []))
            continue
        by_rank, both = {}, {}
        for r, s_, v in rows_by[i]:
            by_rank[r] = s_
            for k, x in zip(KINDS, v):
                if x > 0:
                    both[(r, k)] = x
        out.append(({"by_rank": by_rank, "by_kind": dict(zip(KINDS, tot[i].tolist())),
                     "by_rank_kind": both}, prow[i]))
    return out
