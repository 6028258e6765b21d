"""The metrics `trainprof compare` knows and how each is read out of a summary.json: per-step
samples (step time, throughput, MFU, pipeline bubble), one value per run (CPU time per step, the
dotted VALUE_PATHS), peak memory per rank; a summary's type errors (`malformed`) and why a run
cannot be trusted at all (`run_problems`)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

MIN_STEPS = 6


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
        return [float(p["max_ms"]) for p in per_step if isinstance(p, Mapping) and finite(p.get("max_ms"))]
    by_rank = st.get("step_ms_by_rank") if isinstance(st, Mapping) else None
    if not isinstance(by_rank, Mapping) or not by_rank:
        return []
    first = int(st.get("first_step") or 0)
    excluded = {s for v in (st.get("excluded_steps") or {}).values() if isinstance(v, list) for s in v}
    rows = [v for v in by_rank.values() if isinstance(v, list)]
    out = []
    for i in range(max((len(v) for v in rows), default=0)):
        vals = [v[i] for v in rows if i < len(v) and finite(v[i])]
        if vals and first + i not in excluded:
            out.append(float(max(vals)))
    return out


def throughput_samples(summary: Mapping) -> list[float]:
    tokens = first_path(summary, "metrics.step_time.job.tokens_per_step", "run.run_info.tokens_per_step")
    if not finite(tokens) or float(tokens) <= 0:
        return []
    return [float(tokens) / s for ms in step_samples(summary) if (s := ms / 1e3) > 0
            and math.isfinite(float(tokens) / s)]


def mfu_samples(summary: Mapping) -> list[float]:
    """MFU per analysed step (metrics.roofline.per_step[].mfu, or .job.per_step)."""
    per_step = first_path(summary, "metrics.roofline.per_step", "metrics.roofline.job.per_step")
    if not isinstance(per_step, list):
        return []
    return [float(p["mfu"]) for p in per_step if isinstance(p, Mapping) and finite(p.get("mfu"))]


def mfu_peak(summary: Mapping) -> tuple[float | None, bool, str | None]:
    """(Σ peak FLOP/s the run's MFU divides by, whether it was calibrated on the host, dtype)."""
    total = first_path(summary, "metrics.roofline.job.peak_flops_per_s_total",
                       "metrics.roofline.peak_flops_per_s_total")
    basis = first_path(summary, "metrics.roofline.peak.basis") or ""
    dtype = first_path(summary, "metrics.roofline.peak.dtype", "metrics.roofline.compute_dtype")
    return finite_or_none(total), isinstance(basis, str) and basis.startswith("calibration"), dtype


def bubble_samples(summary: Mapping) -> list[float]:
    """Pipeline bubble fraction per analysed step (metrics.pipeline.bubble_fraction_by_step)."""
    by_step = get_path(summary, "metrics.pipeline.bubble_fraction_by_step")
    if not isinstance(by_step, Mapping):
        return []
    items = sorted(((int(k), v) for k, v in by_step.items() if str(k).lstrip("-").isdigit()),
                   key=lambda kv: kv[0])
    return [float(v) for _, v in items if finite(v)]


def cpu_time_value(summary: Mapping) -> float | None:
    """CPU time per step of the busiest rank's training thread: the largest of
    metrics.stragglers.per_rank[].cpu_ms (each rank's median over the analysed steps of the
    steps stream's `cpu_ms`). None when a rank lacks it (probes without scheduler statistics)."""
    rows = get_path(summary, "metrics.stragglers.per_rank")
    if not isinstance(rows, list) or not rows:
        return None
    vals = [r.get("cpu_ms") if isinstance(r, Mapping) else None for r in rows]
    if not all(finite(v) and v > 0 for v in vals):
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
    keys = [key] if key else [k for k in MEMORY_KEYS if any(finite(r.get(k)) for r in rows)]
    if not keys:
        return {}, None
    k = keys[0]
    return {str(r["rank"]): float(r[k]) for r in rows if finite(r.get(k))}, k


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


def holds_no_rank_data(summary: Mapping) -> bool:
    """A summary of a run in which no rank wrote anything: no rank, world size 0, no steps."""
    run = summary.get("run") if isinstance(summary, dict) else None
    if not isinstance(run, dict):
        return False
    steps = ((summary.get("metrics") or {}).get("step_time") or {}) if isinstance(
        summary.get("metrics"), dict) else {}
    return not run.get("ranks") and not run.get("world_size") and not steps


def run_problems(summary: Mapping, min_steps: int = MIN_STEPS, check_steps: bool = True) -> list[str]:
    """Why a run cannot be trusted for any metric: too few analysed steps, ranks missing."""
    problems = []
    n = len(step_samples(summary))
    if check_steps and n < min_steps:
        problems.append(f"{n} analysed step{'s' * (n != 1)} (need ≥{min_steps})")
    world = get_path(summary, "run.world_size")
    reporting = get_path(summary, "metrics.step_time.job.ranks_reporting")
    if finite(world) and finite(reporting) and reporting < world:
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


def finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def finite_or_none(x):
    return float(x) if finite(x) else None
