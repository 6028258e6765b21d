"""Which CPU op launched each GPU op (kernel, memcpy, memset), on every trace format.

Current torch.profiler traces give a GPU op the ``External id`` of the CPU op that launched it.
Older traces (Kineto before PyTorch ~1.13, e.g. HTA's trace_filter and df_index_resolver test
traces) give the GPU op, and its runtime launch call, an ``External id`` equal to its
correlation id, which matches no CPU op (or, by coincidence, an unrelated one). There the link
is the runtime call with the GPU op's correlation id (cudaLaunchKernel, cudaMemcpyAsync, ...):
the innermost CPU op on the same thread whose span encloses that call launched it.

Every function takes the events ``Table`` of a trace (``trace.tables.events``).

``launch_op_rows(events)``: per events row, the positional row of the launching CPU op (-1 for
host rows and GPU ops whose launch is not found).
``kernel_external_ids(events)``: per events row, the External id of that CPU op for GPU rows
(what the ``external_id`` column says on current traces), -1 elsewhere.
``launch_calls(events, gpu_rows)``: positional row of the runtime call that launched each GPU op
(same correlation id), -1 when the trace does not hold it.
``older_format(events)``: True when the trace's GPU ops carry correlation ids as External ids.
"""

from __future__ import annotations

import numpy as np

LAUNCHED = ("kernel", "gpu_memcpy", "gpu_memset")
RUNTIME = ("cuda_runtime", "cuda_driver")


def older_format(ev) -> bool:
    """Most GPU ops that have both ids have External id == correlation id."""
    g = ev["cat"].isin(LAUNCHED)
    ext, corr = ev["external_id"][g], ev["correlation"][g]
    both = (ext >= 0) & (corr >= 0)
    return bool(both.any()) and float((ext[both] == corr[both]).mean()) >= 0.5


def launch_calls(ev, gpu_rows: np.ndarray) -> np.ndarray:
    """Positional row of the runtime call with each GPU op's correlation id, -1 when none."""
    cat = ev["cat"]
    corr = ev["correlation"]
    rt = np.flatnonzero(cat.isin(RUNTIME) & (corr >= 0))
    out = np.full(len(gpu_rows), -1, np.int64)
    if not len(rt) or not len(gpu_rows):
        return out
    ok, found = _match(corr[rt], rt, corr[gpu_rows])
    out[ok] = found
    return out


def _match(keys, rows, want):
    """For each of ``want`` (ids; < 0 never matches): whether some key equals it, and for those
    that match, the row of the first such key (stable order)."""
    order = np.argsort(keys, kind="stable")
    k, r = keys[order], rows[order]
    j = np.searchsorted(k, want)
    ok = (j < len(k)) & (want >= 0)
    ok[ok] = k[j[ok]] == want[ok]
    return ok, r[j[ok]]


def _enclosing_ops(ev, queries: np.ndarray) -> np.ndarray:
    """For each query row (a host event; < 0: none), the positional row of the innermost cpu_op
    on the same (pid, tid) whose span contains it; -1 when none.

    Innermost: the latest start, then the shortest, then the last written (a parent op and its
    child with the same span: Kineto writes the parent first). Containment is inclusive at both
    ends (an op ending where a zero-length call starts contains it)."""
    out = np.full(len(queries), -1, np.int64)
    valid = queries >= 0
    ops = np.flatnonzero(ev["cat"].eq("cpu_op"))
    if not valid.any() or not len(ops):
        return out
    end = ev["end_ns"]
    q = queries[valid]
    op_order, prefix, first = _thread_prefixes(ev, ops, q)
    out[valid] = _last_reaching(end[ops[op_order]], prefix, first, end[q], ops[op_order])
    return out


def _thread_prefixes(ev, ops: np.ndarray, q: np.ndarray):
    """Ops ordered by (pid, tid, start, longest first, row): that order, and per query the
    positions in it of the last op of its thread starting no later than the query (``prefix``;
    ``first`` - 1 when none) and of its thread's first op (``first``)."""
    rows = np.concatenate([ops, q])
    pid, tid = ev["pid"][rows], ev["tid"][rows]
    tids = _distinct(tid)
    thread = _dense(_dense(pid) * len(tids) + np.searchsorted(tids, tid))
    key, span = _thread_time_keys(thread, ev["ts_ns"][rows])
    n = len(ops)
    order = _op_order(key[:n], (ev["end_ns"] - ev["ts_ns"])[ops])
    ks = key[:n][order]
    prefix = np.searchsorted(ks, key[n:], "right") - 1
    first = np.searchsorted(ks, thread[n:] * span, "left")
    return order, prefix, first


def _distinct(values: np.ndarray) -> np.ndarray:
    """The sorted distinct values, looked for among those that differ from their predecessor
    (few where equal values come in runs, as a thread's rows do)."""
    changed = np.ones(len(values), bool)
    changed[1:] = values[1:] != values[:-1]
    return np.unique(values[changed], return_counts=True)[0]  # counts: numpy.ma stays unimported


def _dense(values: np.ndarray) -> np.ndarray:
    """Each value's index among the sorted distinct values."""
    return np.searchsorted(_distinct(values), values)


def _thread_time_keys(thread: np.ndarray, ts: np.ndarray):
    """One int64 per row ordering rows by (thread, start): thread * span + time, time being
    the start from the earliest, or its rank among the distinct starts when that would not fit
    in 62 bits. Returns the keys and span."""
    t0 = int(ts.min())
    span = int(ts.max()) - t0 + 1
    if (int(thread.max()) + 1) * span < 2 ** 62:
        return thread * span + (ts - t0), span
    t = _dense(ts)
    span = int(t.max()) + 1
    return thread * span + t, span


def _op_order(key: np.ndarray, dur: np.ndarray) -> np.ndarray:
    """Positions sorted by (key, longest first, position). Ops come in start order per thread,
    so the stable sort by key alone meets few equal keys; only those are sorted by duration."""
    order = np.argsort(key, kind="stable")
    ks = key[order]
    tie = ks[1:] == ks[:-1]
    if not tie.any():
        return order
    grouped = np.zeros(len(ks), bool)
    grouped[1:] |= tie
    grouped[:-1] |= tie
    at = np.flatnonzero(grouped)
    group = np.cumsum(grouped & ~np.concatenate([[False], tie]))[at]
    sub = order[at]
    order[at] = sub[np.lexsort((sub, -dur[sub], group))]
    return order


def _last_reaching(op_end: np.ndarray, prefix: np.ndarray, first: np.ndarray, reach: np.ndarray,
                   op_rows: np.ndarray) -> np.ndarray:
    """Per query: ``op_rows[j]`` for the largest j in [first, prefix] with op_end[j] >= reach,
    -1 when none. A sparse table of range maxima of ``op_end`` (level k: the max over 2**k
    ops from each position) lets every query skip, from ``prefix`` down, the longest run of
    ops ending too early in one pass per level."""
    levels = [op_end]
    while 2 ** len(levels) <= len(op_end):
        h, prev = 2 ** (len(levels) - 1), levels[-1]
        levels.append(np.maximum(prev[:-h], prev[h:]))
    pos = prefix + 1  # exclusive end of the run not yet skipped
    for k in range(len(levels) - 1, -1, -1):
        cand = pos - 2 ** k
        ok = cand >= first
        ok[ok] = levels[k][cand[ok]] < reach[ok]
        pos[ok] = cand[ok]
    j = pos - 1
    found = j >= first
    found[found] = op_end[j[found]] >= reach[found]
    return np.where(found, op_rows[np.where(found, j, 0)], -1)


def launch_op_rows(ev) -> np.ndarray:
    """Per row of ``ev``: positional row of the CPU op that launched it (GPU ops), else -1."""
    out = np.full(len(ev), -1, np.int64)
    gpu_rows = np.flatnonzero(ev["cat"].isin(LAUNCHED))
    if not len(gpu_rows):
        return out
    ext = ev["external_id"]
    cpu = ev["cat"].eq("cpu_op")
    if not older_format(ev):
        # current traces: the GPU op's External id is its CPU op's
        cpu_rows = np.flatnonzero(cpu & (ext >= 0))
        ok, found = _match(ext[cpu_rows], cpu_rows, ext[gpu_rows])
        out[gpu_rows[ok]] = found
        rest = gpu_rows[~ok]
    else:
        rest = gpu_rows
    if len(rest):
        out[rest] = _enclosing_ops(ev, launch_calls(ev, rest))
    return out


def kernel_external_ids(ev) -> np.ndarray:
    """Per row of ``ev``: the External id of the CPU op that launched it (GPU ops), else -1."""
    rows = launch_op_rows(ev)
    ext = ev["external_id"]
    out = np.full(len(ev), -1, np.int64)
    ok = rows >= 0
    out[ok] = ext[rows[ok]]
    return out
