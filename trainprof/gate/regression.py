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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from trainprof.gate.metrics import (BUILTIN, MIN_STEPS, SAMPLES, VALUE_PATHS, cpu_time_value, finite,
                                    finite_or_none, first_path, get_path, mfu_peak, mfu_samples,
                                    peak_memory, run_problems, step_samples)
from trainprof.gate.stats import SEED, bootstrap_ratio_ci, mann_whitney_p, se_df, t_test
from trainprof.gate.threshold import Threshold, parse_threshold
from trainprof.gate.verdict import (INSUFFICIENT, MISSING, TEST_RUNS, TEST_STEPS, TEST_THRESHOLD,
                                    UNCHANGED, Comparison, adjust, decide, settle)

MIN_SAMPLES = MIN_STEPS
DEFAULT_ALPHA = 0.01
DEFAULT_MIN_EFFECT = 0.05


def _exp(x: float) -> float:
    """math.exp, inf past the largest float (a CI bound of runs near 1e308) instead of raising."""
    return math.exp(x) if x < 709.7 else math.inf


def _ratio(b, c):
    if b is None or c is None:
        return None, None
    if b == 0:
        return (None, None) if c != 0 else (1.0, 0.0)
    return c / b, c / b - 1.0


def _as_runs(x) -> list[list[float]]:
    """A flat list of numbers is one run; a list of lists is one list per run."""
    x = list(x) if x is not None else []
    if x and all(isinstance(r, (list, tuple, np.ndarray)) for r in x):
        return [[float(v) for v in r if finite(v)] for r in x]
    return [[float(v) for v in x if finite(v)]]


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
            out.se, out.df = se_df(np.log(b), np.log(c))
            out.log_scale = True
    else:
        short = [f"{side} run {i + 1} has {len(r)}" for side, runs in (("baseline", rb), ("candidate", rc))
                 for i, r in enumerate(runs) if len(r) < min_samples]
        if short:
            out.verdict = INSUFFICIENT
            out.detail = f"need ≥{min_samples} samples per run: " + ", ".join(short)
            return out
        _runs_test(out, [float(np.median(r)) for r in rb], [float(np.median(r)) for r in rc], threshold)
    out.moved = decide(threshold, out.baseline, out.candidate, metric)
    return settle(out, alpha)


def _runs_test(out: Comparison, vb: list[float], vc: list[float], threshold: Threshold) -> None:
    """t-test over per-run numbers; log scale (ratio of geometric means) for relative thresholds."""
    log = threshold.relative and min(vb + vc) > 0
    xb, xc = (np.log(vb), np.log(vc)) if log else (np.asarray(vb), np.asarray(vc))
    p, d, (lo, hi) = t_test(xb, xc)
    out.test, out.p_value = TEST_RUNS, p
    out.se, out.df = se_df(np.asarray(xb, dtype=float), np.asarray(xc, dtype=float))
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
    missing = [side for side, v in (("baseline", vb), ("candidate", vc)) if any(finite_or_none(x) is None for x in v)]
    if missing:
        if len(vb) == 1 and len(vc) == 1:
            out.baseline, out.candidate = finite_or_none(vb[0]), finite_or_none(vc[0])
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
        out.moved = decide(threshold, out.baseline, out.candidate, metric)
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
        out.verdict = decide(threshold, out.baseline, out.candidate, metric)
        out.detail = "one number per run: gated with ≥3 runs in all (a t-test over the runs)"
        return out
    _runs_test(out, vb, vc, threshold)
    out.moved = decide(threshold, out.baseline, out.candidate, metric)
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
        bad = [s for s, vs in (("baseline", vb), ("candidate", vc)) if any(v is not None and not finite(v) for v in vs)]
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


def _is_samples(x) -> bool:
    return isinstance(x, list) and bool(x) and all(finite(v) for v in x)


def _join(*parts: str) -> str:
    return "; ".join(p for p in parts if p)
