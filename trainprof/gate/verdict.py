"""A metric's verdict in `trainprof compare`: the Comparison record, the threshold's decision on
the point estimates, significance and the single-run rule (`settle`), the Benjamini–Hochberg
adjustment over the gated metrics (`adjust`) and the exit code (`overall_verdict`)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from trainprof.gate.metrics import BUILTIN
from trainprof.gate.stats import benjamini_hochberg
from trainprof.gate.threshold import Threshold, UntrustedValue, exceeds

# verdicts; the exit code is decided from them (see overall_verdict)
REGRESSION, IMPROVEMENT, UNCHANGED, INSUFFICIENT, MISSING, DIFFERS = (
    "regression", "improvement", "unchanged", "insufficient data", "missing", "runs differ")
INCONCLUSIVE = (INSUFFICIENT, MISSING, DIFFERS)
TEST_STEPS, TEST_RUNS, TEST_THRESHOLD = "U over steps", "t over runs", "threshold only"


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


def decide(th: Threshold, base: float, cand: float, metric: str = "") -> str:
    if th.relative:  # the built-in metrics are times, sizes, rates, fractions: never below 0
        floor = 0 if metric in BUILTIN else -math.inf
        bad = [f"{side} {v!r}" for side, v in (("baseline", base), ("candidate", cand))
               if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= floor)]
        if bad:
            raise UntrustedValue(f"{metric or 'a metric'}: {' and '.join(bad)} cannot be judged by a "
                                 f"relative threshold ({th.describe()}): a damaged or foreign "
                                 f"summary.json? refused")
    if exceeds(th, base, cand, th.direction):
        return REGRESSION
    if exceeds(th, base, cand, -th.direction):
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


def _pct(x) -> str:
    return "n/a" if x is None else f"{x * 100:+.1f}%"
