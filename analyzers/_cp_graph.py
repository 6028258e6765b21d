"""A dependency graph of timed work across ranks, its longest path, and replays of it.

Nodes are moments on one rank (or a join shared by several ranks); edges are either work (a
duration on one rank, split into kinds: compute, host, data, communication, idle) or plain
dependencies (weight 0: a rank reaching a collective, a send before its receive). Every work
edge's weight is at most the time between its ends, so the longest path is never longer than the
wall time it covers; a join edge (arrival -> collective) carries no weight: the rank waited, and
the path goes through the last rank to arrive instead.

``Graph`` is built edge by edge (the profiler window's graph); ``Arrays`` holds a graph as numpy
columns (the step graphs of the log, built vectorized). ``longest_path`` works on both: a
frontier-at-a-time topological pass (numpy per frontier, not per edge), so a 1,024-rank step of
60k edges costs tens of milliseconds. ``replay`` recomputes it with changed weights (a rank's
excess work removed, a collective hidden): the graph's answer to "what would the step take".
"""

from __future__ import annotations

import numpy as np

KINDS = ("compute", "host", "data", "communication", "idle")


def uniq(a) -> np.ndarray:
    """np.unique; with counts asked, numpy does not import numpy.ma (the bare-trace analysis
    stays on plain numpy: tests/unit/trainprof/test_startup.py)."""
    return np.unique(a, return_counts=True)[0]


KIND_INDEX = {k: i for i, k in enumerate(KINDS)}
# edge types (Arrays.etype)
DEP, WORK, COLL = 0, 1, 2


class Arrays:
    """A graph as numpy columns: node_ts, node_rank; per edge src, dst, weight, rank, parts
    (E × len(KINDS) ns), etype (DEP / WORK / COLL), inst (collective instance code or -1),
    label (a string per edge, or None)."""

    def __init__(self, node_ts, node_rank, src, dst, weight, rank, parts, etype, inst, label=None):
        self.node_ts = np.asarray(node_ts, np.int64)
        self.node_rank = np.asarray(node_rank, np.int64)
        self.src = np.asarray(src, np.int64)
        self.dst = np.asarray(dst, np.int64)
        self.weight = np.maximum(np.asarray(weight, np.int64), 0)
        self.rank = np.asarray(rank, np.int64)
        self.parts = np.asarray(parts, np.int64).reshape(len(self.src), len(KINDS))
        self.etype = np.asarray(etype, np.int8)
        self.inst = np.asarray(inst, np.int64)
        self.label = label
        self.inst_names: list = []

    def __len__(self) -> int:
        return len(self.node_ts)


class Graph:
    """Append-only DAG built edge by edge; ``arrays()`` converts it for the path."""

    def __init__(self):
        self.node_rank: list[int] = []
        self.node_ts: list[int] = []
        self.src: list[int] = []
        self.dst: list[int] = []
        self.weight: list[int] = []
        self.rank: list[int] = []
        self.parts: list[dict | None] = []
        self.etype: list[int] = []
        self.inst: list = []
        self.label: list[str | None] = []

    def node(self, rank: int, ts: int) -> int:
        self.node_rank.append(rank)
        self.node_ts.append(int(ts))
        return len(self.node_ts) - 1

    def edge(self, u: int, v: int, weight: int = 0, rank: int = -1, parts: dict | None = None,
             etype: int = DEP, inst=None, label: str | None = None) -> int:
        """A work edge when ``parts`` ({kind: ns}) is given (scaled to sum to the weight), else
        a dependency. Negative weights (clock noise) are clamped to 0."""
        self.src.append(u)
        self.dst.append(v)
        self.weight.append(max(0, int(weight)))
        self.rank.append(rank)
        self.parts.append(parts)
        self.etype.append(etype if parts is not None or etype != DEP else DEP)
        self.inst.append(inst)
        self.label.append(label)
        return len(self.src) - 1

    def __len__(self) -> int:
        return len(self.node_ts)

    def arrays(self) -> Arrays:
        n = len(self.src)
        parts = np.zeros((n, len(KINDS)), np.int64)
        for e, p in enumerate(self.parts):
            w = self.weight[e]
            if p is None or not w:
                continue
            tot = sum(max(0, v) for v in p.values())
            for k, v in p.items():
                if v > 0 and tot:
                    parts[e, KIND_INDEX[k]] = int(round(v * w / tot))
        names = {}
        inst = [-1 if x is None else names.setdefault(x, len(names)) for x in self.inst]
        a = Arrays(self.node_ts, self.node_rank, self.src, self.dst, self.weight, self.rank, parts,
                   self.etype, inst, self.label)
        a.inst_names = list(names)
        return a


def _as_arrays(g) -> Arrays:
    return g if isinstance(g, Arrays) else g.arrays()


def longest_path(g, weights=None) -> tuple[int, np.ndarray]:
    """(length ns, edge ids along the path in order). Every node may start a path. Raises
    ValueError on a cycle (a builder bug: edges follow time or a join)."""
    a = _as_arrays(g)
    w = a.weight if weights is None else np.maximum(np.asarray(weights, np.int64), 0)
    n = len(a.node_ts)
    if n == 0:
        return 0, np.zeros(0, np.int64)
    ranks = max(1, len(uniq(a.node_rank)))
    if n / ranks > DEEP:  # long chains, few ranks (a profiled window): one edge at a time
        return _longest_path_py(a, w)
    dist, pred, seen = frontier_pass(a.src, a.dst, w, n)
    if not seen.all():
        raise ValueError("critical-path graph has a cycle")
    end = int(np.argmax(dist))
    path = []
    while pred[end] >= 0:
        path.append(int(pred[end]))
        end = int(a.src[pred[end]])
    path.reverse()
    return int(dist.max()), np.asarray(path, np.int64)


def frontier_pass(src, dst, w, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The longest distance to each of ``n`` nodes over edges src -> dst of weight ``w``, a
    frontier (the nodes whose in-edges are all done) at a time: (dist, pred (the edge it is
    reached by, -1 for none), seen (False: on or after a cycle)). Ties among a node's in-edges
    go to the later edge, so a chain is followed."""
    order = np.argsort(src, kind="stable")
    starts = np.searchsorted(src[order], np.arange(n + 1))
    indeg = np.bincount(dst, minlength=n).astype(np.int64)
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
        d = dst[es]
        cand = dist[src[es]] + w[es]
        srt = np.lexsort((es, cand, d))
        last = np.r_[d[srt][1:] != d[srt][:-1], True]
        bd, bc, be = d[srt][last], cand[srt][last], es[srt][last]
        better = (bc > dist[bd]) | ((bc == dist[bd]) & (pred[bd] < 0))
        dist[bd[better]] = bc[better]
        pred[bd[better]] = be[better]
        np.subtract.at(indeg, d, 1)
        touched = uniq(d)
        frontier = touched[indeg[touched] == 0]
    return dist, pred, seen


DEEP = 2000  # nodes per rank above which the frontier pass has too many, too small frontiers


def _longest_path_py(a: Arrays, w) -> tuple[int, np.ndarray]:
    n = len(a.node_ts)
    src, dst, wl = a.src.tolist(), a.dst.tolist(), np.asarray(w).tolist()
    out: list[list[int]] = [[] for _ in range(n)]
    indeg = [0] * n
    for e, v in enumerate(dst):
        out[src[e]].append(e)
        indeg[v] += 1
    dist = [0] * n
    pred = [-1] * n
    stack = [i for i in range(n) if indeg[i] == 0]
    seen = 0
    while stack:
        u = stack.pop()
        seen += 1
        du = dist[u]
        for e in out[u]:
            v = dst[e]
            d = du + wl[e]
            if d > dist[v] or (pred[v] < 0 and d >= dist[v]):
                dist[v] = d
                pred[v] = e
            indeg[v] -= 1
            if indeg[v] == 0:
                stack.append(v)
    if seen != n:
        raise ValueError("critical-path graph has a cycle")
    end = max(range(n), key=dist.__getitem__)
    path = []
    while pred[end] >= 0:
        path.append(pred[end])
        end = src[pred[end]]
    path.reverse()
    return int(dist[max(range(n), key=dist.__getitem__)]), np.asarray(path, np.int64)


def attribute(g, path, weights=None) -> dict:
    """The path's time by rank and by kind (ns): {"by_rank": {rank: ns}, "by_kind": {kind: ns},
    "by_rank_kind": {(rank, kind): ns}}. A replayed weight scales its edge's parts."""
    a = _as_arrays(g)
    path = np.asarray(path, np.int64)
    if not len(path):
        return {"by_rank": {}, "by_kind": {}, "by_rank_kind": {}}
    parts = a.parts[path].astype(float)
    if weights is not None:
        w0 = a.weight[path].astype(float)
        w1 = np.asarray(weights, float)[path]
        parts *= np.where(w0 > 0, w1 / np.where(w0 > 0, w0, 1), 0)[:, None]
    ranks = a.rank[path]
    by_rank: dict = {}
    both: dict = {}
    for r in uniq(ranks):
        sub = parts[ranks == r].sum(axis=0)
        if sub.sum() > 0:
            by_rank[int(r)] = float(sub.sum())
            for k, v in zip(KINDS, sub):
                if v > 0:
                    both[(int(r), k)] = float(v)
    tot = parts.sum(axis=0)
    return {"by_rank": by_rank, "by_kind": {k: float(v) for k, v in zip(KINDS, tot)},
            "by_rank_kind": both}


def path_rows(a: Arrays, paths) -> list[list[tuple]]:
    """Per path (edge ids of ``a``): (rank, kind, start ns, end ns, label) of its edges with
    weight (the timeline's highlighted track), kind the edge's largest part ("idle": none)."""
    n = len(paths)
    e = np.concatenate([np.asarray(p, np.int64) for p in paths]) if n else np.zeros(0, np.int64)
    blk = np.repeat(np.arange(n), [len(p) for p in paths])
    parts = a.parts[e]
    kind = np.where(parts.any(axis=1), np.argmax(parts, axis=1), -1) if len(e) else e
    lab = a.label
    labels = ([None] * len(e) if lab is None else lab[e].tolist() if isinstance(lab, np.ndarray)
              else [lab[i] for i in e.tolist()])
    rows: list[list[tuple]] = [[] for _ in range(n)]
    for b, r, k, ts, w, x in zip(blk.tolist(), a.rank[e].tolist(), kind.tolist(),
                                 a.node_ts[a.dst[e]].tolist(), a.weight[e].tolist(), labels):
        if w:
            rows[b].append((r, KINDS[k] if k >= 0 else "idle", ts - w, ts, x))
    return rows


def replay(g, weights) -> tuple[int, np.ndarray]:
    """The longest path under other ``weights`` (same edges)."""
    return longest_path(g, weights)
