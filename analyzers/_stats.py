"""np.median and np.percentile (linear interpolation) without their first call's import of
numpy.ma (tens of ms of a traces-only analysis that otherwise imports nothing it does not use).
Same float arithmetic as numpy's: tests/unit/trainprof/test_launch.py checks them against numpy."""

from __future__ import annotations

import numpy as np


def median(values, axis: int | None = None):
    """np.median(values, axis): the middle value, or the mean of the two middle values, of the
    sorted data (NaN where the data holds a NaN, as numpy's; NaN for no data)."""
    a = np.asarray(values, dtype=np.float64)
    if axis is None:
        a, axis = a.ravel(), 0
    n = a.shape[axis]
    if n == 0:
        out = np.full(a.shape[:axis] + a.shape[axis + 1:], np.nan)
        return out if out.ndim else float("nan")
    s = np.sort(a, axis=axis)
    hi = s.take(n // 2, axis=axis)
    m = hi if n % 2 else (s.take(n // 2 - 1, axis=axis) + hi) / 2.0
    m = np.where(np.isnan(s).any(axis=axis), np.nan, m)  # np.sort puts NaN last, numpy says NaN
    return m if m.ndim else float(m)


def percentiles(values, qs) -> list[float]:
    """np.percentile(values, qs) (its default, linear interpolation, the same float arithmetic)."""
    a = np.sort(np.asarray(values, dtype=np.float64))
    n, out = len(a), []
    for q in qs:
        vi = (n - 1) * (q / 100)
        lo = int(np.floor(vi))
        hi, t = min(lo + 1, n - 1), vi - lo
        d = a[hi] - a[lo]
        out.append(float(a[hi] - d * (1 - t) if t >= 0.5 else a[lo] + d * t))
    return out
