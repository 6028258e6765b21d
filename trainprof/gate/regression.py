"""Regression decisions between two sets of runs (`trainprof compare`). Pure: no I/O.

Each side is one or more runs (summary.json dicts). A metric is *sampled* (one sample per analysed
step: step time, throughput, MFU, pipeline bubble) or a *value* (one number per run: exposed
communication over the profiled window, MFU of a run without per-step data, peak memory per rank,
the busiest rank's CPU time per step, any dotted number).

The test depends on how many runs there are:
- one run per side: sampled metrics go through a two-sided Mann–Whitney U test over the steps,
  with a bootstrap CI of the median ratio. Steps of one run share the host's state, so this sees
  within-run noise only; values have no test at all (an explicit threshold only).
- three or more runs, at least two on one side: the run is the unit. A t-test on the per-run
  medians (values: the per-run values; Welch's when both sides have ≥2 runs), on the log scale
  when the threshold is relative, so the between-run variation is the error term (as in the
  nested-ANOVA test of a fixed effect with runs as a random factor).
A regression needs run-to-run noise seen on both sides: with a single run on a side (one run
each, or one candidate run against a history) a significant slowdown says only that the runs
differ — inconclusive (DIFFERS). One run can be hit by a neighbour's load burst as a whole.

A metric regresses only when its change is significant AND beyond its threshold in the bad
direction (sampled metrics: the minimum effect unless set explicitly). Step time, throughput,
MFU and CPU time per step gate by default (CPU time only when every run has it, and with ≥3 runs in
all: it is one measured number per run, so a single run per side has no noise estimate); bubble, exposed communication and peak memory are informational unless the
user sets a threshold for them. The p-values of the gated metrics are adjusted together with
Benjamini–Hochberg: when nothing changed (A/A) the false-discovery rate is the chance of any false
alarm, so identical code fails with probability ≤ alpha however many metrics are gated (for
independent or positively dependent tests, which per-step metrics of the same runs are).
Insufficient data (a run with fewer than MIN_STEPS analysed steps, ranks missing, a metric absent
from some runs) is inconclusive, never a regression.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

MIN_STEPS = 6
MIN_SAMPLES = MIN_STEPS
DEFAULT_ALPHA = 0.01
DEFAULT_MIN_EFFECT = 0.05
N_BOOT = 2000
CI_LEVEL = 0.95
SEED = 0

# verdicts; the exit code is decided from them (see overall_verdict)
REGRESSION, IMPROVEMENT, UNCHANGED, INSUFFICIENT, MISSING, DIFFERS = (
    "regression", "improvement", "unchanged", "insufficient data", "missing", "runs differ")
INCONCLUSIVE = (INSUFFICIENT, MISSING, DIFFERS)
TEST_STEPS, TEST_RUNS, TEST_THRESHOLD = "U over steps", "t over runs", "threshold only"


class ThresholdError(ValueError):
    pass


@dataclass(frozen=True)
class Threshold:
    """Fail when the metric moves in the bad `direction` (+1: increase is bad, -1: decrease is
    bad) by more than `value`: relative (fraction of the baseline) or absolute (metric units)."""

    direction: int
    value: float
    relative: bool = True

    def describe(self, unit: str = "") -> str:
        sign = "+" if self.direction > 0 else "-"
        if self.relative:
            return f"{sign}{self.value * 100:g}%"
        if unit == "fraction":
            return f"{sign}{self.value * 100:g}pp"
        return f"{sign}{self.value:g}" + (f" {unit}" if unit in ("ms",) else "")


_UNITS = {"pp": 0.01, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "kib": 2**10, "mib": 2**20,
          "gib": 2**30, "tib": 2**40, "ms": 1.0, "s": 1e3}
_THRESH = re.compile(r"^\s*([+-]?)\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z%]*)\s*$")


def parse_threshold(text: str, default_direction: int) -> Threshold:
    """'+5%' (relative), '-3%', '5%' (the metric's own bad direction), '+2pp' (absolute, for
    fractions: 2 percentage points), '+512MiB', '+0.02' (absolute, in the metric's units)."""
    m = _THRESH.match(str(text))
    if not m:
        raise ThresholdError(f"bad threshold {text!r}: expected e.g. +5%, -3%, +2pp, +512MiB")
    sign, num, unit = m.groups()
    direction = {"+": 1, "-": -1}.get(sign, default_direction)
    value = float(num)
    unit_l = unit.lower()
    if unit_l == "%":
        return Threshold(direction, value / 100.0, True)
    if unit_l and unit_l not in _UNITS:
        raise ThresholdError(f"bad threshold {text!r}: unknown unit {unit!r} "
                             f"(use %, pp, B/KiB/MiB/GiB, ms, s or none)")
    return Threshold(direction, value * _UNITS.get(unit_l, 1.0), False)


@dataclass
class Comparison:
    metric: str
    label: str
    unit: str
    kind: str  # "sampled" | "value"
    verdict: str
    baseline: float | None = None  # sampled: the median (several runs: mean of the run medians)
    candidate: float | None = None
    ratio: float | None = None  # candidate / baseline
    change: float | None = None  # candidate / baseline - 1
    threshold: str | None = None
    direction: int = 1
    p_value: float | None = None  # the test's own p-value
    p_adjusted: float | None = None  # Benjamini–Hochberg over the gated metrics
    ci: list[float] | None = None  # CI of the ratio
    n: list[int] | None = None  # samples per side
    runs: list[int] | None = None  # runs per side
    test: str | None = None  # TEST_STEPS | TEST_RUNS | TEST_THRESHOLD
    detail: str = ""
    gate: bool = True  # False: shown, never fails
    moved: str | None = None  # the threshold's decision on the point estimates alone
    reason: str = ""  # why the verdict is not `moved` (not significant, within the threshold)
    se: float | None = None  # standard error of the tested difference (log scale when log_scale)
    df: float | None = None  # its degrees of freedom
    log_scale: bool = False
    underpowered: bool = False  # moved beyond its threshold the bad way, but not significant
    mde: float | None = None  # smallest relative change detectable at α with POWER (underpowered)

    def to_dict(self) -> dict:
        return asdict(self)


# --- statistics ---------------------------------------------------------------------------------

def mann_whitney_p(b, c) -> float:
    from scipy.stats import mannwhitneyu

    if np.ptp(np.concatenate([b, c])) == 0:
        return 1.0  # every sample equal: nothing to test
    p = float(mannwhitneyu(b, c, alternative="two-sided").pvalue)
    return p if math.isfinite(p) else 1.0


def _se_df(xb: np.ndarray, xc: np.ndarray) -> tuple[float, float]:
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
    if _se_df(xb, xc)[0] == 0:
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


# --- decisions ----------------------------------------------------------------------------------

def _exp(x: float) -> float:
    """math.exp, inf past the largest float (a CI bound of runs near 1e308) instead of raising."""
    return math.exp(x) if x < 709.7 else math.inf


def _ratio(b, c):
    if b is None or c is None:
        return None, None
    if b == 0:
        return (None, None) if c != 0 else (1.0, 0.0)
    return c / b, c / b - 1.0


class UntrustedValue(ThresholdError):
    """A value a relative threshold cannot judge (negative, or not a finite number): input the
    gate cannot trust (exit 2), never a pass."""


def _exceeds(th: Threshold, base: float, cand: float, direction: int) -> bool:
    """Did the metric move by more than the threshold in `direction`? From a baseline of 0 a
    relative threshold is exceeded by any move: the relative change is infinite."""
    delta = (cand - base) * direction
    if th.relative:
        return delta > 0 if base == 0 else delta / abs(base) > th.value
    return delta > th.value


def _decide(th: Threshold, base: float, cand: float, metric: str = "") -> str:
    if th.relative:  # the built-in metrics are times, sizes, rates, fractions: never below 0
        floor = 0 if metric in BUILTIN else -math.inf
        bad = [f"{side} {v!r}" for side, v in (("baseline", base), ("candidate", cand))
               if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= floor)]
        if bad:
            raise UntrustedValue(f"{metric or 'a metric'}: {' and '.join(bad)} cannot be judged by a "
                                 f"relative threshold ({th.describe()}): a damaged or foreign "
                                 f"summary.json? refused")
    if _exceeds(th, base, cand, th.direction):
        return REGRESSION
    if _exceeds(th, base, cand, -th.direction):
        return IMPROVEMENT
    return UNCHANGED


POWER = 0.8  # the power at which min_detectable_change is stated


def min_detectable_change(out: Comparison, alpha: float, power: float = POWER) -> float | None:
    """The smallest relative change the test would find significant at `alpha` with `power`
    at the noise it measured: (t(1-α/2) + t(power)) standard errors of the difference, as a
    fraction of the baseline (log scale: exp(·) - 1). None without a standard error."""
    from scipy.stats import t as t_dist

    if not out.se or not out.df or out.df <= 0 or not math.isfinite(out.se):
        return None
    k = float(t_dist.ppf(1 - alpha / 2, out.df) + t_dist.ppf(power, out.df))
    if out.log_scale:
        return math.expm1(k * out.se)
    return k * out.se / abs(out.baseline) if out.baseline else None


def _runs_text(out: Comparison) -> str:
    if not out.runs:
        return ""
    b, c = out.runs
    return f" with {c} candidate vs {b} baseline run{'s' * (b != 1)}"


def settle(out: Comparison, alpha: float) -> Comparison:
    """The verdict from `moved` and the (adjusted, when set) p-value: a move beyond the threshold
    counts only when significant; with a single run on a side, a significant regression only says
    that the runs differ (inconclusive). Insufficient or missing data stays. A move beyond the
    threshold the bad way that is not significant stays unchanged but is marked `underpowered`,
    with the smallest change the gate could detect at this noise (`mde`)."""
    out.underpowered, out.mde = False, None
    if out.verdict in (INSUFFICIENT, MISSING) or out.moved is None:
        return out
    p = out.p_adjusted if out.p_adjusted is not None else out.p_value
    if p is None:  # one value per side: the threshold alone
        out.verdict = out.moved
        return out
    which = "adjusted p" if out.p_adjusted is not None else "p"
    out.reason = ""
    if out.moved == REGRESSION and p >= alpha:
        out.verdict, out.underpowered = UNCHANGED, True
        out.mde = min_detectable_change(out, alpha)
        out.reason = (f"moved {_pct(out.change)} but not significant{_runs_text(out)} "
                      f"({which}={p:.3g} ≥ α={alpha:g})")
        if out.mde is not None:
            out.reason += (f"; the smallest change this gate can detect at this noise is "
                           f"~{out.mde * 100:.0f}%")
        out.reason += "; add runs"
    elif out.moved != UNCHANGED and p >= alpha:
        out.verdict = UNCHANGED
        out.reason = f"moved {_pct(out.change)} but not significant ({which}={p:.3g} ≥ α={alpha:g})"
    elif out.moved == UNCHANGED and p < alpha:
        out.verdict = UNCHANGED
        out.reason = f"significant ({which}={p:.3g}) but within {out.threshold}"
    elif out.moved == REGRESSION and _single_run(out):
        what, single = _single_run(out)
        out.verdict = DIFFERS
        out.reason = (f"{what} ({_pct(out.change)}, {which}={p:.3g}), but {single} cannot tell a "
                      f"code change from run-to-run noise (one run's load, host state): compare ≥2 "
                      f"runs per side (3 recommended), or ≥2 candidate runs with --baseline-dir")
    else:
        out.verdict = out.moved
        if out.moved == IMPROVEMENT and _single_run(out):
            out.reason = f"{_single_run(out)[1]}: may be run-to-run noise"
    return out


def _single_run(out: Comparison) -> tuple[str, str] | None:
    """A regression needs run-to-run noise seen on both sides (≥2 runs each): (what differs,
    which side has a single run) when a side has one run, else None."""
    if out.test not in (TEST_STEPS, TEST_RUNS) or not out.runs:
        return None
    if out.runs[0] == 1 and out.runs[1] == 1:
        return "the two runs differ", "one run per side"
    if out.runs[1] == 1:
        return "the candidate run differs from the baseline runs", "a single candidate run"
    if out.runs[0] == 1:
        return "the candidate runs differ from the baseline run", "a single baseline run"
    return None


def _as_runs(x) -> list[list[float]]:
    """A flat list of numbers is one run; a list of lists is one list per run."""
    x = list(x) if x is not None else []
    if x and all(isinstance(r, (list, tuple, np.ndarray)) for r in x):
        return [[float(v) for v in r if _finite(v)] for r in x]
    return [[float(v) for v in x if _finite(v)]]


def compare_samples(metric: str, base, cand, threshold: Threshold, alpha: float = DEFAULT_ALPHA,
                    label: str | None = None, unit: str = "", min_samples: int = MIN_STEPS,
                    seed: int = SEED, gate: bool = True) -> Comparison:
    """Per-step samples; `base`/`cand` are one list of samples or one list per run."""
    rb, rc = _as_runs(base), _as_runs(cand)
    out = Comparison(metric, label or metric, unit, "sampled", UNCHANGED,
                     n=[sum(map(len, rb)), sum(map(len, rc))], runs=[len(rb), len(rc)],
                     threshold=threshold.describe(unit), direction=threshold.direction, gate=gate)
    if len(rb) == 1 and len(rc) == 1:
        b, c = np.asarray(rb[0]), np.asarray(rc[0])
        if len(b):
            out.baseline = float(np.median(b))
        if len(c):
            out.candidate = float(np.median(c))
        out.ratio, out.change = _ratio(out.baseline, out.candidate)
        if len(b) < min_samples or len(c) < min_samples:
            out.verdict = INSUFFICIENT
            out.detail = f"need ≥{min_samples} samples per side, have {len(b)} and {len(c)}"
            return out
        out.test = TEST_STEPS
        out.p_value = mann_whitney_p(b, c)
        out.ci = bootstrap_ratio_ci(b, c, seed=seed)
        if threshold.relative and min(b.min(), c.min()) > 0:  # the noise, for the power statement
            out.se, out.df = _se_df(np.log(b), np.log(c))
            out.log_scale = True
    else:
        short = [f"{side} run {i + 1} has {len(r)}" for side, runs in (("baseline", rb), ("candidate", rc))
                 for i, r in enumerate(runs) if len(r) < min_samples]
        if short:
            out.verdict = INSUFFICIENT
            out.detail = f"need ≥{min_samples} samples per run: " + ", ".join(short)
            return out
        _runs_test(out, [float(np.median(r)) for r in rb], [float(np.median(r)) for r in rc], threshold)
    out.moved = _decide(threshold, out.baseline, out.candidate, metric)
    return settle(out, alpha)


def _runs_test(out: Comparison, vb: list[float], vc: list[float], threshold: Threshold) -> None:
    """t-test over per-run numbers; log scale (ratio of geometric means) for relative thresholds."""
    log = threshold.relative and min(vb + vc) > 0
    xb, xc = (np.log(vb), np.log(vc)) if log else (np.asarray(vb), np.asarray(vc))
    p, d, (lo, hi) = t_test(xb, xc)
    out.test, out.p_value = TEST_RUNS, p
    out.se, out.df = _se_df(np.asarray(xb, dtype=float), np.asarray(xc, dtype=float))
    out.log_scale = bool(log)
    if log:
        out.baseline, out.candidate = float(np.exp(xb.mean())), float(np.exp(xc.mean()))
        out.ci = [_exp(lo), _exp(hi)]
    else:
        out.baseline, out.candidate = float(xb.mean()), float(xc.mean())
        if out.baseline:
            out.ci = [1 + lo / out.baseline, 1 + hi / out.baseline]
    out.ratio, out.change = _ratio(out.baseline, out.candidate)


def compare_values(metric: str, base, cand, threshold: Threshold | None, label: str | None = None,
                   unit: str = "", detail: str = "", gate: bool | None = None,
                   alpha: float = DEFAULT_ALPHA) -> Comparison:
    """One value per run; `base`/`cand` are a number or a list of numbers (one per run). With a
    single run on a side the threshold decides alone (on the means); with ≥2 runs per side a
    t-test over the runs must agree. No threshold: shown, never gated."""
    vb = list(base) if isinstance(base, (list, tuple)) else [base]
    vc = list(cand) if isinstance(cand, (list, tuple)) else [cand]
    out = Comparison(metric, label or metric, unit, "value", UNCHANGED, detail=detail,
                     threshold=threshold.describe(unit) if threshold else None, runs=[len(vb), len(vc)],
                     direction=threshold.direction if threshold else 0,
                     gate=(threshold is not None) if gate is None else gate)
    missing = [side for side, v in (("baseline", vb), ("candidate", vc)) if any(_float(x) is None for x in v)]
    if missing:
        if len(vb) == 1 and len(vc) == 1:
            out.baseline, out.candidate = _float(vb[0]), _float(vc[0])
        out.verdict, out.detail = MISSING, _join(detail, f"not in {' and '.join(missing)}"
                                                 + ("" if len(vb) + len(vc) == 2 else " (every run)"))
        return out
    vb, vc = [float(x) for x in vb], [float(x) for x in vc]
    if min(len(vb), len(vc)) == 1:  # no spread on one side: the threshold alone (on the means)
        out.baseline, out.candidate = float(np.mean(vb)), float(np.mean(vc))
        out.ratio, out.change = _ratio(out.baseline, out.candidate)
        out.test = TEST_THRESHOLD
    else:
        _runs_test(out, vb, vc, threshold or Threshold(+1, 0.0))
    if threshold is not None:
        out.moved = _decide(threshold, out.baseline, out.candidate, metric)
        settle(out, alpha)
    return out


def compare_run_values(metric: str, base: Sequence[float], cand: Sequence[float], threshold: Threshold,
                       alpha: float = DEFAULT_ALPHA, label: str | None = None, unit: str = "",
                       gate: bool = True) -> Comparison:
    """One measured number per run (not per step), gated like a sampled metric over runs: the
    t-test over the runs (log scale for relative thresholds); a single run on a side can only
    say that the runs differ. One run each: no spread to test against, so shown, never gated."""
    vb, vc = [float(v) for v in base], [float(v) for v in cand]
    out = Comparison(metric, label or metric, unit, "value", UNCHANGED, runs=[len(vb), len(vc)],
                     threshold=threshold.describe(unit),
                     direction=threshold.direction, gate=gate)
    if len(vb) + len(vc) < 3:
        out.baseline, out.candidate = float(np.mean(vb)), float(np.mean(vc))
        out.ratio, out.change = _ratio(out.baseline, out.candidate)
        out.test, out.gate = TEST_THRESHOLD, False
        out.verdict = _decide(threshold, out.baseline, out.candidate, metric)
        out.detail = "one number per run: gated with ≥3 runs in all (a t-test over the runs)"
        return out
    _runs_test(out, vb, vc, threshold)
    out.moved = _decide(threshold, out.baseline, out.candidate, metric)
    return settle(out, alpha)


def compare_per_rank(metric: str, base, cand, threshold: Threshold, label: str | None = None,
                     unit: str = "", gate: bool | None = None, alpha: float = DEFAULT_ALPHA) -> Comparison:
    """{rank: value} per run (one mapping, or a list with one per run) on both sides: the rank
    that moved most in the bad direction decides. Ranks missing from some run: inconclusive."""
    rb = [base] if isinstance(base, Mapping) else list(base)
    rc = [cand] if isinstance(cand, Mapping) else list(cand)
    all_runs = rb + rc
    ranks = [set(r) for r in all_runs]
    common = sorted(set.intersection(*ranks) if ranks else set(), key=lambda r: (len(str(r)), str(r)))
    union = set.union(*ranks) if ranks else set()
    if not common or union != set(common):
        out = compare_values(metric, [max(r.values()) if r else None for r in rb],
                             [max(r.values()) if r else None for r in rc], threshold, label, unit,
                             gate=gate, alpha=alpha)
        if not any(ranks):
            return out
        out.verdict = MISSING
        out.detail = (f"ranks not in every run: {sorted(union - set(common), key=str)}" if common
                      else "no rank present in every run")
        return out

    def mean(runs, r):
        return float(np.mean([float(x[r]) for x in runs]))

    def badness(r):
        b, c = mean(rb, r), mean(rc, r)
        d = (c - b) * threshold.direction
        return d / abs(b) if threshold.relative and b else d

    worst = max(common, key=badness)
    out = compare_values(metric, [x[worst] for x in rb], [x[worst] for x in rc], threshold, label,
                         unit, gate=gate, alpha=alpha)
    if out.p_value is not None and len(common) > 1:
        out.p_value = min(1.0, out.p_value * len(common))  # Bonferroni: the worst of N ranks was picked
        settle(out, alpha)
    out.detail = f"rank {worst} (worst of {len(common)} ranks)"
    return out


# sampled metrics that are step time in other units (tokens ÷ step time; model FLOPs ÷ (step time
# × a common peak)): the same samples, so the same test — one hypothesis in the family
SAME_TEST = {"throughput": "step_time", "mfu": "step_time"}


def adjust(results: list[Comparison], alpha: float) -> None:
    """Benjamini–Hochberg over the gated metrics that have a p-value; verdicts re-settled.
    Throughput and MFU per step count as one hypothesis with step time (SAME_TEST): counting
    one test three times would only make the other metrics harder to find. Each member's
    adjusted p-value is its own p-value scaled as its hypothesis's smallest one was."""
    family = [r for r in results if r.gate and r.p_value is not None and r.verdict not in (INSUFFICIENT, MISSING)]
    groups: dict[str, list[Comparison]] = {}
    for r in family:
        key = SAME_TEST.get(r.metric, r.metric) if r.kind == "sampled" else r.metric
        groups.setdefault(key, []).append(r)
    lowest = [min(r.p_value for r in members) for members in groups.values()]
    for members, p, q in zip(groups.values(), lowest, benjamini_hochberg(lowest)):
        for r in members:
            r.p_adjusted = min(1.0, r.p_value * q / p) if p > 0 else (q if r.p_value == 0 else
                                                                      min(1.0, r.p_value * len(groups)))
            settle(r, alpha)


def overall_verdict(results: list[Comparison]) -> tuple[int, str]:
    """Exit code and word: 1 any gated regression, else 3 anything gated inconclusive, else 0."""
    gated = [r for r in results if r.gate]
    if any(r.verdict == REGRESSION for r in gated):
        return 1, "regression"
    if any(r.verdict in INCONCLUSIVE for r in gated):
        return 3, "inconclusive"
    return 0, "pass"


# --- reading metrics out of a summary -------------------------------------------------------

def get_path(summary: Mapping, dotted: str):
    """summary['a']['b'][0]... for 'a.b.0'; None if any part is missing."""
    cur = summary
    for part in dotted.split("."):
        if isinstance(cur, Mapping):
            if part not in cur:
                return None
            cur = cur[part]
        elif isinstance(cur, list):
            try:
                cur = cur[int(part)]
            except (ValueError, IndexError):
                return None
        else:
            return None
    return cur


def first_path(summary: Mapping, *paths: str):
    for p in paths:
        v = get_path(summary, p)
        if v is not None:
            return v
    return None


def step_samples(summary: Mapping) -> list[float]:
    """The job's step time per analysed step (slowest rank): metrics.step_time.per_step[].max_ms,
    else the per-step maximum of step_ms_by_rank without the excluded steps."""
    st = get_path(summary, "metrics.step_time") or {}
    per_step = st.get("per_step") if isinstance(st, Mapping) else None
    if isinstance(per_step, list) and per_step:
        return [float(p["max_ms"]) for p in per_step if isinstance(p, Mapping) and _finite(p.get("max_ms"))]
    by_rank = st.get("step_ms_by_rank") if isinstance(st, Mapping) else None
    if not isinstance(by_rank, Mapping) or not by_rank:
        return []
    first = int(st.get("first_step") or 0)
    excluded = {s for v in (st.get("excluded_steps") or {}).values() if isinstance(v, list) for s in v}
    rows = [v for v in by_rank.values() if isinstance(v, list)]
    out = []
    for i in range(max((len(v) for v in rows), default=0)):
        vals = [v[i] for v in rows if i < len(v) and _finite(v[i])]
        if vals and first + i not in excluded:
            out.append(float(max(vals)))
    return out


def throughput_samples(summary: Mapping) -> list[float]:
    tokens = first_path(summary, "metrics.step_time.job.tokens_per_step", "run.run_info.tokens_per_step")
    if not _finite(tokens) or float(tokens) <= 0:
        return []
    return [float(tokens) / s for ms in step_samples(summary) if (s := ms / 1e3) > 0
            and math.isfinite(float(tokens) / s)]


def mfu_samples(summary: Mapping) -> list[float]:
    """MFU per analysed step (metrics.roofline.per_step[].mfu, or .job.per_step)."""
    per_step = first_path(summary, "metrics.roofline.per_step", "metrics.roofline.job.per_step")
    if not isinstance(per_step, list):
        return []
    return [float(p["mfu"]) for p in per_step if isinstance(p, Mapping) and _finite(p.get("mfu"))]


def mfu_peak(summary: Mapping) -> tuple[float | None, bool, str | None]:
    """(Σ peak FLOP/s the run's MFU divides by, whether it was calibrated on the host, dtype)."""
    total = first_path(summary, "metrics.roofline.job.peak_flops_per_s_total",
                       "metrics.roofline.peak_flops_per_s_total")
    basis = first_path(summary, "metrics.roofline.peak.basis") or ""
    dtype = first_path(summary, "metrics.roofline.peak.dtype", "metrics.roofline.compute_dtype")
    return _float(total), isinstance(basis, str) and basis.startswith("calibration"), dtype


def bubble_samples(summary: Mapping) -> list[float]:
    """Pipeline bubble fraction per analysed step (metrics.pipeline.bubble_fraction_by_step)."""
    by_step = get_path(summary, "metrics.pipeline.bubble_fraction_by_step")
    if not isinstance(by_step, Mapping):
        return []
    items = sorted(((int(k), v) for k, v in by_step.items() if str(k).lstrip("-").isdigit()),
                   key=lambda kv: kv[0])
    return [float(v) for _, v in items if _finite(v)]


def cpu_time_value(summary: Mapping) -> float | None:
    """CPU time per step of the busiest rank's training thread: the largest of
    metrics.stragglers.per_rank[].cpu_ms (each rank's median over the analysed steps of the
    steps stream's `cpu_ms`). None when a rank lacks it (probes without scheduler statistics)."""
    rows = get_path(summary, "metrics.stragglers.per_rank")
    if not isinstance(rows, list) or not rows:
        return None
    vals = [r.get("cpu_ms") if isinstance(r, Mapping) else None for r in rows]
    if not all(_finite(v) and v > 0 for v in vals):
        return None
    return float(max(vals))


MEMORY_KEYS = ("peak_allocated_bytes", "peak_reserved_bytes", "peak_bytes", "peak_rss_bytes")


def peak_memory(summary: Mapping, key: str | None = None) -> tuple[dict, str | None]:
    """{rank: peak bytes} from metrics.memory.per_rank (a list of {rank, ...} or {rank: {...}}),
    using the first of MEMORY_KEYS present (or `key`)."""
    per_rank = get_path(summary, "metrics.memory.per_rank")
    if isinstance(per_rank, Mapping):
        per_rank = [{"rank": r, **v} for r, v in per_rank.items() if isinstance(v, Mapping)]
    if not isinstance(per_rank, list):
        return {}, None
    rows = [r for r in per_rank if isinstance(r, Mapping) and "rank" in r]
    keys = [key] if key else [k for k in MEMORY_KEYS if any(_finite(r.get(k)) for r in rows)]
    if not keys:
        return {}, None
    k = keys[0]
    return {str(r["rank"]): float(r[k]) for r in rows if _finite(r.get(k))}, k


def _number_or_null(x) -> bool:
    return x is None or (isinstance(x, (int, float)) and not isinstance(x, bool))


def malformed(summary: Mapping) -> list[str]:
    """Type errors in the parts of a summary compare reads ("path: expected ..."); absent parts
    are fine (a metric a run does not have), wrong types mean a damaged or foreign file."""
    errors = []

    def expect(path, ok, what):
        v = get_path(summary, path)
        if v is not None and not ok(v):
            errors.append(f"{path}: expected {what}, got {type(v).__name__}")
            return None
        return v

    def rows(path, key):
        v = expect(path, lambda x: isinstance(x, list), "a list")
        for i, row in enumerate(v or []):
            if not isinstance(row, Mapping):
                errors.append(f"{path}[{i}]: expected an object, got {type(row).__name__}")
            elif key and not _number_or_null(row.get(key)):
                errors.append(f"{path}[{i}].{key}: expected a number, got {type(row.get(key)).__name__}")

    for path in ("metrics.step_time", "metrics.step_time.job", "metrics.roofline", "metrics.pipeline",
                 "metrics.comm_compute", "metrics.memory", "metrics.stragglers", "run.run_info"):
        expect(path, lambda x: isinstance(x, Mapping), "an object")
    for path in ("run.world_size", "metrics.step_time.job.tokens_per_step",
                 "metrics.step_time.job.ranks_reporting", "metrics.step_time.first_step",
                 "metrics.roofline.job.peak_flops_per_s_total", *(p for ps in VALUE_PATHS.values() for p in ps)):
        expect(path, _number_or_null, "a number")
    if isinstance(get_path(summary, "metrics.step_time"), Mapping):
        rows("metrics.step_time.per_step", "max_ms")
        by_rank = expect("metrics.step_time.step_ms_by_rank", lambda x: isinstance(x, Mapping), "an object")
        for r, v in (by_rank or {}).items():
            if not (isinstance(v, list) and all(_number_or_null(x) for x in v)):
                errors.append(f"metrics.step_time.step_ms_by_rank.{r}: expected a list of numbers")
    if isinstance(get_path(summary, "metrics.roofline.job"), Mapping):
        rows("metrics.roofline.job.per_step", "mfu")
    by_step = expect("metrics.pipeline.bubble_fraction_by_step", lambda x: isinstance(x, Mapping), "an object")
    if by_step and not all(_number_or_null(v) for v in by_step.values()):
        errors.append("metrics.pipeline.bubble_fraction_by_step: expected numbers")
    if isinstance(get_path(summary, "metrics.stragglers"), Mapping):
        rows("metrics.stragglers.per_rank", "cpu_ms")
    per_rank = get_path(summary, "metrics.memory.per_rank")
    if isinstance(per_rank, list):
        rows("metrics.memory.per_rank", None)
        for i, row in enumerate(per_rank):
            if isinstance(row, Mapping):
                bad = [k for k in MEMORY_KEYS if not _number_or_null(row.get(k))]
                if bad:
                    errors.append(f"metrics.memory.per_rank[{i}].{bad[0]}: expected a number")
    elif per_rank is not None and not isinstance(per_rank, Mapping):
        errors.append(f"metrics.memory.per_rank: expected a list, got {type(per_rank).__name__}")
    return errors


def run_problems(summary: Mapping, min_steps: int = MIN_STEPS, check_steps: bool = True) -> list[str]:
    """Why a run cannot be trusted for any metric: too few analysed steps, ranks missing."""
    problems = []
    n = len(step_samples(summary))
    if check_steps and n < min_steps:
        problems.append(f"{n} analysed step{'s' * (n != 1)} (need ≥{min_steps})")
    world = get_path(summary, "run.world_size")
    reporting = get_path(summary, "metrics.step_time.job.ranks_reporting")
    if _finite(world) and _finite(reporting) and reporting < world:
        problems.append(f"step times from {int(reporting)} of {int(world)} ranks")
    return problems


def side_info(summaries: Sequence[Mapping]) -> dict:
    """Runs and analysed steps per run of one side (for the output)."""
    steps = [len(step_samples(s)) for s in summaries]
    return {"runs": len(steps), "steps": steps}


# builtin metric name -> (label, unit, bad direction, kind, display threshold, gated by default)
BUILTIN = {
    "step_time": ("step time", "ms", +1, "sampled", None, True),  # None: --min-effect
    "throughput": ("throughput", "tokens/s", -1, "sampled", None, True),
    "mfu": ("MFU", "fraction", -1, "sampled", None, True),
    "cpu_time": ("CPU time per step (busiest rank)", "ms", +1, "run_value", None, True),
    "exposed_comm": ("exposed comm fraction", "fraction", +1, "value", "5pp", False),
    "bubble": ("pipeline bubble fraction", "fraction", +1, "sampled", "5pp", False),
    "peak_memory": ("peak memory (worst rank)", "bytes", +1, "per_rank", "5%", False),
}
ALIASES = {"step": "step_time", "step_ms": "step_time", "tokens_per_s": "throughput",
           "tokens/s": "throughput", "exposed_comm_fraction": "exposed_comm",
           "bubble_fraction": "bubble", "memory": "peak_memory", "peak_mem": "peak_memory",
           "cpu": "cpu_time", "cpu_ms": "cpu_time"}
SAMPLES = {"step_time": step_samples, "throughput": throughput_samples, "mfu": mfu_samples,
           "bubble": bubble_samples}

# one value per run: keys read defensively (analyzers owned by others; the first present wins);
# sampled metrics fall back to these when no run has per-step samples
VALUE_PATHS = {
    "mfu": ("metrics.roofline.mfu", "metrics.roofline.job.mfu"),
    "exposed_comm": ("metrics.comm_compute.exposed_comm_fraction",
                     "metrics.comm_compute.job.exposed_comm_fraction",
                     "metrics.comm_compute.exposed_fraction",
                     "metrics.comm_compute.job.exposed_fraction"),
    "bubble": ("metrics.pipeline.bubble_fraction", "metrics.pipeline.job.bubble_fraction"),
}


def canonical(name: str) -> str:
    return ALIASES.get(name, name)


@dataclass
class Settings:
    alpha: float = DEFAULT_ALPHA
    min_effect: float = DEFAULT_MIN_EFFECT
    thresholds: dict[str, str] = field(default_factory=dict)  # metric -> threshold text
    extra: list[str] = field(default_factory=list)  # dotted paths to compare too
    seed: int = SEED


def _threshold_for(name: str, settings: Settings, direction: int, default: str | None) -> Threshold:
    text = settings.thresholds.get(name)
    if text is None:
        text = default if default is not None else f"{settings.min_effect * 100:g}%"
    return parse_threshold(text, direction)


def _missing_runs(bases, cands, present) -> str:
    gone = [f"{side} run {i + 1}" for side, runs in (("baseline", bases), ("candidate", cands))
            for i, s in enumerate(runs) if not present(s)]
    return "not in " + ", ".join(gone)


def _mfu_runs(bases, cands) -> tuple[list, list, str]:
    """Per-step MFU per run. Host-calibrated peaks (CPU) are measurements of the same hardware
    whose run-to-run spread is not a change of MFU: then every run is put on the first baseline
    run's peak, so MFU moves with step time and model FLOPs only."""
    runs = [mfu_samples(s) for s in (*bases, *cands)]
    peaks = [mfu_peak(s) for s in (*bases, *cands)]
    note = ""
    if (all(p[0] and p[1] for p in peaks) and len({p[2] for p in peaks}) == 1
            and len({p[0] for p in peaks}) > 1):
        ref = peaks[0][0]
        runs = [[v * p[0] / ref for v in r] for r, p in zip(runs, peaks)]
        spread = max(p[0] for p in peaks) / min(p[0] for p in peaks) - 1
        note = f"at the first baseline run's calibrated peak (peaks differ by {spread * 100:.0f}%)"
    return runs[:len(bases)], runs[len(bases):], note


def compare_runs(bases: Sequence[Mapping], cands: Sequence[Mapping],
                 settings: Settings) -> tuple[list[Comparison], list[str]]:
    """Every metric over one or more runs per side, plus the names of explicitly requested
    metrics found in no run. Multiple comparisons adjusted (Benjamini–Hochberg) over the gated."""
    bases, cands = list(bases), list(cands)
    everything = bases + cands
    results: list[Comparison] = []
    absent: list[str] = []
    for name, (label, unit, direction, kind, default, gated) in BUILTIN.items():
        th = _threshold_for(name, settings, direction, default)
        gate = gated or name in settings.thresholds
        r = None
        if kind == "sampled":
            note = ""
            if name == "mfu":
                rb, rc, note = _mfu_runs(bases, cands)
            else:
                rb, rc = [SAMPLES[name](s) for s in bases], [SAMPLES[name](s) for s in cands]
            if all(rb + rc):
                r = compare_samples(name, rb, rc, th, settings.alpha, label, unit, seed=settings.seed,
                                    gate=gate)
                r.detail = _join(note, r.detail)
            elif any(rb + rc):
                r = Comparison(name, label, unit, "sampled", MISSING, threshold=th.describe(unit),
                               direction=direction, gate=gate, runs=[len(rb), len(rc)],
                               detail=_join(_missing_runs(bases, cands, SAMPLES[name]), "per-step samples"))
        if r is None and kind in ("sampled", "value") and name in VALUE_PATHS:
            vb = [first_path(s, *VALUE_PATHS[name]) for s in bases]
            vc = [first_path(s, *VALUE_PATHS[name]) for s in cands]
            if any(v is not None for v in vb + vc):  # one number per run: gated only on request
                r = compare_values(name, vb, vc, th, label, unit, gate=name in settings.thresholds,
                                   alpha=settings.alpha)
                if r.verdict == MISSING and len(everything) > 2:
                    r.detail = _missing_runs(bases, cands, lambda s: first_path(s, *VALUE_PATHS[name]) is not None)
        if r is None and kind == "run_value":
            vb, vc = [cpu_time_value(s) for s in bases], [cpu_time_value(s) for s in cands]
            if all(v is not None for v in vb + vc):
                r = compare_run_values(name, vb, vc, th, settings.alpha, label, unit, gate=gate)
            elif any(v is not None for v in vb + vc):  # older runs: shown, gated only on request
                r = Comparison(name, label, unit, "value", MISSING, threshold=th.describe(unit),
                               direction=direction, gate=name in settings.thresholds,
                               runs=[len(vb), len(vc)],
                               detail=_missing_runs(bases, cands, lambda s: cpu_time_value(s) is not None))
        if r is None and kind == "per_rank":
            key = next((k for k in (peak_memory(s)[1] for s in everything) if k), None)
            mb = [peak_memory(s, key)[0] for s in bases]
            mc = [peak_memory(s, key)[0] for s in cands]
            if any(mb + mc):
                r = compare_per_rank(name, mb, mc, th, label, unit, gate=gate, alpha=settings.alpha)
                if key:
                    r.detail = _join(r.detail, f"[{key}]")
        if r is None:
            if name in settings.thresholds:
                absent.append(name)
            continue
        results.append(r)
    custom = list(dict.fromkeys([*settings.extra, *(k for k in settings.thresholds if k not in BUILTIN)]))
    for path in custom:
        vb, vc = [get_path(s, path) for s in bases], [get_path(s, path) for s in cands]
        if all(v is None for v in vb + vc):
            absent.append(path)
            continue
        text = settings.thresholds.get(path)
        th = parse_threshold(text, +1) if text else None
        if all(_is_samples(v) for v in vb + vc):
            results.append(compare_samples(path, vb, vc, th or Threshold(+1, settings.min_effect),
                                           settings.alpha, seed=settings.seed, gate=th is not None))
            continue
        bad = [s for s, vs in (("baseline", vb), ("candidate", vc)) if any(v is not None and not _finite(v) for v in vs)]
        if bad:
            results.append(Comparison(path, path, "", "value", MISSING, gate=th is not None,
                                      detail=f"not a number or a list of numbers in {' and '.join(bad)}"))
            continue
        results.append(compare_values(path, vb, vc, th, alpha=settings.alpha))
    # runs without any step times (custom metrics only) have no steps to count
    steps_known = any(step_samples(s) for s in everything)
    problems = [f"{side} run {i + 1}: {p}" for side, runs in (("baseline", bases), ("candidate", cands))
                for i, s in enumerate(runs) for p in run_problems(s, check_steps=steps_known)]
    if problems:  # a run that cannot be trusted makes every metric inconclusive
        for r in results:
            r.verdict, r.moved = INSUFFICIENT, None
            r.detail = "; ".join(problems)
    adjust(results, settings.alpha)
    return results, absent


def compare_summaries(base: Mapping, cand: Mapping, settings: Settings) -> tuple[list[Comparison], list[str]]:
    """One run per side (see compare_runs)."""
    return compare_runs([base], [cand], settings)


# --- environment fingerprint --------------------------------------------------------------------

FINGERPRINT = (("device", "run.device"), ("world_size", "run.world_size"), ("mesh", "run.mesh"),
               ("torch_version", "run.torch_version"))


def fingerprint(summary: Mapping) -> dict:
    return {name: get_path(summary, path) for name, path in FINGERPRINT}


def fingerprint_mismatches(base: Mapping, cand: Mapping) -> list[str]:
    fb, fc = fingerprint(base), fingerprint(cand)
    return [f"{k}: baseline {fb[k]!r}, candidate {fc[k]!r}" for k in fb if not same_fact(k, fb[k], fc[k])]


def same_fact(name: str, a, b) -> bool:
    """Equal, where a mesh one side does not know ({}: a summary written before plain DDP jobs
    got their dp size) is not a difference."""
    if name == "mesh" and (not a or not b):
        return True
    return a == b


# What the job is, as the probes recorded it (run.run_info: framework and model facts) and the
# script it ran. Compared only where both runs know the fact: an absent one proves nothing.
JOB_FACTS = (("script", None), ("framework", "run.run_info.framework"),
             ("model parameters (non-embedding)", "run.run_info.n_params_non_embedding"),
             ("layers", "run.run_info.layers"), ("hidden size", "run.run_info.hidden"),
             ("attention heads", "run.run_info.heads"), ("vocabulary", "run.run_info.vocab"),
             ("sequence length", "run.run_info.seq_len"),
             ("global batch", "run.run_info.global_batch"),
             ("gradient accumulation steps", "run.run_info.gradient_accumulation_steps"),
             ("tokens per step", "run.run_info.tokens_per_step"), ("dtype", "run.run_info.dtype"))


# `python -m` of these is a launcher (torchrun's module, its predecessor): the job is what it runs
LAUNCHER_MODULES = frozenset({"torch.distributed.run", "torch.distributed.launch"})


def _script(summary: Mapping) -> str | None:
    """The job's script (file name of the first *.py argument, or the -m module; a launcher's
    module, as in ``python -m torch.distributed.run train.py``, is not the job)."""
    cmd = get_path(summary, "run.command")
    if not isinstance(cmd, list):
        return None
    for i, a in enumerate(cmd):
        a = str(a)
        if a == "-m" and i + 1 < len(cmd) and str(cmd[i + 1]) not in LAUNCHER_MODULES:
            return f"-m {cmd[i + 1]}"
        if a.endswith(".py"):
            return a.replace("\\", "/").rsplit("/", 1)[-1]
    return None


def job_facts(summary: Mapping) -> dict:
    out = {}
    for name, path in JOB_FACTS:
        v = _script(summary) if path is None else get_path(summary, path)
        if v is not None and v != "":
            out[name] = v
    return out


def job_differences(base: Mapping, other: Mapping) -> list[tuple[str, object, object]]:
    """(fact, baseline value, other value) for every job fact both runs know and that differs."""
    fb, fo = job_facts(base), job_facts(other)
    return [(k, fb[k], fo[k]) for k in fb if k in fo and fb[k] != fo[k]]


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _float(x):
    return float(x) if _finite(x) else None


def _is_samples(x) -> bool:
    return isinstance(x, list) and bool(x) and all(_finite(v) for v in x)


def _join(*parts: str) -> str:
    return "; ".join(p for p in parts if p)


def _pct(x) -> str:
    return "n/a" if x is None else f"{x * 100:+.1f}%"
