"""summary.json stays a few MB at any run length and any number of ranks. The analyzers compute
from every step of every rank; only what is written out is bounded, and every bound is said in
the analyzer's metrics (never a silent cut):

1. **Rank × step tables** (a dict of more than RANK_SERIES ranks, each a per-step list of one
   length, e.g. ``step_ms_by_rank``, ``busy_ms_by_rank``): the series of the ranks that matter
   are kept — the ranks findings name first, then the ranks whose median is furthest above the
   median of all ranks' medians in any table of the analyzer — RANK_SERIES in all, the same
   ranks in every table of that analyzer; each table gains ``<table>_all_ranks``: per step the
   min / median / max over all ranks (aligned with the series). ``rank_series`` says so:
   ``{"ranks": N, "kept": [...], "omitted": N − kept, "tables": [...], "chosen": "..."}``.
2. **Per-step series** (lists longer than MIN_POINTS; within one analyzer every list of the same
   length L is aligned with the others of that length: ``steps``, ``per_step``, the tables
   above), one choice of indices for all of them: the last RECENT_POINTS entries (the recent
   steps, every one) and every k-th older one, MAX_POINTS per list at most and TOTAL_POINTS over
   the lists of one length. ``series_resolution`` says so per length: ``{"length": L, "kept":
   n, "every": k, "recent_full": r, "axis": the list giving each kept point's step
   ("steps", "per_step[].step"), "steps": [first, last]}``.
3. **Long lists inside records** (a list of more than LIST_LIMIT entries in a per-rank record
   or a finding's evidence, e.g. ``per_rank[].straggling_steps`` over 100,000s of steps): the
   first LIST_KEEP entries, ``<key>_total`` (how many there were) and, for a list of step
   numbers, ``<key>_ranges``: the [first, last] runs of consecutive steps (at most LIST_KEEP,
   ``<key>_ranges_total`` past that).
4. **Numbers**: once any analyzer's metrics were bounded (a long or wide run), every float of
   the metrics and of the findings' evidence is written to FLOAT_DIGITS significant digits.
"""

from __future__ import annotations

import math
import warnings

import numpy as np

MAX_POINTS = 2000
RECENT_POINTS = 500
TOTAL_POINTS = 100_000  # per analyzer, over all its series of one length
MIN_POINTS = 50
RANK_SERIES = 8         # ranks whose series a rank × step table keeps
LIST_LIMIT = 1000       # entries of a list inside a record before it is cut
LIST_KEEP = 200
FLOAT_DIGITS = 6


def bound_metrics(metrics: dict, max_points: int = MAX_POINTS, recent: int = RECENT_POINTS,
                  named: list | None = None) -> bool:
    """Bound, in place, every analyzer's metrics (see the module doc); ``named``: the ranks
    the findings name (their series are kept first). True when any was bounded."""
    any_bounded = False
    for name, m in metrics.items():
        if not isinstance(m, dict):
            continue
        bounded = _rank_tables(m, named or [])
        bounded |= _records(m)
        counts: dict[int, int] = {}
        _lengths(m, MIN_POINTS, counts)
        picks = {}
        for L, c in counts.items():
            limit = max(MIN_POINTS, min(max_points, TOTAL_POINTS // c))
            if L > limit:
                picks[L] = _pick(L, limit, recent)
        if picks:
            axes = {L: _axis(m, L) for L in picks}
            _apply(m, picks)
            m["series_resolution"] = [_said(m, L, p, axes[L]) for L, p in sorted(picks.items())]
            bounded = True
        any_bounded |= bounded
    if any_bounded:
        for name in list(metrics):
            metrics[name] = _round(metrics[name])
    return any_bounded


def _said(m: dict, L: int, p: tuple, axis: str | None) -> dict:
    out = {"length": L, "kept": len(p[0]), "every": p[1], "recent_full": p[2], "axis": axis}
    steps = _axis_steps(m, axis)
    if steps:
        out["steps"] = [steps[0], steps[-1]]
    return out


def _axis(m: dict, L: int) -> str | None:
    """Where the step of each point of m's series of length L is: a list of steps
    ("steps", "timeline.0.step"), a field of each record ("per_step[].step") or the first item
    of each [step, value] pair ("loss.0[][0]")."""
    for k in ("steps", "steps_analysed"):
        v = m.get(k)
        if isinstance(v, list) and len(v) == L and all(isinstance(x, int) for x in v[:5]):
            return k
    found: list[str] = []

    def walk(x, path: str) -> None:
        if found or not isinstance(x, dict):
            return
        for k, v in x.items():
            p = f"{path}.{k}" if path else str(k)
            if isinstance(v, list) and len(v) == L and v:
                if k in ("step", "steps") and isinstance(v[0], int):
                    found.append(p)
                elif isinstance(v[0], dict) and isinstance(v[0].get("step"), int):
                    found.append(f"{p}[].step")
                elif isinstance(v[0], list) and v[0] and isinstance(v[0][0], int):
                    found.append(f"{p}[][0]")
                if found:
                    return
            else:
                walk(v, p)

    walk(m, "")
    return found[0] if found else None


def _axis_steps(m: dict, axis: str | None) -> list:
    if not axis:
        return []
    path, _, tail = axis.partition("[]")
    x = m
    for k in path.split("."):
        x = x.get(k) if isinstance(x, dict) else None
    if not isinstance(x, list):
        return []
    if tail == ".step":
        return [e.get("step") for e in x if isinstance(e, dict)]
    if tail == "[0]":
        return [e[0] for e in x if isinstance(e, list) and e]
    return x


def _lengths(x, limit: int, out: dict) -> None:
    """How many lists of each length > limit (series of one length are aligned)."""
    if isinstance(x, dict):
        for v in x.values():
            _lengths(v, limit, out)
    elif isinstance(x, list) and len(x) > limit:
        out[len(x)] = out.get(len(x), 0) + 1


def _pick(n: int, limit: int, recent: int) -> tuple[list[int], int, int]:
    recent = min(recent, limit // 2)
    old = n - recent
    every = max(1, math.ceil(old / max(1, limit - recent)))
    return list(range(0, old, every)) + list(range(old, n)), every, recent


def _apply(x, picks: dict) -> None:
    if isinstance(x, dict):
        for k, v in x.items():
            if isinstance(v, list) and len(v) in picks:
                x[k] = [v[i] for i in picks[len(v)][0]]
            else:
                _apply(v, picks)


# --- rank × step tables ----------------------------------------------------------------------

def _scalar(x) -> bool:
    return x is None or (isinstance(x, (int, float)) and not isinstance(x, bool))


def _is_table(v) -> bool:
    """{rank: [number per step]}: more ranks than RANK_SERIES, series of one length whose
    entries are numbers or None (a series of pairs or records is no rank × step table)."""
    if not isinstance(v, dict) or len(v) <= RANK_SERIES:
        return False
    lens = set()
    for k, s in v.items():
        if not (isinstance(k, str) and k.isdigit() and isinstance(s, list)):
            return False
        if not all(_scalar(x) for x in s[:16]):
            return False
        lens.add(len(s))
    return len(lens) == 1


def _rank_tables(m: dict, named: list) -> bool:
    tables = [k for k, v in m.items() if _is_table(v)]
    if not tables:
        return False
    ranks = sorted({r for k in tables for r in m[k]}, key=int)
    score: dict[str, float] = {r: -math.inf for r in ranks}
    for k in tables:
        meds = {r: _median(s) for r, s in m[k].items()}
        ok = [v for v in meds.values() if v is not None]
        if not ok:
            continue
        mid = float(np.median(ok))
        scale = abs(mid) or max(abs(v) for v in ok) or 1.0
        for r, v in meds.items():
            if v is not None:
                score[r] = max(score[r], (v - mid) / scale)
    first = [str(r) for r in dict.fromkeys(named) if str(r) in score][:RANK_SERIES]
    rest = sorted((r for r in ranks if r not in first), key=lambda r: (-score[r], int(r)))
    kept = sorted(first + rest[:RANK_SERIES - len(first)], key=int)
    for k in tables:
        t = m[k]
        m[f"{k}_all_ranks"] = _envelope(list(t.values()))
        m[k] = {r: t[r] for r in kept if r in t}
    m["rank_series"] = {"ranks": len(ranks), "kept": [int(r) for r in kept],
                        "omitted": len(ranks) - len(kept), "tables": tables,
                        "chosen": "the ranks findings name, then the ranks whose median is "
                                  "furthest above all ranks' median; <table>_all_ranks: per step "
                                  "min / median / max over every rank"}
    return True


def _floats(s: list) -> np.ndarray:
    """A series as floats (None and non-numbers: NaN)."""
    try:
        return np.array(s, dtype=float)
    except (TypeError, ValueError):
        return np.array([x if isinstance(x, (int, float)) and not isinstance(x, bool) else np.nan
                         for x in s], float)


def _median(s: list) -> float | None:
    v = _floats(s)
    v = v[np.isfinite(v)]
    return float(np.median(v)) if v.size else None


def _envelope(series: list[list]) -> dict:
    a = np.stack([_floats(s) for s in series])
    out = {}
    with np.errstate(all="ignore"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            for name, fn in (("min", np.nanmin), ("median", np.nanmedian), ("max", np.nanmax)):
                col = fn(a, axis=0)
                out[name] = [None if not np.isfinite(v) else float(v) for v in col]
    return out


# --- long lists inside records ---------------------------------------------------------------

def _records(m: dict) -> bool:
    """Long lists inside the records of m's lists of records (per_rank[], ...)."""
    hit = False
    for v in m.values():
        if isinstance(v, list):
            for rec in v:
                if isinstance(rec, dict):
                    hit |= cut_lists(rec)
        elif isinstance(v, dict):
            hit |= _records(v)
    return hit


def cut_lists(rec: dict, limit: int = LIST_LIMIT) -> bool:
    """A record's lists of more than ``limit`` entries: the first LIST_KEEP, ``<key>_total``
    and for step numbers ``<key>_ranges`` (see the module doc). True when one was cut."""
    hit = False
    for k, v in list(rec.items()):
        if isinstance(v, list) and len(v) > limit:
            rec[k] = v[:LIST_KEEP]
            rec[f"{k}_total"] = len(v)
            if all(isinstance(x, int) and not isinstance(x, bool) for x in v):
                runs = _runs(v)
                rec[f"{k}_ranges"] = runs[:LIST_KEEP]
                if len(runs) > LIST_KEEP:
                    rec[f"{k}_ranges_total"] = len(runs)
            hit = True
    return hit


def _runs(steps: list[int]) -> list[list[int]]:
    out: list[list[int]] = []
    for x in sorted(set(steps)):
        if out and x == out[-1][1] + 1:
            out[-1][1] = x
        else:
            out.append([x, x])
    return out


def _round(x):
    if isinstance(x, float):
        return float(f"{x:.{FLOAT_DIGITS}g}") if math.isfinite(x) else x
    if isinstance(x, dict):
        return {k: _round(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_round(v) for v in x]
    return x


EVIDENCE_POINTS = LIST_KEEP


def bound_findings(findings: list[dict], limit: int = LIST_LIMIT, digits: bool = False) -> None:
    """A finding's evidence list of more than ``limit`` entries (the steps a chronic straggler
    was slow in, over a run of 100,000s of steps) keeps its first entries and says how many
    there were (``<key>_total``; step numbers also as ``<key>_ranges``); ``digits``: its
    floats to FLOAT_DIGITS significant digits (a bounded summary)."""
    for f in findings:
        ev = f.get("evidence")
        if isinstance(ev, dict):
            cut_lists(ev, limit)
            if digits:
                f["evidence"] = _round(ev)


def named_ranks(findings: list[dict]) -> list[int]:
    """The ranks findings name, warnings first (their order in the findings)."""
    out: list[int] = []
    for sev in ("error", "warning", "info"):
        for f in findings:
            if f.get("severity") == sev:
                out += [r for r in f.get("ranks") or [] if isinstance(r, int)]
    return list(dict.fromkeys(out))


def bounded(summary: dict) -> bool:
    """Whether any analyzer's metrics were bounded (summary.json is then written compact)."""
    return any(isinstance(m, dict) and ("series_resolution" in m or "rank_series" in m)
               for m in (summary.get("metrics") or {}).values())
