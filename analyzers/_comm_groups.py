"""Which process group — and so which mesh dimension (dp/pp/tp) — a communication event served.

Group -> dimension, first source that knows: the collective log's ``groups.jsonl`` (mesh_dim
recorded by the probe), the trace's own ``distributedInfo.pg_config`` / collective args
(DeviceMesh names its groups ``mesh_<dim>``), else the group's ranks against the ranks' mesh
coordinates from meta.json (the one coordinate that varies inside the group).

Event -> group: NCCL kernels of recent PyTorch carry "Process Group Name" in their args. gloo
events carry nothing, so they are matched by time and op to this rank's collective log: a gloo
event belongs to the logged collective of the same op whose [enqueue, end] contains it; each gloo
worker thread serves one group, so ambiguous events take their thread's majority group.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from trainprof.trace import name_mask

MATCH_SLACK_NS = 500_000  # kineto's and time.time_ns() clocks agree far better than this


def coll_type(name: str) -> str:
    n = name.lower().replace("_", "")
    for key, canon in (("allreduce", "all_reduce"), ("allgather", "all_gather"),
                       ("reducescatter", "reduce_scatter"), ("alltoall", "all_to_all"),
                       ("broadcast", "broadcast"), ("sendrecv", "send_recv"), ("send", "send"),
                       ("recv", "recv"), ("barrier", "barrier"), ("scatter", "scatter"),
                       ("gather", "gather"), ("reduce", "reduce")):
        if key in n:
            return canon
    return "other"


def coll_types(names) -> np.ndarray:
    """coll_type of every row (object array), computed once per distinct name: a trace holds
    few names over many events (22k NCCL kernels: 0.12 s row by row). ``names``: a Cat, or any
    sequence of names (a missing one, None or NaN, is "other")."""
    codes = getattr(names, "codes", None)
    if codes is not None:  # a Cat: its distinct values are known
        vals = np.array([coll_type(v) for v in names.values] + ["other"], dtype=object)
        return vals[codes]
    seen: dict = {}
    out = np.empty(len(names), dtype=object)
    for i, v in enumerate(names):
        if _missing(v):
            out[i] = "other"
            continue
        t = seen.get(v)
        if t is None:
            t = seen[v] = coll_type(str(v))
        out[i] = t
    return out


def _missing(v) -> bool:
    """None or NaN: a value a record or row does not have."""
    return v is None or (isinstance(v, float) and v != v)


def _nones(a: np.ndarray) -> np.ndarray:
    """Where an object array holds None."""
    return np.fromiter((v is None for v in a), bool, len(a))


def dim_of_ranks(ranks, coords: dict, world_size: int | None) -> str | None:
    ranks = [int(r) for r in ranks or []]
    if not ranks:
        return None
    if world_size and len(ranks) == world_size and len(ranks) > 1:
        return "world"
    if not all(r in coords and coords[r] for r in ranks):
        return None
    names = list(coords[ranks[0]])
    varying = [d for d in names if len({coords[r].get(d) for r in ranks}) > 1]
    return "+".join(varying) if varying else None


def _plain(v):
    """A trace value as JSON keeps it: NaN (a column absent on this row) -> None, numpy
    scalars -> Python numbers, arrays and tuples -> lists."""
    if v is None or (isinstance(v, float) and v != v):
        return None
    if isinstance(v, (list, tuple, np.ndarray)):
        return [_plain(x) for x in v]
    return v.item() if isinstance(v, np.generic) else v


def trace_groups(trace) -> dict:
    """What group_dims needs from one trace (part of its digest): the trace's world size and
    its process groups — distributedInfo.pg_config, then those its collectives name — as
    [{"pg_name", "pg_desc", "pg_size", "ranks"}] in that order."""
    dist = trace.meta.get("distributedInfo")
    pgc = dist.get("pg_config") if isinstance(dist, dict) else None
    cfgs = [c for c in pgc if isinstance(c, dict)] if isinstance(pgc, list) else []
    comm = trace.tables.comm
    if len(comm) and "pg_name" in comm:
        cols = [comm.get(k) for k in ("pg_name", "pg_desc", "pg_ranks")]
        seen = set()
        for i, name in enumerate(comm["pg_name"].tolist()):  # the first row of each group
            if name in seen:
                continue
            seen.add(name)
            n, d, rk = (None if c is None else c[i] for c in cols)
            cfgs.append({"pg_name": n, "pg_desc": d, "ranks": rk})
    keep = ("pg_name", "pg_desc", "pg_size", "ranks")
    return {"world_size": _plain(trace.world_size),
            "configs": [{k: _plain(c.get(k)) for k in keep if c.get(k) is not None} for c in cfgs]}


def trace_pg_names(trace) -> list[str]:
    """The names of the process groups a trace knows of (distributedInfo.pg_config and the
    groups its collectives name), in that order, each once."""
    return list(dict.fromkeys(str(c["pg_name"]) for c in trace_groups(trace)["configs"]
                              if c.get("pg_name") is not None))


def group_dims(run, groups) -> dict[str, str]:
    """pg name -> mesh dimension label ('dp', 'tp', 'pp', 'dp+pp', 'world', ...). ``groups``:
    each rank's trace_groups(trace), in rank order (the first rank that names a group wins)."""
    coords, world = {}, None
    try:
        world = run.world_size
        for r in run.ranks:
            coords[r] = run.coords(r) or {}
    except Exception:  # noqa: BLE001 - a run directory without meta still has traces
        pass
    out: dict[str, str] = {}
    # each rank's groups.jsonl records (equal member lists shared: a frame of them would hold
    # ranks x group size integers, 16 million at 4,096 ranks); the first record that names a
    # group's dimension wins
    try:
        for r in run.ranks:
            for g in run.stream(r, "groups"):
                pg = g.get("pg")
                if pg is None or str(pg) in out:
                    continue
                dim = g.get("mesh_dim")
                if not isinstance(dim, str) or not dim:
                    dim = dim_of_ranks(g.get("ranks"), coords, world)
                if dim:
                    out[str(pg)] = dim
    except Exception:  # noqa: BLE001 - the group records are optional
        pass
    for tg in groups:
        world = world or tg.get("world_size")
        for c in tg.get("configs") or []:
            name = c.get("pg_name")
            if name is None or str(name) in out:
                continue
            desc = str(c.get("pg_desc") or "")
            dim = desc[len("mesh_"):] if desc.startswith("mesh_") else None
            if desc == "default_pg" and (c.get("pg_size") or len(c.get("ranks") or [])) != 1:
                dim = "world"
            ranks = c.get("ranks")
            dim = dim or dim_of_ranks(ranks if isinstance(ranks, list) else None, coords, world)
            if dim:
                out[str(name)] = dim
    return out


def gpu_event_groups(trace, rows: np.ndarray) -> np.ndarray:
    """pg name (or None) of each events row in ``rows``, from the collective args on the row
    (the first args row of an event where it has several)."""
    rows = np.asarray(rows, np.int64)
    out = np.full(len(rows), None, dtype=object)
    comm = trace.tables.comm
    if not len(comm) or "pg_name" not in comm:
        return out
    crow, first = np.unique(comm["row"], return_index=True)
    if not len(crow):
        return out
    names = comm["pg_name"][first]
    j = np.clip(np.searchsorted(crow, rows), 0, len(crow) - 1)
    hit = np.flatnonzero(crow[j] == rows)
    got = names[j[hit]]
    ok = ~_nones(got)
    out[hit[ok]] = [str(v) for v in got[ok]]
    return out


def _ns_column(values) -> tuple[np.ndarray, np.ndarray]:
    """A log's ns column (int64, float64 with NaN, or objects with None/NaN) -> (int64 values,
    where present)."""
    a = np.asarray(values)
    if a.dtype.kind in "iu":
        return a.astype(np.int64, copy=False), np.ones(len(a), bool)
    if a.dtype.kind == "f":
        ok = ~np.isnan(a)
        return np.where(ok, a, 0).astype(np.int64), ok
    ok = np.fromiter((not _missing(v) for v in a), bool, len(a))
    return np.array([int(v) if k else 0 for v, k in zip(a.tolist(), ok.tolist())], np.int64), ok


def gloo_event_groups(events, log, trace_pgs=()) -> np.ndarray:
    """pg name (or None) of each gloo event row, matched to this rank's collective log.
    ``events``: a Table (or DataFrame) with name, tid, ts_ns, end_ns; ``log``: a Table (or
    DataFrame) with pg, op, enqueue_ns, end_ns (a record without pg names no group; one without
    either time matches no event). A rank whose log names one process group only (plain DDP:
    the default group) has no other group for an unmatched event to belong to: those take it
    too. ``trace_pgs``: the process groups the trace itself knows of (trace_pg_names): when it
    knows exactly one (a plain DDP job's default group), every event the log leaves unnamed —
    all of them on bare traces, which have no log — belongs to it."""
    out = np.full(len(events), None, dtype=object)
    sole = trace_pgs[0] if len(trace_pgs) == 1 else None
    if (not len(events) or log is None or not len(log)
            or not all(c in log for c in ("pg", "op", "enqueue_ns", "end_ns"))):
        if sole is not None:
            out[:] = sole
        return out
    pg, op = (np.asarray(log[c], dtype=object) for c in ("pg", "op"))
    (enq_raw, enq_ok), (end_raw, end_ok) = (_ns_column(log[c]) for c in ("enqueue_ns", "end_ns"))
    names = list(dict.fromkeys(str(p) for p in pg if not _missing(p)))
    only = names[0] if len(names) == 1 else None
    starts = np.asarray(events["ts_ns"], dtype=np.int64)
    ends = np.asarray(events["end_ns"], dtype=np.int64)
    lo, hi = starts.min() - MATCH_SLACK_NS, ends.max() + MATCH_SLACK_NS
    keep = enq_ok & end_ok & (end_raw >= lo) & (enq_raw <= hi)
    only = only if only is not None else sole
    if not keep.any():
        if only is not None:
            out[:] = only
        return out
    ltype = coll_types(op[keep])
    lpg = np.array([None if _missing(p) else str(p) for p in pg[keep]], dtype=object)  # None: no pg
    enq = enq_raw[keep] - MATCH_SLACK_NS
    end = end_raw[keep] + MATCH_SLACK_NS
    etype = coll_types(events["name"])
    for t in set(etype):
        ei = np.flatnonzero(etype == t)
        li = np.flatnonzero(ltype == t)
        if not len(li):
            continue
        inside = (enq[li][None, :] <= starts[ei][:, None]) & (end[li][None, :] >= ends[ei][:, None])
        for k, row in zip(ei, inside):
            pgs = set(lpg[li][row])
            if len(pgs) == 1:
                out[k] = pgs.pop()
    # a gloo worker thread serves one group: settle ambiguous events by their thread's majority
    tids = np.asarray(events["tid"])
    main_like = name_mask(events["name"], lambda n: n.startswith(("gloo:send", "gloo:recv")))
    for tid in np.unique(tids, return_counts=True)[0]:  # with counts: numpy.ma stays unimported
        sel = (tids == tid) & ~main_like
        votes = Counter(v for v in out[sel] if v is not None)
        if votes:
            out[sel & _nones(out)] = votes.most_common(1)[0][0]
    if only is not None:
        out[_nones(out)] = only
    return out
