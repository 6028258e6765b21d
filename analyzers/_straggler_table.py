"""The per-(rank, step) table the stragglers analysis judges (analyzers/stragglers.py): each
rank's step time, collective waits (p2p hand-overs apart), data wait and arrival lateness against
its peers, from the collective log's per-collective detail and, for the steps the bounded
capture keeps no whole detail of, its compact per-step records; the analysed steps and the peer
groups (ranks doing identical work)."""

from __future__ import annotations

from trainprof._lazy import pd
from trainprof.rundir import series
from trainprof.analyzers import _lateness
from trainprof.analyzers import _straggler_cause as cause
from trainprof.analyzers.step_time import excluded_steps, overhead_spans

P2P_OPS = ("send", "recv", "isend", "irecv")


MIN_KEPT_WITHOUT_OVERHEAD = 20  # analysed steps left once the overhead spans' steps are out


def kept_steps(run, steps):
    """(the analysed steps, step_time's excluded steps): warm-up, profiler window and the steps
    trainprof's own work (trace export, NaN replay) or the job's profiler overlapped left out —
    those last only while at least MIN_KEPT_WITHOUT_OVERHEAD steps stay: a rank slow in every
    step is as slow beside the export, and a short run would have none left."""
    excluded = excluded_steps(steps.drop_duplicates(["rank", "step"], keep="last"),
                              overhead_spans(run))
    all_steps = sorted(int(s) for s in steps["step"].unique())
    base = set(excluded["warmup"]) | set(excluded["profiler"])
    kept = [s for s in all_steps if s not in set().union(base, *excluded.values())]
    if len(kept) < MIN_KEPT_WITHOUT_OVERHEAD:
        kept = [s for s in all_steps if s not in base]
    if not kept:  # a very short run: better some numbers than none
        kept = [s for s in all_steps if s >= 1] or all_steps
    return kept, excluded


def _raw_sum(run, df, field, ops=None) -> pd.DataFrame:
    """Sum of ``field`` per (rank, step) over the records of a raw stream frame."""
    if ops is not None and not df.empty:
        df = df[df["op"].isin(ops)] if "op" in df.columns else df.iloc[:0]
    if df.empty or field not in df.columns or "step" not in df.columns:
        return pd.DataFrame(columns=["rank", "step", field])
    d = df[["rank", "step", field]].copy()
    d[field] = pd.to_numeric(d[field], errors="coerce").fillna(0.0)
    d = d.dropna(subset=["step"])
    d["step"] = d["step"].astype(int)
    return d.groupby(["rank", "step"], as_index=False)[field].sum()


def table(run, groups_of) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(per rank and step table, the aligned collectives frame); ``groups_of(ranks)`` gives
    each rank's peer-group label (arrival lateness is against the rank's peers)."""
    steps = run.steps()
    if steps.empty:  # (the run's empty frame: no DataFrame built for a run without streams)
        return steps, steps
    if "dur_ms" not in steps.columns:
        return pd.DataFrame(), pd.DataFrame()
    cols = ["rank", "step", "dur_ms"] + [c for c in cause.SCHED_FIELDS if c in steps.columns]
    st = steps.drop_duplicates(["rank", "step"], keep="last")[cols].copy()
    st["step"] = st["step"].astype(int)
    coll = run.collectives()  # the job's own (no NaN-replay collectives)
    if coll.empty and st["rank"].nunique() > 1:
        run.problems.append("stragglers: no collective log (collectives.jsonl): the time ranks "
                            "wait for each other is unknown, so a straggler cannot be told from "
                            "the ranks waiting for it")
    fr = _lateness.frame(run) if not coll.empty else pd.DataFrame()
    if not fr.empty:
        blocked = _lateness.per_step(fr, "wait_ms", "sum").rename(columns={"wait_ms": "blocked_ms"})
        p2p = _lateness.per_step(fr.loc[fr["op"].isin(P2P_OPS), ["rank", "step", "wait_ms"]],
                                 "wait_ms", "sum").rename(
            columns={"wait_ms": "p2p_ms"})
        blocked, p2p = _beyond_detail(run, fr, blocked, p2p)
        fr = fr.assign(late_ms=_lateness.lateness(
            fr, groups_of(sorted(int(r) for r in fr["rank"].unique()))))
        late = _late_beyond_detail(run, fr, _lateness.per_step(fr, "late_ms", "median"),
                                   groups_of)
    else:
        if not coll.empty:
            run.problems.append(f"{run.path}/ranks/*/collectives.jsonl: records lack the fields "
                                "to align them; waits summed per rank, no arrival lateness")
        blocked = _raw_sum(run, coll, "blocked_ms")
        p2p = _raw_sum(run, coll, "blocked_ms", P2P_OPS).rename(columns={"blocked_ms": "p2p_ms"})
        late = pd.DataFrame(columns=["rank", "step", "late_ms"])
    data = run.frame("data")
    if not data.empty and not {"step", "wait_ms"} <= set(data.columns):
        run.problems.append(f"{run.path}/ranks/*/data.jsonl: records lack step/wait_ms; ignored")
    data = _raw_sum(run, data, "wait_ms").rename(columns={"wait_ms": "data_ms"})
    t = st
    for other in (blocked, p2p, data, late):
        t = t.merge(other.astype({"rank": int, "step": int}), on=["rank", "step"], how="left")
    for c in ("blocked_ms", "p2p_ms", "data_ms"):  # p2p_ms: part of blocked_ms (stage hand-overs)
        t[c] = pd.to_numeric(t[c], errors="coerce").fillna(0.0)
    t["late_ms"] = pd.to_numeric(t["late_ms"], errors="coerce")
    t["own_ms"] = (t["dur_ms"] - t["blocked_ms"]).clip(lower=0.0)
    t["busy_ms"] = (t["own_ms"] - t["data_ms"]).clip(lower=0.0)
    return t, fr


def _beyond_detail(run, fr, blocked, p2p):
    """Bounded capture keeps per-collective detail for the recent steps only: the blocked and
    p2p sums of every other step (and of a ring's partial first step) come from the compact
    per-step table (RunDir.collective_steps)."""
    if getattr(run, "resolution", None) is None or run.resolution() is None:
        return blocked, p2p
    cs = run.collective_steps()
    if cs.empty:
        return blocked, p2p
    have = fr.groupby(["rank", "step"]).size().rename("n_detail")
    out = []
    for frame, col, ops in ((blocked, "blocked_ms", None), (p2p, "p2p_ms", P2P_OPS)):
        c = cs if ops is None else cs[cs["op"].isin(ops)]
        g = c.groupby(["rank", "step"]).agg(v=("blocked_ms", "sum"), n=("count", "sum"))
        g = g.join(have, how="left")
        keep = g["n_detail"].isna() | (g["n_detail"] < g["n"])  # not (wholly) in the detail
        extra = g.loc[keep, ["v"]].rename(columns={"v": col}).reset_index()
        base = frame.merge(extra[["rank", "step"]], on=["rank", "step"], how="left",
                           indicator=True)
        base = frame[(base["_merge"] == "left_only").to_numpy()]
        out.append(pd.concat([base, extra], ignore_index=True))
    return out[0], out[1]


def compact_steps(run, fr) -> set[int]:
    """Steps some rank's per-collective detail does not hold whole (bounded capture): their
    collective figures come from the compact per-step records. Empty for a run without them."""
    cache = getattr(run, "_cache", None)
    key = "analyzers.stragglers.compact_steps"
    if cache is not None and key in cache:
        return cache[key]
    out: set[int] = set()
    if getattr(run, "resolution", None) is not None and run.resolution() is not None:
        cs = run.collective_steps()
        if not cs.empty:
            n = cs.groupby(["rank", "step"])["count"].sum()
            have = fr.groupby(["rank", "step"]).size() if not fr.empty else pd.Series(dtype=float)
            have = have.reindex(n.index)
            short = n.index[(have.isna() | (have < n)).to_numpy()]
            out = {int(s) for s in short.get_level_values("step")}
    if cache is not None:
        cache[key] = out
    return out


def _late_beyond_detail(run, fr, late, groups_of):
    """Arrival lateness of the steps the detail does not hold whole, from the compact per-step
    records (analyzers/_lateness.py compact_lateness: per (group, kind) the rank's mean enqueue
    against its other peers', clock-aligned), the median over its (group, kind) rows per step
    as the detail's is over its collectives."""
    short = compact_steps(run, fr)
    if not short:
        return late
    cf = _lateness.compact_frame(run)
    # what this analysis needed of the per-step collective table is derived now (the blocked
    # sums, the steps short of detail, the compact frame): its GB at 1,024 ranks go
    series.release_collective_steps(run)
    if cf.empty:
        return late
    m = cf["step"].isin(short).to_numpy()
    if not m.all():
        cf = cf[m]
    # the three columns per_step reads (a copy of the compact frame is ~250 MB at 1,024 ranks)
    late_ms = _lateness.compact_lateness(cf, groups_of(sorted(int(r) for r in cf["rank"].unique())))
    extra = _lateness.per_step(pd.DataFrame({"rank": cf["rank"].to_numpy(), "step": cf["step"].to_numpy(),
                                             "late_ms": late_ms.to_numpy()}), "late_ms", "median")
    del cf, late_ms
    keep = late[~late["step"].isin(short)] if len(late) else late
    return pd.concat([x for x in (keep, extra) if len(x)], ignore_index=True) \
        if len(keep) or len(extra) else late


def peer_groups(run, ranks) -> dict[int, str]:
    """rank -> label of the ranks doing identical work: same pp coordinate and same stages."""
    out = {}
    for r in ranks:
        meta = run.rank_meta(r)
        pp = (meta.get("coords") or {}).get("pp")
        stages = (meta.get("pipeline") or {}).get("stages") \
            or (meta.get("run_info") or {}).get("my_stages")
        if pp is None and not stages:
            out[r] = "all"
        else:
            out[r] = f"pp{pp}" + (f" stages {','.join(map(str, stages))}" if stages else "")
    return out
