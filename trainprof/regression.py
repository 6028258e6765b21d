"""Regression decisions between two summary.json files (`trainprof compare`). Pure: no I/O.

Sampled metrics (step time, throughput: one sample per analysed step) regress only when the
change is both significant (two-sided Mann–Whitney U, p < alpha) and larger than a minimum
effect on the median; the bootstrap confidence interval of the median ratio (fixed seed) says how
sure we are of its size. Fewer than MIN_SAMPLES per side → insufficient data. Single-valued
metrics (peak memory, MFU, fractions measured over the profiler window) compare against a
threshold. Every threshold is direction-aware: for each metric one direction is bad.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

import numpy as np

MIN_SAMPLES = 6
DEFAULT_ALPHA = 0.01
DEFAULT_MIN_EFFECT = 0.05
N_BOOT = 2000
CI_LEVEL = 0.95
SEED = 0

# verdicts; the exit code is decided from them (see overall_verdict)
REGRESSION, IMPROVEMENT, UNCHANGED, INSUFFICIENT, MISSING = (
    "regression", "improvement", "unchanged", "insufficient data", "missing")
INCONCLUSIVE = (INSUFFICIENT, MISSING)


class ThresholdError(ValueError):
    pass


@dataclass(frozen=True)
class Threshold:
    """Fail when the metric moves in the bad `direction` (+1: increase is bad, -1: decrease is
    bad) by more than `value`: relative (fraction of the baseline) or absolute (metric units)."""

    direction: int
    value: float
    relative: bool = True

    def describe(self) -> str:
        sign = "+" if self.direction > 0 else "-"
        return f"{sign}{self.value * 100:g}%" if self.relative else f"{sign}{self.value:g}"


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
    baseline: float | None = None  # the median for sampled metrics
    candidate: float | None = None
    ratio: float | None = None  # candidate / baseline
    change: float | None = None  # candidate / baseline - 1
    threshold: str | None = None
    direction: int = 1
    p_value: float | None = None
    ci: list[float] | None = None  # bootstrap CI of the ratio
    n: list[int] | None = None  # samples per side
    detail: str = ""
    gate: bool = True  # False: shown, never fails

    def to_dict(self) -> dict:
        return asdict(self)


def _ratio(b, c):
    if b is None or c is None:
        return None, None
    if b == 0:
        return (None, None) if c != 0 else (1.0, 0.0)
    return c / b, c / b - 1.0


def _exceeds(th: Threshold, base: float, cand: float, direction: int) -> bool:
    """Did the metric move by more than the threshold in `direction`?"""
    delta = (cand - base) * direction
    if th.relative:
        return base != 0 and delta / abs(base) > th.value
    return delta > th.value


def _decide(th: Threshold, base: float, cand: float) -> str:
    if _exceeds(th, base, cand, th.direction):
        return REGRESSION
    if _exceeds(th, base, cand, -th.direction):
        return IMPROVEMENT
    return UNCHANGED


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


def compare_samples(metric: str, base, cand, threshold: Threshold, alpha: float = DEFAULT_ALPHA,
                    label: str | None = None, unit: str = "", min_samples: int = MIN_SAMPLES,
                    seed: int = SEED) -> Comparison:
    """Significant (Mann–Whitney U, two-sided, p < alpha) AND beyond the threshold on the median."""
    from scipy.stats import mannwhitneyu

    b = np.asarray([x for x in base if _finite(x)], dtype=float)
    c = np.asarray([x for x in cand if _finite(x)], dtype=float)
    out = Comparison(metric, label or metric, unit, "sampled", UNCHANGED, n=[len(b), len(c)],
                     threshold=threshold.describe(), direction=threshold.direction)
    if len(b):
        out.baseline = float(np.median(b))
    if len(c):
        out.candidate = float(np.median(c))
    out.ratio, out.change = _ratio(out.baseline, out.candidate)
    if len(b) < min_samples or len(c) < min_samples:
        out.verdict = INSUFFICIENT
        out.detail = f"need ≥{min_samples} samples per side, have {len(b)} and {len(c)}"
        return out
    if np.ptp(np.concatenate([b, c])) == 0:
        p = 1.0  # every sample equal: nothing to test
    else:
        p = float(mannwhitneyu(b, c, alternative="two-sided").pvalue)
    out.p_value = p if math.isfinite(p) else 1.0
    out.ci = bootstrap_ratio_ci(b, c, seed=seed)
    decision = _decide(threshold, out.baseline, out.candidate)
    if decision != UNCHANGED and out.p_value >= alpha:
        out.detail = f"median moved {_pct(out.change)} but not significant (p={out.p_value:.3g} ≥ α={alpha:g})"
        decision = UNCHANGED
    elif decision == UNCHANGED and out.p_value < alpha:
        out.detail = f"significant (p={out.p_value:.3g}) but within {threshold.describe()}"
    out.verdict = decision
    return out


def compare_values(metric: str, base, cand, threshold: Threshold | None, label: str | None = None,
                   unit: str = "", detail: str = "") -> Comparison:
    """A single value per run against a threshold (no threshold: shown, never gates)."""
    out = Comparison(metric, label or metric, unit, "value", UNCHANGED,
                     baseline=_float(base), candidate=_float(cand), detail=detail,
                     threshold=threshold.describe() if threshold else None,
                     direction=threshold.direction if threshold else 0, gate=threshold is not None)
    if out.baseline is None or out.candidate is None:
        side = " and ".join(s for s, v in (("baseline", out.baseline), ("candidate", out.candidate))
                            if v is None)
        out.verdict, out.detail = MISSING, f"not in {side}"
        return out
    out.ratio, out.change = _ratio(out.baseline, out.candidate)
    if threshold is not None:
        out.verdict = _decide(threshold, out.baseline, out.candidate)
    return out


def compare_per_rank(metric: str, base: Mapping, cand: Mapping, threshold: Threshold,
                     label: str | None = None, unit: str = "") -> Comparison:
    """{rank: value} on both sides: the rank that moved most in the bad direction decides."""
    common = sorted(set(base) & set(cand), key=lambda r: (len(str(r)), str(r)))
    if not common:
        return compare_values(metric, None if not base else max(base.values()),
                              None if not cand else max(cand.values()), threshold, label, unit,
                              detail="no rank present in both runs" if base and cand else "")

    def badness(r):
        b, c = float(base[r]), float(cand[r])
        d = (c - b) * threshold.direction
        return d / abs(b) if threshold.relative and b else d

    worst = max(common, key=badness)
    out = compare_values(metric, base[worst], cand[worst], threshold, label, unit)
    out.detail = f"rank {worst} (worst of {len(common)} ranks)"
    if set(base) != set(cand):
        out.detail += f"; ranks only in one run: {sorted(set(base) ^ set(cand), key=str)}"
    return out


def overall_verdict(results: list[Comparison]) -> tuple[int, str]:
    """Exit code and word: 1 any gated regression, else 3 anything gated inconclusive, else 0."""
    gated = [r for r in results if r.gate]
    if any(r.verdict == REGRESSION for r in gated):
        return 1, "regression"
    if any(r.verdict in INCONCLUSIVE for r in gated):
        return 3, "inconclusive"
    return 0, "pass"


# --- reading metrics out of a summary ---------------------------------------------------------

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
    return [float(tokens) / (ms / 1e3) for ms in step_samples(summary) if ms > 0]


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


# builtin metric name -> (label, unit, bad direction, kind, default threshold text)
BUILTIN = {
    "step_time": ("step time", "ms", +1, "sampled", None),  # None: --min-effect
    "throughput": ("throughput", "tokens/s", -1, "sampled", None),
    "mfu": ("MFU", "fraction", -1, "value", "5%"),
    "exposed_comm": ("exposed comm fraction", "fraction", +1, "value", "5pp"),
    "bubble": ("pipeline bubble fraction", "fraction", +1, "value", "5pp"),
    "peak_memory": ("peak memory (worst rank)", "bytes", +1, "per_rank", "5%"),
}
ALIASES = {"step": "step_time", "step_ms": "step_time", "tokens_per_s": "throughput",
           "tokens/s": "throughput", "exposed_comm_fraction": "exposed_comm",
           "bubble_fraction": "bubble", "memory": "peak_memory", "peak_mem": "peak_memory"}

# keys read defensively (analyzers owned by others; the first present wins)
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


def compare_summaries(base: Mapping, cand: Mapping, settings: Settings) -> tuple[list[Comparison], list[str]]:
    """All comparisons, plus the names of explicitly requested metrics found in neither run."""
    results: list[Comparison] = []
    absent: list[str] = []
    for name, (label, unit, direction, kind, default) in BUILTIN.items():
        th = _threshold_for(name, settings, direction, default)
        if kind == "sampled":
            fn = step_samples if name == "step_time" else throughput_samples
            b, c = fn(base), fn(cand)
            if not b and not c:
                if name in settings.thresholds:
                    absent.append(name)
                continue
            results.append(compare_samples(name, b, c, th, settings.alpha, label, unit, seed=settings.seed))
        elif kind == "per_rank":
            b, key = peak_memory(base)
            c, _ = peak_memory(cand, key) if key else peak_memory(cand)
            if not b and not c:
                if name in settings.thresholds:
                    absent.append(name)
                continue
            r = compare_per_rank(name, b, c, th, label, unit)
            if key:
                r.detail += f" [{key}]"
            results.append(r)
        else:
            paths = VALUE_PATHS[name]
            b, c = first_path(base, *paths), first_path(cand, *paths)
            if b is None and c is None:
                if name in settings.thresholds:
                    absent.append(name)
                continue
            results.append(compare_values(name, b, c, th, label, unit))
    custom = list(dict.fromkeys([*settings.extra, *(k for k in settings.thresholds if k not in BUILTIN)]))
    for path in custom:
        b, c = get_path(base, path), get_path(cand, path)
        if b is None and c is None:
            absent.append(path)
            continue
        text = settings.thresholds.get(path)
        th = parse_threshold(text, +1) if text else None
        if _is_samples(b) and _is_samples(c):
            results.append(compare_samples(path, b, c, th or Threshold(+1, settings.min_effect),
                                           settings.alpha, seed=settings.seed))
            results[-1].gate = th is not None
        else:
            bad = [s for s, v in (("baseline", b), ("candidate", c)) if v is not None and not _finite(v)]
            if bad:
                results.append(Comparison(path, path, "", "value", MISSING, gate=th is not None,
                                          detail=f"not a number or a list of numbers in {' and '.join(bad)}"))
                continue
            results.append(compare_values(path, b, c, th))
    return results, absent


# --- environment fingerprint --------------------------------------------------------------------

FINGERPRINT = (("device", "run.device"), ("world_size", "run.world_size"), ("mesh", "run.mesh"),
               ("torch_version", "run.torch_version"))


def fingerprint(summary: Mapping) -> dict:
    return {name: get_path(summary, path) for name, path in FINGERPRINT}


def fingerprint_mismatches(base: Mapping, cand: Mapping) -> list[str]:
    fb, fc = fingerprint(base), fingerprint(cand)
    return [f"{k}: baseline {fb[k]!r}, candidate {fc[k]!r}" for k in fb if fb[k] != fc[k]]


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _float(x):
    return float(x) if _finite(x) else None


def _is_samples(x) -> bool:
    return isinstance(x, list) and bool(x) and all(_finite(v) for v in x)


def _pct(x) -> str:
    return "n/a" if x is None else f"{x * 100:+.1f}%"
