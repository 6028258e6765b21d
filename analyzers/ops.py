"""Op and kernel breakdown of the profiled steps: the GPU kernels and the CPU ops that take the
time, per rank and across ranks.

GPU kernels (kernels, memcpys, memsets launched in a profiled step) are grouped as HTA's kernel
breakdown groups them: communication (NCCL kernels), memory (Memcpy/Memset) and compute (the
rest); per kernel name: calls, total time, shortest and longest call. Per group: total time, busy
time (union of the group's intervals) and HTA's partition of kernel time into the group(s)
running at each instant ("compute overlapping communication", ...).

CPU ops (host events of the cpu_op, user_annotation, cuda_runtime and cuda_driver categories
starting in a profiled step, ProfilerStep itself left out; each cut at the end of its step): per
(name, role), calls, total time and self time — the op's duration minus the time of the ops
nested directly inside it on the same thread (a child's part outside its parent is not
subtracted) — so self times add up to the thread's busy time without counting nested work twice.

Each op has a role, from its thread and its name (``thread_roles``, ``op_roles``): ``compute``
(on the step's threads: the thread holding the ProfilerStep spans, and autograd engine threads
running backward), ``wait`` (on those threads, an op that waits for others: c10d / functional
collectives, record_param_comms, nccl:/gloo: ops, ``wait`` ops, device synchronization),
``communication`` (gloo's worker threads) and ``other`` (every other thread: data loader
workers, ...). Waits and communication grow when a peer or the device is slow, not when the op
itself does more work.

Per rank (``trace_digest``): the top TOP_DIGEST rows by total (and, for CPU ops, by self) time
plus an ``other`` remainder, checksums of every row key (so a comparison can tell an op that is
absent from one that is below the top), self time per role, and the step's threads' time
outside any op. Across ranks (``analyze``): sums, means per profiled step over the ranks (a rank
without the op counts 0), the rank where the op takes longest, and in how many ranks' top
tables each op is. Definitions: docs/ops.md.
"""

from __future__ import annotations

import zlib

import numpy as np

from trainprof.analyzers import _intervals as iv
from trainprof.findings import AnalyzerResult
from trainprof.trace import name_mask
from trainprof.trace._table import Cat
from trainprof.wording import ranks_phrase

NAME = "ops"
TOP_DIGEST = 100          # names kept per ranking in a rank's digest
TOP_JOB = 60              # rows kept per job-level ranking (the report shows fewer)
TOP_PER_RANK = 3          # per-rank top lists in the job metrics ...
PER_RANK_LISTS_MAX = 64   # ... for jobs with at most this many ranks
MAX_NAME_SUMS = 20000     # name checksums kept per table (more: added/removed not decided)
KERNEL_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_OP_CATS = ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver")
GROUPS = ("compute", "communication", "memory")  # HTA: COMPUTATION, COMMUNICATION, MEMORY
ROLES = ("compute", "wait", "communication", "other")  # CPU ops, by thread and name
CRITICAL = ("compute",)                     # what the step's time is made of (the diff ranks these)
WAITING = ("wait", "communication")         # grows when a peer or the device is slow
# ops that wait for other ranks or the device: prefixes, exact names, and names containing "wait"
WAIT_PREFIXES = ("c10d::", "c10d_functional::", "_c10d_functional::", "record_param_comms",
                 "nccl:", "gloo:", "ProcessGroup")
SYNC_CALLS = frozenset({"cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize",
                        "cuCtxSynchronize", "cuStreamSynchronize", "cuEventSynchronize",
                        "hipDeviceSynchronize", "hipStreamSynchronize", "hipEventSynchronize"})
NOT_WAITS = frozenset({"cudaStreamWaitEvent", "cuStreamWaitEvent", "hipStreamWaitEvent"})  # enqueue only
BACKWARD_PREFIX = "autograd::engine::evaluate_function"
COMM_THREAD_PREFIX = "gloo:"


def kernel_group(name: str, cat: str = "kernel") -> str:
    """HTA's kernel type: communication for NCCL kernels, memory for memcpy/memset, else compute."""
    if "nccl" in name.lower():
        return "communication"
    if cat in ("gpu_memcpy", "gpu_memset") or "Memcpy" in name or "Memset" in name:
        return "memory"
    return "compute"


def name_sum(name: str) -> int:
    """The checksum that stands for an op name in the digests' name lists."""
    return zlib.crc32(name.encode("utf-8", "surrogatepass"))


def key_sum(name: str, role: str | None = None) -> int:
    """The checksum of a row key: the name (kernels), or role and name (CPU ops)."""
    return name_sum(name if role is None else f"{role}\t{name}")


def is_wait(name: str) -> bool:
    """An op that waits for other ranks or for the device (its time grows when they are slow)."""
    if name in NOT_WAITS:
        return False
    return name.startswith(WAIT_PREFIXES) or name in SYNC_CALLS or "wait" in name.lower()


def _unique(values: np.ndarray) -> np.ndarray:
    """The distinct values of an integer array, ascending: np.unique, by counting when they
    span a small range, else by one stable sort (fast on runs already sorted; both faster than
    np.unique's hashing of int64)."""
    if not len(values):
        return values[:0]
    lo, hi = int(values.min()), int(values.max())
    if hi - lo < 1 << 16:
        return (np.flatnonzero(np.bincount(values - lo)) + lo).astype(values.dtype)
    srt = np.sort(values, kind="stable")
    return srt[np.concatenate(([True], srt[1:] != srt[:-1]))]


def _dense(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the distinct values, ascending; each value's index into them)."""
    uniq = _unique(values)
    return uniq, np.searchsorted(uniq, values)


def _argsort_codes(codes: np.ndarray, bound: int) -> np.ndarray:
    """Stable argsort of integer codes in [0, bound): a radix sort when they fit in 16 bits."""
    if bound <= np.iinfo(np.int16).max:
        codes = codes.astype(np.int16)
    return np.argsort(codes, kind="stable")


def thread_roles(thread: np.ndarray, names: Cat, step_threads: np.ndarray) -> dict[int, str]:
    """{thread key: main | backward | communication | other}. main: the threads holding the
    ProfilerStep spans; communication: other threads running gloo: ops; backward: other threads
    running autograd engine functions; other: the rest."""
    gloo = name_mask(names, lambda n: n.startswith(COMM_THREAD_PREFIX))
    bwd = name_mask(names, lambda n: n.startswith(BACKWARD_PREFIX))
    out = dict.fromkeys(_unique(thread).tolist(), "other")
    out.update(dict.fromkeys(_unique(thread[bwd]).tolist(), "backward"))
    out.update(dict.fromkeys(_unique(thread[gloo]).tolist(), "communication"))
    out.update(dict.fromkeys(np.asarray(step_threads).tolist(), "main"))
    return out


def op_roles(thread: np.ndarray, names: Cat, roles: dict[int, str]) -> np.ndarray:
    """Each event's role as an index into ROLES: compute or wait on the step's threads (main,
    backward), else the thread's role (communication, other)."""
    uniq, inv = _dense(thread)
    code = {"main": -1, "backward": -1, "communication": ROLES.index("communication"),
            "other": ROLES.index("other")}
    th = np.array([code[roles[t]] for t in uniq.tolist()], dtype=np.int8)[inv]
    wait = name_mask(names, is_wait)
    return np.where(th < 0, np.where(wait, ROLES.index("wait"), ROLES.index("compute")), th).astype(np.int8)


# --------------------------------------------------------------------------- per rank
def _nest_order(ts: np.ndarray, end: np.ndarray, thread: np.ndarray) -> np.ndarray:
    """The rows in (thread, start, longer first) order, ties in row order: the order of
    np.lexsort((ts - end, ts, thread)), found with stable sorts that are fast on rows already
    nearly in start order (a trace's events are): by start, then each run of equal starts by
    length, then by thread (a radix sort over the few threads' indices)."""
    order = np.argsort(ts, kind="stable")
    s = ts[order]
    tie = s[1:] == s[:-1]
    if tie.any():
        in_run = np.zeros(len(s), bool)
        in_run[1:] |= tie
        in_run[:-1] |= tie
        at = np.flatnonzero(in_run)
        rows = order[at]
        order[at] = rows[np.lexsort((ts[rows] - end[rows], s[at]))]
    uniq, code = _dense(thread[order])
    return order[_argsort_codes(code, len(uniq))]


def nest_parents(ts: np.ndarray, end: np.ndarray, thread: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(order, parent): the events in (thread, start, longer first) order, and for each event in
    that order the position of its parent there (-1 for none), the innermost earlier event of
    its thread still running when it starts (pointer jumping, see self_times)."""
    order = _nest_order(ts, end, thread)
    s, e, th = ts[order], end[order], thread[order]
    par = np.arange(-1, len(ts) - 1)
    par[1:][th[1:] != th[:-1]] = -1
    todo = np.flatnonzero(par >= 0)
    todo = todo[e[par[todo]] <= s[todo]]
    while len(todo):
        par[todo] = par[par[todo]]
        todo = todo[par[todo] >= 0]
        todo = todo[e[par[todo]] <= s[todo]]
    return order, par


def self_times(ts: np.ndarray, end: np.ndarray, thread: np.ndarray) -> np.ndarray:
    """Self time of each event: its duration minus the parts of its direct children (events
    nested in it on the same thread) that lie inside it. An event's parent is the innermost
    event of its thread still running when it starts: in (thread, start, longer first) order,
    the last earlier event of the thread that ends after the start.

    Found for all events at once by pointer jumping: each event's candidate starts at its
    predecessor; while the candidate ends at or before the event's start, the candidate is
    replaced by the candidate's own current candidate. Every event skipped that way ends at or
    before the event's start (it ends before the skipped-from candidate's start), so it cannot
    be the parent; rounds grow logarithmically with the nesting."""
    n = len(ts)
    if n == 0:
        return np.zeros(0, np.int64)
    order, par = nest_parents(ts, end, thread)
    s, e = ts[order], end[order]
    has = np.flatnonzero(par >= 0)
    p = par[has]
    child = np.bincount(p, weights=np.minimum(e[has], e[p]) - s[has], minlength=n) if len(has) \
        else np.zeros(n)
    out = np.empty(n, np.int64)
    out[order] = np.maximum(e - s - child.astype(np.int64), 0)
    return out


def _segments(key: np.ndarray, bound: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows grouped by an integer key in [0, bound): (row order that puts each group's rows
    together, rows of a group in their original order; where each group starts in that order;
    the groups' keys, ascending)."""
    order = _argsort_codes(key, bound)
    k = key[order]
    starts = np.flatnonzero(np.concatenate(([True], k[1:] != k[:-1])))
    return order, starts, k[starts]


def _table(name: Cat, role: np.ndarray | None, dur: np.ndarray, sums: dict[str, np.ndarray],
           labels: dict[str, tuple[np.ndarray, list]], top_by: list[str]) -> dict:
    """Events grouped by name (role None) or by name and role (codes into ROLES): per group
    count, the sums, shortest and longest dur and each label (codes into a value list) of its
    first event. rows: the top TOP_DIGEST groups by each of top_by (largest first, ties by
    name then role), listed by the first; other: the groups not listed; total: all groups;
    name_sums: the row keys' checksums (None above MAX_NAME_SUMS groups)."""
    zero = {c: 0 for c in sums}
    if not len(dur):
        return {"rows": [], "other": {"names": 0, "count": 0, **zero},
                "total": {"names": 0, "count": 0, **zero}, "name_sums": []}
    nr = len(ROLES)
    key = name.codes if role is None else name.codes * nr + role.astype(np.int64)
    order, starts, ukey = _segments(key, len(name.values) * (1 if role is None else nr))
    ncode = ukey if role is None else ukey // nr
    rcode = None if role is None else ukey % nr
    n = len(ukey)
    count = np.diff(np.append(starts, len(key)))
    tot = {c: np.add.reduceat(v[order], starts) for c, v in sums.items()}
    d = dur[order]
    lo, hi = np.minimum.reduceat(d, starts), np.maximum.reduceat(d, starts)
    first = order[starts]
    # the groups are in (name, role) order: a stable sort on a measure breaks its ties by them
    ranking = {c: np.argsort(-tot[c], kind="stable") for c in top_by}
    kept = np.zeros(n, bool)
    for c in top_by:
        kept[ranking[c][:TOP_DIGEST]] = True
    top = ranking[top_by[0]]
    top = top[kept[top]]
    values = name.values
    lab = {k: (codes[first[top]].tolist(), vals) for k, (codes, vals) in labels.items()}
    cols = {"count": count[top].tolist(), **{c: tot[c][top].tolist() for c in sums},
            "min_ns": lo[top].tolist(), "max_ns": hi[top].tolist()}
    rows = []
    for j, i in enumerate(top.tolist()):
        row = {"name": values[ncode[i]]}
        if rcode is not None:
            row["role"] = ROLES[rcode[i]]
        for k, (codes, vals) in lab.items():
            row[k] = str(vals[codes[j]])
        for c, v in cols.items():
            row[c] = int(v[j])
        rows.append(row)
    rest = ~kept
    keys = [(values[a], None) for a in ncode.tolist()] if rcode is None else \
        [(values[a], ROLES[b]) for a, b in zip(ncode.tolist(), rcode.tolist())]
    return {"rows": rows,
            "other": {"names": int(rest.sum()), "count": int(count[rest].sum()),
                      **{c: int(tot[c][rest].sum()) for c in sums}},
            "total": {"names": n, "count": int(count.sum()), **{c: int(tot[c].sum()) for c in sums}},
            "name_sums": sorted({key_sum(x, r) for x, r in keys}) if n <= MAX_NAME_SUMS else None}


def _per_value(col: Cat, fn, dtype) -> np.ndarray:
    """fn(value) per row of a Cat, evaluated once per distinct value present."""
    present = np.flatnonzero(np.bincount(col.codes, minlength=len(col.values)))
    table = np.zeros(len(col.values), dtype)
    values = col.values
    table[present] = [fn(values[i]) for i in present.tolist()]
    return table[col.codes]


def _kernel_groups(name: Cat, cat: Cat) -> np.ndarray:
    """Each kernel's group as an index into GROUPS (kernel_group of its name and cat)."""
    group = _per_value(name, lambda n: GROUPS.index(kernel_group(n)), np.int8)
    copies = cat.isin(("gpu_memcpy", "gpu_memset"))
    group[(group == GROUPS.index("compute")) & copies] = GROUPS.index("memory")
    return group


def _kernel_overlap(ts: np.ndarray, end: np.ndarray, groups: np.ndarray) -> dict[str, int]:
    """HTA's kernel-type partition: ns during which exactly a given set of groups runs,
    labelled like HTA ("compute overlapping communication"); groups: indices into GROUPS."""
    sets = [iv.union(ts[groups == g], end[groups == g]) for g in range(len(GROUPS))]
    pts = _unique(np.concatenate([np.column_stack(s).ravel() for s in sets]))  # 3 sorted runs
    if len(pts) < 2:
        return {}
    lo, hi = pts[:-1], pts[1:]
    mask = np.zeros(len(lo), np.int64)
    for bit, (s, e) in enumerate(sets):
        if len(s):
            i = np.searchsorted(s, lo, side="right") - 1
            inside = (i >= 0) & (lo < e[np.clip(i, 0, None)])
            mask |= inside.astype(np.int64) << bit
    span = np.bincount(mask, weights=hi - lo)
    out: dict[str, int] = {}
    for m in np.flatnonzero(span[1:]) + 1:
        label = " overlapping ".join(g for bit, g in enumerate(GROUPS) if m >> bit & 1)
        out[label] = int(span[m])
    return out


def trace_digest(run, rank, trace) -> dict:
    """One rank's op and kernel breakdown over its profiled steps (small: top tables only)."""
    ev, steps = trace.tables.events, trace.tables.steps
    window = int((steps["end_ns"] - steps["start_ns"]).sum()) if len(steps) else 0
    out = {"steps": steps["step"].tolist(), "n_steps": len(steps),
           "window_ns": window, "whole_trace_window": bool(trace.meta.get("whole_trace_window"))}

    kmask = ev["cat"].isin(KERNEL_CATS) & (ev["step"] >= 0)
    k = ev[["name", "cat", "ts_ns", "end_ns", "dur_ns"]][np.flatnonzero(kmask)]
    ts, end, dur = k["ts_ns"], k["end_ns"], k["dur_ns"]
    groups = _kernel_groups(k["name"], k["cat"])
    out["kernels"] = _table(k["name"], None, dur, {"total_ns": dur}, {"group": (groups, GROUPS)},
                            ["total_ns"])
    out["kernel_groups"] = {}
    for i, g in enumerate(GROUPS):
        m = groups == i
        if m.any():
            out["kernel_groups"][g] = {"count": int(m.sum()), "total_ns": int(dur[m].sum()),
                                       "busy_ns": iv.length(iv.union(ts[m], end[m]))}
    out["kernel_busy_ns"] = iv.length(iv.union(ts, end))
    out["kernel_overlap"] = _kernel_overlap(ts, end, groups) if len(k) else {}
    out["kind"] = "gpu" if len(k) else "cpu"

    out.update(_cpu_digest(ev, steps, window))
    return out


def _step_ends(step: np.ndarray, steps) -> np.ndarray:
    """The end of each event's profiled step (int64 max outside every step); steps: a Table
    of step, end_ns (one row per step number)."""
    big = np.iinfo(np.int64).max
    if not len(steps):
        return np.full(len(step), big, np.int64)
    by = np.argsort(steps["step"], kind="stable")
    nums = steps["step"][by]
    i = np.clip(np.searchsorted(nums, step), 0, len(nums) - 1)
    return np.where(nums[i] == step, steps["end_ns"][by][i], big)


def _thread_key(pid: np.ndarray, tid: np.ndarray) -> np.ndarray:
    """One int64 per (pid, tid): nesting is per thread of a process."""
    return pid * np.int64(1 << 32) + (tid & 0xFFFFFFFF)


def _indices(keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Each of the distinct values' index into the sorted keys; values not among the keys get
    indices len(keys), len(keys) + 1, ..."""
    at = np.searchsorted(keys, values)
    found = at < len(keys)
    found[found] = keys[at[found]] == values[found]
    at[~found] = len(keys) + np.arange(int((~found).sum()))
    return at


def _busiest(thread: np.ndarray, self_ns: np.ndarray, roles: dict[int, str]) -> int | None:
    """The thread with the most self time, gloo's threads left out (ties: the lowest key)."""
    uniq, inv = _dense(thread)
    busy = np.bincount(inv, weights=self_ns, minlength=len(uniq))
    ok = np.array([roles[t] != "communication" for t in uniq.tolist()], bool)
    if not ok.any():
        return None
    return int(uniq[ok][np.argmax(busy[ok])])


def _cpu_digest(ev, steps, window: int) -> dict:
    """CPU ops of the profiled steps by (name, role), self time per role, the step's threads;
    ev, steps: the trace's event and step Tables."""
    host = ~ev["is_gpu"]
    is_step = ev["name"].startswith("ProfilerStep#") & host
    h = ev[["name", "cat", "ts_ns", "end_ns", "pid", "tid", "step"]][
        np.flatnonzero(ev["cat"].isin(HOST_OP_CATS) & host & ~is_step)]
    keys, thread = _dense(_thread_key(h["pid"], h["tid"]))  # threads as indices into keys
    ts, step = h["ts_ns"], h["step"]
    end = np.minimum(h["end_ns"], _step_ends(step, steps))  # cut at the step's end
    self_ns = self_times(ts, end, thread)
    stepped = step >= 0
    name, cat = h["name"][stepped], h["cat"][stepped]
    thread, ts, end, self_ns = thread[stepped], ts[stepped], end[stepped], self_ns[stepped]
    step_threads = _indices(keys, _unique(_thread_key(ev["pid"][is_step], ev["tid"][is_step])))
    roles = thread_roles(thread, name, step_threads)
    if not len(step_threads) and len(thread):  # no ProfilerStep: the busiest thread that is not gloo's
        main = _busiest(thread, self_ns, roles)
        if main is not None:
            roles[main] = "main"
    role = op_roles(thread, name, roles)
    dur = end - ts
    on_step = role <= ROLES.index("wait")  # compute and wait: the step's threads
    busy = iv.length(iv.union(ts[on_step], end[on_step]))
    n_role = np.bincount(role, minlength=len(ROLES))
    self_role = [int(self_ns[role == i].sum()) if n_role[i] else 0 for i in range(len(ROLES))]
    by_role = {r: {"count": int(n_role[i]), "self_ns": self_role[i]}
               for i, r in enumerate(ROLES) if n_role[i]}
    kinds = list(roles.values())
    return {"cpu_ops": _table(name, role, dur, {"total_ns": dur, "self_ns": self_ns},
                              {"cat": (cat.codes, cat.values)}, ["self_ns", "total_ns"]),
            "cpu_roles": by_role,
            "step_threads_busy_ns": busy, "outside_ops_ns": max(window - busy, 0),
            "threads": len(roles),
            "thread_roles": {k: kinds.count(k) for k in ("main", "backward", "communication", "other")
                             if k in kinds}}


# --------------------------------------------------------------------------- job
def _ms(ns) -> float:
    return round(float(ns) / 1e6, 6)


def _row_key(row: dict) -> tuple:
    return row["name"], row.get("role")


def _job_table(digests: dict, key: str, extra: str, sums: list[str], sort: str) -> tuple[list[dict], dict]:
    """Rows across ranks by name (and role): sums, means per profiled step over all ranks, spread."""
    acc: dict[tuple, dict] = {}
    ranks = sorted(digests)
    for r in ranks:
        d = digests[r]
        n = max(d.get("n_steps") or 0, 1)
        for row in d[key]["rows"]:
            a = acc.setdefault(_row_key(row), {"name": row["name"], "role": row.get("role"),
                                               extra: row.get(extra), "ranks": 0,
                                             "count": 0, "min_ns": row["min_ns"], "max_ns": 0,
                                             **{c: 0 for c in sums},
                                             "per_rank": {}})
            a["ranks"] += 1
            a["count"] += row["count"]
            a["min_ns"] = min(a["min_ns"], row["min_ns"])
            a["max_ns"] = max(a["max_ns"], row["max_ns"])
            for c in sums:
                a[c] += row[c]
            a["per_rank"][r] = {c: row[c] / n for c in sums} | {"count": row["count"] / n}
    window = sum(d.get("window_ns") or 0 for d in digests.values())
    nr = len(ranks)
    rows = []
    for a in acc.values():
        per = a.pop("per_rank")
        out = {"name": a["name"], **({"role": a["role"]} if a["role"] else {}),
               extra: a[extra], "ranks": a["ranks"], "count": a["count"],
               "calls_per_step": round(sum(p["count"] for p in per.values()) / nr, 3)}
        for c in sums:
            base = c[:-3]  # total / self
            vals = [per[r][c] if r in per else 0.0 for r in ranks]
            out[f"{base}_ms"] = _ms(a[c])
            out[f"{base}_ms_per_step"] = _ms(sum(vals) / nr)
            out[f"{base}_share"] = round(a[c] / window, 6) if window else None
        first = sums[0][:-3]
        vals = {r: (per[r][sums[0]] if r in per else 0.0) for r in ranks}
        worst = max(vals, key=lambda r: (vals[r], -r))
        out[f"max_rank_{first}_ms_per_step"] = _ms(vals[worst])
        out[f"min_rank_{first}_ms_per_step"] = _ms(min(vals.values()))
        out["max_rank"] = worst
        out["per_call_us"] = round(a[sums[0]] / a["count"] / 1e3, 3) if a["count"] else None
        out["min_us"], out["max_us"] = round(a["min_ns"] / 1e3, 3), round(a["max_ns"] / 1e3, 3)
        rows.append(out)
    keep: set[tuple] = set()
    for c in sums:  # the top by each measure (CPU ops: self and total time)
        keep.update(_row_key(x) for x in sorted(rows, key=lambda x: (-x[f"{c[:-3]}_ms"], *_sort_key(x)))[:TOP_JOB])
    kept = sorted((x for x in rows if _row_key(x) in keep), key=lambda x: (-x[f"{sort[:-3]}_ms"], *_sort_key(x)))
    tot = {c: sum(d[key]["total"][c] for d in digests.values()) for c in ["count", *sums]}
    other = {"names_not_shown": len(rows) - len(kept) + sum(d[key]["other"]["names"] for d in digests.values()),
             "count": tot["count"] - sum(x["count"] for x in kept),
             **{f"{c[:-3]}_ms": _ms(tot[c] - sum(acc[_row_key(x)][c] for x in kept)) for c in sums}}
    totals = {"count": tot["count"], **{f"{c[:-3]}_ms": _ms(tot[c]) for c in sums},
              **{f"{c[:-3]}_ms_per_step": _ms(sum(d[key]["total"][c] / max(d.get("n_steps") or 0, 1)
                                                  for d in digests.values()) / nr) for c in sums}}
    return kept, {"other": other, "total": totals}


def _sort_key(row: dict) -> tuple:
    return row["name"], row.get("role") or ""


def _name_sums(digests: dict, key: str) -> list[int] | None:
    sums: set[int] = set()
    for d in digests.values():
        s = d[key].get("name_sums")
        if s is None:
            return None
        sums.update(s)
    return sorted(sums) if len(sums) <= MAX_NAME_SUMS else None


def _groups(digests: dict) -> list[dict]:
    nr = len(digests)
    ktotal = sum(g["total_ns"] for d in digests.values() for g in d["kernel_groups"].values())
    window = sum(d.get("window_ns") or 0 for d in digests.values())
    out = []
    for g in GROUPS:
        rows = [(d["kernel_groups"][g], max(d.get("n_steps") or 0, 1)) for d in digests.values()
                if g in d["kernel_groups"]]
        if not rows:
            continue
        total = sum(x["total_ns"] for x, _ in rows)
        out.append({"group": g, "count": sum(x["count"] for x, _ in rows), "total_ms": _ms(total),
                    "ms_per_step": _ms(sum(x["total_ns"] / n for x, n in rows) / nr),
                    "busy_ms_per_step": _ms(sum(x["busy_ns"] / n for x, n in rows) / nr),
                    "share_of_kernel_time": round(total / ktotal, 6) if ktotal else None,
                    "share_of_step": round(total / window, 6) if window else None})
    return out


def _overlap(digests: dict) -> list[dict]:
    acc: dict[str, int] = {}
    for d in digests.values():
        for k, v in d["kernel_overlap"].items():
            acc[k] = acc.get(k, 0) + v
    tot = sum(acc.values())
    return [{"kernel_type": k, "total_ms": _ms(v), "pct": round(100.0 * v / tot, 2)}
            for k, v in sorted(acc.items(), key=lambda kv: -kv[1])] if tot else []


def _per_rank(digests: dict) -> list[dict]:
    out = []
    lists = len(digests) <= PER_RANK_LISTS_MAX
    for r, d in sorted(digests.items()):
        n = max(d.get("n_steps") or 0, 1)
        k, c = d["kernels"], d["cpu_ops"]
        row = {"rank": r, "kind": d["kind"], "steps": d["n_steps"],
               "step_window_ms": _ms(d["window_ns"] / n),
               "kernels_per_step": round(k["total"]["count"] / n, 2),
               "kernel_ms_per_step": _ms(k["total"]["total_ns"] / n),
               "kernel_busy_ms_per_step": _ms(d["kernel_busy_ns"] / n),
               **{f"{g}_ms_per_step": _ms(d["kernel_groups"][g]["total_ns"] / n)
                  for g in GROUPS if g in d["kernel_groups"]},
               "cpu_ops_per_step": round(c["total"]["count"] / n, 2),
               "cpu_self_ms_per_step": _ms(c["total"]["self_ns"] / n),
               **{f"{role}_self_ms_per_step": _ms(x["self_ns"] / n)
                  for role, x in (d.get("cpu_roles") or {}).items()},
               "outside_ops_ms_per_step": _ms((d.get("outside_ops_ns") or 0) / n)}
        if lists:
            kr = k["rows"][:TOP_PER_RANK]
            cr = sorted((x for x in c["rows"] if x.get("role") in CRITICAL),
                        key=lambda x: (-x["self_ns"], x["name"]))[:TOP_PER_RANK]
            row["top_kernels"] = [{"name": x["name"][:200], "group": x["group"],
                                   "ms_per_step": _ms(x["total_ns"] / n)} for x in kr]
            row["top_compute_ops_self"] = [{"name": x["name"][:200], "self_ms_per_step": _ms(x["self_ns"] / n)}
                                           for x in cr]
        out.append(row)
    return out


def combine(digests: dict) -> dict:
    """Job-level metrics from {rank: trace_digest}."""
    digests = {r: d for r, d in digests.items() if d and d.get("n_steps")}
    if not digests:
        return {}
    nr = len(digests)
    kernels, ksum = _job_table(digests, "kernels", "group", ["total_ns"], "total_ns")
    cpu, csum = _job_table(digests, "cpu_ops", "cat", ["self_ns", "total_ns"], "self_ns")
    gpu_ranks = [r for r, d in sorted(digests.items()) if d["kind"] == "gpu"]
    job = {"ranks": nr, "kind": "gpu" if gpu_ranks else "cpu",
           "gpu_ranks": len(gpu_ranks),
           "steps_per_rank": sorted({d["n_steps"] for d in digests.values()}),
           "step_window_ms": _ms(sum(d["window_ns"] / d["n_steps"] for d in digests.values()) / nr),
           "kernel_ms_per_step": ksum["total"]["total_ms_per_step"],
           "kernel_busy_ms_per_step": _ms(sum(d["kernel_busy_ns"] / d["n_steps"] for d in digests.values()) / nr),
           "kernels_per_step": round(sum(d["kernels"]["total"]["count"] / d["n_steps"]
                                         for d in digests.values()) / nr, 2),
           "cpu_self_ms_per_step": csum["total"]["self_ms_per_step"],
           "cpu_self_ms_per_step_by_role": {
               role: _ms(sum((d.get("cpu_roles") or {}).get(role, {}).get("self_ns", 0) / d["n_steps"]
                             for d in digests.values()) / nr)
               for role in ROLES if any(role in (d.get("cpu_roles") or {}) for d in digests.values())},
           "outside_ops_ms_per_step": _ms(sum((d.get("outside_ops_ns") or 0) / d["n_steps"]
                                              for d in digests.values()) / nr),
           "thread_roles": {k: max((d.get("thread_roles") or {}).get(k, 0) for d in digests.values())
                            for k in ("main", "backward", "communication", "other")},
           "cpu_ops_per_step": round(sum(d["cpu_ops"]["total"]["count"] / d["n_steps"]
                                         for d in digests.values()) / nr, 2)}
    whole = [r for r, d in sorted(digests.items()) if d.get("whole_trace_window")]
    notes = []
    if not gpu_ranks:
        notes.append("no GPU kernels in the profiled steps (a CPU-only job, or a trace without "
                     "device activity): the kernel tables are empty; CPU ops only")
    elif len(gpu_ranks) < nr:
        notes.append(f"GPU kernels on {len(gpu_ranks)} of {nr} ranks only")
    if whole:
        notes.append(f"{ranks_phrase(whole)}: no ProfilerStep, the whole trace counts as one step")
    return {"job": job, "kernel_groups": _groups(digests), "kernel_overlap": _overlap(digests),
            "kernels": kernels, "kernels_other": ksum["other"], "kernels_total": ksum["total"],
            "cpu_ops": cpu, "cpu_ops_other": csum["other"], "cpu_ops_total": csum["total"],
            "per_rank": _per_rank(digests),
            "name_sums": {"kernels": _name_sums(digests, "kernels"),
                          "cpu_ops": _name_sums(digests, "cpu_ops")},
            "notes": notes, "definitions": "docs/ops.md"}


def analyze(run) -> AnalyzerResult:
    return AnalyzerResult(metrics=combine(run.trace_digests(NAME)), findings=[])
