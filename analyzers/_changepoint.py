"""Change points in a per-step series: where its level shifts, found by binary segmentation on
the mean (Vostrikova 1981; the method `ruptures.Binseg` implements) made robust for step times
of a shared machine.

    y      = running median of x over MEDIAN_WIDTH steps: isolated slow steps (a GC pause, the
             scheduler) are removed while a lasting shift keeps its exact edge (a median filter
             preserves monotone edges)
    blocks = y averaged over blocks of B steps, B = ceil(n / MAX_POINTS): 100,000 steps cost
             the same as 4,096
    σ      = 1.4826 · median |b(i) − b(i−1)| / √2 over the blocks of the raw x: one block's
             noise from its step-to-step variation, so a level shift (one large difference)
             does not inflate it (the smoothed y's neighbours are correlated: its own
             differences would understate the noise)
    split  = the cut maximizing the CUSUM gain n₁n₂/n · (m₁ − m₂)² / σ², kept when the gain is
             over PENALTY · log(n) and both sides hold ≥ min_size blocks; each side is split again

A cut found on the blocks is refined at full resolution: within the block before and after it,
the step maximizing the same gain on y. Segments come back as (first step index, end index
exclusive, mean of the raw x over it). Pure numpy, O(n log n) for the segments of a series.
"""

from __future__ import annotations

import math

import numpy as np

MEDIAN_WIDTH = 5      # running median width (isolated slow steps removed, edges kept)
MAX_POINTS = 4096     # blocks at most: longer series are block-averaged first
PENALTY = 6.0         # a cut is kept when its gain is ≥ PENALTY · log(n) (BIC would be 2: CPU
                      # step times are not independent from step to step, so more is asked)
MAX_SEGMENTS = 64     # cuts at most per series


def running_median(x: np.ndarray, width: int = MEDIAN_WIDTH) -> np.ndarray:
    """Centred running median (edges padded with the end values)."""
    x = np.asarray(x, dtype=float)
    if x.size < width or width < 2:
        return x.copy()
    h = width // 2
    p = np.concatenate([np.full(h, x[0]), x, np.full(h, x[-1])])
    if width == 5:  # branch-free median of 5 (elementwise min/max: ~20× np.median's speed)
        a, b, c, d, e = (p[i:i + x.size] for i in range(5))
        f = np.maximum(np.minimum(a, b), np.minimum(c, d))  # the 2nd and 3rd of a..d
        g = np.minimum(np.maximum(a, b), np.maximum(c, d))
        lo, hi = np.minimum(f, g), np.maximum(f, g)
        return np.maximum(lo, np.minimum(e, hi))  # the median of those two and e
    win = np.lib.stride_tricks.sliding_window_view(p, width)
    return np.median(win, axis=1)


def noise(x: np.ndarray) -> float:
    """One point's noise from consecutive differences (robust to level shifts)."""
    d = np.abs(np.diff(np.asarray(x, dtype=float)))
    d = d[np.isfinite(d)]
    return 1.4826 * float(np.median(d)) / math.sqrt(2) if d.size else float("nan")


def _best_cut(c: np.ndarray, lo: int, hi: int, min_size: int) -> tuple[int, float]:
    """(cut, gain in squared units) of the best single mean shift in points [lo, hi), from the
    prefix sums ``c`` of x; (-1, 0) when too short."""
    n = hi - lo
    if n < 2 * min_size:
        return -1, 0.0
    k = np.arange(lo + min_size, hi - min_size + 1)
    n1 = (k - lo).astype(float)
    n2 = (hi - k).astype(float)
    s1 = c[k] - c[lo]
    s2 = c[hi] - c[k]
    gain = n1 * n2 / n * (s1 / n1 - s2 / n2) ** 2
    i = int(np.argmax(gain))
    return int(k[i]), float(gain[i])


def _binseg(b: np.ndarray, sigma: float, min_size: int, penalty: float) -> list[int]:
    """Cut indices into ``b`` (sorted), by binary segmentation."""
    c = np.concatenate([[0.0], np.cumsum(b)])
    thr = penalty * math.log(max(b.size, 2)) * sigma ** 2
    cuts: list[int] = []
    todo = [(0, b.size)]
    while todo and len(cuts) < MAX_SEGMENTS:
        lo, hi = todo.pop()
        k, g = _best_cut(c, lo, hi, min_size)
        if k < 0 or g < thr:
            continue
        cuts.append(k)
        todo += [(lo, k), (k, hi)]
    return sorted(cuts)


def segments(x, min_size: int = 5, penalty: float = PENALTY,
             sigma: float | None = None) -> tuple[list[tuple[int, int, float]], float]:
    """Segments of constant mean of ``x`` (NaNs filled by the previous value): ([(start, end,
    mean of x)], σ of one step of the smoothed series). One segment when there is no shift."""
    x = np.asarray(x, dtype=float)
    n = x.size
    if n == 0:
        return [], float("nan")
    if np.isnan(x).any():  # steps a rank did not log: carry the previous value
        idx = np.where(np.isnan(x), 0, np.arange(n))
        np.maximum.accumulate(idx, out=idx)
        x = x[idx]
        x = np.where(np.isnan(x), np.nanmedian(x) if np.isfinite(x).any() else 0.0, x)
    y = running_median(x)
    bsize = max(1, math.ceil(n / MAX_POINTS))
    nb = n // bsize
    b = y[:nb * bsize].reshape(nb, bsize).mean(axis=1) if nb else y[:0]
    # the noise of the raw series' blocks (the running median's neighbours are correlated:
    # its own differences would understate it and cut pure noise)
    bx = x[:nb * bsize].reshape(nb, bsize).mean(axis=1) if nb else x[:0]
    s = noise(bx) if sigma is None else sigma / math.sqrt(bsize)
    if not np.isfinite(s) or s <= 0:
        s = max(1e-9, 1e-6 * float(np.abs(b).max() if b.size else 1.0))
    cuts = _binseg(b, s, max(1, math.ceil(min_size / bsize)), penalty) if nb >= 2 else []
    full = [_refine(y, k * bsize, bsize) for k in cuts]
    edges = [0] + sorted(set(full)) + [n]
    out = [(a, e, float(np.mean(x[a:e]))) for a, e in zip(edges[:-1], edges[1:]) if e > a]
    return out, s * math.sqrt(bsize)


def _refine(y: np.ndarray, cut: int, bsize: int) -> int:
    """The step within one block of ``cut`` that maximizes the mean-shift gain of y between the
    neighbouring blocks (the cut itself at block size 1)."""
    if bsize == 1:
        return cut
    lo, hi = max(0, cut - 2 * bsize), min(y.size, cut + 2 * bsize)
    c = np.concatenate([[0.0], np.cumsum(y[lo:hi])])
    k, _ = _best_cut(c, 0, hi - lo, 1)
    return lo + k if k >= 0 else cut


def episodes(x, threshold: float, min_len: int, sigma: float | None = None,
             penalty: float = PENALTY) -> list[dict]:
    """Runs of consecutive segments whose mean is ≥ ``threshold`` and that span ≥ ``min_len``
    steps: [{"start", "end" (exclusive), "mean"}] (indices into x)."""
    segs, _ = segments(x, min_size=max(2, min_len // 2), penalty=penalty, sigma=sigma)
    x = np.asarray(x, dtype=float)
    out: list[dict] = []
    for a, e, m in segs:
        if m < threshold:
            continue
        if out and out[-1]["end"] == a:
            out[-1]["end"] = e
        else:
            out.append({"start": a, "end": e})
    res = []
    for ep in out:
        if ep["end"] - ep["start"] >= min_len:
            v = x[ep["start"]:ep["end"]]
            res.append({**ep, "mean": float(np.nanmean(v)), "median": float(np.nanmedian(v))})
    return res
