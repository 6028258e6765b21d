"""The statistics of `trainprof compare`: Mann–Whitney U over steps, the t-test over runs, the
Benjamini–Hochberg adjustment and the bootstrap CI of a median ratio."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

N_BOOT = 2000
CI_LEVEL = 0.95
SEED = 0


def mann_whitney_p(b, c) -> float:
    from scipy.stats import mannwhitneyu

    if np.ptp(np.concatenate([b, c])) == 0:
        return 1.0  # every sample equal: nothing to test
    p = float(mannwhitneyu(b, c, alternative="two-sided").pvalue)
    return p if math.isfinite(p) else 1.0


def se_df(xb: np.ndarray, xc: np.ndarray) -> tuple[float, float]:
    """Standard error and degrees of freedom of mean(xc) - mean(xb), as t_test uses them."""
    nb, nc = len(xb), len(xc)
    vb = float(xb.var(ddof=1)) if nb > 1 else 0.0
    vc = float(xc.var(ddof=1)) if nc > 1 else 0.0
    if nb > 1 and nc > 1:
        se2 = vb / nb + vc / nc
        denom = (vb / nb) ** 2 / (nb - 1) + (vc / nc) ** 2 / (nc - 1)
        df = se2 ** 2 / denom if denom > 0 else nb + nc - 2
    else:
        df = nb + nc - 2
        pooled = ((nb - 1) * vb + (nc - 1) * vc) / df if df > 0 else 0.0
        se2 = pooled * (1 / nb + 1 / nc)
    return math.sqrt(se2), float(df)


def t_test(xb, xc, level: float = CI_LEVEL) -> tuple[float, float, list[float]]:
    """Two-sample t-test (scipy.stats.ttest_ind): p-value, mean(xc) - mean(xb) and its CI.
    Welch's (unequal variances, Welch–Satterthwaite degrees of freedom) when both sides have ≥2
    values: a side whose runs scatter more — a load burst hitting some of them — is not judged by
    the other side's tighter spread. Student's pooled test when one side has a single value (its
    variance is unknown; needs ≥3 values in all). No spread at all: p = 1 if the means are
    equal, else 0 (scipy has no p-value there)."""
    from scipy.stats import ttest_ind

    xb, xc = np.asarray(xb, dtype=float), np.asarray(xc, dtype=float)
    d = float(xc.mean() - xb.mean())
    if se_df(xb, xc)[0] == 0:
        return (1.0 if d == 0 else 0.0), d, [d, d]
    res = ttest_ind(xc, xb, equal_var=not (len(xb) > 1 and len(xc) > 1))
    ci = res.confidence_interval(confidence_level=level)
    return float(res.pvalue), d, [float(ci.low), float(ci.high)]


def benjamini_hochberg(pvalues: Sequence[float]) -> list[float]:
    """Adjusted p-values (q-values) of the Benjamini–Hochberg step-up procedure
    (scipy.stats.false_discovery_control)."""
    from scipy.stats import false_discovery_control

    if not len(pvalues):
        return []
    return [float(q) for q in false_discovery_control(np.asarray(pvalues, dtype=float))]


def bootstrap_ratio_ci(base, cand, n_boot: int = N_BOOT, level: float = CI_LEVEL,
                       seed: int = SEED) -> list[float]:
    """Percentile bootstrap CI of median(cand) / median(base), resampling each side."""
    rng = np.random.default_rng(seed)
    b = np.asarray(base, dtype=float)
    c = np.asarray(cand, dtype=float)
    # chunks bound memory for long runs (n_boot × n indices at once would be GBs at 100k steps)
    chunk = max(1, min(n_boot, 2_000_000 // max(len(b), len(c), 1)))
    mb, mc = [], []
    for start in range(0, n_boot, chunk):
        k = min(chunk, n_boot - start)
        mb.append(np.median(b[rng.integers(0, len(b), (k, len(b)))], axis=1))
        mc.append(np.median(c[rng.integers(0, len(c), (k, len(c)))], axis=1))
    mb, mc = np.concatenate(mb), np.concatenate(mc)
    with np.errstate(divide="ignore", invalid="ignore"):
        r = mc / mb
    r = r[np.isfinite(r)]
    if not len(r):
        return [math.nan, math.nan]
    tail = (1 - level) / 2 * 100
    return [float(np.percentile(r, tail)), float(np.percentile(r, 100 - tail))]
