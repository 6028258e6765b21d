"""One rank's time breakdown per profiled step, from its trace alone: compute, communication, the
part of communication hidden under compute (overlap), exposed communication, data loading,
other, idle — split by collective type and by process group — plus host-side stalls
(``rank_breakdown``; analyzers/comm_compute.py judges the job from these rows).

GPU traces: kernels on all streams. comm = NCCL kernels, other = memcpy/memset, compute = the
other kernels, idle = no kernel running. CPU traces (gloo): the main thread (the one with the
ProfilerStep spans) computes in aten ops; communication runs on gloo worker threads (``gloo:*``)
and blocks the main thread in waits (``c10d::*``, ``_c10d_functional::wait_tensor``,
synchronous ``gloo:send/recv``). Exact definitions and the differences from HTA are in
docs/comm-compute.md.
"""

from __future__ import annotations

import re

import numpy as np

from trainprof.analyzers import _async_p2p, _coll_kernels, _gpu_calls, _log_labels
from trainprof.analyzers import _intervals as iv
from trainprof.analyzers._comm_groups import coll_types, gloo_event_groups, gpu_event_groups, trace_pg_names
from trainprof.analyzers._hta_numbers import hta_view
from trainprof.analyzers.ops import nest_parents
from trainprof.trace._table import Table, objects
from trainprof.trace.threads import main_thread

_WAIT_PREFIXES = ("c10d::", "_c10d_functional::", "c10d_functional::", "gloo:", "nccl:",
                  "record_param_comms")
# host calls that block until the device catches up (what .item(), .cpu(), .tolist() and
# explicit synchronize() do); cudaStreamWaitEvent is a device-side wait and not one of them
_SYNC_CALLS = _gpu_calls.SYNC_CALLS  # CUDA and HIP
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")  # "<built-in method … object at 0x7f…>"
TOP_OTHER = 5                 # host events named per step in other_by_name_ms (CPU traces)
MIN_OTHER_NS = 50_000         # ... of at least this much self time (50 µs)


def _ms(ns) -> float:
    return round(float(ns) / 1e6, 4)


def _by_key(keys, starts, ends, lo=None, hi=None) -> dict[str, int]:
    """Union length of the intervals of each key (clipped to [lo, hi))."""
    out: dict[str, int] = {}
    keys = np.asarray(keys, dtype=object)
    for k in sorted({k for k in keys if k is not None}, key=str):
        m = keys == k
        s = iv.union(starts[m], ends[m])
        if lo is not None:
            s = iv.clip(s, lo, hi)
        if iv.length(s):
            out[str(k)] = iv.length(s)
    return out


def _key_sets(keys, starts, ends, with_none: bool) -> list[tuple[str, iv.Set]]:
    """(key, union of its intervals) per distinct key, in _by_key's / _dim_split's order: built
    once, then clipped to each step (_by_key_in, _dim_split_in)."""
    keys = np.asarray(keys, dtype=object)
    return [(str(k), iv.union(starts[m], ends[m])) for k in sorted(
        {k for k in keys if with_none or k is not None}, key=str) for m in (keys == k,)]


def _by_key_in(sets: list, lo: int, hi: int) -> dict[str, int]:
    """_by_key(keys, starts, ends, lo, hi) from _key_sets(keys, starts, ends, False)."""
    out = {}
    for k, s in sets:
        n = iv.length(iv.clip(s, lo, hi))
        if n:
            out[k] = n
    return out


def _dim_split_in(sets: list, exposed: iv.Set, lo: int, hi: int) -> dict[str, dict]:
    """_dim_split(keys, starts, ends, exposed, lo, hi) from _key_sets(keys, starts, ends, True)."""
    out = {}
    for k, s in sets:
        s = iv.clip(s, lo, hi)
        if iv.length(s):
            out[k] = {"comm_ms": _ms(iv.length(s)), "exposed_ms": _ms(iv.length(iv.intersect(s, exposed)))}
    return out


def _dim_split(comm_keys, starts, ends, exposed: iv.Set, lo=None, hi=None) -> dict[str, dict]:
    """Per mesh dim: comm time (union of its events) and the exposed time under its events."""
    keys = np.asarray(comm_keys, dtype=object)
    out = {}
    for k in sorted({k for k in keys}, key=str):
        m = keys == k
        s = iv.union(starts[m], ends[m])
        if lo is not None:
            s = iv.clip(s, lo, hi)
        if iv.length(s):
            out[str(k)] = {"comm_ms": _ms(iv.length(s)),
                           "exposed_ms": _ms(iv.length(iv.intersect(s, exposed)))}
    return out


def _tail(comm: iv.Set, exposed: iv.Set) -> int:
    """Exposed time (ns) of the step's last communication interval: its last collective, which
    reduces the last gradients (DDP's last bucket, FSDP's last reduce-scatter) and so has no
    compute left to run under."""
    if not len(comm[0]):
        return 0
    return iv.length(iv.intersect((comm[0][-1:], comm[1][-1:]), exposed))


# --------------------------------------------------------------------------- GPU
def _gpu_rows(trace, dims: dict, split: list | None = None, used: dict | None = None) -> list[dict]:
    ev = trace.tables.events
    cat = ev["cat"]
    rows_idx = np.flatnonzero(cat.isin(["kernel", "gpu_memcpy", "gpu_memset"]) & (ev["step"] >= 0))
    name, kcat = ev["name"][rows_idx], cat[rows_idx]
    is_comm = name.mask(lambda n: "nccl" in n.lower())
    is_mem = kcat.isin(["gpu_memcpy", "gpu_memset"])
    is_d2h = is_mem & name.mask(lambda n: "DtoH" in n)
    kstep = ev["step"][rows_idx]
    ks, ke = ev["ts_ns"][rows_idx], ev["end_ns"][rows_idx]
    ctype = coll_types(name) if is_comm.any() else np.full(len(rows_idx), None, dtype=object)
    pgs = gpu_event_groups(trace, rows_idx)
    _name_generic_kernels(trace, rows_idx, is_comm, ctype, pgs)
    kdim = np.array([dims.get(p, f"pg {p}") if p is not None else "unknown" for p in pgs], dtype=object)
    kpg = _note_groups(pgs, dims, used)
    stalls = _host_stalls(ev)
    spans = _step_spans(trace.tables.steps)
    out = []
    # each step's rows by one stable sort (a mask per step cost steps x kernels)
    order = np.argsort(kstep, kind="stable")
    steps_sorted = kstep[order]
    for step in _distinct(kstep).tolist():
        m = order[np.searchsorted(steps_sorted, step, "left"):np.searchsorted(steps_sorted, step, "right")]
        s, e = ks[m], ke[m]
        comm, comp = iv.union(s[is_comm[m]], e[is_comm[m]]), iv.union(s[~is_comm[m] & ~is_mem[m]], e[~is_comm[m] & ~is_mem[m]])
        mem = iv.union(s[is_mem[m]], e[is_mem[m]])
        window = int(e.max() - s.min())
        overlapped = iv.length(iv.intersect(comm, comp))
        exposed = iv.subtract(comm, comp)
        other = iv.length(iv.subtract(iv.subtract(mem, comp), comm))
        idle = window - iv.length(iv.union(s, e))
        cm = m[is_comm[m]]
        st = stalls.get(step, (0, 0))
        span = spans.get(step, window)
        if split is not None:
            split.append(_dim_split(kpg[cm], ks[cm], ke[cm], exposed))
        out.append({
            "step": step, "window_ms": _ms(window),
            "compute_ms": _ms(iv.length(comp) - overlapped), "overlapped_ms": _ms(overlapped),
            "exposed_comm_ms": _ms(iv.length(exposed)), "data_ms": 0.0, "other_ms": _ms(other),
            "idle_ms": _ms(idle), "comm_ms": _ms(iv.length(comm)),
            "tail_exposed_ms": _ms(_tail(comm, exposed)),
            "comm_by_type_ms": {t: _ms(v) for t, v in _by_key(ctype[cm], ks[cm], ke[cm]).items()},
            "by_dim": _dim_split(kdim[cm], ks[cm], ke[cm], exposed),
            "host_step_ms": _ms(span), "sync_calls": st[0], "sync_ms": _ms(st[1]),
            "d2h_copies": int(is_d2h[m].sum())})
    return out


def _name_generic_kernels(trace, rows_idx, is_comm, ctype, pgs) -> None:
    """NCCL/RCCL kernels whose name says no collective (ncclDevKernel_Generic) or that carry no
    process group: both from the op that launched them (analyzers/_coll_kernels.py)."""
    no_pg = np.fromiter((p is None for p in pgs), bool, len(pgs))
    need = np.flatnonzero(is_comm & ((ctype == "other") | no_pg))
    if not len(need):
        return
    for i, a in zip(need.tolist(), _coll_kernels.attribute(trace, rows_idx[need])):
        if ctype[i] == "other":
            ctype[i] = a["collective"]
        if pgs[i] is None and a["pg_name"] is not None:
            pgs[i] = a["pg_name"]


def _distinct(a: np.ndarray) -> np.ndarray:
    """np.unique(a), sorted; asked with counts, which skips the masked-array check that imports
    numpy.ma (~10 ms in a process without pandas)."""
    return np.unique(a, return_counts=True)[0]


def _step_spans(steps) -> dict[int, int]:
    """step -> length (ns) of its ProfilerStep span (the first span of a step number)."""
    out: dict[int, int] = {}
    for st, lo, hi in zip(steps["step"].tolist(), steps["start_ns"].tolist(), steps["end_ns"].tolist()):
        out.setdefault(st, hi - lo)
    return out


def _host_stalls(ev) -> dict[int, tuple[int, int]]:
    """step -> (calls, ns) of host calls blocked on the device: synchronize calls, synchronous
    memcpys, and cudaMemcpyAsync into pageable memory (which blocks like a sync copy)."""
    cat = ev["cat"]
    rt = np.flatnonzero(cat.isin(["cuda_runtime", "cuda_driver"]) & (ev["step"] >= 0))
    if not len(rt):
        return {}
    name = ev["name"]
    rname = name[rt]
    blocking = rname.mask(lambda n: n in _SYNC_CALLS)
    async_cp = rname.isin(_gpu_calls.ASYNC_COPIES)
    if async_cp.any():
        cp = np.flatnonzero(cat.eq("gpu_memcpy"))
        pageable = ev["correlation"][cp][name[cp].mask(lambda n: "DtoH" in n and "Pageable" in n)]
        blocking |= async_cp & np.isin(ev["correlation"][rt], pageable)
    b = rt[blocking]
    if not len(b):
        return {}
    steps, inv = np.unique(ev["step"][b], return_inverse=True)
    size = np.bincount(inv, minlength=len(steps))
    total = np.zeros(len(steps), np.int64)
    np.add.at(total, inv, ev["dur_ns"][b])
    return {s: (n, t) for s, n, t in zip(steps.tolist(), size.tolist(), total.tolist())}


# --------------------------------------------------------------------------- CPU
def _cpu_rows(trace, dims: dict, log=None, split: list | None = None,
              used: dict | None = None) -> list[dict]:
    """``log``: this rank's collective log (rank_log) or None."""
    ev = trace.tables.events
    main = main_thread(ev)
    if main is None:
        return []
    on_main = ev["tid"] == main
    name = ev["name"]
    is_wait = name.mask(lambda n: n.startswith(_WAIT_PREFIXES))
    is_gloo = name.mask(lambda n: n.startswith(("gloo:", "nccl:")))
    is_aten = name.startswith("aten::")
    is_data = name.startswith("enumerate(DataLoader)")
    is_step = name.startswith("ProfilerStep#")
    s_all, e_all = ev["ts_ns"], ev["end_ns"]
    gl = ev[["name", "tid", "ts_ns", "end_ns"]][is_gloo]
    gs, ge = gl["ts_ns"], gl["end_ns"]
    gtype = _log_labels.types(gl["name"], gs, ge, log)  # reduce_scatter run as gloo:all_reduce
    relabelled = gtype != coll_types(gl["name"])
    if relabelled.any():  # matched to the log by the job's op
        names = np.asarray(gl["name"].tolist(), dtype=object)
        names[relabelled] = ["gloo:" + t for t in gtype[relabelled]]
        gl["name"] = names
    pgs = gloo_event_groups(gl, log, trace_pg_names(trace))
    gdim = np.array([dims.get(p, f"pg {p}") if p is not None else "unknown" for p in pgs], dtype=object)
    gpg = _note_groups(pgs, dims, used)
    # async point-to-point: communication only where the thread waits for it (_async_p2p)
    p2p = on_main & name.isin(_async_p2p.P2P_EVENTS)
    if p2p.any():
        if _async_p2p.all_async(log):  # posting an isend/irecv is host work, not a wait
            is_wait = is_wait & ~name.isin(_async_p2p.ISSUE_OPS)
        own = on_main & ev["cat"].eq("cpu_op") & ~is_wait
        rows, lo, hi = _async_p2p.split(gs[p2p[is_gloo]], ge[p2p[is_gloo]], gtype[p2p[is_gloo]],
                                        log, iv.union(s_all[own], e_all[own]))
        sel = np.concatenate([np.flatnonzero(~p2p[is_gloo]), np.flatnonzero(p2p[is_gloo])[rows]])
        gs = np.concatenate([gs[~p2p[is_gloo]], lo])
        ge = np.concatenate([ge[~p2p[is_gloo]], hi])
        gtype, gdim, gpg = gtype[sel], gdim[sel], gpg[sel]
        s_all, e_all = s_all.copy(), e_all.copy()
        e_all[p2p] = s_all[p2p]  # their spans leave the waits; their waits join them below
    sets = {key: iv.union(s_all[m], e_all[m]) for key, m in (
        ("wait", on_main & is_wait), ("aten", on_main & is_aten & ~is_wait),
        ("data", on_main & is_data), ("busy", on_main & ~is_step))}
    if p2p.any():
        sets["wait"] = iv.union(np.concatenate([sets["wait"][0], lo]),
                                np.concatenate([sets["wait"][1], hi]))
    comm_all = iv.union(np.concatenate([sets["wait"][0], gs]), np.concatenate([sets["wait"][1], ge]))
    out, others = [], []
    steps = trace.tables.steps
    # each key's intervals united once and clipped to each step (steps x log(events), not
    # steps x events: 40,000 one-op steps took 38 s)
    by_type, by_dim = _key_sets(gtype, gs, ge, False), _key_sets(gdim, gs, ge, True)
    by_pg = _key_sets(gpg, gs, ge, True) if split is not None else None
    for step, lo, hi in zip(steps["step"].tolist(), steps["start_ns"].tolist(), steps["end_ns"].tolist()):
        waits = iv.clip(sets["wait"], lo, hi)
        comm = iv.clip(comm_all, lo, hi)
        compute = iv.subtract(iv.clip(sets["aten"], lo, hi), waits)
        data = iv.subtract(iv.clip(sets["data"], lo, hi), compute)
        overlapped = iv.intersect(comm, compute)
        exposed = iv.subtract(iv.subtract(comm, compute), data)
        accounted = iv.union(np.concatenate([compute[0], comm[0], data[0]]),
                             np.concatenate([compute[1], comm[1], data[1]]))
        other = iv.subtract(iv.clip(sets["busy"], lo, hi), accounted)
        others.append(other)
        window = hi - lo
        if split is not None:
            split.append(_dim_split_in(by_pg, exposed, lo, hi))
        out.append({
            "step": step, "start_ns": int(lo), "end_ns": int(hi), "window_ms": _ms(window),
            "compute_ms": _ms(iv.length(compute) - iv.length(overlapped)),
            "overlapped_ms": _ms(iv.length(overlapped)), "exposed_comm_ms": _ms(iv.length(exposed)),
            "data_ms": _ms(iv.length(data)), "other_ms": _ms(iv.length(other)),
            "idle_ms": _ms(max(window - iv.length(accounted) - iv.length(other), 0)),
            "comm_ms": _ms(iv.length(comm)), "tail_exposed_ms": _ms(_tail(comm, exposed)),
            "comm_by_type_ms": {t: _ms(v) for t, v in _by_key_in(by_type, lo, hi).items()},
            "by_dim": _dim_split_in(by_dim, exposed, lo, hi),
            "host_step_ms": _ms(window), "sync_calls": 0, "sync_ms": 0.0, "d2h_copies": 0})
    if out:
        other = iv.union(np.concatenate([o[0] for o in others]), np.concatenate([o[1] for o in others]))
        named = _other_by_name(ev, on_main & ~is_step, is_aten | is_wait | is_data, other)
        for row in out:
            row["other_by_name_ms"] = named.get(row["step"], {})
    return out


def _other_by_name(ev, rows: np.ndarray, ops: np.ndarray, other: iv.Set) -> dict[int, dict[str, float]]:
    """step -> {name: ms} of the main thread's host events that are not torch ops (Python
    functions with with_stack, annotations such as Lightning's or Optimizer.step, autograd
    bookkeeping): the part of their self time (outside the events nested in them) that lies in
    ``other``, the TOP_OTHER largest per step of at least MIN_OTHER_NS. ``rows``: the main
    thread's events but the ProfilerStep spans; ``ops``: those that are compute, communication
    or data; ``other``: the main thread's other time of every step."""
    idx = np.flatnonzero(rows)
    if not len(idx) or not len(other[0]):
        return {}
    ts, end = ev["ts_ns"][idx], ev["end_ns"][idx]
    # time in `other` up to t: C(t); an interval's share of `other` is C(end) - C(start)
    cum = np.concatenate(([0], np.cumsum(other[1] - other[0])))

    def upto(t):
        k = np.searchsorted(other[0], t, side="right")  # pieces starting at or before t
        last = np.maximum(k - 1, 0)
        inside = np.minimum(t, other[1][last]) - other[0][last]
        return cum[np.maximum(k - 1, 0)] + np.where(k > 0, np.maximum(inside, 0), 0)

    n = len(idx)
    order, par = nest_parents(ts, end, np.zeros(n, np.int64))  # one thread: the main one
    s, e = ts[order], end[order]
    incl = upto(e) - upto(s)
    has = np.flatnonzero(par >= 0)
    child = (np.bincount(par[has], weights=upto(np.minimum(e[has], e[par[has]])) - upto(s[has]),
                         minlength=n) if len(has) else np.zeros(n))
    own = np.empty(n, np.int64)
    own[order] = np.maximum(incl - child.astype(np.int64), 0)
    keep = ~ops[idx] & (own > 0) & (ev["step"][idx] >= 0)
    if not keep.any():
        return {}
    idx, own = idx[keep], own[keep]
    codes, step = ev["name"].codes[idx], ev["step"][idx]
    values = ev["name"].values
    key = step.astype(np.int64) * (len(values) + 1) + codes
    uniq, inv, _ = np.unique(key, return_inverse=True, return_counts=True)  # no numpy.ma
    tot = np.bincount(inv, weights=own.astype(np.float64), minlength=len(uniq))
    out: dict[int, dict[str, float]] = {}
    for k, t in sorted(zip(uniq.tolist(), tot.tolist()), key=lambda kv: -kv[1]):
        st, code = divmod(k, len(values) + 1)
        d = out.setdefault(st, {})
        if t >= MIN_OTHER_NS and len(d) < TOP_OTHER:
            name = _ADDRESS.sub("", str(values[code]))[:200]  # one name on every rank
            d[name] = round(d.get(name, 0.0) + _ms(t), 4)
    return out


def _note_groups(pgs, dims: dict, used: dict | None) -> np.ndarray:
    """The events' groups as split keys ("" for none), noting in ``used`` the label each
    group got."""
    if used is not None:
        used.update({str(p): dims.get(p, f"pg {p}") for p in set(pgs) if p is not None})
    return np.array(["" if p is None else str(p) for p in pgs], dtype=object)


# --------------------------------------------------------------------------- per rank
def is_gpu(trace) -> bool:
    return bool(trace.tables.events["cat"].eq("kernel").any())


def rank_breakdown(trace, dims: dict | None = None, log=None,
                   split: list | None = None, used: dict | None = None):
    """(per-step rows, HTA view or None, 'gpu'|'cpu') for one rank's trace. ``split``: a list
    that gets, per row, the communication time by process group ({pg or "": {comm_ms,
    exposed_ms}}); ``used``: a dict that gets the label each group was given; ``log``: the
    rank's collective log (rank_log), which names the groups of a CPU trace's gloo events."""
    dims = dims or {}
    ev = trace.tables.events
    if is_gpu(trace):
        base = trace.meta.get("baseTimeNanoseconds")
        base = int(base) if isinstance(base, (int, float)) and not isinstance(base, bool) else 0
        return _gpu_rows(trace, dims, split, used), hta_view(ev, base), "gpu"
    return _cpu_rows(trace, dims, log, split, used), None, "cpu"


_LOG_COLUMNS = ("pg", "op", "enqueue_ns", "end_ns", "blocked_ms", "async")


def rank_log(run, rank) -> Table | None:
    """This rank's collectives (collectives.jsonl without NaN replays), for matching gloo
    events: a Table of the columns gloo_event_groups reads that some record has (a record
    without one holds NaN there), or None without records."""
    try:
        recs = run.stream(rank, "collectives")
    except Exception:  # noqa: BLE001 - the log is optional
        return None
    if not recs:
        return None
    recs = [r for r in recs if r.get("replay") is not True]
    cols = {}
    for c in _LOG_COLUMNS:
        if any(c in r for r in recs):
            vals = [r.get(c, np.nan) for r in recs]
            cols[c] = (np.array(vals, np.int64) if vals and all(type(v) is int for v in vals)
                       else objects(vals))
    return Table(cols, len(recs))
