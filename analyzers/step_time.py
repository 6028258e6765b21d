"""Step-time statistics per rank and per step, from each rank's steps stream.

Excluded from statistics (and listed in the metrics): step 0, which runs from probe activation
to the first step boundary and so includes set-up, and the steps the profiler window touched
(its warm-up step, the recorded steps, and the step that paid for the trace export), whose
times include profiler overhead. The job's step time for a step is the slowest rank's; when
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


def excluded_steps(steps) -> dict[str, list[int]]:
    out = {"warmup": list(range(WARMUP_STEPS)), "profiler": []}
    if "profiled" in steps:
        prof = sorted(int(s) for s in steps.loc[steps["profiled"].fillna(False).astype(bool), "step"].unique())
        if prof:
            # one warm-up step before each window and the export step after it (the steps
            # themselves, never a range between them: step numbers come from files)
            seen = set(prof)
            edges = {s - 1 for s in seen if s - 1 not in seen} | {s + 1 for s in seen if s + 1 not in seen}
            out["profiler"] = sorted(seen | edges)
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
    excluded = excluded_steps(steps)
    drop = set(excluded["warmup"]) | set(excluded["profiler"])
    kept = steps[~steps["step"].isin(drop)]
    only_excluded = kept.empty
    if only_excluded:  # a very short run: better some numbers than none, said so
        kept = steps[steps["step"] >= min(WARMUP_STEPS, int(steps["step"].max()))]
        used = sorted(int(x) for x in kept["step"].unique())
        n = int(steps["step"].max()) + 1
        if set(used) & set(excluded["warmup"]):  # the first step's start-up cost is in it
            run.problems.append(
                f"{NAME}: the job recorded {n} step{'s' * (n != 1)}, each one a warm-up or "
                f"profiler step that statistics leave out; the step time shown is from "
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
    })
