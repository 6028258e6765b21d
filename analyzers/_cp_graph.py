"""A dependency graph of timed work across ranks, its longest path, and replays of it.

Nodes are moments on one rank (or a join shared by several ranks); edges are either work (a
duration on one rank, split into kinds: compute, host, data, communication, idle) or plain
dependencies (weight 0: a rank reaching a collective, a send before its receive). Every work
edge's weight is at most the time between its ends, so the longest path is never longer than the
wall time it covers; a join edge (arrival -> collective) carries no weight: the rank waited, and
the path goes through the last rank to arrive instead.

``longest_path`` is the critical path. ``replay`` recomputes it with changed weights (a rank's
excess work removed, a collective hidden): the graph's answer to "what would the step take".
"""

from __future__ import annotations

from collections import deque

KINDS = ("compute", "host", "data", "communication", "idle")


class Graph:
    """Append-only DAG. ``key`` on an edge names what a change may target (e.g. ("coll", group,
    ordinal) for a collective's transfer)."""

    __slots__ = ("node_rank", "node_ts", "src", "dst", "weight", "rank", "parts", "key", "label")

    def __init__(self):
        self.node_rank: list[int] = []
        self.node_ts: list[int] = []
        self.src: list[int] = []
        self.dst: list[int] = []
        self.weight: list[int] = []
        self.rank: list[int] = []
        self.parts: list[dict | None] = []
        self.key: list[tuple | None] = []
        self.label: list[str | None] = []

    def node(self, rank: int, ts: int) -> int:
        self.node_rank.append(rank)
        self.node_ts.append(int(ts))
        return len(self.node_ts) - 1

    def edge(self, u: int, v: int, weight: int = 0, rank: int = -1, parts: dict | None = None,
             key: tuple | None = None, label: str | None = None) -> int:
        """A work edge when ``parts`` ({kind: ns}, summing to weight) is given, else a
        dependency. Negative weights (clock noise) are clamped to 0."""
        w = max(0, int(weight))
        if parts is not None:
            parts = {k: max(0, int(v)) for k, v in parts.items() if v > 0}
            tot = sum(parts.values())
            if tot != w and tot > 0:  # rescale rounding so the parts sum to the weight
                f = w / tot
                parts = {k: int(round(v * f)) for k, v in parts.items()}
        self.src.append(u)
        self.dst.append(v)
        self.weight.append(w)
        self.rank.append(rank)
        self.parts.append(parts)
        self.key.append(key)
        self.label.append(label)
        return len(self.src) - 1

    def __len__(self) -> int:
        return len(self.node_ts)


def longest_path(g: Graph, weights: list[int] | None = None) -> tuple[int, list[int]]:
    """(length ns, edge ids along the path in order). Kahn's order; every node may start a path.
    Raises ValueError on a cycle (a graph builder bug: edges must follow time or a join)."""
    w = g.weight if weights is None else weights
    n = len(g.node_ts)
    if n == 0:
        return 0, []
    out_edges: list[list[int]] = [[] for _ in range(n)]
    indeg = [0] * n
    for e, (u, v) in enumerate(zip(g.src, g.dst)):
        out_edges[u].append(e)
        indeg[v] += 1
    dist = [0] * n
    pred = [-1] * n
    q = deque(i for i in range(n) if indeg[i] == 0)
    seen = 0
    while q:
        u = q.popleft()
        seen += 1
        du = dist[u]
        for e in out_edges[u]:
            v = g.dst[e]
            d = du + w[e]
            if d > dist[v] or (pred[v] < 0 and d >= dist[v]):
                dist[v] = d
                pred[v] = e
            indeg[v] -= 1
            if indeg[v] == 0:
                q.append(v)
    if seen != n:
        raise ValueError("critical-path graph has a cycle")
    end = max(range(n), key=lambda i: (dist[i], -i))
    path = []
    while pred[end] >= 0:
        path.append(pred[end])
        end = g.src[pred[end]]
    path.reverse()
    return dist[max(range(n), key=lambda i: dist[i])], path


def attribute(g: Graph, path: list[int], weights: list[int] | None = None) -> dict:
    """The path's time by rank and by kind (ns): {"by_rank": {rank: ns}, "by_kind": {kind: ns},
    "by_rank_kind": {(rank, kind): ns}}."""
    w = g.weight if weights is None else weights
    by_rank: dict[int, int] = {}
    by_kind: dict[str, int] = {}
    both: dict[tuple, int] = {}
    for e in path:
        if not w[e]:
            continue
        parts = g.parts[e] or {"idle": g.weight[e]}
        scale = w[e] / g.weight[e] if g.weight[e] else 0.0
        r = g.rank[e]
        for k, ns in parts.items():
            ns = ns * scale
            by_rank[r] = by_rank.get(r, 0) + ns
            by_kind[k] = by_kind.get(k, 0) + ns
            both[(r, k)] = both.get((r, k), 0) + ns
    return {"by_rank": by_rank, "by_kind": by_kind, "by_rank_kind": both}


def replay(g: Graph, change) -> tuple[int, list[int]]:
    """The longest path with ``change(edge_id, graph) -> new weight | None`` applied (None keeps
    the weight). Returns (length ns, path)."""
    w = list(g.weight)
    for e in range(len(w)):
        nw = change(e, g)
        if nw is not None:
            w[e] = max(0, int(nw))
    return longest_path(g, w)
