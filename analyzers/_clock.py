"""Clock alignment for analyzers: local epoch ns of a rank -> the reference rank's clock.

Reads each rank's clock.jsonl (probes/clock.py): ``offset_ns`` measured at ``t_ns`` (local) at
the start and at the end of the run. Between the two the offset is interpolated linearly (clock
drift); outside it is held at the nearest estimate. A rank with no estimate, and every rank on
the reference rank's host (one host has one wall clock, so a measured offset there is only
round-trip noise), gets the identity.
"""

from __future__ import annotations

from typing import Callable


def _identity(ns):
    return ns


def estimates(run) -> dict[int, list[tuple[int, float, float]]]:
    """rank -> [(t_ns, offset_ns, uncertainty_ns)] sorted by time (valid records only)."""
    out: dict[int, list] = {}
    for r in run.ranks:
        pts = []
        for i, rec in enumerate(run.stream(r, "clock")):
            try:
                pts.append((int(rec["t_ns"]), float(rec["offset_ns"]),
                            float(rec.get("uncertainty_ns") or 0.0)))
            except (KeyError, TypeError, ValueError):
                run.problems.append(f"{run.stream_path(r, 'clock')}: record {i + 1} lacks a "
                                    "numeric t_ns/offset_ns; clock estimate ignored")
        if pts:
            out[r] = sorted(pts)
    return out


def _linear(pts) -> Callable:
    (ta, oa, _), (tb, ob, _) = pts[0], pts[-1]
    if tb <= ta:
        return lambda ns: ns + round(oa)
    slope = (ob - oa) / (tb - ta)

    def align(ns):
        t = min(max(ns, ta), tb)
        return ns + round(oa + slope * (t - ta))

    return align


def offsets(run) -> dict[int, Callable]:
    """{rank: fn(local ns) -> aligned ns}; every rank of the run has an entry. Works on scalars
    and on numpy arrays / pandas Series of int64 ns."""
    key = "analyzers._clock.offsets"
    cache = getattr(run, "_cache", None)
    if cache is not None and key in cache:
        return cache[key]
    est = estimates(run)
    ref_rank = 0
    ref_host = run.rank_meta(ref_rank).get("host") if ref_rank in run.ranks else None
    out: dict[int, Callable] = {}
    for r in run.ranks:
        host = run.rank_meta(r).get("host")
        if r == ref_rank or r not in est or (ref_host is not None and host == ref_host):
            out[r] = _identity
        else:
            out[r] = _vectorized(_linear(est[r]), est[r])
    if cache is not None:
        cache[key] = out
    return out


def _vectorized(fn, pts):
    """The same mapping, accepting arrays too (np.clip instead of min/max)."""
    (ta, oa, _), (tb, ob, _) = pts[0], pts[-1]

    def align(ns):
        if isinstance(ns, (int, float)):
            return fn(ns)
        import numpy as np

        arr = np.asarray(ns, dtype=np.int64)
        if tb <= ta:
            off = np.full(arr.shape, oa)
        else:
            off = oa + (ob - oa) / (tb - ta) * (np.clip(arr, ta, tb) - ta)
        return arr + np.round(off).astype(np.int64)

    return align


def uncertainty_ns(run) -> dict[int, float]:
    """rank -> the worst uncertainty of its estimates (0 for identity-aligned ranks)."""
    est = estimates(run)
    return {r: max((u for _, _, u in est.get(r, [])), default=0.0) for r in run.ranks}
