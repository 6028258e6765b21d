"""Stragglers: ranks slower than the peers doing the same work, and ranks starved of input.

In synchronous training every rank's step takes as long as the slowest one's, so step time
says nothing about who is slow. What differs is how a rank spends the step:

    busy_ms = step dur_ms − time blocked in collectives (collectives.jsonl blocked_ms, p2p
              waits of the pipeline included) − time waiting for input (data.jsonl wait_ms)

A straggler has more busy time than its *peers*: the ranks doing identical work, i.e. the same
pipeline stage(s) (pp coordinate; without pipelining every rank). Per analysed step (warm-up
and profiler window excluded, as step_time does):

    excess(step) = busy − median(busy of the rank's peer group in that step, itself included)
    E            = median of excess over the steps
    score        = E / max(1.4826 · MAD over ranks of E, FLOOR × median step)

A *chronic* straggler (a finding) has score ≥ SCORE, E ≥ MIN_EXCESS × median step and an
excess over MIN_EXCESS × step in ≥ CHRONIC of the analysed steps and in at least
CHRONIC_MIN_STEPS of them. A rank whose excess passes max(SCORE × scale, MIN_EXCESS × step)
in some steps only is *transient* (metrics only: one descheduled step on a busy host must not
raise a finding). A whole stage slower than the others is stage imbalance (the pipeline
analyzer emits it, this one never does), not a straggler here: peers share the stage. Time spent waiting for data is not
busy time; a rank whose data wait is a large share of its step is `data_starvation`.
Evidence: mesh coordinates, host, arrival lateness at collectives (clock-aligned, same
definition as the collectives analyzer), NVML telemetry when sampled.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from trainprof.findings import AnalyzerResult, Finding

NAME = "stragglers"
SCORE = 3.0          # robust z-like score for "slower than the peers" in one step
FLOOR = 0.03         # spread floor: 3 % of the median step (peers are often near-identical)
MIN_EXCESS = 0.10    # ... and at least 10 % of the median step (identical-work CPU ranks
                     # measured up to ~9 % apart in clean 8-rank runs on 2 shared cores)
CHRONIC = 0.5        # share of analysed steps for a chronic straggler ...
CHRONIC_MIN_STEPS = 3  # ... and seen in at least this many steps (2 noisy steps are not a habit)
DATA_SHARE = 0.10    # data wait ≥ 10 % of the step ...
DATA_MIN_MS = 20.0   # ... and ≥ 20 ms (median over analysed steps) → data starvation
TELEMETRY_FIELDS = ("sm_clock_mhz", "power_w", "temp_c", "sm_util_pct")
# NVML clock-event reasons that slow a busy GPU down (gpu_idle, app clocks etc. do not)
PERF_THROTTLES = {"sw_power_cap", "hw_slowdown", "sw_thermal", "hw_thermal", "hw_power_brake"}
P2P_OPS = ("send", "recv", "isend", "irecv")


def _kept(run, steps):
    from trainprof.analyzers.step_time import excluded_steps

    excluded = excluded_steps(steps.drop_duplicates(["rank", "step"], keep="last"))
    drop = set(excluded["warmup"]) | set(excluded["profiler"])
    all_steps = sorted(int(s) for s in steps["step"].unique())
    kept = [s for s in all_steps if s not in drop]
    if not kept:  # a very short run: better some numbers than none
        kept = [s for s in all_steps if s >= 1] or all_steps
    return kept, excluded


def _per_step_sum(run, df, name, field, ops=None) -> pd.DataFrame:
    """Sum of ``field`` per (rank, step) over the records of stream ``name`` (frame ``df``)."""
    if ops is not None and not df.empty:
        df = df[df["op"].isin(ops)] if "op" in df.columns else df.iloc[:0]
    if df.empty or field not in df.columns or "step" not in df.columns:
        if not df.empty:
            run.problems.append(f"{run.path}/ranks/*/{name}.jsonl: records lack step/{field}; ignored")
        return pd.DataFrame(columns=["rank", "step", field])
    d = df[["rank", "step", field]].copy()
    d[field] = pd.to_numeric(d[field], errors="coerce").fillna(0.0)
    d = d.dropna(subset=["step"])
    d["step"] = d["step"].astype(int)
    return d.groupby(["rank", "step"], as_index=False)[field].sum()


def _table(run) -> pd.DataFrame:
    steps = run.steps()
    if steps.empty or "dur_ms" not in steps.columns:
        return pd.DataFrame()
    st = steps.drop_duplicates(["rank", "step"], keep="last")[["rank", "step", "dur_ms"]].copy()
    st["step"] = st["step"].astype(int)
    coll = run.collectives()  # the job's own (no NaN-replay collectives)
    blocked = _per_step_sum(run, coll, "collectives", "blocked_ms")
    p2p = _per_step_sum(run, coll, "collectives", "blocked_ms", P2P_OPS).rename(
        columns={"blocked_ms": "p2p_ms"})
    data = _per_step_sum(run, run.frame("data"), "data", "wait_ms")
    t = (st.merge(blocked, on=["rank", "step"], how="left")
         .merge(p2p, on=["rank", "step"], how="left").merge(data, on=["rank", "step"], how="left"))
    t["blocked_ms"] = t["blocked_ms"].fillna(0.0)
    t["p2p_ms"] = t["p2p_ms"].fillna(0.0)  # part of blocked_ms: the pipeline's stage hand-overs
    t["wait_ms"] = t["wait_ms"].fillna(0.0)
    t["busy_ms"] = (t["dur_ms"] - t["blocked_ms"] - t["wait_ms"]).clip(lower=0.0)
    return t


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


def _residuals(t: pd.DataFrame, groups: dict[int, str]) -> pd.DataFrame:
    """Per (rank, step): excess = busy − median busy of the rank's peers in that step."""
    t = t.copy()
    t["group"] = t["rank"].map(groups)
    t["step_med"] = t["step"].map(t.groupby("step")["dur_ms"].median())
    t["peer_busy_ms"] = np.nan
    for _, g in t.groupby(["group", "step"]):
        if len(g) < 2:
            continue
        # the group's median with the rank itself included: a leave-one-out median would hold
        # the straggler for every *other* rank of a small group (of {a, b, S} the median is the
        # larger normal rank), biasing all of them negative and inflating the spread
        t.loc[g.index, "peer_busy_ms"] = float(g["busy_ms"].median())
    t["excess_ms"] = t["busy_ms"] - t["peer_busy_ms"]
    t["rel_excess"] = t["excess_ms"] / t["step_med"]
    return t


def _rank_scores(k: pd.DataFrame, step_ms: float) -> tuple[dict[int, float], float]:
    """Score per rank = its median excess over the steps / the spread of that median across
    ranks (1.4826·MAD, robust to the straggler itself), floored at FLOOR × median step:
    per-step busy time is noisy (±15 % under CPU contention) but a straggler is slower
    in most steps, so its median excess stands out while the others' hover near 0."""
    med = k.dropna(subset=["excess_ms"]).groupby("rank")["excess_ms"].median()
    if med.empty:
        return {}, float("nan")
    v = med.to_numpy(dtype=float)
    scale = max(1.4826 * float(np.median(np.abs(v - np.median(v)))), FLOOR * step_ms, 1e-6)
    return {int(r): float(x) / scale for r, x in med.items()}, scale


def _lateness(run, kept) -> dict[int, dict]:
    """Arrival lateness per rank (collectives analyzer definitions), {} when not computable."""
    try:
        from trainprof.analyzers import collectives as coll

        df = coll._frame(run)
        if df.empty:
            return {}
        lat = coll._lateness(df, coll._instances(df), kept)
        return {int(p["rank"]): p for p in lat.get("per_rank", [])}
    except Exception as e:  # noqa: BLE001 - corroborating evidence only
        run.problems.append(f"stragglers: arrival lateness unavailable ({type(e).__name__}: {e})")
        return {}


def _telemetry(run, kept) -> dict[int, dict]:
    out = {}
    for r in run.ranks:
        recs = [x for x in run.stream(r, "telemetry") if x.get("step") in kept]
        if not recs:
            continue
        d = {}
        for f in TELEMETRY_FIELDS:
            v = [float(x[f]) for x in recs if isinstance(x.get(f), (int, float))]
            if v:
                d[f] = float(np.median(v))
        thr = [x for x in recs if set(x.get("throttle") or []) & PERF_THROTTLES]
        if thr:
            d["throttle"] = sorted({t for x in thr for t in x["throttle"]} & PERF_THROTTLES)
            d["throttled_frac"] = len(thr) / len(recs)
        if d:
            out[r] = d
    return out


def _telemetry_text(mine: dict, peers: list[dict]) -> str:
    """'; GPU throttled (sw_thermal) in 80 % of samples, SM clock 1410 vs 1980 MHz ...'."""
    parts = []
    if mine.get("throttle"):
        parts.append(f"GPU throttled ({', '.join(mine['throttle'])}) in "
                     f"{100 * mine.get('throttled_frac', 0):.0f} % of samples")
    for f, label, unit in (("sm_clock_mhz", "SM clock", "MHz"), ("temp_c", "temperature", "°C"),
                           ("power_w", "power", "W")):
        peer = [q[f] for q in peers if isinstance(q.get(f), (int, float))]
        if isinstance(mine.get(f), (int, float)) and peer:
            parts.append(f"{label} {mine[f]:.0f} vs {np.median(peer):.0f} {unit} for its peers")
    return ("; " + ", ".join(parts)) if parts else ""


def _matrix(t, col, steps) -> dict[str, list]:
    w = t.pivot(index="rank", columns="step", values=col).reindex(columns=steps)
    return {str(int(r)): [None if pd.isna(v) else float(v) for v in row]
            for r, row in zip(w.index, w.to_numpy(dtype=float))}


def _coords_text(c: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in c.items()) if c else "unknown mesh coordinates"


def analyze(run) -> AnalyzerResult:
    t = _table(run)
    if t.empty:
        return AnalyzerResult()
    kept, excluded = _kept(run, run.steps())
    ranks = sorted(int(r) for r in t["rank"].unique())
    groups = _peer_groups(run, ranks)
    scored = _residuals(t, groups)
    k = scored[scored["step"].isin(kept)]
    step_ms = float(k.groupby("step")["dur_ms"].median().median()) if not k.empty else 0.0
    scores, scale = _rank_scores(k, step_ms)
    # spread of a single step's excess (pooled over ranks and steps): the transient threshold
    ex = k["excess_ms"].dropna().to_numpy(dtype=float)
    step_scale = max(1.4826 * float(np.median(np.abs(ex - np.median(ex)))) if ex.size else 0.0,
                     FLOOR * step_ms)
    lateness = _lateness(run, kept)
    telemetry = _telemetry(run, kept)

    per_rank, findings = [], []
    starving = []
    for r, g in k.groupby("rank"):
        r = int(r)
        score = scores.get(r)
        excess = _f(g["excess_ms"].median())
        over = g["excess_ms"] >= MIN_EXCESS * step_ms
        # transient: single steps whose excess alone stands out of the per-step noise
        strong = over & (g["excess_ms"] >= SCORE * step_scale)
        chronic = (score is not None and score >= SCORE and excess is not None
                   and excess >= MIN_EXCESS * step_ms and float(over.mean()) >= CHRONIC
                   and int(over.sum()) >= CHRONIC_MIN_STEPS)
        status = "chronic" if chronic else ("transient" if strong.any() else "ok")
        hit = over if chronic else strong
        frac = float(hit.mean()) if len(g) else 0.0
        data_med = float(g["wait_ms"].median())
        data_share = float((g["wait_ms"] / g["dur_ms"]).median()) if len(g) else 0.0
        lat = lateness.get(r, {})
        rec = {"rank": r, "group": groups[r], "coords": run.coords(r),
               "host": run.rank_meta(r).get("host"), "steps": int(len(g)),
               "busy_ms": float(g["busy_ms"].median()), "blocked_ms": float(g["blocked_ms"].median()),
               "p2p_ms": float(g["p2p_ms"].median()),
               "data_wait_ms": data_med, "data_share": data_share,
               "step_ms": float(g["dur_ms"].median()),
               "peer_busy_ms": _f(g["peer_busy_ms"].median()),
               "excess_ms": excess, "score": score,
               "max_excess_ms": _f(g["excess_ms"].max()), "rel_excess": _f(g["rel_excess"].median()),
               "straggling_steps": [int(s) for s in g.loc[hit, "step"]],
               "straggling_frac": frac, "status": status,
               "lateness_mean_ms": lat.get("mean_ms"), "lateness_max_ms": lat.get("max_ms"),
               "last_frac": lat.get("last_frac")}
        if r in telemetry:
            rec["telemetry"] = telemetry[r]
        per_rank.append(rec)
        if data_med >= DATA_MIN_MS and step_ms and data_share >= DATA_SHARE:
            starving.append(rec)

    for p in per_rank:
        if p["status"] != "chronic":
            continue
        peers = [q for q in per_rank if q["group"] == p["group"] and q["rank"] != p["rank"]]
        ev = {"rank": p["rank"], "coords": p["coords"], "host": p["host"], "peer_group": p["group"],
              "peers": [q["rank"] for q in peers], "busy_ms": p["busy_ms"],
              "peer_busy_ms": p["peer_busy_ms"], "excess_ms": p["excess_ms"],
              "score": p["score"], "rel_excess": p["rel_excess"],
              "straggling_steps": p["straggling_steps"], "analysed_steps": kept,
              "blocked_ms": p["blocked_ms"],
              "peer_blocked_ms": _f(np.median([q["blocked_ms"] for q in peers])) if peers else None,
              "data_wait_ms": p["data_wait_ms"]}
        late = ""
        if p["lateness_mean_ms"] is not None:
            peer_lat = [q["lateness_mean_ms"] for q in peers if q["lateness_mean_ms"] is not None]
            ev.update(lateness_mean_ms=p["lateness_mean_ms"], last_frac=p["last_frac"],
                      peer_lateness_mean_ms=_f(np.median(peer_lat)) if peer_lat else None)
            late = (f"; it arrives last at {100 * (p['last_frac'] or 0):.0f} % of its collectives "
                    f"(mean lateness {p['lateness_mean_ms']:.1f} ms"
                    + (f" vs {np.median(peer_lat):.1f} ms for its peers)" if peer_lat else ")"))
        if "telemetry" in p:
            ev["telemetry"] = p["telemetry"]
            ev["peer_telemetry"] = {q["rank"]: q["telemetry"] for q in peers if "telemetry" in q}
            late += _telemetry_text(p["telemetry"], list(ev["peer_telemetry"].values()))
        findings.append(Finding(
            "straggler", "warning", [p["rank"]],
            f"rank {p['rank']} ({_coords_text(p['coords'])}, host {p['host']}) is a chronic "
            f"straggler: {p['busy_ms']:.0f} ms of work per step vs a median of "
            f"{p['peer_busy_ms']:.0f} ms in its peer group ({p['group']}: ranks "
            f"{', '.join(map(str, sorted([p['rank']] + ev['peers'])))}; +{p['excess_ms']:.0f} ms, "
            f"score {p['score']:.1f}) in "
            f"{len(p['straggling_steps'])} of {p['steps']} analysed steps; its peers spend that "
            f"time waiting for it in collectives{late}", evidence=ev))

    if starving:
        rs = [p["rank"] for p in starving]
        others = [p["data_wait_ms"] for p in per_rank if p["rank"] not in rs]
        findings.append(Finding(
            "data_starvation", "warning", rs,
            f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} wait"
            f"{'' if len(rs) > 1 else 's'} for input "
            + ", ".join(f"{p['data_wait_ms']:.0f} ms ({100 * p['data_share']:.0f} % of the step)"
                        for p in starving)
            + " per step (median)"
            + (f", other ranks {np.median(others):.1f} ms" if others else "")
            + "; the whole job waits for the slowest input pipeline: add DataLoader workers, "
              "prefetch, or speed up the dataset",
            evidence={"ranks": {str(p["rank"]): {"data_wait_ms": p["data_wait_ms"],
                                                 "data_share": p["data_share"],
                                                 "coords": p["coords"], "host": p["host"]}
                                for p in starving},
                      "others_median_ms": _f(np.median(others)) if others else None,
                      "threshold_share": DATA_SHARE, "threshold_ms": DATA_MIN_MS}))

    shown = [s for s in sorted(int(x) for x in t["step"].unique()) if s not in excluded["warmup"]]
    metrics = {
        "steps_analysed": kept, "excluded_steps": excluded, "median_step_ms": step_ms,
        "peer_groups": {str(r): g for r, g in groups.items()},
        "thresholds": {"score": SCORE, "floor": FLOOR, "min_excess": MIN_EXCESS,
                       "chronic": CHRONIC, "chronic_min_steps": CHRONIC_MIN_STEPS,
                       "data_share": DATA_SHARE, "data_min_ms": DATA_MIN_MS},
        "per_rank": per_rank,
        "chronic": [p["rank"] for p in per_rank if p["status"] == "chronic"],
        "transient": [p["rank"] for p in per_rank if p["status"] == "transient"],
        "steps": shown,
        "busy_ms_by_rank": _matrix(t, "busy_ms", shown),
        "wait_ms_by_rank": _matrix(t, "blocked_ms", shown),
        "data_ms_by_rank": _matrix(t, "wait_ms", shown),
        "excess_ms_by_rank": _matrix(scored, "excess_ms", shown),
        "score_scale_ms": _f(scale), "step_scale_ms": _f(step_scale),
        "has_data_stream": bool(not run.frame("data").empty),
        "has_collectives": bool(not run.collectives().empty),
    }
    return AnalyzerResult(metrics=metrics, findings=findings)


def _f(x):
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return None if np.isnan(v) else v
