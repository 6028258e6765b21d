"""Communication vs computation, per rank and profiled step: compute, communication, the part of
communication hidden under compute (overlap), exposed communication, data loading, other, idle —
split by collective type and by mesh dimension — plus host-side stalls and warm-up steps.

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

from trainprof._lazy import pd
from trainprof.analyzers import _async_p2p, _coll_kernels, _gpu_calls, _log_labels
from trainprof.analyzers import _lateness, _overlap_credit
from trainprof.analyzers import _intervals as iv
from trainprof.analyzers._stats import median
from trainprof.analyzers.estimates import MIN_SAVING, exposed_comm_hidden
from trainprof.analyzers._profiled_window import off_training
from trainprof.analyzers._comm_groups import (coll_types, gloo_event_groups, gpu_event_groups,
                                              group_dims, trace_groups, trace_pg_names)
from trainprof.findings import AnalyzerResult, Finding
from trainprof.trace._table import Table, objects
from trainprof.trace.threads import main_thread
from trainprof.wording import ranks_phrase
from trainprof.analyzers.ops import nest_parents
from trainprof.analyzers.stragglers import waits_or_problem
from trainprof.analyzers.trace_stragglers import has_collective_log, waits

NAME = "comm_compute"
HOST_STALL_FINDING = 0.05     # host blocked in synchronizations ≥ this share of the step
WARMUP_FACTOR = 1.5           # a profiled step this much slower than the others' median is warm-up
UNTYPICAL_WINDOW = 2.0        # profiled steps this much slower than the job's other steps: the
                              # window does not show the job's usual step (the profiler's cost)

_WAIT_PREFIXES = ("c10d::", "_c10d_functional::", "c10d_functional::", "gloo:", "nccl:",
                  "record_param_comms")
# host calls that block until the device catches up (what .item(), .cpu(), .tolist() and
# explicit synchronize() do); cudaStreamWaitEvent is a device-side wait and not one of them
_SYNC_CALLS = _gpu_calls.SYNC_CALLS  # CUDA and HIP
CATEGORIES = ("compute_ms", "overlapped_ms", "exposed_comm_ms", "data_ms", "other_ms", "idle_ms")
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


# HTA's kernel classes (hta/common/types.py, re.match on the name) and the categories its
# breakdown counts: events with a "stream" argument
_HTA_GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset", "cuda_sync")
_HTA_STEP = re.compile(r"^ProfilerStep#(\d+)")
_HTA_COMM = re.compile(r"(^nccl.*)|(^hip)|(^hccl)|(.*ncclKernel.*)")
_HTA_MEM = re.compile(r"(^(hip)?Memcpy)|(^(hip)?Memset)|(^dma)")
_HTA_NOT_COMPUTE = re.compile(
    r"(^nccl)|(.*Memcpy)|(.*Memset)|(.*dma)|(^.*Sync)|(^Stream Wait Event)|(cuda.*LaunchKernel)"
    r"|(^runFunction)|(^hip)|(^job_exe)|(^packet)|(^pe_exe)|(^cpum_exe_subgraph)|(^hccl)"
    r"|(^collective_subgraph_execution)")


def _hta_merge(s: np.ndarray, e: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """HTA's merge_kernel_intervals: sorted by start, an interval joins the group before it
    unless it starts after every end seen so far; a group spans min start .. max end. A sub-µs
    op that HTA's rounding turns into a negative length (start rounded up past its end rounded
    down) counts as zero length here; HTA counts it negative, which can make its busy time of
    all ops less than that of the compute kernels alone (it then fails an assertion)."""
    if not len(s):
        return s, e
    e = np.maximum(e, s)
    order = np.argsort(s, kind="stable")
    s, e = s[order], e[order]
    first = np.ones(len(s), bool)
    first[1:] = s[1:] > np.maximum.accumulate(e)[:-1]
    idx = np.flatnonzero(first)
    return s[idx], np.maximum.reduceat(e, idx)


def _hta_overlap(comm: tuple, comp: tuple) -> int:
    """HTA's overlap sweep: +1/-1 at communication starts/ends, +2/-2 at compute ones; time
    while the running sum is 3."""
    t = np.concatenate([comm[0], comm[1], comp[0], comp[1]])
    d = np.concatenate([np.full(len(comm[0]), 1), np.full(len(comm[1]), -1),
                        np.full(len(comp[0]), 2), np.full(len(comp[1]), -2)])
    if not len(t):
        return 0
    order = np.argsort(t, kind="stable")
    t, run = t[order], np.cumsum(d[order])
    m = run[:-1] == 3
    return int((t[1:][m] - t[:-1][m]).sum())


def hta_view(ev, base_ns: int = 0) -> dict | None:
    """HTA's get_temporal_breakdown (idle / compute / non-compute % of the window) and
    get_comm_comp_overlap (% of communication time overlapped with compute), computed the way
    HTA (traceinsight 0.6.1) does:

    - its GPU ops: kernels, memcpys, memsets and CUDA synchronization events (cuda_sync);
    - when the trace has two or more distinct ``ProfilerStep#N`` names: only those launched (same
      correlation id) by a host event that starts before the latest ProfilerStep event — the
      GPU timeline's ProfilerStep annotation included — so the last profiled iteration, and ops
      queued before recording started, are left out; otherwise every GPU op of the trace;
    - timestamps in whole µs of the trace: start rounded up, end down;
    - window = first op start .. end of the last-starting group of overlapping ops; idle = window
      − merged busy time; compute = merged time of compute kernels (not NCCL, memcpy/memset,
      synchronization); non-compute = the rest.

    ``ev``: a trace's events Table. ``overlap_pct`` is 0.0 when there is no communication
    kernel (HTA divides 0 by 0: NaN)."""
    is_gpu = ev["cat"].isin(_HTA_GPU_CATS)
    if not is_gpu.any():
        return None
    ts, end = ev["ts_ns"], ev["end_ns"]
    up = lambda a: -((base_ns - a) // 1000)  # noqa: E731 - ceil to whole µs
    corr = ev["correlation"]
    name = ev["name"]
    step_names = name.value_mask(lambda n: _HTA_STEP.match(n) is not None)
    is_step = step_names[name.codes] if len(step_names) else np.zeros(len(ts), bool)
    if np.count_nonzero(np.bincount(name.codes[is_step])) >= 2:  # two distinct step names
        # HTA's host events: all but the GPU ops with a correlation id
        host = ~(is_gpu & (corr >= 0))
        before = up(ts) < up(int(ts[host & is_step].max()))
        launched = np.isin(corr, corr[host & before & (corr >= 0)])
        keep = is_gpu & (((corr >= 0) & launched) | ((corr < 0) & before))
    else:
        keep = is_gpu
    if not keep.any():
        return None
    kname = name[keep]
    comm_m = kname.mask(lambda n: _HTA_COMM.match(n) is not None)
    mem_m = kname.mask(lambda n: _HTA_MEM.match(n) is not None)
    comp_m = ~comm_m & ~mem_m & kname.mask(lambda n: _HTA_NOT_COMPUTE.match(n) is None)
    s, e = up(ts[keep]), (end[keep] - base_ns) // 1000
    alls, comp, comm = _hta_merge(s, e), _hta_merge(s[comp_m], e[comp_m]), _hta_merge(s[comm_m], e[comm_m])
    window = int(alls[1][-1] - alls[0][0])
    if window <= 0:
        return None
    busy, comp_t, comm_t = (int((x[1] - x[0]).sum()) for x in (alls, comp, comm))
    pct = lambda x: round(100 * (x / window), 2)  # noqa: E731
    return {"idle_pct": pct(window - busy), "compute_pct": pct(comp_t),
            "non_compute_pct": pct(busy - comp_t),
            "overlap_pct": round(100 * (_hta_overlap(comm, comp) / comm_t), 2) if comm_t else 0.0}


# --------------------------------------------------------------------------- CPU
def _cpu_rows(trace, dims: dict, log=None, split: list | None = None,
              used: dict | None = None) -> list[dict]:
    """``log``: this rank's collective log (_rank_log) or None."""
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


# --------------------------------------------------------------------------- per rank / job
def _is_gpu(trace) -> bool:
    return bool(trace.tables.events["cat"].eq("kernel").any())


def rank_breakdown(trace, dims: dict | None = None, log=None,
                   split: list | None = None, used: dict | None = None):
    """(per-step rows, HTA view or None, 'gpu'|'cpu') for one rank's trace. ``split``: a list
    that gets, per row, the communication time by process group ({pg or "": {comm_ms,
    exposed_ms}}); ``used``: a dict that gets the label each group was given; ``log``: the
    rank's collective log (_rank_log), which names the groups of a CPU trace's gloo events."""
    dims = dims or {}
    ev = trace.tables.events
    if _is_gpu(trace):
        base = trace.meta.get("baseTimeNanoseconds")
        base = int(base) if isinstance(base, (int, float)) and not isinstance(base, bool) else 0
        return _gpu_rows(trace, dims, split, used), hta_view(ev, base), "gpu"
    return _cpu_rows(trace, dims, log, split, used), None, "cpu"


_LOG_COLUMNS = ("pg", "op", "enqueue_ns", "end_ns", "blocked_ms", "async")


def _rank_log(run, rank) -> Table | None:
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


def trace_digest(run, rank, trace) -> dict:
    """One rank's breakdown per profiled step (rows as rank_breakdown gives them, its groups
    labelled with what this trace and the run's files say) plus what the job needs to label
    them the job's way: the trace's process groups, the label each of its groups got, and
    per row the communication time by group."""
    groups = trace_groups(trace)
    dims = group_dims(run, [groups])
    split, used = [], {}
    rows, hta, kind = rank_breakdown(trace, dims, None if _is_gpu(trace) else _rank_log(run, rank),
                                     split, used)
    return {"kind": kind, "rows": rows, "hta": hta, "groups": groups, "pg_dims": used,
            "by_pg": split, "whole_trace_window": bool(trace.meta.get("whole_trace_window"))}


def _job_rows(d: dict, dims: dict) -> list[dict]:
    """A digest's rows under the job's group -> dimension labels: as digested when this trace
    alone gave its groups the same labels (the usual case); else each row's by_dim rebuilt from
    its per-group split (groups that share a label summed)."""
    if all(dims.get(p, f"pg {p}") == lab for p, lab in d["pg_dims"].items()):
        return d["rows"]
    out = []
    for row, split in zip(d["rows"], d["by_pg"]):
        acc: dict[str, dict] = {}
        for p, v in split.items():
            a = acc.setdefault(dims.get(p, f"pg {p}") if p else "unknown",
                               {"comm_ms": 0.0, "exposed_ms": 0.0})
            a["comm_ms"] += v["comm_ms"]
            a["exposed_ms"] += v["exposed_ms"]
        out.append(dict(row, by_dim={k: {m: round(x, 4) for m, x in acc[k].items()}
                                     for k in sorted(acc, key=str)}))
    return out


def warmup_steps(rows: list[dict]) -> list[int]:
    """Profiled steps ≥ WARMUP_FACTOR × the median of the other steps (needs ≥ 3 steps)."""
    if len(rows) < 3:
        return []
    w = np.asarray([r["window_ms"] for r in rows], dtype=np.float64)
    others = _medians_of_the_others(w)
    return [r["step"] for r, x, m in zip(rows, w.tolist(), others.tolist()) if x > WARMUP_FACTOR * m]


def _medians_of_the_others(a: np.ndarray) -> np.ndarray:
    """[median(a without a[i]) for every i], from one sort (the median of each copy without one
    value, done one by one, cost steps² at 40,000 profiled steps: 38 s). NaN where a holds one."""
    n = len(a)
    if np.isnan(a).any():
        return np.full(n, np.nan)
    order = np.argsort(a, kind="stable")
    s = a[order]
    pos = np.empty(n, np.int64)
    pos[order] = np.arange(n)

    def kth(k: int) -> np.ndarray:  # the k-th smallest of the others, for every i
        return np.where(k < pos, s[k], s[min(k + 1, n - 1)])

    m = n - 1
    return kth(m // 2) if m % 2 else (kth(m // 2 - 1) + kth(m // 2)) / 2.0


def _rank_summary(rank, rows, hta, kind, coords) -> dict:
    warm = warmup_steps(rows)
    use = [r for r in rows if r["step"] not in warm] or rows
    tot = {k: sum(r[k] for r in use) for k in ("window_ms", "comm_ms", "sync_ms", "host_step_ms", *CATEGORIES)}
    w = tot["window_ms"] or 1.0
    by_type: dict[str, float] = {}
    by_dim: dict[str, dict] = {}
    for r in use:
        for t, v in r["comm_by_type_ms"].items():
            by_type[t] = by_type.get(t, 0.0) + v
        for d, v in r["by_dim"].items():
            acc = by_dim.setdefault(d, {"comm_ms": 0.0, "exposed_ms": 0.0})
            acc["comm_ms"] += v["comm_ms"]
            acc["exposed_ms"] += v["exposed_ms"]
    n = len(use)
    return {
        "rank": rank, "coords": coords, "kind": kind, "steps": [r["step"] for r in use],
        "warmup_steps": warm, "step_window_ms": round(float(median([r["window_ms"] for r in rows])), 3),
        **{k.replace("_ms", "_fraction"): round(tot[k] / w, 4) for k in CATEGORIES},
        "comm_fraction": round(tot["comm_ms"] / w, 4),
        "tail_exposed_fraction": round(sum(r.get("tail_exposed_ms") or 0.0 for r in use) / w, 4),
        "overlap_of_comm": round(tot["overlapped_ms"] / tot["comm_ms"], 4) if tot["comm_ms"] else 0.0,
        "sync_calls_per_step": round(sum(r["sync_calls"] for r in use) / n, 2),
        "sync_ms_per_step": round(tot["sync_ms"] / n, 3),
        "sync_fraction": round(tot["sync_ms"] / tot["host_step_ms"], 4) if tot["host_step_ms"] else 0.0,
        "d2h_copies_per_step": round(sum(r["d2h_copies"] for r in use) / n, 2),
        "comm_by_type_ms_per_step": {t: round(v / n, 3) for t, v in sorted(by_type.items())},
        "by_dim_ms_per_step": {d: {k: round(v / n, 3) for k, v in acc.items()} for d, acc in sorted(by_dim.items())},
        **({"hta_view": hta} if hta else {}),
    }


def _log_blocked_by_dim(run, dims: dict) -> dict[tuple, float]:
    """(rank, dim) -> ms per step blocked in collectives, from the collective log (steps ≥ 1)."""
    try:
        coll = run.collectives()
    except Exception:  # noqa: BLE001 - the log is optional
        return {}
    if coll.empty or not {"blocked_ms", "pg", "step"} <= set(coll):
        return {}
    coll = coll.loc[coll["step"].ge(1), ["rank", "step", "pg", "blocked_ms"]]
    # the dim of each distinct pg once (millions of records, few groups), grouped by its code
    codes, uniq = pd.factorize(coll["pg"])
    names = [dims.get(str(p), f"pg {p}") for p in uniq]
    na = codes < 0  # records without a pg: named one by one, as before
    extra = [dims.get(str(p), f"pg {p}") for p in coll["pg"].to_numpy(dtype=object)[na]] \
        if na.any() else []
    labels = sorted(set(names) | set(extra))
    at = {d: i for i, d in enumerate(labels)}
    dim = np.array([at[d] for d in names] + [-1], dtype=np.int64)[codes]
    if extra:
        dim[na] = [at[d] for d in extra]
    coll = coll.assign(dim=dim)
    nsteps = coll.groupby("rank")["step"].nunique()
    agg = coll.groupby(["rank", "dim"])["blocked_ms"].sum()
    return {(int(r), labels[d]): round(float(v) / max(int(nsteps[r]), 1), 3)
            for (r, d), v in agg.items()}


def _mesh_dim_table(per_rank: list[dict], blocked: dict) -> list[dict]:
    out, seen = [], set()
    for r in per_rank:
        for d, v in r["by_dim_ms_per_step"].items():
            seen.add((r["rank"], d))
            out.append({"rank": r["rank"], "mesh_dim": d, "comm_ms_per_step": v["comm_ms"],
                        "exposed_ms_per_step": v["exposed_ms"],
                        "blocked_ms_per_step": blocked.get((r["rank"], d))})
    for (rank, d), v in sorted(blocked.items(), key=str):
        if (rank, d) not in seen:
            out.append({"rank": rank, "mesh_dim": d, "comm_ms_per_step": None,
                        "exposed_ms_per_step": None, "blocked_ms_per_step": v})
    return sorted(out, key=lambda x: (x["rank"], str(x["mesh_dim"])))


def analyze(run) -> AnalyzerResult:
    digests = run.trace_digests(NAME)
    if not digests:
        return AnalyzerResult(metrics={}, findings=[])
    dims = group_dims(run, [d["groups"] for _, d in sorted(digests.items())])
    per_step, per_rank, kinds = [], [], set()
    for rank, d in sorted(digests.items()):
        rows, hta, kind = _job_rows(d, dims), d["hta"], d["kind"]
        if not rows:
            continue
        kinds.add(kind)
        summary = _rank_summary(rank, rows, hta, kind, _coords(run, rank))
        if d.get("whole_trace_window"):
            summary["whole_trace_window"] = True
            # no steps: any collective may be the last of its iteration (nothing to hide it)
            summary["tail_exposed_fraction"] = summary["exposed_comm_fraction"]
        per_rank.append(summary)
        run_steps = _run_steps(run, rank, len(rows))
        per_step += [{"rank": rank, **r, "run_step": rs, "warmup": r["step"] in summary["warmup_steps"]}
                     for r, rs in zip(rows, run_steps)]
    if not per_rank:
        return AnalyzerResult(metrics={}, findings=[])
    off = off_training(run, per_rank)
    if off:  # a window of start-up / teardown idle time is no measurement of the training
        run.problems.append(off)
        return AnalyzerResult(metrics={"withheld": off, "per_rank": per_rank}, findings=[])
    med = lambda key: round(float(median([r[key] for r in per_rank])), 4)  # noqa: E731
    job = {"trace_kind": "/".join(sorted(kinds)), "ranks": len(per_rank),
           **{k.replace("_ms", "_fraction"): med(k.replace("_ms", "_fraction")) for k in CATEGORIES},
           "comm_fraction": med("comm_fraction"), "sync_fraction": med("sync_fraction"),
           "warmup_steps": sorted({s for r in per_rank for s in r["warmup_steps"]})}
    metrics = {"job": job, "exposed_comm_fraction": job["exposed_comm_fraction"],
               "per_rank": per_rank, "per_step": per_step,
               "by_mesh_dim": _mesh_dim_table(per_rank, _log_blocked_by_dim(run, dims)),
               "group_dims": dims, "thresholds": {"exposed_comm_saving": MIN_SAVING,
                                                  "host_stall": HOST_STALL_FINDING,
                                                  "warmup_factor": WARMUP_FACTOR},
               "definitions": "docs/comm-compute.md"}
    window = _window_vs_other_steps(run)
    if window:
        metrics["window_vs_other_steps"] = window
    late = _late_waits(run, per_rank)
    if late["wait_ms"]:
        metrics["exposed_comm_fraction_excl_late_ranks"] = late["exposed"]
        metrics["waiting_for_late_ranks"] = {"late": late["late"], "wait_ms_per_step": late["wait_ms"]}
    arrival = _peer_arrival_waits(run, per_rank, per_step)
    if arrival:
        for r in per_rank:
            if r["rank"] in arrival:
                r["peer_arrival_wait_fraction"] = arrival[r["rank"]]
        credit = _overlap_credit.credits(run, per_rank, per_step)  # what overlap removes too
        for r in per_rank:
            r.update(credit.get(r["rank"], {}))
        metrics["exposed_comm_fraction_excl_peer_arrival"] = round(float(median(
            [max(0.0, r["exposed_comm_fraction"] - arrival.get(r["rank"], 0.0)) for r in per_rank])), 4)
    missing = _missing_ranks(run)
    found = _findings(per_rank, job["exposed_comm_fraction"], late, missing, window, arrival)
    for f in found:
        if f.kind == "exposed_comm" and _hand_all_reduce(run, f.evidence):
            f.fix = HAND_ALL_REDUCE_FIX
    return AnalyzerResult(metrics=metrics, findings=found)


HAND_ALL_REDUCE_FIX = (
    "all-reduce the gradients while backward runs, not after it: wrap the model in "
    "DistributedDataParallel (it all-reduces buckets of gradients as they become ready), or "
    "start each gradient's all_reduce(async_op=True) from a hook "
    "(register_post_accumulate_grad_hook) and wait on the works before optimizer.step(); or "
    "communicate less (gradient accumulation, bf16 gradients)")


def _hand_all_reduce(run, evidence: dict) -> bool:
    """The exposed communication is mostly all_reduce in a run directory whose ranks record no
    DDP, FSDP or framework: gradients all-reduced by the job's own code (after backward, as
    nothing else in it would overlap them)."""
    types = evidence.get("comm_by_type_ms_per_step") or {}
    if not types or max(types, key=types.get).replace("_", "") != "allreduce":
        return False
    if getattr(run, "trace_inputs", None):
        return False  # bare traces: what wraps the model is not known
    metas = [run.rank_meta(r) or {} for r in run.ranks]
    return bool(metas) and all(metas) and not any(
        m.get("ddp") or m.get("fsdp") or m.get("framework") or (m.get("run_info") or {}).get("framework")
        or (m.get("run_info") or {}).get("dp_mode") for m in metas)


def _window_vs_other_steps(run) -> dict | None:
    """The profiled steps against the job's other steps (steps.jsonl, steps ≥ 1, medians over
    every rank's steps): {profiled_step_ms, other_step_ms, other_steps, untypical, and
    log_blocked_fraction: the collective log's time blocked in collectives over those other
    steps' time (median over ranks)}. None without step records of both kinds (≥ 3 others)."""
    try:
        st = run.steps()
    except Exception:  # noqa: BLE001 - bare traces have no step records
        return None
    if st is None or st.empty or not {"profiled", "dur_ms", "step", "rank"} <= set(st):
        return None
    st = st.loc[st["step"].ge(1), ["rank", "step", "dur_ms", "profiled"]]
    prof = st["profiled"].eq(True).to_numpy()
    if not prof.any() or (~prof).sum() < 3:
        return None
    p_ms = float(np.median(st["dur_ms"].to_numpy()[prof]))
    other = st.loc[~prof]
    o_ms = float(np.median(other["dur_ms"].to_numpy()))
    out = {"profiled_step_ms": round(p_ms, 3), "other_step_ms": round(o_ms, 3),
           "other_steps": int(other["step"].nunique()),
           "untypical": bool(o_ms > 0 and p_ms >= UNTYPICAL_WINDOW * o_ms),
           "threshold": UNTYPICAL_WINDOW}
    try:
        coll = run.collectives()
    except Exception:  # noqa: BLE001 - the log is optional
        coll = None
    if coll is not None and not coll.empty and {"blocked_ms", "step", "rank"} <= set(coll):
        blocked = coll.groupby(["rank", "step"])["blocked_ms"].sum()
        dur = other.groupby("rank")["dur_ms"].sum()
        shares = []
        for r, total in dur.items():
            steps = other.loc[other["rank"].eq(r), "step"]
            b = blocked.reindex([(r, s) for s in steps]).fillna(0.0).sum()
            if total > 0:
                shares.append(float(b) / float(total))
        if shares:
            out["log_blocked_fraction"] = round(float(np.median(shares)), 4)
    return out


def _missing_ranks(run) -> list[int]:
    """Ranks of the job with no data at all (a partial run: a trace unreadable, a rank lost):
    time the others spend waiting for them looks like exposed communication."""
    try:
        p = run.partial()
    except Exception:  # noqa: BLE001
        return []
    return list((p or {}).get("missing_ranks") or [])


def _late_waits(run, per_rank: list[dict]) -> dict:
    """Per rank, the exposed-communication fraction without the time it waits in collectives
    for a late rank (a straggler or a rank starved of input: the stragglers analyzer's finding,
    from the collective log; ms per step over its analysed steps ÷ the profiled step window)."""
    out = {"late": [], "wait_ms": {}, "adjusted": {}, "exposed": None}

    w = waits_or_problem(run, NAME)
    if (w is None or not w["wait_ms"]) and not _has_log(run):  # bare traces: judged from them
        w = waits(run)
    if w is None or not w["wait_ms"]:
        return out
    for r in per_rank:
        wait = w["wait_ms"].get(r["rank"], 0.0)
        win = r["step_window_ms"] or 0.0
        out["adjusted"][r["rank"]] = round(max(0.0, r["exposed_comm_fraction"] - wait / win), 4) \
            if win > 0 else r["exposed_comm_fraction"]
    out.update(late=w["late"], wait_ms={str(k): round(v, 3) for k, v in w["wait_ms"].items()},
               exposed=round(float(median(list(out["adjusted"].values()))), 4))
    return out


def _peer_arrival_waits(run, per_rank: list[dict], per_step: list[dict]) -> dict[int, float]:
    """CPU traces: rank -> the share of its analysed profiled steps it spent blocked in a
    collective before the last other member of that collective had arrived (the collective
    log's complete instances of blocking calls: from its enqueue, min(blocked time, last other
    member's enqueue − its own)). That is the other ranks' lateness — a slower or descheduled
    peer, a straggler — not the transfer: on CPU every blocking collective is exposed, and two
    balanced ranks on a loaded host take turns waiting for each other by tens of ms a step.
    Counted only inside each step's window and within its exposed time. Empty without a log or
    for GPU traces (their waits are on the device: _late_waits)."""
    rows: dict[int, list[dict]] = {}
    for r in per_rank:
        if r["kind"] != "cpu" or r.get("whole_trace_window"):
            continue
        use = set(r["steps"])
        rows[r["rank"]] = [x for x in per_step if x["rank"] == r["rank"] and x["step"] in use
                           and x.get("start_ns") is not None]
    rows = {k: v for k, v in rows.items() if v}
    if not rows or not _has_log(run):
        return {}
    try:
        df = _lateness.frame(run)
    except Exception as e:  # noqa: BLE001 - the log only refines the judgement
        run.problems.append(f"{NAME}: waits for other ranks' arrival unavailable ({type(e).__name__}: {e})")
        return {}
    if df.empty:
        return {}
    sync = ~df["async"].eq(True).to_numpy(bool) if "async" in df else np.ones(len(df), bool)
    c = df.loc[df["complete"].to_numpy(bool) & sync & df["rank"].isin(list(rows)).to_numpy(),
               ["rank", "group", "ordinal", "op", "bytes", "enqueue_ns", "t_enq", "wait_ms"]]
    enq, ends, rank_of = np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
    if not c.empty:
        last = df.loc[df["complete"].to_numpy(bool)].groupby(["group", "ordinal"], observed=True)["t_enq"].max()
        c = c.join(last.rename("t_last"), on=["group", "ordinal"])
        total = np.nan_to_num(c["wait_ms"].to_numpy(float))
        # past the last arrival, the op's own time is a low quantile of that part over the
        # group's instances of the same op and about the same size (_transfer_time: an
        # expert-parallel all_to_all's size changes every step); the rest is the host's delay
        # (on 2 shared cores a 512 KiB all_to_all took 0.6 ms at best, 3.1 ms at the median):
        # a slow link makes every instance slow, and its quantile keeps it communication
        wait, late = _overlap_credit.split_waits(total, c["t_enq"].to_numpy(float),
                                                 c["t_last"].to_numpy(float), c["group"].to_numpy(),
                                                 c["op"].to_numpy(), c["bytes"].to_numpy())
        enq = c["enqueue_ns"].astype(np.int64).to_numpy()
        ends = enq + np.round(wait * 1e6).astype(np.int64)
        rank_of = c["rank"].to_numpy(np.int64)
        d = late > 0
        stop = enq[d] + np.round(total[d] * 1e6).astype(np.int64)
        enq = np.concatenate([enq, stop - np.round(late[d] * 1e6).astype(np.int64)])
        ends = np.concatenate([ends, stop])
        rank_of = np.concatenate([rank_of, rank_of[d]])
    # a pipeline stage's receive waiting for the upstream stage to issue its send: the same
    # lateness of another rank (the schedule's dependency), not a transfer
    up = _lateness.p2p_upstream_waits(df)
    if len(up):
        enq = np.concatenate([enq, up["start_ns"].to_numpy(np.int64)])
        ends = np.concatenate([ends, up["end_ns"].to_numpy(np.int64)])
        rank_of = np.concatenate([rank_of, up["rank"].to_numpy(np.int64)])
    if not len(enq):
        return {}
    out = {}
    for rank, rs in rows.items():
        m = rank_of == rank
        waits = iv.union(enq[m], ends[m])
        got = sum(min(iv.length(iv.clip(waits, x["start_ns"], x["end_ns"])) / 1e6, x["exposed_comm_ms"])
                  for x in rs)
        win = sum(x["window_ms"] for x in rs)
        if win > 0:
            out[rank] = round(got / win, 4)
    return out


def _has_log(run) -> bool:
    return bool(not run.trace_inputs and has_collective_log(run))


def _run_steps(run, rank, n: int) -> list:
    """The training-step index of each profiled step (meta.json profile_steps), when known:
    ProfilerStep#N counts profiler.step() calls, not the job's steps."""
    try:
        ps = list((run.rank_meta(rank) or {}).get("profile_steps") or [])
    except Exception:  # noqa: BLE001
        ps = []
    return ps if len(ps) == n else [None] * n


def _coords(run, rank) -> dict:
    try:
        return run.coords(rank) or {}
    except Exception:  # noqa: BLE001 - traces without a run directory's meta
        return {}


def _findings(per_rank: list[dict], exposed: float, late: dict | None = None,
              missing: list[int] | None = None, window: dict | None = None,
              arrival: dict | None = None) -> list[Finding]:
    out = []
    # waits for a late rank are that rank's finding (stragglers analyzer), not communication;
    # on CPU traces so is any wait for another rank to arrive (_peer_arrival_waits), which
    # holds the late ranks' share: the larger of the two is left out, never both
    adjusted = (late or {}).get("adjusted") or {}
    arrival = arrival or {}
    own = {r["rank"]: min(adjusted.get(r["rank"], r["exposed_comm_fraction"]),
                          max(0.0, r["exposed_comm_fraction"] - arrival.get(r["rank"], 0.0)))
           for r in per_rank}
    judged = round(float(median(list(own.values()))), 4) if (adjusted or arrival) else exposed
    # raised when hiding it is worth it: the overlap bound (estimates.exposed_comm_hidden) of
    # the median rank saves ≥ MIN_SAVING of the step; of an even number of ranks the lower
    # median (in lockstep a rank's saving shortens the step only if its peers' do too)
    ests = {r["rank"]: exposed_comm_hidden(r, own[r["rank"]]) for r in per_rank}
    ranked = sorted((e for e in ests.values() if e), key=lambda e: e["saving_fraction"])
    est = ranked[(len(ranked) - 1) // 2] if ranked else None
    if est and est["saving_fraction"] >= MIN_SAVING:
        worst = sorted(per_rank, key=lambda r: -own[r["rank"]])
        dims: dict[str, float] = {}
        for r in per_rank:
            for d, v in r["by_dim_ms_per_step"].items():
                dims[d] = dims.get(d, 0.0) + v["exposed_ms"] / len(per_rank)
        types: dict[str, float] = {}
        for r in per_rank:
            for t, v in r["comm_by_type_ms_per_step"].items():
                types[t] = types.get(t, 0.0) + v / len(per_rank)
        top_dims = sorted(dims.items(), key=lambda kv: -kv[1])[:3]
        top = sorted(types.items(), key=lambda kv: -kv[1])[:3]
        # a trace without ProfilerStep is one window: its "step" is the whole traced window
        whole = all(r.get("whole_trace_window") for r in per_rank)
        unit, of = ("ms", "traced window (whole trace, no ProfilerStep; ") if whole \
            else ("ms/step", "profiled steps (")
        where = ("; exposed most in " + ", ".join(f"{d} {v:.1f} {unit}" for d, v in top_dims)) if top_dims else ""
        note = ""
        peer = round(float(median([arrival.get(r["rank"], 0.0) for r in per_rank])), 4)
        if adjusted:
            lr = late["late"]
            note = (f" (not counting the time spent waiting for late {ranks_phrase(sorted(lr))}: "
                    f"{exposed:.0%} with it; see that rank's finding)")
        elif arrival and peer > 0:
            note = (f" (not counting the time spent waiting for the other ranks to reach each "
                    f"collective or, in a pipeline, for the upstream stage to send, {peer:.0%} of "
                    f"the step: {exposed:.0%} with it)")
        if missing:  # a rank without data may be the one the others wait for
            note += (f"; {ranks_phrase(sorted(missing))} of the job "
                     f"{'have' if len(missing) > 1 else 'has'} no data here: part of this may be "
                     f"time spent waiting for {'them' if len(missing) > 1 else 'it'}, which cannot "
                     f"be told apart")
        severity = "warning"
        if window and window["untypical"] and not whole:
            # the profiler's own cost (starting it, recording) on small steps: the share is of
            # steps unlike the job's others, and the collective log covers those others
            note += (f"; but the profiled steps took {window['profiled_step_ms']:.1f} ms (median) "
                     f"against {window['other_step_ms']:.1f} ms for the job's other steps: the "
                     "profiler's own cost weighs on this share")
            lb = window.get("log_blocked_fraction")
            if lb is not None:
                note += (f"; over the other steps the collective log puts the time blocked in "
                         f"collectives at {lb:.0%} of the step")
                # the share hideable scaled to the other steps' blocked time
                if judged > 0 and est["saving_fraction"] * lb / judged < MIN_SAVING:
                    severity = "info"
            else:
                note += "; profile steps further into the run (--profile-steps) to check"
        out.append(Finding(
            kind="exposed_comm", severity=severity,  # every rank whose fix is worth it
            ranks=[r["rank"] for r in worst if ests[r["rank"]]
                   and ests[r["rank"]]["saving_fraction"] >= MIN_SAVING],
            message=(f"communication not hidden by compute takes {judged:.0%} of the {of}"
                     f"median rank); hidden under compute, all but the last collective's, it "
                     f"would save up to {est['saving_fraction']:.0%} of the step; largest: "
                     + ", ".join(f"{t} {v:.1f} {unit}" for t, v in top) + where + note),
            estimate=est,
            evidence={"exposed_comm_fraction": judged, "min_saving": MIN_SAVING,
                      "tail_exposed_fraction": {str(r["rank"]): r.get("tail_exposed_fraction")
                                                for r in per_rank},
                      **({"exposed_comm_fraction_with_waits": exposed,
                          "waiting_for_late_ranks_ms": late["wait_ms"], "late_ranks": late["late"]}
                         if adjusted else {}),
                      **({"exposed_comm_fraction_with_waits": exposed,
                          "peer_arrival_wait_fraction": {str(k): v for k, v in sorted(arrival.items())}}
                         if arrival else {}),
                      "per_rank": {str(r["rank"]): own[r["rank"]] for r in per_rank},
                      **({"ranks_without_data": missing} if missing else {}),
                      **({"window_vs_other_steps": window} if window and window["untypical"] else {}),
                      "comm_by_type_ms_per_step": {t: round(v, 2) for t, v in top},
                      "exposed_by_dim_ms_per_step": {d: round(v, 2) for d, v in top_dims}}))
    stalls = [r for r in per_rank if r["sync_fraction"] >= HOST_STALL_FINDING]
    if stalls:
        out.append(Finding(
            kind="host_stall", severity="warning", ranks=[r["rank"] for r in stalls],
            message=(f"the host waits on the GPU (synchronize calls, blocking device-to-host "
                     f"copies from .item()/.cpu()) for up to {max(r['sync_fraction'] for r in stalls):.0%} "
                     f"of the step on {len(stalls)} rank(s) (threshold {HOST_STALL_FINDING:.0%})"),
            evidence={"sync_fraction": {str(r["rank"]): r["sync_fraction"] for r in stalls},
                      "sync_calls_per_step": {str(r["rank"]): r["sync_calls_per_step"] for r in stalls},
                      "sync_ms_per_step": {str(r["rank"]): r["sync_ms_per_step"] for r in stalls},
                      "threshold": HOST_STALL_FINDING}))
    return out
