"""Stragglers: ranks that make the others wait, with the cause named, and ranks starved of input.

In synchronous training every rank's step takes as long as the slowest one's, so step time
says nothing about who is slow. What differs is how a rank spends the step:

    own_ms  = step dur_ms − time waiting in collectives (analyzers/_lateness.py wait_ms: host
              blocked time, p2p waits of the pipeline included, or the device-side wait of
              device-timed collectives)
    busy_ms = own_ms − time waiting for input (data.jsonl wait_ms)

Peers are the ranks doing identical work: the same pipeline stage(s) (pp coordinate; without
pipelining every rank). Two per-step signals, each relative to the *other* peers:

    excess(r, s) = own_ms(r, s) − median of own_ms over r's other peers in step s
    late(r, s)   = median over r's collectives in step s of (its enqueue − the median enqueue
                   of the other members that are its peers): arrival lateness, clock-aligned —
                   the signal when waits are not seen on the host (async collectives)

Per signal and rank (analysed steps: warm-up and profiler window excluded, as step_time does):

    E      = median over the steps of the signal
    noise  = 1.4826 · median |x(s) − x(s−1)| / √2, pooled over every rank's own series: one
             step's noise, from the step-to-step variation
    scale  = max(noise, spread, FLOOR × median step); spread = 1.4826·MAD over the peer group
             of E, only in groups of ≥ SPREAD_MIN_GROUP ranks (systematic rank-to-rank offsets)
    score  = E / scale: how many steps' worth of noise the rank is behind, every step

A *chronic* straggler (a finding) has, for either signal, score ≥ SCORE and score·√n ≥
SIGNIFICANCE (n analysed steps: the median of a short run is itself noisy), E ≥ max(MIN_EXCESS ×
median step, MIN_EXCESS_MS), and the signal over that in ≥ CHRONIC of the analysed steps and in
at least CHRONIC_MIN_STEPS of them. Nothing here divides by a spread over ranks that two ranks
cannot have: on 2 ranks the excess is the difference of the two. Lateness alone is a straggler
only where the host-side waits agree: when collectives block the host (the peers wait per step
≥ HOST_WAIT_SEEN × its lateness), its peers must wait ≥ WAITER_SHARE × its lateness longer than
it does — a rank that arrives late while every rank waits the same is not holding anyone up
(its completion of the previous collective came later: shared cores). A rank whose signal passes
max(STEP_SCORE × noise, MIN_EXCESS × step, MIN_EXCESS_MS) in some steps only is *transient*
(metrics only). A whole stage slower than the others is stage imbalance (the pipeline analyzer), not a straggler.

The finding names the cause (analyzers/_straggler_cause.py: input wait, its own work on the CPU,
CPU wait of the training thread, device throttling, time off the CPU, or its own work) and the
waits it causes: per other rank, the part of its collective waits that the straggler's late
arrival explains (_lateness.waits_caused) — what exposed_comm then leaves out. A rank whose data
wait is a large share of its step is `data_starvation`; a straggler late for its input is
reported there.
"""

from __future__ import annotations

import math
import sys

import numpy as np

from trainprof._lazy import pd
from trainprof.rundir import series
from trainprof.analyzers import _lateness
from trainprof.analyzers import _straggler_episodes as _episodes
from trainprof.analyzers._memo import once
from trainprof.analyzers import _straggler_cause as cause
from trainprof.findings import AnalyzerResult, Finding
from trainprof.wording import ranks_phrase
from trainprof.analyzers.step_time import excluded_steps

NAME = "stragglers"
SCORE = 1.5          # E / scale for a chronic straggler (clean runs measured ≤ 1.1, injected
                     # stragglers 2.8-5.5: docs/stragglers-pipeline.md)
SIGNIFICANCE = 3.0   # ... and score · √n ≥ this (a 3-step median is noisy itself)
STEP_SCORE = 3.0     # one step's excess ≥ this × noise: a transient straggler in that step
FLOOR = 0.03         # scale floor: 3 % of the median step (synthetic runs with no noise)
MIN_EXCESS = 0.10    # ... and at least 10 % of the median step (docs/stragglers-pipeline.md:
                     # clean CPU runs on 2 shared cores measured up to ~9 % apart)
MIN_EXCESS_MS = 2.0  # ... and at least 2 ms per step: on steps of a few ms, what a shared host's
                     # scheduling adds (time slices of 0.75-3 ms) is a large share of the step
CHRONIC = 0.5        # share of analysed steps for a chronic straggler ...
CHRONIC_MIN_STEPS = 3  # ... and seen in at least this many steps (2 noisy steps are not a habit)
SPREAD_MIN_GROUP = 6   # the spread of E over the peer group joins the scale from this size on
DATA_SHARE = 0.10    # data wait ≥ 10 % of the step ...
DATA_MIN_MS = 20.0   # ... and ≥ 20 ms (median over analysed steps) → data starvation
WAITER_SHARE = 0.25  # a rank waits for the straggler: ≥ 25 % of its excess per step
HOST_WAIT_SEEN = 0.5  # peers' host-side wait ≥ this × a rank's lateness: waits are seen on the
                      # host, so lateness needs them to wait ≥ WAITER_SHARE of it more than it
P2P_OPS = ("send", "recv", "isend", "irecv")
MAX_PEER_EVIDENCE = 32  # per-peer entries kept in a finding's evidence (largest first; the
                        # count and median say what the rest are: summary.json at 1,000+ ranks)
SCHED_FIELDS = cause.SCHED_FIELDS
MAX_EPISODES = 8     # straggler episodes of one rank reported (the first ones)


def _kept(run, steps):
    excluded = excluded_steps(steps.drop_duplicates(["rank", "step"], keep="last"))
    drop = set(excluded["warmup"]) | set(excluded["profiler"])
    all_steps = sorted(int(s) for s in steps["step"].unique())
    kept = [s for s in all_steps if s not in drop]
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


def _table(run, groups_of) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(per rank and step table, the aligned collectives frame); ``groups_of(ranks)`` gives
    each rank's peer-group label (arrival lateness is against the rank's peers)."""
    steps = run.steps()
    if steps.empty:  # (the run's empty frame: no DataFrame built for a run without streams)
        return steps, steps
    if "dur_ms" not in steps.columns:
        return pd.DataFrame(), pd.DataFrame()
    cols = ["rank", "step", "dur_ms"] + [c for c in SCHED_FIELDS if c in steps.columns]
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


def _peer_groups(run, ranks) -> dict[int, str]:
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


def loo_median(v: np.ndarray) -> np.ndarray:
    """For each element, the median of the *other* elements (NaN for a single element)."""
    v = np.asarray(v, dtype=float)
    n = v.size
    if n < 2:
        return np.full(n, np.nan)
    order = np.argsort(v, kind="mergesort")
    s = v[order]
    k = np.empty(n, dtype=int)
    k[order] = np.arange(n)
    m = n - 1
    lo, hi = ((m - 1) // 2, (m - 1) // 2) if m % 2 else (m // 2 - 1, m // 2)
    pick = lambda j: s[j + (j >= k)]  # noqa: E731 - the j-th smallest of the others
    return (pick(lo) + pick(hi)) / 2.0


def grouped_loo_median(keys, v: np.ndarray) -> np.ndarray:
    """loo_median within each group of equal ``keys`` (arrays of one length), vectorized: in a
    group sorted by value, the median of the others of the element at position k picks from the
    sorted values skipping k. NaN for a group of one."""
    v = np.asarray(v, dtype=float)
    out = np.full(v.size, np.nan)
    if v.size == 0:
        return out
    order = np.lexsort((v,) + tuple(np.asarray(k) for k in reversed(keys)))
    sk = [np.asarray(k)[order] for k in keys]
    new = np.ones(v.size, bool)
    new[1:] = np.any([k[1:] != k[:-1] for k in sk], axis=0)
    start = np.maximum.accumulate(np.where(new, np.arange(v.size), 0))
    gid = np.cumsum(new) - 1
    n = np.bincount(gid)[gid]
    pos = np.arange(v.size) - start
    s = v[order]
    m = n - 1
    odd = m % 2 == 1
    lo = np.where(odd, (m - 1) // 2, np.maximum(m // 2 - 1, 0))
    hi = np.where(odd, lo, m // 2)

    def other(j):
        return s[np.minimum(start + j + (j >= pos), v.size - 1)]

    med = (other(lo) + other(hi)) / 2.0
    out[order] = np.where(m >= 1, med, np.nan)
    return out


def _residuals(t: pd.DataFrame, groups: dict[int, str]) -> pd.DataFrame:
    """Per (rank, step): excess = own − median own of the rank's other peers in that step."""
    t = t.copy()
    t["group"] = t["rank"].map(groups)
    t["step_med"] = t["step"].map(t.groupby("step")["dur_ms"].median())
    keys = [pd.factorize(t["group"])[0], t["step"].to_numpy()]
    t["peer_own_ms"] = grouped_loo_median(keys, t["own_ms"].to_numpy(float))
    t["peer_busy_ms"] = grouped_loo_median(keys, t["busy_ms"].to_numpy(float))
    t["excess_ms"] = t["own_ms"] - t["peer_own_ms"]
    t["rel_excess"] = t["excess_ms"] / t["step_med"]
    return t


def noise_ms(k: pd.DataFrame, col: str) -> float:
    """One step's noise of a signal: 1.4826 · median |x(s) − x(s−1)| / √2 over consecutive
    analysed steps of every rank's own series, pooled (NaN without two steps anywhere)."""
    v = k.dropna(subset=[col]).sort_values(["rank", "step"])
    d = v.groupby("rank")[col].diff().abs().dropna().to_numpy(dtype=float)
    return 1.4826 * float(np.median(d)) / math.sqrt(2) if d.size else float("nan")


def judge(k: pd.DataFrame, col: str, step_ms: float) -> tuple[dict[int, dict], float]:
    """Per rank: E, n, scale, score, status and the steps that count, for signal ``col`` of the
    analysed-steps table ``k`` (columns rank, step, group, col). Returns (per rank, noise)."""
    noise = noise_ms(k, col)
    nz = 0.0 if math.isnan(noise) else noise
    floor = max(MIN_EXCESS * step_ms, MIN_EXCESS_MS)
    v = k.dropna(subset=[col])
    if v.empty:
        return {}, noise
    v = v.assign(over=v[col] >= floor)
    v = v.assign(strong=v["over"] & (v[col] >= STEP_SCORE * nz))
    g = v.groupby("rank")
    per = pd.DataFrame({"E": g[col].median(), "n": g[col].size(), "group": g["group"].first(),
                        "over_frac": g["over"].mean(), "over_n": g["over"].sum(),
                        "strong": g["strong"].any()})
    # spread of E over each peer group of ≥ SPREAD_MIN_GROUP ranks (1.4826·MAD)
    gm = per.groupby("group")["E"]
    dev = (per["E"] - gm.transform("median")).abs()
    spread = 1.4826 * dev.groupby(per["group"]).transform("median")
    spread = spread.where(gm.transform("size") >= SPREAD_MIN_GROUP, 0.0)
    per["scale"] = np.maximum.reduce([np.full(len(per), nz), spread.to_numpy(float),
                                      np.full(len(per), FLOOR * step_ms), np.full(len(per), 1e-9)])
    per["score"] = per["E"] / per["scale"]
    chronic = ((per["score"] >= SCORE) & (per["score"] * np.sqrt(per["n"]) >= SIGNIFICANCE)
               & (per["E"] >= floor) & (per["over_frac"] >= CHRONIC)
               & (per["over_n"] >= CHRONIC_MIN_STEPS))
    per["status"] = np.where(chronic, "chronic", np.where(per["strong"], "transient", "ok"))
    flagged = per.index[per["status"] != "ok"]
    hits = v[v["rank"].isin(flagged)]
    out = {}
    for r, row in per.iterrows():
        steps = []
        if row["status"] != "ok":
            h = hits[hits["rank"] == r]
            steps = [int(s) for s in h.loc[h["over" if row["status"] == "chronic" else "strong"], "step"]]
        out[int(r)] = {"E": float(row["E"]), "n": int(row["n"]), "scale": float(row["scale"]),
                       "score": float(row["score"]), "status": row["status"], "steps": steps}
    return out, noise


def _late_unconfirmed(r: int, lt: dict, med: pd.DataFrame, groups: dict) -> dict | None:
    """Arrival lateness the host-side waits contradict, or None. When collectives block the
    host (the peers' median wait per step is at least HOST_WAIT_SEEN of the lateness), ranks
    that wait for a late one wait longer than it does, by about its lateness; a rank that
    arrives late while everyone waits the same (on shared cores: its completion of the previous
    collective came later, not its work) is not holding anyone up. Waits not seen on the host
    (asynchronous collectives on a GPU) leave lateness as the only signal."""
    peers = [q for q, g in groups.items() if g == groups[r] and q != r and q in med.index]
    if not peers:
        return None
    own_wait = float(med.loc[r, "blocked_ms"])
    peer_wait = float(np.median([float(med.loc[q, "blocked_ms"]) for q in peers]))
    late = float(lt["E"])
    if late <= 0 or peer_wait < HOST_WAIT_SEEN * late or peer_wait - own_wait >= WAITER_SHARE * late:
        return None
    return {"late_ms": round(late, 3), "wait_ms": round(own_wait, 3),
            "peer_wait_ms": round(peer_wait, 3)}


def _lateness_evidence(fr, kept) -> dict[int, dict]:
    """Per rank over the analysed steps: mean / max arrival lateness vs the first member to
    arrive, and the share of instances it arrived last (collectives analyzer definitions)."""
    if fr.empty:
        return {}
    c = fr.loc[fr["complete"] & fr["step"].isin(kept), ["group", "ordinal", "t_enq", "rank"]]
    if c.empty:
        return {}
    inst = c.groupby(["group", "ordinal"])["t_enq"]
    first, last = inst.transform("min"), inst.transform("max")
    c = c.assign(late=c["t_enq"] - first, last=(c["t_enq"] >= last) & (last > first))
    g = c.groupby("rank")
    d = pd.DataFrame({"mean_ms": g["late"].mean(), "max_ms": g["late"].max(),
                      "last_frac": g["last"].mean()})
    return {int(r): {k: float(x) for k, x in row.items()} for r, row in d.iterrows()}


def _matrix(t, col, steps) -> dict[str, list]:
    w = t.pivot(index="rank", columns="step", values=col).reindex(columns=steps)
    # ms to the ns the records hold (summary.json size at 1,000+ ranks: 17 digits → 10)
    return {str(int(r)): [None if v != v else v for v in row.tolist()]
            for r, row in zip(w.index, np.round(w.to_numpy(dtype=float), 6))}


def _coords_text(c: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in c.items()) if c else "unknown mesh coordinates"


def _ranks_text(rs) -> str:
    """'rank 2', 'ranks 0, 1, 3', 'ranks 0–699, 701–1023' (trainprof.wording.ranks_phrase)."""
    return ranks_phrase(sorted(set(rs)))


def _waits_text(w: dict, late_rank: int) -> str:
    """'ranks 0, 1, 3 wait 62 ms/step in all_reduce for rank 2'."""
    if not w.get("waiters"):
        return ""
    ops = ", ".join(list(w["ops"])[:2]) or "collectives"
    verb = "wait" if len(w["waiters"]) > 1 else "waits"
    return (f"{_ranks_text(w['waiters'])} {verb} {cause.ms(w['wait_ms'])} ms/step in {ops} for "
            f"rank {late_rank} (median)")


def _caused(run, fr, r: int, kept, excess: float) -> dict:
    short = compact_steps(run, fr) if not fr.empty else set()
    c = _lateness.waits_caused(fr, r, kept, _lateness.compact_frame(run) if short else None,
                               short) if not fr.empty else {"by_rank": {}, "ops": {}}
    waiters = sorted(q for q, v in c["by_rank"].items() if v >= WAITER_SHARE * excess and v > 0)
    return {"by_rank": c["by_rank"], "ops": c["ops"], "waiters": waiters,
            "wait_ms": float(np.median([c["by_rank"][q] for q in waiters])) if waiters else 0.0}


def analyze(run) -> AnalyzerResult:
    return once(run, "analyzers.stragglers", _analyze)


def _over_steps(p: dict, per_rank: list[dict], k, ep: dict, cols) -> tuple[dict, list[dict]]:
    """Rank ``p``'s record and its peers' with their medians taken over the episode's steps
    only (the cause and the waits of a straggler for part of the run are those of its
    episode)."""
    sub = k[k["step"].isin(ep["steps"])]
    med = sub.assign(data_share=sub["data_ms"] / sub["dur_ms"]).groupby("rank")[
        list(cols) + ["data_share"]].median()

    def over(q: dict) -> dict:
        if q["rank"] not in med.index:
            return q
        m = med.loc[q["rank"]]
        out = {**q, "own_ms": float(m["own_ms"]), "busy_ms": float(m["busy_ms"]),
               "blocked_ms": float(m["blocked_ms"]), "p2p_ms": float(m["p2p_ms"]),
               "data_wait_ms": float(m["data_ms"]), "data_share": float(m["data_share"]),
               "step_ms": float(m["dur_ms"]), "peer_own_ms": _f(m["peer_own_ms"]),
               "peer_busy_ms": _f(m["peer_busy_ms"]), "rel_excess": _f(m["rel_excess"])}
        for c in SCHED_FIELDS:
            if c in q and c in m.index:
                out[c] = _f(m[c])
        return out

    size = {"excess_ms": ep["excess_ms"], "score": ep["score"]} if ep["signal"] == "own_time" \
        else {"late_ms": ep["excess_ms"], "late_score": ep["score"]}
    me = {**over(p), **size, "signal": ep["signal"],
          "straggling_steps": ep["steps"], "steps": len(ep["steps"]), "episode": ep}
    peers = [over(q) for q in per_rank if q["group"] == p["group"] and q["rank"] != p["rank"]]
    return me, peers


def capped_waits(by_rank: dict) -> dict:
    """A finding's per-peer waits: every entry up to MAX_PEER_EVIDENCE, else the largest ones,
    with ``waits_caused_count`` / ``waits_caused_median_ms`` over all of them."""
    items = sorted(((str(q), float(v)) for q, v in by_rank.items()), key=lambda kv: -kv[1])
    out = {"waits_caused_ms": dict(items[:MAX_PEER_EVIDENCE])}
    if len(items) > MAX_PEER_EVIDENCE:
        out["waits_caused_count"] = len(items)
        out["waits_caused_median_ms"] = float(np.median([v for _, v in items]))
    return out


def _full_waits(run) -> dict:
    """{late rank (or tuple of ranks): {rank: ms}} uncapped, kept beside the cached result."""
    cache = getattr(run, "_cache", None)
    return cache.setdefault("analyzers.stragglers.waits", {}) if cache is not None else {}


def waits_or_problem(run, analyzer: str) -> dict | None:
    """waits_for_stragglers, or None with a problem line (for analyzers that only refine a
    figure with it and keep the plain one when it fails)."""
    try:
        return waits_for_stragglers(run)
    except Exception as e:  # noqa: BLE001
        run.problems.append(f"{analyzer}: waits for stragglers unavailable ({type(e).__name__}: {e})")
        return None


def waits_for_stragglers(run) -> dict:
    """What exposed-communication judgments leave out: ``{"late": [ranks late for the others:
    chronic stragglers and input-starved ranks], "wait_ms": {rank: ms per step (median over the
    analysed steps) it waits in collectives for them}}``; empty lists/dicts when there is none.
    A straggler for part of the run (an episode, ``evidence.episode``) counts where its waits
    fall: with a profiler window (the figures exposed_comm judges), at its per-step rate when
    the window is inside the episode and not at all otherwise; without one (the collective
    log's whole-run figures), spread over the analysed steps."""
    late: set[int] = set()
    wait: dict[int, float] = {}
    res = analyze(run)
    full = _full_waits(run)
    window = [s for s in (res.metrics.get("excluded_steps") or {}).get("profiler") or []]
    n_kept = max(1, len(res.metrics.get("steps_analysed") or ()))
    for f in res.findings:
        ev = f.evidence or {}
        who = tuple(ev.get("late_for_input") or ([ev["rank"]] if "rank" in ev else []))
        ep = ev.get("episode")
        key = (f.kind, who) + ((ep["first"] if ep else None,) if f.kind == "straggler" else ())
        # the evidence keeps the largest waits only: the whole table from this analysis
        caused = full.get(key) or ev.get("waits_caused_ms") or {}
        if ep and window:
            caused = caused if _episodes.overlaps(ep, window) else {}
        elif ep:
            caused = {q: v * ep["steps"] / n_kept for q, v in caused.items()}
        if not caused:
            continue
        late.update(who)
        for q, v in caused.items():
            wait[int(q)] = wait.get(int(q), 0.0) + float(v)
    return {"late": sorted(late), "wait_ms": wait}


def _analyze(run) -> AnalyzerResult:
    t, fr = _table(run, lambda rs: _peer_groups(run, rs))
    if t.empty:
        return AnalyzerResult()
    kept, excluded = _kept(run, run.steps())
    ranks = sorted(int(r) for r in t["rank"].unique())
    groups = _peer_groups(run, ranks)
    scored = _residuals(t, groups)
    k = scored[scored["step"].isin(kept)]
    step_ms = float(k.groupby("step")["dur_ms"].median().median()) if not k.empty else 0.0
    by_excess, noise = judge(k, "excess_ms", step_ms)
    by_late, late_noise = judge(k, "late_ms", step_ms)
    lateness = _lateness_evidence(fr, kept)
    telemetry = cause.telemetry(run, kept)
    has_sched = all(c in k.columns for c in SCHED_FIELDS) and k["cpu_wait_ms"].notna().any()
    cols = ["own_ms", "busy_ms", "blocked_ms", "p2p_ms", "data_ms", "dur_ms", "peer_own_ms",
            "peer_busy_ms", "rel_excess"] + ([c for c in SCHED_FIELDS] if has_sched else [])
    per_rank = _per_rank(run, k, cols, groups, by_excess, by_late, lateness, telemetry, has_sched)
    starving = [p for p in per_rank if p["data_wait_ms"] >= DATA_MIN_MS and step_ms
                and p["data_share"] >= DATA_SHARE]

    episodes = _episodes.find_both(k, step_ms, noise, late_noise, sys.modules[__name__])
    _mark_episodic(per_rank, episodes, kept)
    findings, input_late = _straggler_findings(run, per_rank, episodes, k, kept, cols, fr,
                                               starving, has_sched)

    if starving:
        findings.append(_starvation_finding(starving, per_rank, input_late))
        _full_waits(run)[("data_starvation", tuple(sorted(input_late)))] = \
            _sum_waits(input_late.values())
    metrics = _metrics(run, t, scored, kept, excluded, step_ms, groups, per_rank,
                       (noise, late_noise), has_sched)
    _lateness.release_compact_frame(run)  # (the waits it gave are in the findings)
    return AnalyzerResult(metrics=metrics, findings=findings)


def _status(r: int, ex: dict | None, lt: dict | None, med,
            groups) -> tuple[str, str | None, dict | None, dict | None]:
    """A rank's (status, signal, judgment the signal comes from, unconfirmed lateness): the
    worse of its own-time and lateness judgments; lateness its peers' waits do not show is
    no signal."""
    status = "ok"
    for j in (ex, lt):
        if j and (j["status"] == "chronic" or (j["status"] == "transient" and status == "ok")):
            status = j["status"]
    unconfirmed = None
    if lt and lt["status"] != "ok" and not (ex and ex["status"] == lt["status"]):
        unconfirmed = _late_unconfirmed(r, lt, med, groups)
        if unconfirmed is not None:  # lateness the peers' waits do not show: no signal
            status = ex["status"] if ex else "ok"
    signal = ("own_time" if ex and ex["status"] == status
              else "lateness" if lt and lt["status"] == status and unconfirmed is None
              else None)
    j = ex if signal == "own_time" else lt if signal == "lateness" else ex
    return status, signal, j, unconfirmed


def _per_rank(run, k, cols, groups, by_excess, by_late, lateness, telemetry,
              has_sched) -> list[dict]:
    """Each rank's record over the analysed steps: its medians, judgments and status."""
    per_rank = []
    med = k.assign(data_share=k["data_ms"] / k["dur_ms"]).groupby("rank")[cols + ["data_share"]].median()
    kg = k.groupby("rank")
    n_steps, max_excess = kg.size(), kg["excess_ms"].max()
    for r in med.index:
        r = int(r)
        m = med.loc[r]
        ex, lt = by_excess.get(r), by_late.get(r)
        status, signal, j, unconfirmed = _status(r, ex, lt, med, groups)
        lat = lateness.get(r, {})
        n = int(n_steps[r])
        rec = {"rank": r, "group": groups[r], "coords": run.coords(r),
               "host": run.rank_meta(r).get("host"), "steps": n,
               "own_ms": float(m["own_ms"]), "busy_ms": float(m["busy_ms"]),
               "blocked_ms": float(m["blocked_ms"]), "p2p_ms": float(m["p2p_ms"]),
               "data_wait_ms": float(m["data_ms"]), "data_share": float(m["data_share"]),
               "step_ms": float(m["dur_ms"]),
               "peer_own_ms": _f(m["peer_own_ms"]), "peer_busy_ms": _f(m["peer_busy_ms"]),
               "excess_ms": ex["E"] if ex else None, "score": ex["score"] if ex else None,
               "late_ms": lt["E"] if lt else None, "late_score": lt["score"] if lt else None,
               "max_excess_ms": _f(max_excess[r]), "rel_excess": _f(m["rel_excess"]),
               "signal": signal, "straggling_steps": j["steps"] if j else [],
               "straggling_frac": len(j["steps"]) / n if j and n else 0.0,
               "status": status,
               "lateness_mean_ms": lat.get("mean_ms"), "lateness_max_ms": lat.get("max_ms"),
               "last_frac": lat.get("last_frac")}
        if unconfirmed is not None:
            rec["lateness_unconfirmed"] = unconfirmed
        if has_sched:
            for c in SCHED_FIELDS:
                rec[c] = _f(m[c])
        if r in telemetry:
            rec["telemetry"] = telemetry[r]
        per_rank.append(rec)
    return per_rank


def _metrics(run, t, scored, kept, excluded, step_ms, groups, per_rank, noises,
             has_sched) -> dict:
    """The analyzer's metrics: thresholds, per-rank records, statuses and per-step matrices."""
    noise, late_noise = noises
    shown = [s for s in sorted(int(x) for x in t["step"].unique()) if s not in excluded["warmup"]]
    metrics = {
        "steps_analysed": kept, "excluded_steps": excluded, "median_step_ms": step_ms,
        "peer_groups": {str(r): g for r, g in groups.items()},
        "thresholds": {"score": SCORE, "significance": SIGNIFICANCE, "step_score": STEP_SCORE,
                       "floor": FLOOR, "min_excess": MIN_EXCESS,
                       "min_excess_ms": MIN_EXCESS_MS,
                       "chronic": CHRONIC, "chronic_min_steps": CHRONIC_MIN_STEPS,
                       "spread_min_group": SPREAD_MIN_GROUP,
                       "data_share": DATA_SHARE, "data_min_ms": DATA_MIN_MS},
        "per_rank": per_rank,
        "chronic": [p["rank"] for p in per_rank if p["status"] == "chronic"],
        "episodic": [p["rank"] for p in per_rank if p["status"] == "episodic"],
        "transient": [p["rank"] for p in per_rank if p["status"] == "transient"],
        "steps": shown,
        "busy_ms_by_rank": _matrix(t, "busy_ms", shown),
        "wait_ms_by_rank": _matrix(t, "blocked_ms", shown),
        "data_ms_by_rank": _matrix(t, "data_ms", shown),
        "excess_ms_by_rank": _matrix(scored, "excess_ms", shown),
        "late_ms_by_rank": _matrix(t, "late_ms", shown),
        "noise_ms": _f(noise), "late_noise_ms": _f(late_noise),
        "has_data_stream": bool(not run.frame("data").empty),
        "has_collectives": bool(not run.collectives().empty),
        "has_sched": bool(has_sched),
    }
    if has_sched:
        metrics["cpu_wait_ms_by_rank"] = _matrix(t, "cpu_wait_ms", shown)
    return metrics


def _mark_episodic(per_rank: list[dict], episodes: dict, kept) -> None:
    """Each rank's episodes in its record; a rank slow for part of the run (and a chronic one
    that turned slow after the run's first steps) becomes ``episodic``."""
    for p in per_rank:
        eps = episodes.get(p["rank"], [])
        p["episodes"] = [{x: e[x] for x in ("first", "last", "excess_ms", "score", "signal")}
                         for e in eps]
        if not eps or (p["status"] == "chronic" and not _episodes.started_late(eps, kept)):
            continue  # (a chronic straggler slow from the start: the whole run is its stretch)
        p.update(status="episodic", signal=eps[0]["signal"],  # slow for part of the run (onset)
                 straggling_steps=[s for e in eps for s in e["steps"]])
        p["straggling_frac"] = len(p["straggling_steps"]) / p["steps"] if p["steps"] else 0.0


def _straggler_findings(run, per_rank, episodes, k, kept, cols, fr, starving, has_sched):
    """(straggler findings with onset / end, {rank: waits} of stragglers late for input): one
    per chronic straggler, one per episode of the others (the cause and waits over its steps)."""
    findings, input_late, ops_ms = [], {}, None
    for p in per_rank:
        if p["status"] not in ("chronic", "episodic"):
            continue
        for ep in ([None] if p["status"] == "chronic" else episodes[p["rank"]][:MAX_EPISODES]):
            q, peers = _over_steps(p, per_rank, k, ep, cols) if ep else (
                p, [q for q in per_rank if q["group"] == p["group"] and q["rank"] != p["rank"]])
            size = q["excess_ms"] if q["signal"] == "own_time" else q["late_ms"]
            if ops_ms is None and has_sched:
                ops_ms = _trace_ops_ms(run)
            why = cause.explain(q, peers, size, ops_ms)
            steps = ep["steps"] if ep else kept
            waits = _caused(run, fr, p["rank"], steps, size)
            if why["cause"] == "input" and p["rank"] in {x["rank"] for x in starving}:
                input_late[p["rank"]] = waits  # reported with the data starvation it is
                continue
            f = _straggler_finding(q, peers, size, why, waits, steps)
            _episodes.stamp(f, run, p, ep, kept)
            if ep:
                _episodes.judge_cause(f, p, ep, why)
            findings.append(f)
            _full_waits(run)[("straggler", (p["rank"],), ep["first"] if ep else None)] = \
                dict(waits["by_rank"])
    return findings, input_late


def _trace_ops_ms(run) -> dict[int, float]:
    """rank -> median time in torch ops per profiled step of a CPU job (comm_compute's
    compute_ms from the rank's trace digest); {} without profiler traces. On a GPU the ops run
    on the device, which says nothing of the training thread's CPU time."""
    try:
        if not run.profiler_traces():
            return {}
        digests = run.trace_digests("comm_compute")
    except Exception:  # noqa: BLE001 - comm_compute reports an unreadable trace
        return {}
    out = {}
    for r, d in digests.items():
        v = [x["compute_ms"] for x in d.get("rows") or []
             if isinstance(x, dict) and isinstance(x.get("compute_ms"), (int, float))]
        if d.get("kind") == "cpu" and v:
            out[int(r)] = float(np.median(v))
    return out


def _straggler_finding(p, peers, size, why, waits, kept) -> Finding:
    ranks = sorted([p["rank"]] + [q["rank"] for q in peers])
    if p["signal"] == "own_time":
        what = (f"{cause.ms(p['own_ms'])} ms of its own time per step vs "
                f"{cause.ms(p['peer_own_ms'])} ms for its peers (median excess {cause.ms(size)} ms "
                f"per step, score {p['score']:.1f})")
    else:
        what = (f"it issues its collectives {cause.ms(size)} ms after its peers (median per step, "
                f"score {p['late_score']:.1f})")
    wait_text = _waits_text(waits, p["rank"])
    ep = p.get("episode")
    kind = (f"a straggler from step {ep['first']}" + (f" to step {ep['last']}" if ep.get("over")
                                                       else " on") if ep else "a chronic straggler")
    msg = (f"rank {p['rank']} ({_coords_text(p['coords'])}, host {p['host']}) is {kind}: "
           f"{what} in {len(p['straggling_steps'])} of {p['steps']} analysed steps "
           + ("of that stretch " if ep else "")
           + f"(peer group {p['group']}: {_ranks_text(ranks)}); {why['text']}"
           + (f"; {wait_text}" if wait_text else
              "; the waits it causes are not in the collective log (async collectives: its peers "
              "wait on the device or at their next synchronization)")
           + (f"; it arrives last at {100 * p['last_frac']:.0f} % of its collectives"
              if p.get("last_frac") is not None else ""))
    ev = {"rank": p["rank"], "coords": p["coords"], "host": p["host"], "peer_group": p["group"],
          "peers": [q["rank"] for q in peers], "signal": p["signal"], "excess_ms": size,
          "own_ms": p["own_ms"], "peer_own_ms": p["peer_own_ms"],
          "busy_ms": p["busy_ms"], "peer_busy_ms": p["peer_busy_ms"],
          "score": p["score"], "late_ms": p["late_ms"], "late_score": p["late_score"],
          "rel_excess": p["rel_excess"], "straggling_steps": p["straggling_steps"],
          "analysed_steps": kept, "blocked_ms": p["blocked_ms"],
          "peer_blocked_ms": _f(np.median([q["blocked_ms"] for q in peers])) if peers else None,
          "data_wait_ms": p["data_wait_ms"], "cause": why["cause"], "cause_parts": why["parts"],
          "waiters": waits["waiters"], "waiters_wait_ms": waits["wait_ms"],
          **capped_waits(waits["by_rank"]), "waits_caused_by_op_ms": waits["ops"]}
    if ep:  # straggling for part of the run: its stretch (onset / end on the finding)
        ev["episode"] = {"first": ep["first"], "last": ep["last"], "steps": len(ep["steps"]),
                         "excess_ms": ep["excess_ms"], "score": ep["score"]}
        ev["straggling_steps"] = _episodes.compact(p["straggling_steps"])
    for c in SCHED_FIELDS:
        if c in p:
            ev[c] = p[c]
    if p.get("lateness_mean_ms") is not None:
        ev.update(lateness_mean_ms=p["lateness_mean_ms"], last_frac=p["last_frac"])
    if "telemetry" in p:
        ev["telemetry"] = p["telemetry"]
        ev["peer_telemetry"] = {q["rank"]: q["telemetry"] for q in peers if "telemetry" in q}
    return Finding("straggler", "warning", [p["rank"]], msg, evidence=ev)


def _starvation_finding(starving, per_rank, input_late) -> Finding:
    rs = [p["rank"] for p in starving]
    others = [p["data_wait_ms"] for p in per_rank if p["rank"] not in rs]
    late = "".join(f"; {_waits_text(w, r)}" for r, w in input_late.items() if w["waiters"])
    return Finding(
        "data_starvation", "warning", rs,
        f"{_ranks_text(rs)} wait{'' if len(rs) > 1 else 's'} for input "
        + ", ".join(f"{p['data_wait_ms']:.0f} ms ({100 * p['data_share']:.0f} % of the step)"
                    for p in starving)
        + " per step (median)"
        + (f", other ranks {np.median(others):.1f} ms" if others else "") + late
        + "; the whole job waits for the slowest input pipeline: add DataLoader workers, "
          "prefetch, or speed up the dataset",
        evidence={"ranks": {str(p["rank"]): {"data_wait_ms": p["data_wait_ms"],
                                             "data_share": p["data_share"],
                                             "coords": p["coords"], "host": p["host"]}
                            for p in starving},
                  "others_median_ms": _f(np.median(others)) if others else None,
                  "threshold_share": DATA_SHARE, "threshold_ms": DATA_MIN_MS,
                  **capped_waits(_sum_waits(input_late.values())),
                  "late_for_input": sorted(input_late)})


def _sum_waits(waits) -> dict[str, float]:
    out: dict[str, float] = {}
    for w in waits:
        for q, v in w["by_rank"].items():
            out[str(q)] = out.get(str(q), 0.0) + v
    return out


def _f(x):
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return None if np.isnan(v) else v
