"""Which ops moved between two sets of runs (`trainprof compare`): an op-level diff of the
profiled steps, like HTA's trace diff — ops added and removed, each op's time per step before
and after, and the ops that contribute most to the change, largest absolute change first.

Each run's op breakdown is the ops analyzer's job-level metrics (metrics.ops of summary.json,
built from the per-rank trace digests; a run directory whose summary predates them is analyzed
from its traces). GPU kernels are compared by their GPU time per profiled step, CPU ops by their
self time per profiled step (nested ops not counted twice), both as the mean over ranks; with
several runs per side, the mean over the side's runs. Informational: it never changes the
gate's verdict or exit code.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

TOP = 20           # contributors listed per table
LISTED = 20        # added / removed ops listed per table
KINDS = {  # table -> (value key in the ops rows, type key, what the value is)
    "kernels": ("total_ms_per_step", "group", "GPU time per profiled step"),
    "cpu_ops": ("self_ms_per_step", "cat", "CPU self time per profiled step"),
}
SIDE_TOTAL = {"kernels": "kernel_ms_per_step", "cpu_ops": "cpu_self_ms_per_step"}


def run_ops(summary: Mapping, path: Path | None) -> tuple[dict | None, str | None]:
    """(the run's ops metrics, None) or (None, why there are none)."""
    ops = (summary.get("metrics") or {}).get("ops") if isinstance(summary, Mapping) else None
    if isinstance(ops, Mapping) and ops.get("job"):
        return dict(ops), None
    run_dir = _run_dir(path)
    if run_dir is None:
        return None, "no op breakdown in the summary and no run directory beside it"
    try:
        from trainprof.analyzers import ops as ops_analyzer
        from trainprof.rundir import RunDir

        metrics = ops_analyzer.analyze(RunDir(run_dir)).metrics
    except Exception as e:  # noqa: BLE001 - informational: a run that cannot be read has no diff
        return None, f"{run_dir}: op breakdown failed ({type(e).__name__}: {e})"
    return (metrics, None) if metrics.get("job") else (None, f"{run_dir}: no profiled steps in its traces")


def _run_dir(path: Path | None) -> Path | None:
    from trainprof.rundir import MANIFEST, SUMMARY

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


def _index(ops: Mapping, table: str) -> tuple[dict, set | None]:
    """({name: row}, the set of name checksums of every op of the run, or None when not kept)."""
    rows = {r["name"]: r for r in ops.get(table) or []
            if isinstance(r, Mapping) and isinstance(r.get("name"), str)}
    sums = (ops.get("name_sums") or {}).get(table)
    return rows, (set(sums) if isinstance(sums, list) else None)


def _side(runs: list[tuple[dict, set | None]], name: str, table: str) -> dict:
    """One op on one side: the mean over its runs of the op's value — the row's value; 0 when
    a run's name checksums say the op never ran there, and also (counted in below_top) when it
    ran but is below that run's top tables."""
    from trainprof.analyzers.ops import name_sum

    key, type_key, _ = KINDS[table]
    vals, calls, kind, absent, below = [], [], None, 0, 0
    for rows, sums in runs:
        row = rows.get(name)
        if row is not None:
            kind = kind or row.get(type_key)
            vals.append(float(row.get(key) or 0.0))
            calls.append(float(row.get("calls_per_step") or 0.0))
        elif sums is not None and name_sum(name) not in sums:
            vals.append(0.0)
            calls.append(0.0)
            absent += 1
        else:
            vals.append(0.0)
            below += 1
    return {"ms": round(_mean(vals), 6), "calls": round(_mean(calls), 3) if calls else None,
            "type": kind, "absent": absent == len(runs), "below_top": below}


def _table_diff(bases: list[Mapping], cands: list[Mapping], table: str) -> dict:
    measure = KINDS[table][2]
    ib, ic = [_index(o, table) for o in bases], [_index(o, table) for o in cands]
    names = list(dict.fromkeys(n for rows, _ in (*ib, *ic) for n in rows))
    rows = []
    for name in names:
        b, c = _side(ib, name, table), _side(ic, name, table)
        delta = c["ms"] - b["ms"]
        status = ("added" if b["absent"] and not c["absent"] else
                  "removed" if c["absent"] and not b["absent"] else "changed")
        row = {"name": name, "type": b["type"] or c["type"], "baseline_ms": b["ms"],
               "candidate_ms": c["ms"], "delta_ms": round(delta, 6),
               "change": round(delta / b["ms"], 4) if b["ms"] > 0 else None,
               "baseline_calls": b["calls"], "candidate_calls": c["calls"], "status": status}
        below = [side for side, s in (("baseline", b), ("candidate", c)) if s["below_top"]]
        if below:  # counted as 0 where it is below a run's top tables: the change is approximate
            row["below_top_in"] = below
        rows.append(row)
    rows.sort(key=lambda r: (-abs(r["delta_ms"]), r["name"]))
    tb = _mean([float((o.get("job") or {}).get(SIDE_TOTAL[table]) or 0.0) for o in bases])
    tc = _mean([float((o.get("job") or {}).get(SIDE_TOTAL[table]) or 0.0) for o in cands])
    listed = lambda status, side: sorted(  # noqa: E731
        ({"name": r["name"], "type": r["type"], "ms": r[side]} for r in rows if r["status"] == status),
        key=lambda x: (-x["ms"], x["name"]))[:LISTED]
    return {"measure": measure, "baseline_ms": round(tb, 6), "candidate_ms": round(tc, 6),
            "delta_ms": round(tc - tb, 6), "top": rows[:TOP],
            "added": listed("added", "candidate_ms"), "removed": listed("removed", "baseline_ms"),
            "ops_compared": len(rows)}


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
    first = (out.get("kernels") or out["cpu_ops"])["top"]
    out["top_contributor"] = ({k: first[0][k] for k in ("name", "type", "baseline_ms", "candidate_ms",
                                                        "delta_ms", "status")}
                              | {"table": "kernels" if out.get("kernels") else "cpu_ops"}) if first else None
    return out


def _pair(vb: list, vc: list) -> dict:
    b = [float(x) for x in vb if isinstance(x, (int, float))]
    c = [float(x) for x in vc if isinstance(x, (int, float))]
    mb, mc = (_mean(b) if b else None), (_mean(c) if c else None)
    return {"baseline": None if mb is None else round(mb, 6), "candidate": None if mc is None else round(mc, 6),
            "delta": None if mb is None or mc is None else round(mc - mb, 6)}
