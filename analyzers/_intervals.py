"""Interval arithmetic on numpy arrays of [start, end) ns: unions, intersections, differences.

Every set is kept as a sorted, disjoint (starts, ends) pair, so lengths are plain sums."""

from __future__ import annotations

import numpy as np

Set = tuple[np.ndarray, np.ndarray]
EMPTY: Set = (np.empty(0, np.int64), np.empty(0, np.int64))


def union(starts, ends) -> Set:
    s = np.asarray(starts, dtype=np.int64)
    e = np.asarray(ends, dtype=np.int64)
    keep = e > s
    s, e = s[keep], e[keep]
    if s.size == 0:
        return EMPTY
    order = np.argsort(s, kind="stable")
    s, e = s[order], e[order]
    run_end = np.maximum.accumulate(e)
    # a new disjoint piece starts where the start is past everything seen so far
    new = np.empty(s.size, dtype=bool)
    new[0] = True
    new[1:] = s[1:] > run_end[:-1]
    idx = np.flatnonzero(new)
    return s[idx], np.append(run_end[idx[1:] - 1], run_end[-1])


def length(a: Set) -> int:
    return int((a[1] - a[0]).sum())


def intersect(a: Set, b: Set) -> Set:
    if a[0].size == 0 or b[0].size == 0:
        return EMPTY
    # sweep over all boundaries: inside both when the coverage count is 2
    pts = np.concatenate([a[0], a[1], b[0], b[1]])
    delta = np.concatenate([np.ones(a[0].size), -np.ones(a[1].size),
                            np.ones(b[0].size), -np.ones(b[1].size)]).astype(np.int64)
    order = np.lexsort((delta, pts))  # ends before starts at equal points: [x, y) semantics
    pts, delta = pts[order], delta[order]
    cover = np.cumsum(delta)
    inside = cover == 2
    starts = pts[:-1][inside[:-1]]
    ends = pts[1:][inside[:-1]]
    return union(starts, ends)


def subtract(a: Set, b: Set) -> Set:
    """a minus b."""
    if a[0].size == 0 or b[0].size == 0:
        return a
    pts = np.concatenate([a[0], a[1], b[0], b[1]])
    da = np.concatenate([np.ones(a[0].size), -np.ones(a[1].size), np.zeros(2 * b[0].size)]).astype(np.int64)
    db = np.concatenate([np.zeros(2 * a[0].size), np.ones(b[0].size), -np.ones(b[1].size)]).astype(np.int64)
    order = np.argsort(pts, kind="stable")
    pts = pts[order]
    ca, cb = np.cumsum(da[order]), np.cumsum(db[order])
    inside = (ca > 0) & (cb == 0)
    return union(pts[:-1][inside[:-1]], pts[1:][inside[:-1]])


def clip(a: Set, lo: int, hi: int) -> Set:
    """a within [lo, hi). The pieces that reach into it are found by binary search (a set's
    starts and ends are both sorted): clipping to every profiled step costs steps x log(size),
    not steps x size."""
    i = int(np.searchsorted(a[1], lo, side="right"))
    j = int(np.searchsorted(a[0], hi, side="left"))
    s, e = np.maximum(a[0][i:j], lo), np.minimum(a[1][i:j], hi)
    keep = e > s
    return s[keep], e[keep]


def of(frame, mask=None) -> Set:
    """The union of the [ts_ns, end_ns) intervals of a Table's (or a pandas DataFrame's) rows,
    optionally of the rows in mask only."""
    s, e = np.asarray(frame["ts_ns"]), np.asarray(frame["end_ns"])
    if mask is not None:
        mask = np.asarray(mask)
        s, e = s[mask], e[mask]
    return union(s, e)
