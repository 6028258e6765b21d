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
import pandas as pd

from trainprof.analyzers import _intervals as iv
from trainprof.findings import AnalyzerResult
from trainprof.trace import name_mask
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


def thread_roles(thread: np.ndarray, names: pd.Series, step_threads: np.ndarray) -> dict[int, str]:
    """{thread key: main | backward | communication | other}. main: the threads holding the
    ProfilerStep spans; communication: other threads running gloo: ops; backward: other threads
    running autograd engine functions; other: the rest."""
    gloo = name_mask(names, lambda n: n.startswith(COMM_THREAD_PREFIX))
    bwd = name_mask(names, lambda n: n.startswith(BACKWARD_PREFIX))
    out = {int(t): "other" for t in np.unique(thread)}
    for t in np.unique(thread[bwd]):
        out[int(t)] = "backward"
    for t in np.unique(thread[gloo]):
        out[int(t)] = "communication"
    for t in step_threads:
        out[int(t)] = "main"
    return out


def op_roles(thread: np.ndarray, names: pd.Series, roles: dict[int, str]) -> np.ndarray:
    """Each event's role as an index into ROLES: compute or wait on the step's threads (main,
    backward), else the thread's role (communication, other)."""
    uniq, inv = np.unique(thread, return_inverse=True)
    code = {"main": -1, "backward": -1, "communication": ROLES.index("communication"),
            "other": ROLES.index("other")}
    th = np.array([code[roles[int(t)]] for t in uniq], dtype=np.int8)[inv.reshape(-1)]
    wait = name_mask(names, is_wait)
    return np.where(th < 0, np.where(wait, ROLES.index("wait"), ROLES.index("compute")), th).astype(np.int8)


# --------------------------------------------------------------------------- per rank
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
    order = np.lexsort((-(end - ts), ts, thread))
    s, e, th = ts[order], end[order], thread[order]
    par = np.arange(n) - 1
    par[0] = -1
    par[1:][th[1:] != th[:-1]] = -1
    todo = np.flatnonzero(par >= 0)
    todo = todo[e[par[todo]] <= s[todo]]
    while len(todo):
        par[todo] = par[par[todo]]
        todo = todo[par[todo] >= 0]
        todo = todo[e[par[todo]] <= s[todo]]
    child = np.zeros(n, np.int64)
    has = np.flatnonzero(par >= 0)
    p = par[has]
    np.add.at(child, p, np.minimum(e[has], e[p]) - s[has])
    out = np.empty(n, np.int64)
    out[order] = np.maximum(e - s - child, 0)
    return out


def _table(frame: pd.DataFrame, keys: list[str], sums: dict[str, str], top_by: list[str],
           by: tuple[str, ...] = ("name",)) -> dict:
    """rows (the top TOP_DIGEST by each of top_by, largest first by the first), the remainder
    and the totals of a per-event frame grouped by ``by`` (the name, or name and role)."""
    if frame.empty:
        return {"rows": [], "other": {"names": 0, "count": 0, **{c: 0 for c in sums}},
                "total": {"names": 0, "count": 0, **{c: 0 for c in sums}}, "name_sums": []}
    g = frame.groupby(list(by), observed=True, sort=False)
    agg = g.agg(count=("dur_ns", "size"), **{c: (src, "sum") for c, src in sums.items()},
                min_ns=("dur_ns", "min"), max_ns=("dur_ns", "max"))
    for k in keys:
        agg[k] = g[k].first()
    agg = agg.reset_index()
    agg["name"] = agg["name"].astype(str)
    keep = set()
    for col in top_by:
        keep.update(agg.sort_values([col, *by], ascending=[False] + [True] * len(by)).head(TOP_DIGEST).index)
    top = agg.loc[sorted(keep)].sort_values([top_by[0], *by], ascending=[False] + [True] * len(by))
    rest = agg.drop(index=list(keep))
    cols = list(dict.fromkeys(["name", *by, *keys, "count", *sums, "min_ns", "max_ns"]))
    rows = [{c: (int(v) if isinstance(v, (np.integer, int)) else str(v)) for c, v in zip(cols, r)}
            for r in top[cols].itertuples(index=False, name=None)]
    role = agg["role"].astype(str).tolist() if "role" in by else [None] * len(agg)
    return {"rows": rows,
            "other": {"names": len(rest), "count": int(rest["count"].sum()),
                      **{c: int(rest[c].sum()) for c in sums}},
            "total": {"names": len(agg), "count": int(agg["count"].sum()),
                      **{c: int(agg[c].sum()) for c in sums}},
            "name_sums": (sorted({key_sum(x, r) for x, r in zip(agg["name"], role)})
                          if len(agg) <= MAX_NAME_SUMS else None)}


def _kernel_overlap(k: pd.DataFrame, groups: np.ndarray) -> dict[str, int]:
    """HTA's kernel-type partition: ns during which exactly a given set of groups runs,
    labelled like HTA ("compute overlapping communication")."""
    sets = [iv.union(k["ts_ns"].to_numpy()[groups == g], k["end_ns"].to_numpy()[groups == g])
            for g in GROUPS]
    pts = np.unique(np.concatenate([np.concatenate(s) for s in sets]))
    if len(pts) < 2:
        return {}
    lo, hi = pts[:-1], pts[1:]
    mask = np.zeros(len(lo), np.int64)
    for bit, (s, e) in enumerate(sets):
        if len(s):
            i = np.searchsorted(s, lo, side="right") - 1
            inside = (i >= 0) & (lo < e[np.clip(i, 0, None)])
            mask |= inside.astype(np.int64) << bit
    out: dict[str, int] = {}
    for m in np.unique(mask[mask > 0]):
        label = " overlapping ".join(g for bit, g in enumerate(GROUPS) if m >> bit & 1)
        out[label] = int((hi - lo)[mask == m].sum())
    return out


def trace_digest(run, rank, trace) -> dict:
    """One rank's op and kernel breakdown over its profiled steps (small: top tables only)."""
    ev = trace.events
    steps = trace.steps
    step_col = ev["step"].to_numpy()
    in_step = step_col >= 0
    window = int((steps["end_ns"] - steps["start_ns"]).sum()) if len(steps) else 0
    out = {"steps": [int(s) for s in steps["step"]], "n_steps": int(len(steps)),
           "window_ns": window, "whole_trace_window": bool(trace.meta.get("whole_trace_window"))}

    kmask = ev["cat"].isin(KERNEL_CATS).to_numpy() & in_step
    k = ev.loc[kmask, ["name", "cat", "ts_ns", "end_ns", "dur_ns"]]
    comm = name_mask(k["name"], lambda n: kernel_group(n) == "communication")
    mem = name_mask(k["name"], lambda n: kernel_group(n) == "memory") | \
        k["cat"].isin(["gpu_memcpy", "gpu_memset"]).to_numpy()
    groups = np.where(comm, "communication", np.where(mem, "memory", "compute")).astype(object)
    k = k.assign(group=groups, total_ns=k["dur_ns"])
    out["kernels"] = _table(k, ["group"], {"total_ns": "total_ns"}, ["total_ns"])
    out["kernel_groups"] = {
        g: {"count": int((groups == g).sum()), "total_ns": int(k["dur_ns"].to_numpy()[groups == g].sum()),
            "busy_ns": iv.length(iv.union(k["ts_ns"].to_numpy()[groups == g], k["end_ns"].to_numpy()[groups == g]))}
        for g in GROUPS if (groups == g).any()}
    out["kernel_busy_ns"] = iv.length(iv.union(k["ts_ns"].to_numpy(), k["end_ns"].to_numpy()))
    out["kernel_overlap"] = _kernel_overlap(k, groups) if len(k) else {}
    out["kind"] = "gpu" if len(k) else "cpu"

    out.update(_cpu_digest(ev, steps, window))
    return out


def _step_ends(step: np.ndarray, steps: pd.DataFrame) -> np.ndarray:
    """The end of each event's profiled step (int64 max outside every step)."""
    ends = steps["end_ns"].to_numpy(np.int64)
    if not len(ends):
        return np.full(len(step), np.iinfo(np.int64).max, np.int64)
    idx = pd.Index(steps["step"].to_numpy(np.int64)).get_indexer(step)
    return np.where(idx >= 0, ends[np.clip(idx, 0, None)], np.iinfo(np.int64).max)


def _cpu_digest(ev: pd.DataFrame, steps: pd.DataFrame, window: int) -> dict:
    """CPU ops of the profiled steps by (name, role), self time per role, the step's threads."""
    host = ~ev["is_gpu"].to_numpy()
    is_step = name_mask(ev["name"], lambda n: n.startswith("ProfilerStep#")) & host
    hmask = ev["cat"].isin(HOST_OP_CATS).to_numpy() & host & ~is_step
    h = ev.loc[hmask, ["name", "cat", "ts_ns", "end_ns", "pid", "tid", "step"]]
    key = lambda f: f["pid"].to_numpy() * np.int64(1 << 32) + (f["tid"].to_numpy() & 0xFFFFFFFF)  # noqa: E731
    thread = key(h)  # nesting is per (pid, tid)
    ts = h["ts_ns"].to_numpy()
    end = np.minimum(h["end_ns"].to_numpy(), _step_ends(h["step"].to_numpy(), steps))  # cut at the step's end
    self_ns = self_times(ts, end, thread)
    stepped = h["step"].to_numpy() >= 0
    h, thread, ts, end, self_ns = h[stepped], thread[stepped], ts[stepped], end[stepped], self_ns[stepped]
    step_threads = np.unique(key(ev.loc[is_step, ["pid", "tid"]]))
    roles = thread_roles(thread, h["name"], step_threads)
    if not len(step_threads) and len(h):  # no ProfilerStep: the busiest thread that is not gloo's
        busy = pd.Series(self_ns).groupby(thread).sum()
        busy = busy[[roles[int(t)] != "communication" for t in busy.index]]
        if len(busy):
            roles[int(busy.idxmax())] = "main"
    role = op_roles(thread, h["name"], roles)
    h = h.assign(cat=h["cat"].astype(str), role=pd.Categorical.from_codes(role, ROLES),
                 dur_ns=end - ts, total_ns=end - ts, self_ns=self_ns)
    on_step = role <= ROLES.index("wait")  # compute and wait: the step's threads
    busy = iv.length(iv.union(ts[on_step], end[on_step]))
    by_role = {r: {"count": int((role == i).sum()), "self_ns": int(self_ns[role == i].sum())}
               for i, r in enumerate(ROLES) if (role == i).any()}
    kinds = list(roles.values())
    return {"cpu_ops": _table(h, ["cat"], {"total_ns": "total_ns", "self_ns": "self_ns"},
                              ["self_ns", "total_ns"], by=("name", "role")),
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
