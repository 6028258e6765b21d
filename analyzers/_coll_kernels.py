"""Which collective each NCCL/RCCL kernel of a GPU trace ran: its type, size, process group and
sequence number — also for kernels whose name says none (``ncclDevKernel_Generic``, RCCL's
generic kernels).

Per kernel, first source that knows: the kernel's own collective args (recent NCCL kernels carry
"Collective name", "In msg nelems", "dtype", "Process Group Name", "Seq"); else the host op that
launched it — the innermost ``record_param_comms``, ``nccl:*`` or ``c10d::*`` op on the launching
thread whose span holds the kernel's runtime launch call (same correlation id) — with that op's
collective args, or the collective its name says; else the kernel's own name.
"""

from __future__ import annotations

import numpy as np

from trainprof.analyzers._comm_groups import coll_type
from trainprof.analyzers._kernel_ops import launch_calls

# bytes per element of the dtype names record_param_comms writes
DTYPE_BYTES = {"Float": 4, "BFloat16": 2, "Half": 2, "Double": 8, "Long": 8, "Int": 4, "Short": 2,
               "Char": 1, "Byte": 1, "Bool": 1, "Float8_e4m3fn": 1, "Float8_e5m2": 1,
               "Float8_e4m3fnuz": 1, "Float8_e5m2fnuz": 1, "ComplexFloat": 8, "ComplexDouble": 16}
_COMM_OPS = ("nccl:", "c10d::", "gloo:")


def _comm_args(trace) -> dict[int, dict]:
    comm = trace.tables.comm
    if not len(comm):
        return {}
    cols = [c for c in ("collective", "in_nelems", "out_nelems", "dtype", "pg_name", "pg_desc",
                        "seq", "group_size") if c in comm]
    out: dict[int, dict] = {}
    for i, r in enumerate(comm["row"].tolist()):
        if r not in out:
            out[r] = {c: comm[c][i] for c in cols}
    return out


def _enclosing(ev, rt_rows: np.ndarray) -> np.ndarray:
    """Per runtime call row: the innermost communication op on its thread whose span holds the
    call's start, -1 when none."""
    out = np.full(len(rt_rows), -1, np.int64)
    name, cat = ev["name"], ev["cat"]
    cand = np.flatnonzero(cat.isin(("cpu_op", "user_annotation")) & (
        name.eq("record_param_comms") | name.mask(lambda n: n.startswith(_COMM_OPS))))
    ok = rt_rows >= 0
    if not len(cand) or not ok.any():
        return out
    tid, ts, end = ev["tid"], ev["ts_ns"], ev["end_ns"]
    # counts asked for: np.unique without them imports numpy.ma (tests/unit/trainprof/test_startup.py)
    for t in np.unique(tid[rt_rows[ok]], return_counts=True)[0].tolist():
        c = cand[tid[cand] == t]
        if not len(c):
            continue
        c = c[np.argsort(ts[c], kind="stable")]
        for i in np.flatnonzero(ok & (tid[np.maximum(rt_rows, 0)] == t)).tolist():
            at = ts[rt_rows[i]]
            j = int(np.searchsorted(ts[c], at, side="right")) - 1
            while j >= 0 and end[c[j]] < at:  # the latest-starting op that still holds it
                j -= 1
            if j >= 0:
                out[i] = c[j]
    return out


def attribute(trace, rows: np.ndarray) -> list[dict]:
    """Per kernel row: {"collective", "bytes", "pg_name", "pg_desc", "group_size", "seq",
    "source"} (None where unknown)."""
    ev = trace.tables.events
    rows = np.asarray(rows, np.int64)
    args = _comm_args(trace)
    ops = _enclosing(ev, launch_calls(ev, rows))
    names = ev["name"]
    out = []
    for r, op in zip(rows.tolist(), ops.tolist()):
        src, a = "kernel", args.get(r)
        if not (a and a.get("collective")) and op >= 0:
            src, a = "launching op", args.get(op) or {}
            if not a.get("collective"):
                a = dict(a, collective=names[op] if names[op] != "record_param_comms" else None)
        a = a or {}
        ctype = coll_type(str(a["collective"])) if a.get("collective") else "other"
        if ctype == "other":
            ctype, src = coll_type(names[r]), ("kernel name" if coll_type(names[r]) != "other" else src)
        n, dt = a.get("in_nelems"), a.get("dtype")
        nbytes = (int(n) * DTYPE_BYTES[dt] if isinstance(n, (int, np.integer)) and not isinstance(n, bool)
                  and dt in DTYPE_BYTES else None)
        seq, size = a.get("seq"), a.get("group_size")
        out.append({"collective": ctype, "bytes": nbytes,
                    "pg_name": None if a.get("pg_name") is None else str(a["pg_name"]),
                    "pg_desc": None if a.get("pg_desc") is None else str(a["pg_desc"]),
                    "group_size": int(size) if isinstance(size, (int, np.integer)) else None,
                    "seq": int(seq) if isinstance(seq, (int, np.integer)) and seq >= 0 else None,
                    "source": src})
    return out


def summary(trace, rows: np.ndarray) -> list[dict]:
    """The kernels grouped by (collective, bytes, process group): count and kernel time, the
    largest first (TraceLens' collective table)."""
    ev = trace.tables.events
    att = attribute(trace, rows)
    agg: dict = {}
    for r, a in zip(np.asarray(rows).tolist(), att):
        k = (a["collective"], a["bytes"], a["pg_name"])
        g = agg.setdefault(k, {"collective": k[0], "bytes": k[1], "pg_name": k[2],
                               "pg_desc": a["pg_desc"], "group_size": a["group_size"], "count": 0,
                               "kernel_ms": 0.0, "seqs": []})
        g["count"] += 1
        g["kernel_ms"] += float(ev["dur_ns"][r]) / 1e6
        if a["seq"] is not None and len(g["seqs"]) < 16:
            g["seqs"].append(a["seq"])
    return sorted(({**g, "kernel_ms": round(g["kernel_ms"], 4)} for g in agg.values()),
                  key=lambda g: -g["kernel_ms"])
