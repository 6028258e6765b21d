"""Step-time statistics per rank and per step, from each rank's steps stream.

Excluded from statistics (and listed in the metrics ``excluded_steps``, each list's reason in
``excluded_reasons``): step 0 (``warmup``), which runs from probe activation to the first step
boundary and so includes set-up; the steps the profiler window touched (``profiler``: its
warm-up step, the recorded steps, and the step that collected the trace), whose times include
profiler overhead; and the steps that overlap a span of meta.json ``overhead_spans`` on any
rank (compared by wall clock: a replay on one rank delays the others' next collective), by
kind: ``trace_export`` (trainprof's trace export on its own thread, which runs on beside the
next steps), ``nan_replay`` (trainprof's replay locating a NaN's origin) and ``job_profiler``
(the job's own profiler from its start to its stop, and its trace exports). A run directory
without ``overhead_spans`` excludes only the first two. The job's step time for a step is the slowest rank's; when
some ranks of the job left no step records (a rank directory missing, a rank that never
started), the job figures carry ``partial`` (the slowest rank may be among those not seen).

Throughput: ``tokens_per_s`` at the median step (the typical step's rate) and
``tokens_per_s_mean``, total tokens ÷ total time of the analysed steps (the job's rate, what a
framework's own figure counts); they part when some steps are much slower (analyzers/slow_steps.py).
"""

from __future__ import annotations

import numpy as np

from trainprof.analyzers._memo import once
from trainprof.findings import AnalyzerResult

NAME = "step_time"
WARMUP_STEPS = 1


# meta.json overhead_spans kinds -> the excluded_steps list their steps go to
SPAN_KEYS = {"trace_export": "trace_export", "nan_replay": "nan_replay",
             "job_profiler": "job_profiler", "job_trace_export": "job_profiler"}
REASONS = {
    "warmup": "step 0 runs from the probes' start to the first step boundary: set-up",
    "profiler": "trainprof's profiler window: its warm-up step, the recorded steps and the step "
                "that collected the trace",
    "trace_export": "trainprof was writing the profiler window's trace on a thread of its own, "
                    "beside the job's steps",
    "nan_replay": "trainprof was replaying a step to locate a NaN/Inf's origin",
    "job_profiler": "the job's own profiler was running or exporting its trace",
}
_OPEN = np.iinfo(np.int64).max  # a span still running when its rank's files were last written


def overhead_spans(run) -> dict[str, list[tuple[int, int]]]:
    """{excluded_steps key: [(start_ns, end_ns)]} from every rank's meta.json ``overhead_spans``
    (a span still running, end null, reaches past the rank's last step); {} for a run directory
    without them."""
    return once(run, "analyzers.step_time.overhead_spans", _overhead_spans)


def _overhead_spans(run) -> dict[str, list[tuple[int, int]]]:
    out: dict[str, list[tuple[int, int]]] = {}
    for r in getattr(run, "ranks", None) or []:
        for sp in run.rank_meta(r).get("overhead_spans") or []:
            key, a, b = SPAN_KEYS.get(sp.get("kind")), sp.get("start_ns"), sp.get("end_ns")
            if key is None or a is None or (b is not None and b < a):
                continue
            out.setdefault(key, []).append((int(a), _OPEN if b is None else int(b)))
    return out


def _overlapping(steps, spans: list[tuple[int, int]]) -> list[int]:
    """The steps some rank's record of which overlaps one of the spans (wall-clock ns)."""
    if not spans or not {"start_ns", "end_ns"} <= set(steps.columns):
        return []
    merged: list[list[int]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    starts = np.array([m[0] for m in merged], dtype=np.int64)
    ends = np.array([m[1] for m in merged], dtype=np.int64)
    s0 = steps["start_ns"].to_numpy(dtype=float)
    s1 = steps["end_ns"].to_numpy(dtype=float)
    ok = np.isfinite(s0) & np.isfinite(s1)
    s0, s1 = s0[ok].astype(np.int64), s1[ok].astype(np.int64)
    # the last span starting before the step ends (disjoint spans: the one reaching furthest)
    i = np.searchsorted(starts, s1, side="left") - 1
    hit = (i >= 0) & (ends[np.maximum(i, 0)] > s0)
    return sorted(int(x) for x in np.unique(steps["step"].to_numpy()[ok][hit]))


def excluded_set(excluded: dict[str, list[int]]) -> set[int]:
    """Every step some list of ``excluded_steps`` holds."""
    return {int(s) for v in excluded.values() for s in v}


def excluded_steps(steps, spans: dict | None = None) -> dict[str, list[int]]:
    """{"warmup": [0], "profiler": [...], and for each kind of ``spans`` (overhead_spans(run))
    that overlaps some step: its list}."""
    out = {"warmup": list(range(WARMUP_STEPS)), "profiler": []}
    if "profiled" in steps:
        prof = sorted(int(s) for s in steps.loc[steps["profiled"].fillna(False).astype(bool), "step"].unique())
        if prof:
            # one warm-up step before each window and the export step after it (the steps
            # themselves, never a range between them: step numbers come from files)
            seen = set(prof)
            edges = {s - 1 for s in seen if s - 1 not in seen} | {s + 1 for s in seen if s + 1 not in seen}
            out["profiler"] = sorted(seen | edges)
    for key, sp in (spans or {}).items():
        hit = _overlapping(steps, sp)
        if hit:
            out[key] = hit
    return out


def excluded_reasons(excluded: dict[str, list[int]], spans: dict | None = None) -> dict[str, str]:
    """Why each non-empty list of ``excluded_steps`` is left out; for a span kind, with its
    longest span."""
    out = {}
    for key in (k for k, v in excluded.items() if v):
        text = REASONS.get(key, key)
        longest = max((b - a for a, b in (spans or {}).get(key) or () if b != _OPEN), default=None)
        if longest is not None:
            text += f"; longest {longest / 1e6:,.0f} ms"
        out[key] = text
    return out


def partial_note(run, ranks_reporting: int) -> dict | None:
    """What a job-level figure computed from ``ranks_reporting`` ranks lacks: None when every
    rank of the job is there, else {world_size, ranks_reporting, missing_ranks, ...}."""
    p = run.partial() if hasattr(run, "partial") else None
    world = max(run.world_size, (p or {}).get("world_size") or 0)
    if p is None and ranks_reporting >= world:
        return None
    return {**(p or {"world_size": world, "missing_ranks": []}), "ranks_reporting": ranks_reporting}


def analyze(run) -> AnalyzerResult:
    return once(run, "analyzers.step_time", _analyze)


def _analyze(run) -> AnalyzerResult:
    steps = run.steps()
    if steps.empty:
        return AnalyzerResult()
    steps = steps.drop_duplicates(["rank", "step"], keep="last")
    spans = overhead_spans(run)
    excluded = excluded_steps(steps, spans)
    kept = steps[~steps["step"].isin(excluded_set(excluded))]
    only_excluded = kept.empty
    if only_excluded:  # a very short run: better some numbers than none, said so
        kept = steps[steps["step"] >= min(WARMUP_STEPS, int(steps["step"].max()))]
        used = sorted(int(x) for x in kept["step"].unique())
        n = int(steps["step"].max()) + 1
        if set(used) & set(excluded["warmup"]):  # the first step's start-up cost is in it
            run.problems.append(
                f"{NAME}: the job recorded {n} step{'s' * (n != 1)}, each one a warm-up, "
                f"profiler or overhead step that statistics leave out; the step time shown is from "
                f"step{'s' * (len(used) != 1)} {', '.join(map(str, used))} alone, the warm-up "
                f"included, and does not represent training")

    per_rank = []
    for rank, g in kept.groupby("rank"):
        d = g["dur_ms"].to_numpy(dtype=float)
        med = float(np.median(d))
        p90 = float(np.percentile(d, 90))
        per_rank.append({"rank": int(rank), "steps": int(len(d)), "median_ms": med, "p90_ms": p90,
                         "min_ms": float(d.min()), "max_ms": float(d.max()),
                         "mean_ms": float(d.mean()),
                         "spread_pct": 100.0 * (p90 - med) / med if med > 0 else 0.0})

    by_step = kept.groupby("step")["dur_ms"].agg(["max", "median", "min", "size"])
    job_ms = by_step["max"].to_numpy(dtype=float)
    per_step = [{"step": s, "max_ms": a, "median_ms": b, "min_ms": c, "ranks": n}
                for s, a, b, c, n in zip(by_step.index.astype(np.int64).tolist(), job_ms.tolist(),
                                         by_step["median"].to_numpy(float).tolist(),
                                         by_step["min"].to_numpy(float).tolist(),
                                         by_step["size"].to_numpy(np.int64).tolist())]

    wide = steps.pivot(index="rank", columns="step", values="dur_ms").sort_index()
    first_step = int(wide.columns.min())
    step_ms_by_rank = {str(int(r)): [None if v != v else v for v in row.tolist()]
                       for r, row in zip(wide.index, wide.to_numpy(dtype=float))}

    tokens = (run.rank_meta(run.ranks[0]).get("run_info") or {}).get("tokens_per_step") \
        if run.ranks else None
    median = float(np.median(job_ms)) if len(job_ms) else None
    job = {
        "steps": int(len(job_ms)),
        "median_ms": median,
        "p90_ms": float(np.percentile(job_ms, 90)) if len(job_ms) else None,
        "mean_ms": float(job_ms.mean()) if len(job_ms) else None,
        "tokens_per_step": tokens,
        "tokens_per_s": (tokens / (median / 1e3)) if tokens and median else None,
        # total tokens ÷ total time of the analysed steps (what a framework's own figure counts):
        # below tokens_per_s by as much as slow steps (evaluation, checkpoints) weigh
        "tokens_per_s_mean": (tokens / (float(job_ms.mean()) / 1e3))
        if tokens and len(job_ms) and job_ms.mean() > 0 else None,
        "steps_recorded": int(steps["step"].max()) + 1,
        "ranks_reporting": int(steps["rank"].nunique()),
        **({"from_excluded_steps": True} if only_excluded else {}),
    }
    partial = partial_note(run, job["ranks_reporting"])
    if partial:
        job["partial"] = partial
    return AnalyzerResult(metrics={
        "job": job, "per_rank": per_rank, "per_step": per_step,
        "step_ms_by_rank": step_ms_by_rank, "first_step": first_step,
        "steps": [int(s) for s in wide.columns],  # the step of each point of step_ms_by_rank
        "warmup_steps": WARMUP_STEPS, "excluded_steps": excluded,
        "excluded_reasons": excluded_reasons(excluded, spans),
    })
