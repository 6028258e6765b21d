"""The periodic search of the slow-steps analysis (analyzers/slow_steps.py), at any run length.

A class of steps s ≡ φ (mod P) is *slow* when it has at least ``min_n`` kept steps, at least
``min_n`` of them (and at least half) are *high* (≥ the threshold ``lo``) and none is *low*
(≤ the median m). Among all P in 2 … span // min_n and all φ, the class with the largest mean
excess (x − m) wins: the smallest P on a tie, then the smallest φ; then the smallest period
dividing P whose class holds the winner and whose other steps are slow too (``fundamental``). P is at most ``max_period``
(slow_steps.PERIODIC_MAX_STEPS): over a long run, three steps tens of thousands of steps apart
are not a period, and without the bound the classes that pass (a run slow for its first 80 %
has thousands of such "classes" of 3 to 6 steps) cost time quadratic in the run's length.

Trying every class of every P costs (number of steps) × (number of periods): minutes at
100,000 steps.
The same answer is found by ruling most periods out in bulk (numpy over every period at once),
then looking only at the classes that can still be slow:

- cut the steps t = s − s₀ into rows [kP, (k + 1)P): each row holds exactly one step of every
  class. A class has at most as many high steps as there are rows holding a high step, and at
  least (full rows − steps missing from the range) steps: a period whose rows cannot give any
  class ``min_n`` high steps, half of its steps, is ruled out; so is one with a full row of
  low steps only (every class has a low step there), and (with a few thousand high steps at
  most) one that divides fewer than 3 of the differences between two high steps (a class of
  c ≥ 3 high steps holds c(c − 1)/2 ≥ 3 such pairs);
- the classes left are those of the high steps seen ≥ ``min_n`` times, or of the not-low steps
  of the full row with the fewest of them (whichever is fewer); each is checked row after row
  for a low step, and the ones left are counted and their mean taken exactly as a bincount over
  the class would (the excess summed in step order).
"""

from __future__ import annotations

import numpy as np

ROWS_PER_CHUNK = 2_000_000  # rows (period, k) judged at once in the bulk pass: ~100 MB
SMALL_SPAN = 3000          # shorter runs: every class of every period in turn (milliseconds)
MAX_PAIRS_HIGH = 2000      # high steps whose pairwise differences are counted (4 M pairs)
LOCAL_K = 2.0              # a step of the fundamental's class is slow: ≥ 2 σ_d over its neighbours
LOCAL_SHARE = 0.25         # ... and ≥ 25 % of the periodic threshold's margin over the median
MIN_NOISE_PAIRS = 4        # σ_d from at least this many step-to-step differences


def slow_class(steps, x, edges, m: float, lo: float, min_n: int, max_period: int):
    """(P, φ, [steps of the class]) of the slow class with the largest mean excess, or of the
    fundamental period under it (``fundamental``), or None. ``steps`` ascending, ``x`` their
    values, ``edges`` steps never counted."""
    if len(steps) and int(steps[-1]) - int(steps[0]) + 1 <= SMALL_SPAN:
        best = reference(steps, x, edges, m, lo, min_n, max_period)
    else:
        best = _fast(steps, x, edges, m, lo, min_n, max_period)
    return None if best is None else fundamental(best, steps, x, edges, m, lo)


def fundamental(best, steps, x, edges, m: float, lo: float):
    """The smallest period d dividing the winning class's P whose class s ≡ φ (mod d) holds the
    winner and whose other steps are slow too, as (d, φ mod d, its steps); else ``best``.

    The largest mean excess prefers a sparser harmonic of the real period: checkpoints every 8
    steps that cost 600, 140, 180 ms at steps 8, 24, 40 and 70, 65, 280 ms at 16, 32, 48 make
    the class of every 16th step the one with the largest mean. A step of the class of d not in
    the winner's is slow too when it is over m and over its neighbours (the steps up to 2 away
    outside the class, edges excluded: their median) by ``LOCAL_K`` · σ_d, σ_d the step-to-step
    noise (1.4826 · median |x(s + 1) − x(s)| / √2 over the pairs outside the class), and at
    least ``LOCAL_SHARE`` of the periodic threshold's margin (lo − m). A typical step passes that
    by chance a few times in a hundred, so a true period of 16 is not reported as 8."""
    p, phi, members = best
    st = np.asarray(steps, dtype=np.int64)
    v = np.asarray(x, dtype=float)
    keep = ~np.isin(st, np.fromiter(edges, dtype=np.int64, count=len(edges)))
    st, v = st[keep], v[keep]
    won = np.isin(st, np.asarray(members, dtype=np.int64))
    for d in range(2, p):
        if p % d:
            continue
        cls = st % d == phi % d
        extra = cls & ~won
        if extra.any() and _all_slow(st, v, cls, extra, m, lo):
            return d, phi % d, [int(s) for s in st[cls]]
    return best


def _all_slow(st, v, cls, extra, m, lo) -> bool:
    """Every step of ``extra`` over m and over its neighbours outside ``cls`` by the margin."""
    if (v[extra] <= m).any():
        return False
    out = ~cls
    pair = (np.diff(st) == 1) & out[:-1] & out[1:]
    if int(pair.sum()) < MIN_NOISE_PAIRS:
        return False
    sigma_d = 1.4826 * float(np.median(np.abs(np.diff(v))[pair])) / np.sqrt(2)
    margin = max(LOCAL_K * sigma_d, LOCAL_SHARE * (lo - m))
    es = st[extra]
    near = np.full((es.size, 4), np.nan)
    for j, off in enumerate((-2, -1, 1, 2)):
        i = np.minimum(np.searchsorted(st, es + off), st.size - 1)
        ok = (st[i] == es + off) & out[i]
        near[ok, j] = v[i[ok]]
    if np.isnan(near).all(axis=1).any():
        return False
    return bool((v[extra] - np.nanmedian(near, axis=1) >= margin).all())


def _fast(steps, x, edges, m, lo, min_n, max_period):
    steps = np.asarray(steps, dtype=np.int64)
    x = np.asarray(x, dtype=float)
    keep = ~np.isin(steps, np.fromiter(edges, dtype=np.int64, count=len(edges)))
    st, v = steps[keep], x[keep]
    if st.size < min_n:
        return None
    span = int(steps[-1] - steps[0] + 1)
    pmax = min(span // min_n, max_period)
    if pmax < 2:
        return None
    T = int(st[-1] - st[0] + 1)
    if np.isnan(v).any() or (np.diff(st) <= 0).any() or T > 4 * st.size + 4096:
        # not step-ordered, sparse or NaN
        return reference(steps, x, edges, m, lo, min_n, max_period)
    base = int(st[0])
    pos = st - base
    L = T + pmax + 1  # a class's last row reaches past T: padding, neither present nor low
    pres = np.zeros(L, bool)
    pres[pos] = True
    blk = np.zeros(L, bool)
    blk[pos] = v <= m
    hi = np.zeros(L, bool)
    hi[pos] = v >= lo
    exd = np.zeros(L)
    exd[pos] = v - m
    hpos = np.flatnonzero(hi)
    if hpos.size < min_n:
        return None
    absent = T - int(st.size)
    ch = np.concatenate([[0], np.cumsum(hi[:T])])
    cnb = np.concatenate([[0], np.cumsum(~blk[:T])])
    pairs = None
    if hpos.size <= MAX_PAIRS_HIGH:  # pairs[d]: high steps d apart
        d = (hpos[None, :] - hpos[:, None])[np.triu_indices(hpos.size, 1)]
        pairs = np.bincount(d, minlength=T + pmax + 1)
        del d
    best = None
    for p, kmin, nbmin in _possible(T, pmax, min_n, absent, ch, cnb, pairs):
        got = _best_of(p, kmin, nbmin, T, base, pres, blk, hi, exd, hpos, min_n)
        if got is not None and (best is None or got[0] > best[0]):
            best = got
    return None if best is None else best[1:]


def _possible(T, pmax, min_n, absent, ch, cnb, pairs):
    """(P, its full row with the fewest not-low steps, that count) for every P a slow class may
    have: judged for every P at once, a chunk of periods at a time."""
    ps = np.arange(2, pmax + 1, dtype=np.int64)
    rows = -(-T // ps)
    ps, rows = ps[rows >= min_n], rows[rows >= min_n]  # fewer rows: no class has min_n steps
    i = 0
    while i < ps.size:
        j = i + max(1, int(np.searchsorted(np.cumsum(rows[i:]), ROWS_PER_CHUNK)))
        p, r = ps[i:j], rows[i:j]
        off = np.concatenate([[0], np.cumsum(r)[:-1]])
        pp = np.repeat(p, r)
        k = np.arange(int(r.sum()), dtype=np.int64) - np.repeat(off, r)
        a = k * pp
        b = np.minimum(a + pp, T)
        rows_hi = np.add.reduceat((ch[b] - ch[a]) > 0, off)
        full = T // p
        nb = np.where(b - a == pp, cnb[b] - cnb[a], T + 1)
        nb_min = np.minimum.reduceat(nb, off)
        ok = (rows_hi >= min_n) & (2 * rows_hi >= full - absent) & (nb_min > 0)
        if pairs is not None:  # high steps a multiple of P apart: (k + 1) P < T + P
            ok &= np.add.reduceat(pairs[(k + 1) * pp], off) >= min_n * (min_n - 1) // 2
        for q in np.flatnonzero(ok):
            yield int(p[q]), int(np.argmin(nb[off[q]:off[q] + r[q]])), int(nb_min[q])
        i = j


def _best_of(p, kmin, nbmin, T, base, pres, blk, hi, exd, hpos, min_n):
    """(mean excess, P, φ, steps) of P's slow class with the largest mean excess, or None."""
    if hpos.size <= nbmin or nbmin > T:  # the high steps' classes seen min_n times
        r, cnt = np.unique(hpos % p, return_counts=True)
        cands = r[cnt >= min_n]
    else:  # the not-low steps of the row with the fewest
        cands = np.flatnonzero(~blk[kmin * p:(kmin + 1) * p])
    if not cands.size:
        return None
    rows = np.arange(-(-T // p), dtype=np.int64) * p
    step = max(1, 65536 // cands.size)
    for j in range(0, rows.size, step):  # drop a class at its first low step
        cands = cands[~blk[cands[:, None] + rows[None, j:j + step]].any(axis=1)]
        if not cands.size:
            return None
        step = max(1, 65536 // cands.size)
    idx = cands[:, None] + rows[None, :]
    n = pres[idx].sum(axis=1)
    h = hi[idx].sum(axis=1)
    ok = (n >= min_n) & (h >= min_n) & (2 * h >= n)
    if not ok.any():
        return None
    idx, n = idx[ok], n[ok]
    mean = np.cumsum(exd[idx], axis=1)[:, -1] / np.maximum(n, 1)  # summed in step order
    phi = (cands[ok] + base) % p
    order = np.argsort(phi, kind="stable")
    i = int(order[np.argmax(mean[order])])
    return float(mean[i]), p, int(phi[i]), [int(s) + base for s in idx[i][pres[idx[i]]]]


def reference(steps, x, edges, m: float, lo: float, min_n: int, max_period: int):
    """The same search, every class of every period in turn (short or irregular series)."""
    keep = np.array([s not in edges for s in steps], dtype=bool)
    st, v = np.asarray(steps, dtype=np.int64)[keep], np.asarray(x, dtype=float)[keep]
    if st.size < min_n:
        return None
    high, low, ex = (v >= lo).astype(float), (v <= m).astype(float), v - m
    span = int(steps[-1] - steps[0] + 1)
    best = None
    for p in range(2, min(span // min_n, max_period) + 1):
        cls = st % p
        n = np.bincount(cls, minlength=p)
        h = np.bincount(cls, weights=high, minlength=p)
        ok = (n >= min_n) & (h >= min_n) & (2 * h >= n) \
            & (np.bincount(cls, weights=low, minlength=p) == 0)
        if not ok.any():
            continue
        mean = np.bincount(cls, weights=ex, minlength=p) / np.maximum(n, 1)
        phi = int(np.flatnonzero(ok)[np.argmax(mean[ok])])
        if best is None or mean[phi] > best[0]:
            best = (float(mean[phi]), p, phi, [int(s) for s in st[cls == phi]])
    return None if best is None else best[1:]
