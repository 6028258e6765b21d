"""The step graph from the always-on log, for every step: each rank's step as a chain of work
between its collectives, collectives as joins across their group, p2p send -> recv as a join
of the two sides.

Per rank and step: nodes at the step's start and end, at each logged op's enqueue, at the start
of its wait (sync ops: the enqueue; async ops: end − blocked_ms) and at its end. Consecutive
nodes are joined by a work edge unless the interval lies inside a wait (there the rank did
nothing but wait for the others); its kinds: ``data`` for the data loader's wait (data.jsonl
gives its length; it is placed at the step's start, where the batch is drawn), ``compute``
for the rest (the log cannot tell host work from compute: the profiled steps' path, from the
traces, can). A collective instance
(group, ordinal) is a join node at its last member's arrival: each member's enqueue -> join
(no weight), join -> each member's end (``communication``: the time after the last arrival,
or after the member started waiting, whichever is later). The k-th send a->b and the k-th recv
on b from a are one join of two.
"""

from __future__ import annotations

import numpy as np

from trainprof.analyzers._cp_graph import Graph


def _by_rank_step(df, cols) -> dict:
    out: dict = {}
    if df is None or df.empty or not set(cols) <= set(df.columns):
        return out
    sub = df[list(cols)].dropna()
    for key, g in sub.groupby(["rank", "step"], sort=False):
        out[(int(key[0]), int(key[1]))] = g
    return out


def prepare(run, al) -> dict:
    """Aligned per-(rank, step) inputs of the step graphs."""
    from trainprof.analyzers import collectives as coll

    steps = run.steps()
    st = {}
    if not steps.empty:
        s = steps.drop_duplicates(["rank", "step"], keep="last").dropna(subset=["start_ns", "end_ns"])
        for r, g in s.groupby("rank"):
            a = al(int(r), g["start_ns"].astype(np.int64).to_numpy())
            b = al(int(r), g["end_ns"].astype(np.int64).to_numpy())
            for k, x, y in zip(g["step"].astype(int), a, b):
                st[(int(r), int(k))] = (int(x), int(y))
    data = {}
    d = run.frame("data")
    if not d.empty and {"rank", "step", "wait_ms"} <= set(d.columns):
        for r, k, w in d[["rank", "step", "wait_ms"]].dropna().itertuples(index=False):
            data[(int(r), int(k))] = data.get((int(r), int(k)), 0.0) + float(w)
    spans = {}
    p = run.frame("pipeline")
    for key, g in _by_rank_step(p, ("rank", "step", "start_ns", "end_ns")).items():
        a = al(key[0], g["start_ns"].astype(np.int64).to_numpy())
        b = al(key[0], g["end_ns"].astype(np.int64).to_numpy())
        spans[key] = _merge(list(zip(a.tolist(), b.tolist())))
    df = coll._frame(run)
    recs: dict = {}
    if not df.empty:
        df = df[df["end_ns"].notna() & df["step"].notna()]
        ranks = df["rank"].to_numpy(int)
        enq = df["enqueue_ns"].astype(np.int64).to_numpy().copy()
        end = df["end_ns"].astype(np.int64).to_numpy().copy()
        for r in np.unique(ranks):
            m = ranks == r
            enq[m] = al(int(r), enq[m])
            end[m] = al(int(r), end[m])
        blocked = np.nan_to_num(df["blocked_ms"].astype(float).to_numpy()) * 1e6
        wait = np.maximum(enq, end - blocked.astype(np.int64))
        p2p = df["p2p"].to_numpy(bool)
        peer = df["peer"].to_numpy(object)
        op = df["op"].astype(str).to_numpy()
        group = df["group"].astype(str).to_numpy()
        ordinal = df["ordinal"].to_numpy(int)
        step = df["step"].astype(int).to_numpy()
        k_p2p = _p2p_keys(group, op, ranks, peer, p2p)
        for i in range(len(df)):
            key = k_p2p[i] if p2p[i] else ("c", group[i], int(ordinal[i]))
            if key is None:
                continue
            recs.setdefault((int(ranks[i]), int(step[i])), []).append(
                (int(enq[i]), int(wait[i]), int(end[i]), key, op[i]))
    return {"steps": st, "data": data, "spans": spans, "recs": recs}


def _p2p_keys(group, op, ranks, peer, p2p) -> list:
    """("p", group, src, dst, k): the k-th send src->dst and the k-th recv of it share a key."""
    count: dict = {}
    out: list = [None] * len(group)
    for i in np.flatnonzero(p2p):
        if peer[i] is None or (isinstance(peer[i], float) and np.isnan(peer[i])):
            continue
        src, dst = (int(ranks[i]), int(peer[i])) if op[i] == "send" else (int(peer[i]), int(ranks[i]))
        c = (group[i], op[i], src, dst)
        k = count.get(c, 0)
        count[c] = k + 1
        out[i] = ("p", group[i], src, dst, k)
    return out


def _merge(iv: list) -> list:
    iv = sorted((a, b) for a, b in iv if b > a)
    out: list = []
    for a, b in iv:
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _overlap(a: int, b: int, iv: list) -> int:
    return sum(max(0, min(b, y) - max(a, x)) for x, y in iv if x < b and y > a)


def step_graph(prep: dict, step: int, ranks) -> Graph | None:
    """The graph of one step over ``ranks`` (those with a step record)."""
    g = Graph()
    joins: dict = {}
    arrivals: dict = {}
    leaves: list = []
    any_rank = False
    for r in ranks:
        se = prep["steps"].get((r, step))
        if se is None:
            continue
        any_rank = True
        start, end = se
        end = max(end, start)
        recs = prep["recs"].get((r, step), ())
        dwait = int(prep["data"].get((r, step), 0.0) * 1e6)
        dend = min(end, start + dwait)
        ts = {start, end, dend}
        blocked = []
        for enq, wait, fin, _, _ in recs:
            enq, wait, fin = (min(max(x, start), end) for x in (enq, wait, fin))
            ts.update((enq, wait, fin))
            if fin > wait:
                blocked.append((wait, fin))
        blocked = _merge(blocked)
        order = sorted(ts)
        node = {t: g.node(r, t) for t in order}
        bi = 0
        for a, b in zip(order, order[1:]):
            while bi < len(blocked) and blocked[bi][1] < b:
                bi += 1
            if bi < len(blocked) and blocked[bi][0] <= a and b <= blocked[bi][1]:
                continue  # waiting for others: the join carries this time
            d = _overlap(a, b, [(start, dend)])
            parts = {"data": d, "compute": (b - a) - d}
            g.edge(node[a], node[b], b - a, r, parts, key=("work", r))
        for enq, wait, fin, key, op in recs:
            enq, wait, fin = (min(max(x, start), end) for x in (enq, wait, fin))
            arrivals.setdefault(key, []).append((r, node[enq], enq))
            leaves.append((key, r, node[fin], wait, fin, op))
    if not any_rank:
        return None
    for key, arr in arrivals.items():
        t = max(x[2] for x in arr)
        j = g.node(-1, t)
        joins[key] = (j, t)
        for _, n, _ in arr:
            g.edge(n, j)
    for key, r, n, wait, fin, op in leaves:
        j, t = joins[key]
        w = fin - max(t, wait)
        g.edge(j, n, w, r, {"communication": w}, key=("coll", key), label=op)
    return g
