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

Parts: the per-(rank, step) table (analyzers/_straggler_table.py), the judgment and its
thresholds (_straggler_judge.py), episodes (_straggler_episodes.py), the findings and the
waits they cause (_straggler_findings.py); here the per-rank records, the metrics and
waits_for_stragglers.
"""

from __future__ import annotations

import numpy as np

from trainprof._lazy import pd
from trainprof.analyzers import _lateness
from trainprof.analyzers import _straggler_cause as cause
from trainprof.analyzers import _straggler_episodes as _episodes
from trainprof.analyzers import _straggler_judge as judging
from trainprof.analyzers._memo import once
from trainprof.analyzers._straggler_findings import (full_waits, opt_float, starvation_finding,
                                                     straggler_findings, sum_waits)
from trainprof.analyzers._straggler_table import kept_steps, peer_groups, table
from trainprof.findings import AnalyzerResult

NAME = "stragglers"


def analyze(run) -> AnalyzerResult:
    return once(run, "analyzers.stragglers", _analyze)


def _analyze(run) -> AnalyzerResult:
    t, fr = table(run, lambda rs: peer_groups(run, rs))
    if t.empty:
        return AnalyzerResult()
    kept, excluded = kept_steps(run, run.steps())
    ranks = sorted(int(r) for r in t["rank"].unique())
    groups = peer_groups(run, ranks)
    scored = judging.residuals(t, groups)
    k = scored[scored["step"].isin(kept)]
    step_ms = float(k.groupby("step")["dur_ms"].median().median()) if not k.empty else 0.0
    by_excess, noise = judging.judge(k, "excess_ms", step_ms)
    by_late, late_noise = judging.judge(k, "late_ms", step_ms)
    lateness = _lateness_evidence(fr, kept)
    telemetry = cause.telemetry(run, kept)
    has_sched = all(c in k.columns for c in cause.SCHED_FIELDS) and k["cpu_wait_ms"].notna().any()
    cols = ["own_ms", "busy_ms", "blocked_ms", "p2p_ms", "data_ms", "dur_ms", "peer_own_ms",
            "peer_busy_ms", "rel_excess"] + ([c for c in cause.SCHED_FIELDS] if has_sched else [])
    per_rank = _per_rank(run, k, cols, groups, by_excess, by_late, lateness, telemetry, has_sched)
    starving = [p for p in per_rank if p["data_wait_ms"] >= judging.DATA_MIN_MS and step_ms
                and p["data_share"] >= judging.DATA_SHARE]

    episodes = _episodes.find_both(k, step_ms, noise, late_noise, judging)
    _mark_episodic(per_rank, episodes, kept)
    findings, input_late = straggler_findings(run, per_rank, episodes, k, kept, cols, fr,
                                              starving, has_sched)

    if starving:
        findings.append(starvation_finding(starving, per_rank, input_late))
        full_waits(run)[("data_starvation", tuple(sorted(input_late)))] = \
            sum_waits(input_late.values())
    metrics = _metrics(run, t, scored, kept, excluded, step_ms, groups, per_rank,
                       (noise, late_noise), has_sched)
    _lateness.release_compact_frame(run)  # (the waits it gave are in the findings)
    return AnalyzerResult(metrics=metrics, findings=findings)


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
        status, signal, j, unconfirmed = judging.rank_status(r, ex, lt, med, groups)
        lat = lateness.get(r, {})
        n = int(n_steps[r])
        rec = {"rank": r, "group": groups[r], "coords": run.coords(r),
               "host": run.rank_meta(r).get("host"), "steps": n,
               "own_ms": float(m["own_ms"]), "busy_ms": float(m["busy_ms"]),
               "blocked_ms": float(m["blocked_ms"]), "p2p_ms": float(m["p2p_ms"]),
               "data_wait_ms": float(m["data_ms"]), "data_share": float(m["data_share"]),
               "step_ms": float(m["dur_ms"]),
               "peer_own_ms": opt_float(m["peer_own_ms"]),
               "peer_busy_ms": opt_float(m["peer_busy_ms"]),
               "excess_ms": ex["E"] if ex else None, "score": ex["score"] if ex else None,
               "late_ms": lt["E"] if lt else None, "late_score": lt["score"] if lt else None,
               "max_excess_ms": opt_float(max_excess[r]),
               "rel_excess": opt_float(m["rel_excess"]),
               "signal": signal, "straggling_steps": j["steps"] if j else [],
               "straggling_frac": len(j["steps"]) / n if j and n else 0.0,
               "status": status,
               "lateness_mean_ms": lat.get("mean_ms"), "lateness_max_ms": lat.get("max_ms"),
               "last_frac": lat.get("last_frac")}
        if unconfirmed is not None:
            rec["lateness_unconfirmed"] = unconfirmed
        if has_sched:
            for c in cause.SCHED_FIELDS:
                rec[c] = opt_float(m[c])
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
        "thresholds": {"score": judging.SCORE, "significance": judging.SIGNIFICANCE,
                       "step_score": judging.STEP_SCORE, "floor": judging.FLOOR,
                       "min_excess": judging.MIN_EXCESS, "min_excess_ms": judging.MIN_EXCESS_MS,
                       "chronic": judging.CHRONIC, "chronic_min_steps": judging.CHRONIC_MIN_STEPS,
                       "spread_min_group": judging.SPREAD_MIN_GROUP,
                       "data_share": judging.DATA_SHARE, "data_min_ms": judging.DATA_MIN_MS},
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
        "noise_ms": opt_float(noise), "late_noise_ms": opt_float(late_noise),
        "has_data_stream": bool(not run.frame("data").empty),
        "has_collectives": bool(not run.collectives().empty),
        "has_sched": bool(has_sched),
    }
    if has_sched:
        metrics["cpu_wait_ms_by_rank"] = _matrix(t, "cpu_wait_ms", shown)
    return metrics


def _mark_episodic(per_rank: list[dict], episodes: dict, kept) -> None:
    """Each rank's episodes in its record; a rank slow for part of the run (and a chronic one
    that turned slow after the first analysed step) becomes ``episodic``."""
    for p in per_rank:
        eps = episodes.get(p["rank"], [])
        p["episodes"] = [{x: e[x] for x in ("first", "last", "excess_ms", "score", "signal")}
                         for e in eps]
        if not eps or (p["status"] == "chronic" and not _episodes.started_late(eps, kept)):
            continue  # (a chronic straggler slow from the start: the whole run is its stretch)
        p.update(status="episodic", signal=eps[0]["signal"],  # slow for part of the run (onset)
                 straggling_steps=[s for e in eps for s in e["steps"]])
        p["straggling_frac"] = len(p["straggling_steps"]) / p["steps"] if p["steps"] else 0.0


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
    full = full_waits(run)
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
