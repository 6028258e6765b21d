"""Which CPU op launched each GPU op (kernel, memcpy, memset), on every trace format.

Current torch.profiler traces give a GPU op the ``External id`` of the CPU op that launched it.
Older traces (Kineto before PyTorch ~1.13, e.g. HTA's trace_filter and df_index_resolver test
traces) give the GPU op, and its runtime launch call, an ``External id`` equal to its
correlation id, which matches no CPU op (or, by coincidence, an unrelated one). There the link
is the runtime call with the GPU op's correlation id (cudaLaunchKernel, cudaMemcpyAsync, ...):
the innermost CPU op on the same thread whose span encloses that call launched it.

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
import pandas as pd

LAUNCHED = ("kernel", "gpu_memcpy", "gpu_memset")
RUNTIME = ("cuda_runtime", "cuda_driver")


def older_format(ev: pd.DataFrame) -> bool:
    """Most GPU ops that have both ids have External id == correlation id."""
    g = ev["cat"].isin(LAUNCHED).to_numpy()
    ext, corr = ev["external_id"].to_numpy()[g], ev["correlation"].to_numpy()[g]
    both = (ext >= 0) & (corr >= 0)
    return bool(both.any()) and float((ext[both] == corr[both]).mean()) >= 0.5


def launch_calls(ev: pd.DataFrame, gpu_rows: np.ndarray) -> np.ndarray:
    """Positional row of the runtime call with each GPU op's correlation id, -1 when none."""
    cat = ev["cat"]
    corr = ev["correlation"].to_numpy()
    rt = np.flatnonzero(cat.isin(RUNTIME).to_numpy() & (corr >= 0))
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


def _enclosing_ops(ev: pd.DataFrame, queries: np.ndarray) -> np.ndarray:
    """For each query row (a host event), the positional row of the innermost cpu_op on the
    same (pid, tid) whose span contains it; -1 when none."""
    out = np.full(len(queries), -1, np.int64)
    valid = queries >= 0
    if not valid.any():
        return out
    ops = np.flatnonzero(ev["cat"].eq("cpu_op").to_numpy())
    if not len(ops):
        return out
    pid, tid = ev["pid"].to_numpy(), ev["tid"].to_numpy()
    ts, end = ev["ts_ns"].to_numpy(), ev["end_ns"].to_numpy()
    q = queries[valid]
    qidx = np.flatnonzero(valid)
    # one sweep per thread: ops pushed in start order (longer first on ties), queries answered
    # by the innermost op still open that contains them
    rows = np.concatenate([ops, q])
    is_q = np.concatenate([np.zeros(len(ops), bool), np.ones(len(q), bool)])
    slot = np.concatenate([np.full(len(ops), -1), qidx])
    order = np.lexsort((is_q, -(end[rows] - ts[rows]), ts[rows], tid[rows], pid[rows]))
    stack: list[int] = []
    key = None
    for k in order.tolist():
        r = int(rows[k])
        thread = (int(pid[r]), int(tid[r]))
        if thread != key:
            stack, key = [], thread
        t0, t1 = int(ts[r]), int(end[r])
        # ops that ended before this event started enclose nothing from here on (an op that
        # ends exactly where a call starts still contains a zero-length call)
        closed = t0 if not is_q[k] else t0 - 1
        while stack and int(end[stack[-1]]) <= closed:
            stack.pop()
        if is_q[k]:
            for s in reversed(stack):
                if int(ts[s]) <= t0 and int(end[s]) >= t1:
                    out[slot[k]] = s
                    break
        else:
            stack.append(r)
    return out


def launch_op_rows(ev: pd.DataFrame) -> np.ndarray:
    """Per row of ``ev``: positional row of the CPU op that launched it (GPU ops), else -1."""
    out = np.full(len(ev), -1, np.int64)
    gpu_rows = np.flatnonzero(ev["cat"].isin(LAUNCHED).to_numpy())
    if not len(gpu_rows):
        return out
    ext = ev["external_id"].to_numpy()
    cpu = ev["cat"].eq("cpu_op").to_numpy()
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


def kernel_external_ids(ev: pd.DataFrame) -> np.ndarray:
    """Per row of ``ev``: the External id of the CPU op that launched it (GPU ops), else -1."""
    rows = launch_op_rows(ev)
    ext = ev["external_id"].to_numpy()
    out = np.full(len(ev), -1, np.int64)
    ok = rows >= 0
    out[ok] = ext[rows[ok]]
    return out
