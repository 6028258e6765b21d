"""Which ops moved between two sets of runs (`trainprof compare`): an op-level diff of the
profiled steps, like HTA's trace diff — ops added and removed, each op's time per step before
and after, and the ops that contribute most to the change of the step time.

Each run's op breakdown is the ops analyzer's job-level metrics (metrics.ops of summary.json,
built from the per-rank trace digests; a run directory whose summary predates them, or predates
the ops' roles, is analyzed from its traces). GPU kernels are compared by their GPU time per
profiled step, CPU ops by their self time per profiled step (nested ops not counted twice), both
as the mean over ranks; with several runs per side, the mean over the side's runs.

Every op has a role (analyzers/ops.py): the top contributors are the ops the step's time is made
of — compute kernels and memory copies on the GPU, compute ops on the step's threads on the CPU —
largest absolute change first. Waits (collectives, device synchronization on the step's threads),
communication kernels and gloo's communication threads are listed apart ("waiting moved"): they
grow when a peer or the device is slow, so they are a symptom, not where the time went. Other
threads (data loader workers, ...) are listed apart too. Informational: it never changes the
gate's verdict or exit code.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from trainprof.analyzers import ops as ops_analyzer
from trainprof.analysis.run import RunDir
from trainprof.rundir.files import MANIFEST, SUMMARY
from trainprof.analyzers.ops import CRITICAL, ROLES, WAITING, is_wait, key_sum

TOP = 20           # contributors listed per table
TOP_APART = 10     # waiting / other-thread ops listed per table
LISTED = 20        # added / removed ops listed per table
KINDS = {  # table -> (value key in the ops rows, type key, what the value is)
    "kernels": ("total_ms_per_step", "group", "GPU time per profiled step"),
    "cpu_ops": ("self_ms_per_step", "cat", "CPU self time per profiled step"),
}
SIDE_TOTAL = {"kernels": "kernel_ms_per_step", "cpu_ops": "cpu_self_ms_per_step"}


def run_ops(summary: Mapping, path: Path | None) -> tuple[dict | None, str | None]:
    """(the run's ops metrics, None) or (None, why there are none). Metrics without roles (a
    summary written before them) are analyzed again from the run directory when there is one."""
    ops = (summary.get("metrics") or {}).get("ops") if isinstance(summary, Mapping) else None
    has = isinstance(ops, Mapping) and bool(ops.get("job"))
    if has and _has_roles(ops):
        return dict(ops), None
    run_dir = _run_dir(path)
    if run_dir is None:
        return (dict(ops), None) if has else \
            (None, "no op breakdown in the summary and no run directory beside it")
    try:
        metrics = ops_analyzer.analyze(RunDir(run_dir)).metrics
    except Exception as e:  # noqa: BLE001 - informational: a run that cannot be read has no diff
        if has:
            return dict(ops), None
        return None, f"{run_dir}: op breakdown failed ({type(e).__name__}: {e})"
    return (metrics, None) if metrics.get("job") else (None, f"{run_dir}: no profiled steps in its traces")


def _has_roles(ops: Mapping) -> bool:
    return "cpu_self_ms_per_step_by_role" in (ops.get("job") or {})


def _run_dir(path: Path | None) -> Path | None:
    if path is None:
        return None
    path = Path(path)
    if path.name == SUMMARY and (path.parent / MANIFEST).is_file():
        return path.parent
    if path.is_dir() and (path / MANIFEST).is_file():
        return path
    return None


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _role(table: str, row: Mapping, legacy: bool) -> str:
    """kernels: communication (NCCL) or compute; CPU ops: the row's role (from its name alone
    in metrics written before roles: gloo: ops communication, other waits wait)."""
    name = row.get("name") or ""
    if table == "kernels":
        return "communication" if row.get("group") == "communication" else "compute"
    if not legacy and row.get("role"):
        return str(row["role"])

    return ("communication" if name.startswith("gloo:") else "wait") if is_wait(name) else "compute"


def _index(ops: Mapping, table: str) -> tuple[dict, set | None, bool]:
    """({(name, role): row}, the checksums of every row key of the run or None when not kept,
    whether the roles are inferred from names)."""
    legacy = table == "cpu_ops" and not _has_roles(ops)
    rows = {(r["name"], _role(table, r, legacy)): r for r in ops.get(table) or []
            if isinstance(r, Mapping) and isinstance(r.get("name"), str)}
    sums = (ops.get("name_sums") or {}).get(table)
    return rows, (set(sums) if isinstance(sums, list) else None), legacy


def _side(runs: list[tuple[dict, set | None, bool]], key: tuple[str, str], table: str) -> dict:
    """One op on one side: the mean over its runs of the op's value — the row's value; 0 when
    a run's checksums say the op never ran there (in that role), and also (counted in
    below_top) when it ran but is below that run's top tables."""
    name, role = key
    value, type_key, _ = KINDS[table]
    vals, calls, kind, absent, below = [], [], None, 0, 0
    for rows, sums, legacy in runs:
        row = rows.get(key)
        if row is not None:
            kind = kind or row.get(type_key)
            vals.append(float(row.get(value) or 0.0))
            calls.append(float(row.get("calls_per_step") or 0.0))
        elif sums is not None and key_sum(name, None if legacy or table == "kernels" else role) not in sums:
            vals.append(0.0)
            calls.append(0.0)
            absent += 1
        else:
            vals.append(0.0)
            below += 1
    return {"ms": round(_mean(vals), 6), "calls": round(_mean(calls), 3) if calls else None,
            "type": kind, "absent": absent == len(runs), "below_top": below}


def _by_role(ops_list: list[Mapping], table: str) -> dict[str, float]:
    """Time per step by role of one side (mean over its runs)."""
    per_run = []
    for o in ops_list:
        got: dict[str, float] = {}
        if table == "kernels":
            for g in o.get("kernel_groups") or []:
                r = "communication" if g.get("group") == "communication" else "compute"
                got[r] = got.get(r, 0.0) + float(g.get("ms_per_step") or 0.0)
        else:
            by = (o.get("job") or {}).get("cpu_self_ms_per_step_by_role") or {}
            got = {k: float(v or 0.0) for k, v in by.items()}
        per_run.append(got)
    return {r: _mean([g.get(r, 0.0) for g in per_run]) for r in set().union(*per_run)}


def _table_diff(bases: list[Mapping], cands: list[Mapping], table: str) -> dict:
    measure = KINDS[table][2]
    ib, ic = [_index(o, table) for o in bases], [_index(o, table) for o in cands]
    keys = list(dict.fromkeys(k for rows, _, _ in (*ib, *ic) for k in rows))
    rows = []
    for key in keys:
        b, c = _side(ib, key, table), _side(ic, key, table)
        delta = c["ms"] - b["ms"]
        status = ("added" if b["absent"] and not c["absent"] else
                  "removed" if c["absent"] and not b["absent"] else "changed")
        row = {"name": key[0], "role": key[1], "type": b["type"] or c["type"], "baseline_ms": b["ms"],
               "candidate_ms": c["ms"], "delta_ms": round(delta, 6),
               "change": round(delta / b["ms"], 4) if b["ms"] > 0 else None,
               "baseline_calls": b["calls"], "candidate_calls": c["calls"], "status": status}
        below = [side for side, s in (("baseline", b), ("candidate", c)) if s["below_top"]]
        if below:  # counted as 0 where it is below a run's top tables: the change is approximate
            row["below_top_in"] = below
        rows.append(row)
    rows.sort(key=lambda r: (-abs(r["delta_ms"]), r["name"], r["role"]))
    tb = _mean([float((o.get("job") or {}).get(SIDE_TOTAL[table]) or 0.0) for o in bases])
    tc = _mean([float((o.get("job") or {}).get(SIDE_TOTAL[table]) or 0.0) for o in cands])
    rb, rc = _by_role(bases, table), _by_role(cands, table)
    listed = lambda status, side: sorted(  # noqa: E731
        ({"name": r["name"], "role": r["role"], "type": r["type"], "ms": r[side]}
         for r in rows if r["status"] == status),
        key=lambda x: (-x["ms"], x["name"]))[:LISTED]
    among = lambda roles, n: [r for r in rows if r["role"] in roles][:n]  # noqa: E731
    return {"measure": measure, "baseline_ms": round(tb, 6), "candidate_ms": round(tc, 6),
            "delta_ms": round(tc - tb, 6),
            "by_role": {r: _pair([rb[r]] if r in rb else [], [rc[r]] if r in rc else [])
                        for r in ROLES if r in rb or r in rc},
            "top": among(CRITICAL, TOP), "waiting": among(WAITING, TOP_APART),
            "other_threads": among(("other",), TOP_APART),
            "added": listed("added", "candidate_ms"), "removed": listed("removed", "baseline_ms"),
            "ops_compared": len(rows), "rows": rows,
            "roles_inferred": any(x[2] for x in (*ib, *ic))}


def op_diff(bases: Sequence[tuple[Mapping, Path | None]], cands: Sequence[tuple[Mapping, Path | None]]) -> dict:
    """The op-level diff of two sides of [(summary, path)]; {"available": False, "reason"} when a
    side has no run with an op breakdown."""
    sides, notes = [], []
    for role, runs in (("baseline", bases), ("candidate", cands)):
        got = []
        for summary, path in runs:
            ops, why = run_ops(summary, path)
            if ops is None:
                notes.append(f"{role} {path}: {why}")
            else:
                got.append(ops)
        sides.append(got)
    b, c = sides
    if not b or not c:
        missing = " and ".join(r for r, s in (("baseline", b), ("candidate", c)) if not s)
        return {"available": False, "reason": f"no op breakdown (profiler traces) on the {missing} "
                f"side{'s' if ' and ' in missing else ''}", "notes": notes}
    out = {"available": True, "runs": [len(b), len(c)], "notes": notes,
           "basis": "per profiled step, mean over ranks" + (", then over each side's runs"
                                                            if max(len(b), len(c)) > 1 else ""),
           "step_window_ms": _pair([(o.get("job") or {}).get("step_window_ms") for o in b],
                                   [(o.get("job") or {}).get("step_window_ms") for o in c])}
    gpu = [all((o.get("job") or {}).get("kind") == "gpu" for o in side) for side in (b, c)]
    if all(gpu):
        out["kernels"] = _table_diff(b, c, "kernels")
    elif any(gpu):
        notes.append("GPU kernels on one side only: kernels not compared")
    out["cpu_ops"] = _table_diff(b, c, "cpu_ops")
    if out["cpu_ops"]["roles_inferred"]:
        notes.append("CPU-op roles inferred from op names on runs whose op breakdown predates them")
    out["outside_ops_ms"] = _pair([(o.get("job") or {}).get("outside_ops_ms_per_step") for o in b if _has_roles(o)],
                                  [(o.get("job") or {}).get("outside_ops_ms_per_step") for o in c if _has_roles(o)])
    tables = [t for t in ("kernels", "cpu_ops") if t in out]
    first = next(((t, out[t]["top"][0]) for t in tables if out[t]["top"] and out[t]["top"][0]["delta_ms"]), None)
    out["top_contributor"] = ({k: first[1][k] for k in ("name", "role", "type", "baseline_ms", "candidate_ms",
                                                        "delta_ms", "status")}
                              | {"table": first[0]}) if first else None
    waiting = sorted(((t, r) for t in tables for r in out[t]["waiting"] if r["delta_ms"]),
                     key=lambda tr: (-abs(tr[1]["delta_ms"]), tr[1]["name"]))
    out["waiting_moved"] = [{"table": t, **{k: r[k] for k in ("name", "role", "delta_ms")}}
                            for t, r in waiting[:3]]
    return out


def _pair(vb: list, vc: list) -> dict:
    b = [float(x) for x in vb if isinstance(x, (int, float))]
    c = [float(x) for x in vc if isinstance(x, (int, float))]
    mb, mc = (_mean(b) if b else None), (_mean(c) if c else None)
    return {"baseline": None if mb is None else round(mb, 6), "candidate": None if mc is None else round(mc, 6),
            "delta": None if mb is None or mc is None else round(mc - mb, 6)}
