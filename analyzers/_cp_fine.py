"""The step graph of the profiler window, from one or several ranks' traces.

Per rank: every CPU thread's events cut into leaf segments (the innermost event at each moment;
gaps between a thread's events are host time too) chained in time order; every GPU stream's
kernels / memcpys / memsets in stream order; a kernel launch (runtime call with the kernel's
correlation id) -> its kernel. A kernel launched before the previous op of its stream ended was
queued: the gap after that op is GPU overhead (``idle``) and the launch edge carries nothing;
otherwise the launch delay is (``idle``) and the stream's gap carries nothing (the GPU waited
for the host). A synchronizing runtime call (cudaDeviceSynchronize, cudaStreamSynchronize,
cudaEventSynchronize, a synchronous cudaMemcpy) is a wait: the host's time inside it carries
nothing, its end follows the last GPU op that ended before it returned. Kinds: GPU
kernels ``compute`` (NCCL / RCCL kernels ``communication``); CPU segments ``host`` when the rank
has GPU work, ``compute`` on a CPU-only trace; the data loader's spans ``data``; collective
CPU ops (c10d / gloo / record_param_comms) ``communication``.

Across ranks (``comm_keys``: event row -> instance key, the same key on every member), a
collective is a join: each member's op start -> join at the last start; join -> each member's op
end (``communication``), and the member's own segments inside the op (its wait) are left out.
An op that returned before the last member arrived (an async launch: isend, irecv, NCCL's host
side) does not wait for the join: it stays its rank's own work.
"""

from __future__ import annotations

import bisect

import numpy as np

from trainprof.analyzers._cp_graph import COLL, WORK, Graph, uniq

SYNC_CALLS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize",
              "cudaMemcpy", "hipDeviceSynchronize", "hipStreamSynchronize", "hipMemcpy")
COMM_MARKS = ("nccl", "rccl", "gloo:", "c10d::", "record_param_comms")
DATA_MARKS = ("dataloader",)


def _is_comm(name: str) -> bool:
    n = name.lower()
    return any(m in n for m in COMM_MARKS)


def _kind_cpu(name: str, cat: str, has_gpu: bool) -> str:
    n = name.lower()
    if any(m in n for m in DATA_MARKS):
        return "data"
    if _is_comm(name):
        return "communication"
    if not has_gpu and cat in ("cpu_op", "user_annotation", "python_function"):
        return "compute"
    return "host"


def window_rows(trace, lo: int, hi: int) -> np.ndarray:
    """Rows of events in [lo, hi]: host events starting in it (zero-length ones left out), GPU
    ops whose launch started in it (or without a launch, starting in it). Step annotations
    (ProfilerStep#N) are left out: they span the whole step."""
    ev = trace.tables.events
    ts = ev["ts_ns"]
    dur = ev["dur_ns"]
    gpu = ev["is_gpu"]
    names = ev["name"]
    step_mark = (names.startswith("ProfilerStep#") | names.isin(["Iteration Start: PyTorch Profiler"])
                 | ev["cat"].isin(["Trace", "gpu_user_annotation"]))
    host = ~gpu & (ts >= lo) & (ts <= hi) & (dur > 0) & ~step_mark
    # the threads that drive the step: the one holding the step annotations (else the busiest)
    # and those launching GPU work; helper threads (gloo's workers, the data loader's pin
    # thread, the profiler's own) run beside the step, not in its chain
    tid = ev["tid"]
    marks = np.flatnonzero(names.startswith("ProfilerStep#"))
    if len(marks):
        main = {int(tid[marks[0]])}
    else:
        vals, cnt = np.unique(tid[host], return_counts=True)
        main = {int(vals[np.argmax(cnt)])} if len(vals) else set()
    launch = np.asarray(ev["cat"].isin(["cuda_runtime", "cuda_driver"])) & host
    main |= {int(x) for x in uniq(tid[launch])}
    host &= np.isin(tid, list(main))
    corr = ev["correlation"]
    launch_ts = {}
    for i in np.flatnonzero(~gpu & (corr >= 0)):
        launch_ts[int(corr[i])] = int(ts[i])
    g = np.flatnonzero(gpu & ~step_mark)
    keep_g = np.array([lo <= launch_ts.get(int(corr[i]), int(ts[i])) <= hi for i in g], bool)
    rows = np.concatenate([np.flatnonzero(host), g[keep_g] if len(g) else g])
    return np.sort(rows)


def _segments(starts, ends, order):
    """Leaf segments of one thread's nested events: [(a, b, row or -1)] in time order."""
    out = []
    stack: list = []  # (end, row)
    cursor = None
    for i in order:
        s, e = starts[i], ends[i]
        while stack and stack[-1][0] <= s:
            pe, prow = stack.pop()
            if cursor is not None and pe > cursor:
                out.append((cursor, pe, prow))
            cursor = pe if cursor is None else max(cursor, pe)
        if cursor is not None and s > cursor:
            out.append((cursor, s, stack[-1][1] if stack else -1))
        if stack:
            e = min(e, stack[-1][0])  # a child never outlives its parent
        stack.append((e, int(i)))
        cursor = s if cursor is None else max(cursor, s)
    while stack:
        pe, prow = stack.pop()
        if cursor is not None and pe > cursor:
            out.append((cursor, pe, prow))
            cursor = pe
    return out


def add_rank(g: Graph, rank: int, trace, rows: np.ndarray, shift, comm_keys: dict | None = None,
             arrivals: dict | None = None, leaves: list | None = None,
             clip: int | None = None) -> None:
    """Add one rank's window (event ``rows``) to ``g``; ``shift(ns array) -> aligned``.
    Collective ops listed in ``comm_keys`` go to ``arrivals`` / ``leaves`` for joining. Host
    events end at ``clip`` (the window's end, local ns) at the latest."""
    ev = trace.tables.events
    names, cats = ev["name"], ev["cat"]
    raw_end = ev["end_ns"][rows]
    if clip is not None:
        raw_end = np.where(ev["is_gpu"][rows], raw_end, np.minimum(raw_end, clip))
    ts = np.asarray(shift(ev["ts_ns"][rows]), np.int64)
    end = np.asarray(shift(raw_end), np.int64)
    gpu = ev["is_gpu"][rows]
    tid = ev["tid"][rows]
    stream = ev["stream"][rows]
    corr = ev["correlation"][rows]
    has_gpu = bool(gpu.any())
    names_l = names[rows].tolist()
    cats_l = cats[rows].tolist()
    ts_l, end_l, tid_l, corr_l = ts.tolist(), end.tolist(), tid.tolist(), corr.tolist()
    gpu_l = gpu.tolist()
    comm_keys = comm_keys or {}
    kinds: dict = {}
    waits: dict = {}  # tid -> [(a, b)] intervals inside joined collectives
    cuts: dict = {}  # tid -> moments a log record adds (its wait's start and its end)
    spans: dict = {}  # local row index -> (arrival, wait start, end) of a joined host op
    spans_sync: list = []  # synchronizing runtime calls
    for k, r in enumerate(rows):
        if int(r) in comm_keys and not gpu[k]:
            key, ws, we = _key_times(comm_keys[int(r)])
            a = ts_l[k]
            ws = ts_l[k] if ws is None else max(int(ws), a)
            we = end_l[k] if we is None else max(int(we), ws)
            spans[k] = (a, ws, we)
            waits.setdefault(tid_l[k], []).append((ws, we))
            cuts.setdefault(tid_l[k], set()).update((ws, we))
        elif has_gpu and not gpu[k] and names_l[k] in SYNC_CALLS:
            # the host waits for the GPU: the last GPU op carries this time (_sync_edges)
            waits.setdefault(tid_l[k], []).append((ts_l[k], end_l[k]))
            spans_sync.append(k)
    node_at: dict = {}  # (tid, ts) -> node on that thread
    host_idx = np.flatnonzero(~gpu)
    for t in uniq(tid[host_idx]) if len(host_idx) else ():
        idx = host_idx[tid[host_idx] == t]
        order = idx[np.lexsort((-(end[idx] - ts[idx]), ts[idx]))]
        segs = _cut(_segments(ts_l, end_l, order.tolist()), cuts.get(int(t)))
        wv = _merge(waits.get(int(t), ()))
        wstarts = [x for x, _ in wv]
        prev = None
        for a, b, k in segs:
            na = node_at.get((int(t), a))
            if na is None:
                na = node_at[(int(t), a)] = g.node(rank, a)
            if prev is not None and prev != na:
                g.edge(prev, na)  # same moment
            nb = node_at.get((int(t), b))
            if nb is None:
                nb = node_at[(int(t), b)] = g.node(rank, b)
            prev = nb
            j = bisect.bisect_right(wstarts, a) - 1
            if j >= 0 and b <= wv[j][1]:
                continue  # waiting inside a joined collective, or for the GPU
            kind = kinds.get(k)
            if kind is None:
                kind = kinds[k] = _kind_cpu(names_l[k], cats_l[k], has_gpu) if k >= 0 else "host"
            g.edge(na, nb, b - a, rank, {kind: b - a}, etype=WORK,
                   label=names_l[k] if k >= 0 else None)
    for k in spans_sync:  # the wait itself has no weight: the chain goes on through it
        na, nb = node_at.get((tid_l[k], ts_l[k])), node_at.get((tid_l[k], end_l[k]))
        if na is not None and nb is not None and na != nb:
            g.edge(na, nb)
    # launches: correlation -> the runtime call's start node
    launch = {}
    for k in host_idx:
        if corr_l[k] >= 0 and cats_l[k] in ("cuda_runtime", "cuda_driver"):
            launch[corr_l[k]] = node_at.get((tid_l[k], ts_l[k]))
    gpu_ends = _add_streams(g, rank, np.flatnonzero(gpu), stream, ts, ts_l, end_l, corr_l, launch,
                            rows, comm_keys, arrivals, leaves, names_l)
    # CPU collective ops that join across ranks
    for k, (a, ws, we) in spans.items():
        na = node_at.get((tid_l[k], a))
        nb = node_at.get((tid_l[k], we))
        if na is not None and nb is not None:
            key = _key_times(comm_keys[int(rows[k])])[0]
            arrivals.setdefault(key, []).append((rank, na, a))
            leaves.append((key, rank, nb, ws, we, names_l[k]))
    _sync_edges(g, rank, host_idx, names_l, tid, ts, end, node_at, gpu_ends)


def _add_streams(g, rank, gpu_idx, stream, ts, ts_l, end_l, corr_l, launch, rows, comm_keys,
                 arrivals, leaves, names_l) -> list:
    """Each GPU stream's ops in order, with their launches; returns [(end, end node)]."""
    gpu_ends = []  # (end, end node)
    for s in uniq(stream[gpu_idx]) if len(gpu_idx) else ():
        idx = gpu_idx[stream[gpu_idx] == s]
        idx = idx[np.argsort(ts[idx], kind="stable")]
        prev_end = None
        for k in idx:
            a, b = ts_l[k], max(end_l[k], ts_l[k])
            if prev_end is not None:
                a = max(a, g.node_ts[prev_end])
                b = max(a, b)
            na, nb = g.node(rank, a), g.node(rank, b)
            ln = launch.get(corr_l[k])
            # queued: launched before the previous op on the stream ended, so the stream's
            # order (not the launch) made it wait; its gap is then GPU overhead
            queued = prev_end is not None and (ln is None or g.node_ts[ln] < g.node_ts[prev_end])
            if prev_end is not None:
                gap = a - g.node_ts[prev_end] if queued else 0
                g.edge(prev_end, na, gap, rank, {"idle": gap}, etype=WORK)
            if ln is not None:
                delay = 0 if queued else a - g.node_ts[ln]
                g.edge(ln, na, delay, rank, {"idle": delay}, etype=WORK)
            if int(rows[k]) in comm_keys:
                key = _key_times(comm_keys[int(rows[k])])[0]
                arrivals.setdefault(key, []).append((rank, na, a))
                leaves.append((key, rank, nb, a, b, names_l[k]))
            else:
                kind = "communication" if _is_comm(names_l[k]) else "compute"
                g.edge(na, nb, b - a, rank, {kind: b - a}, etype=WORK, label=names_l[k])
            gpu_ends.append((b, nb))
            prev_end = nb
    return gpu_ends


def _merge(iv) -> list:
    out: list = []
    for a, b in sorted(iv):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _key_times(v) -> tuple:
    """comm_keys values: a key, or (key, wait start, end) in aligned ns from the log record
    (an async op waits later, in Work.wait(), which the trace does not show as the op)."""
    if isinstance(v, tuple) and len(v) == 3 and v and isinstance(v[0], tuple):
        return v
    return v, None, None


def _cut(segs: list, cuts) -> list:
    """Segments split at the given moments (so that a node exists there)."""
    if not cuts:
        return segs
    import bisect

    cs = sorted(cuts)
    out = []
    for a, b, k in segs:
        i = bisect.bisect_right(cs, a)
        while i < len(cs) and cs[i] < b:
            out.append((a, cs[i], k))
            a = cs[i]
            i += 1
        out.append((a, b, k))
    return out


def _sync_edges(g, rank, host_idx, names_l, tid, ts, end, node_at, gpu_ends) -> None:
    if not gpu_ends:
        return
    gpu_ends.sort()
    ends = [e for e, _ in gpu_ends]

    for k in host_idx:
        if names_l[k] not in SYNC_CALLS:
            continue
        b = int(end[k])
        j = bisect.bisect_right(ends, b) - 1
        nb = node_at.get((int(tid[k]), b))
        if j >= 0 and nb is not None and ends[j] >= int(ts[k]):
            w = b - ends[j]
            g.edge(gpu_ends[j][1], nb, w, rank, {"host": w}, etype=WORK)


def join(g: Graph, arrivals: dict, leaves: list) -> None:
    """Collectives as joins: each member's start -> join at the last start -> each member's end."""
    joins = {}
    for key, arr in arrivals.items():
        t = max(x[2] for x in arr)
        j = g.node(-1, t)
        joins[key] = (j, t)
        for _, n, _ in arr:
            g.edge(n, j)
    for key, rank, nb, a, b, name in leaves:
        j, t = joins[key]
        if b < t:  # returned before the last member arrived: an async launch, not a wait
            na = next((n for r, n, _ in arrivals[key] if r == rank), None)
            if na is not None:
                g.edge(na, nb, b - a, rank, {"communication": b - a}, etype=WORK, label=name)
            continue
        w = b - max(t, a)
        g.edge(j, nb, w, rank, {"communication": w}, etype=COLL, inst=key, label=name)


def rank_graph(trace, lo: int, hi: int, rank: int = 0) -> Graph:
    """One rank's window as a graph (no joins): the single-rank critical path."""
    g = Graph()
    rows = window_rows(trace, lo, hi)
    add_rank(g, rank, trace, rows, lambda a: np.asarray(a, np.int64), {}, {}, [], clip=hi)
    return g


def single_chain(trace, lo: int, hi: int):
    """A CPU-only window driven by one thread is one chain: its path is that thread's leaf
    segments, no graph needed. Returns (length ns, {kind: ns}, {name: ns}) or None when the
    window has GPU work or several driving threads."""
    rows = window_rows(trace, lo, hi)
    ev = trace.tables.events
    if not len(rows) or ev["is_gpu"][rows].any() or len(uniq(ev["tid"][rows])) != 1:
        return None
    ts = ev["ts_ns"][rows].tolist()
    end = np.minimum(ev["end_ns"][rows], hi).tolist()
    order = np.lexsort((-(np.asarray(end) - np.asarray(ts)), np.asarray(ts))).tolist()
    names, cats = ev["name"][rows].tolist(), ev["cat"][rows].tolist()
    by_kind: dict = {}
    by_name: dict = {}
    kinds: dict = {}
    total = 0
    for a, b, k in _segments(ts, end, order):
        kind = kinds.get(k)
        if kind is None:
            kind = kinds[k] = _kind_cpu(names[k], cats[k], False) if k >= 0 else "host"
        by_kind[kind] = by_kind.get(kind, 0) + (b - a)
        if k >= 0:
            by_name[names[k]] = by_name.get(names[k], 0) + (b - a)
        total += b - a
    return total, by_kind, by_name
