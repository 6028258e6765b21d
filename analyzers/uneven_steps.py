"""Ranks of one job that recorded different numbers of steps (steps.jsonl).

In synchronous data-parallel training every rank runs the same steps. Ranks given different
numbers of batches ("uneven inputs") do not: without torch's Join context manager the job fails
when the first rank leaves (the hang analyzer names that rank, reason ``exited_early``); with it
(``with model.join():``) a rank that ran out of inputs leaves its loop and shadows its peers'
collectives until they finish, so it records fewer steps and logs those collectives under the
step after its last one.

A finding (kind ``uneven_steps``, ``info``) when some steps were recorded by only some ranks and
every rank missing them ended normally (exit code 0 in worker-exits.jsonl, else a heartbeat
closed without a failure record, else a job whose launcher status is ``ok``). A rank that
failed or was killed records fewer steps because it stopped: that is the hang analyzer's
finding, not this one. The message says which ranks ran how many steps, which steps were run by
which ranks alone (per-step comparisons between ranks have no peer there: the stragglers
analyzer compares a rank's step time only with peers that recorded the same step), and the
collectives a rank logged after its last step.
"""

from __future__ import annotations

from trainprof._lazy import pd
from trainprof.analyzers._hang_exits import ended_normally
from trainprof.findings import AnalyzerResult, Finding
from trainprof.rundir import worker_exits
from trainprof.rankranges import ranges

NAME = "uneven_steps"
MAX_GROUPS = 4  # rank groups (by steps run) named in the message; the rest counted


def _rank_s(rs) -> str:
    rs = sorted(rs)
    return f"rank{'s' * (len(rs) > 1)} {ranges(rs)}"


def _span(a: int, b: int) -> str:
    return f"step {a}" if a == b else f"steps {a}-{b}"


def _segments(steps: list[int], ranks_of: dict) -> list[tuple[int, int, tuple]]:
    """Runs of consecutive steps recorded by the same ranks: [(first, last, ranks)]."""
    out: list[list] = []
    for s in steps:
        rs = ranks_of[s]
        if out and out[-1][1] == s - 1 and out[-1][2] == rs:
            out[-1][1] = s
        else:
            out.append([s, s, rs])
    return [tuple(x) for x in out]


def analyze(run) -> AnalyzerResult:
    st = run.steps()
    if st.empty or not {"rank", "step"} <= set(st.columns):
        return AnalyzerResult()
    d = pd.DataFrame({"rank": st["rank"], "step": pd.to_numeric(st["step"], errors="coerce")})
    d = d.dropna().astype({"step": int, "rank": int}).drop_duplicates()
    ranks = sorted(int(r) for r in d["rank"].unique())
    if len(ranks) < 2:
        return AnalyzerResult()
    per_step = d.groupby("step")["rank"].nunique()
    partial = sorted(int(s) for s, n in per_step.items() if n < len(ranks))
    g = d.groupby("rank")["step"].agg(["nunique", "min", "max"])
    by_rank = {int(r): (int(x["nunique"]), int(x["min"]), int(x["max"])) for r, x in g.iterrows()}
    metrics = {"ranks_with_steps": len(ranks), "uneven": bool(partial)}
    if not partial:
        metrics["steps"] = by_rank[ranks[0]][0]
        return AnalyzerResult(metrics=metrics)

    sub = d[d["step"].isin(partial)]
    ranks_of = {int(s): tuple(sorted(int(r) for r in grp)) for s, grp in
                sub.groupby("step")["rank"]}
    segs = _segments(partial, ranks_of)
    short = sorted({r for _, _, rs in segs for r in ranks if r not in rs})
    workers = worker_exits.summarize(run.worker_exits())["workers"]
    stopped = [r for r in short if not ended_normally(run, r, workers)]

    groups: dict = {}
    for r, key in by_rank.items():
        groups.setdefault(key, []).append(r)
    ordered = sorted(groups.items(), key=lambda kv: (kv[0][0], kv[1][0]))
    metrics.update({
        "groups": [{"ranks": ranges(rs), "steps": n, "first": a, "last": b}
                   for (n, a, b), rs in ordered],
        "partial_steps": [{"first": a, "last": b, "ranks": ranges(rs)} for a, b, rs in segs],
        "short_ranks": ranges(short),
    })
    if stopped:  # those ranks stopped (failed, killed): the hang analyzer's finding says why
        metrics["ended_abnormally"] = ranges(stopped)
        return AnalyzerResult(metrics=metrics)

    after = _after_last_step(run, short, by_rank)
    metrics["collectives_after_last_step"] = {str(r): n for r, n in after.items()}

    ran = [f"{_rank_s(rs)} ran {n} step{'s' * (n != 1)} ({a}-{b})" if a != b else
           f"{_rank_s(rs)} ran {n} step{'s' * (n != 1)} ({a})"
           for (n, a, b), rs in ordered[:MAX_GROUPS]]
    if len(ordered) > MAX_GROUPS:
        ran.append(f"{len(ordered) - MAX_GROUPS} more groups of ranks (metrics.uneven_steps)")
    parts = [f"Ranks recorded different numbers of steps: {', '.join(ran)}"]
    for a, b, rs in segs[:MAX_GROUPS]:
        if len(rs) == 1:
            parts.append(f"{_span(a, b)} {'was' if a == b else 'were'} run by {_rank_s(rs)} "
                         f"alone: no other rank recorded {'it' if a == b else 'them'}, so "
                         f"per-step comparisons between ranks (stragglers) leave "
                         f"{'it' if a == b else 'them'} out and the job's step time there is "
                         f"{_rank_s(rs)}'s alone")
        elif rs:
            missing = [r for r in ranks if r not in rs]
            parts.append(f"{_span(a, b)} {'was' if a == b else 'were'} run by {_rank_s(rs)} "
                         f"only: per-step comparisons there are between those ranks, without "
                         f"{_rank_s(missing)}")
    if len(segs) > MAX_GROUPS:
        parts.append(f"{len(segs) - MAX_GROUPS} more runs of steps not every rank recorded "
                     f"(metrics.uneven_steps.partial_steps)")
    if after:
        logged = {}
        for r, n in after.items():
            logged.setdefault(by_rank[r][2] + 1, []).append(r)
        how = "; ".join(f"{_rank_s(rs)} logged {sum(after[r] for r in rs)} collective"
                        f"{'s' * (sum(after[r] for r in rs) != 1)} after {'its' if len(rs) == 1 else 'their'} "
                        f"last step, all under step {s}" for s, rs in sorted(logged.items()))
        parts.append(f"{how}, which is what a rank that ran out of inputs does under torch's "
                     f"Join context manager (DDP: `with model.join():`): it shadows its peers' "
                     f"collectives until they finish; uneven inputs (ranks given different "
                     f"numbers of batches)?")
    else:
        parts.append("uneven inputs (ranks given different numbers of batches)?")
    return AnalyzerResult(metrics=metrics, findings=[Finding(
        kind="uneven_steps", severity="info", ranks=short, message="; ".join(parts),
        evidence={k: metrics[k] for k in ("groups", "partial_steps", "short_ranks",
                                          "collectives_after_last_step")})])


def _after_last_step(run, short, by_rank) -> dict[int, int]:
    """{rank: collectives it logged with a step after its last recorded step} (>0 only)."""
    c = run.collectives()
    if c.empty or not {"rank", "step"} <= set(c.columns):
        return {}
    c = c[c["rank"].isin(short)]
    step = pd.to_numeric(c["step"], errors="coerce")
    last = c["rank"].map({r: by_rank[r][2] for r in short})
    n = c[step > last].groupby("rank").size()
    return {int(r): int(k) for r, k in n.items() if k > 0}
