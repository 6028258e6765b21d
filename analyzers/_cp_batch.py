"""The longest paths of many steps at once: what _cp_coarse.step_graph and
_cp_graph.longest_path give step by step, computed over the disjoint union of a chunk of steps'
graphs with numpy (a run whose ring keeps every step's ops has tens of thousands of small
graphs; one at a time they cost ~1 ms each in Python and numpy calls).

The union (_cp_coarse.graphs, of which step_graph is the one-step case) keeps each step's nodes
and edges in one contiguous block, so edge and node ids within a block are step_graph's plus
the block's start. The frontier pass of longest_path visits each
node in the same round and breaks ties among its in-edges by the same (block-shifted) edge
order, so every step's distances, predecessors and path are the ones longest_path returns on
its own graph.
"""

from __future__ import annotations

import numpy as np

from trainprof.analyzers import _cp_coarse, _cp_graph
from trainprof.analyzers._cp_coarse import _sorted_unique
from trainprof.analyzers._cp_graph import DEEP, KINDS, Arrays

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
    o = np.lexsort((w["rank"][sel], w["step"][sel]))
    osel = np.isin(ops["step"], steps)
    b = _cp_coarse.graphs(prep, steps, {k: v[sel][o] for k, v in w.items()},
                          {k: v[osel] for k, v in ops.items()}, limit=1 << 62)
    return None if b is None else (b[0], steps, b[1], b[2])


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
    dist, pred, seen = _cp_graph.frontier_pass(g.src, g.dst, w, n)
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
    _cp_graph.path_rows(g, [path])[0]), for every path at once (the sums are of whole ns: the
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
    prow = _cp_graph.path_rows(g, paths)
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
