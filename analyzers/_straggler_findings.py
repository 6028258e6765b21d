"""The stragglers analysis's findings (analyzers/stragglers.py): one per chronic straggler and
one per episode of the others, with the cause over its steps (analyzers/_straggler_cause.py) and
the waits it causes its peers (_lateness.waits_caused), and one for the ranks starved of input;
the uncapped waits kept beside the cached result for waits_for_stragglers."""

from __future__ import annotations

import numpy as np

from trainprof.analyzers import _lateness
from trainprof.analyzers import _straggler_cause as cause
from trainprof.analyzers import _straggler_episodes as _episodes
from trainprof.analyzers import _straggler_judge as judging
from trainprof.analyzers._straggler_table import compact_steps
from trainprof.findings import Finding
from trainprof.wording import ranks_phrase

MAX_PEER_EVIDENCE = 32  # per-peer entries kept in a finding's evidence (largest first; the
                        # count and median say what the rest are: summary.json at 1,000+ ranks)
MAX_EPISODES = 8     # straggler episodes of one rank reported (the first ones)

# a chronic straggler whose first analysed step is this late: the per-step detail starts there
# (warm-up and profiler exclusions never reach it), so the steps before are not known
LATE_DETAIL_STEP = 100


def full_waits(run) -> dict:
    """{late rank (or tuple of ranks): {rank: ms}} uncapped, kept beside the cached result."""
    cache = getattr(run, "_cache", None)
    return cache.setdefault("analyzers.stragglers.waits", {}) if cache is not None else {}


def capped_waits(by_rank: dict) -> dict:
    """A finding's per-peer waits: every entry up to MAX_PEER_EVIDENCE, else the largest ones,
    with ``waits_caused_count`` / ``waits_caused_median_ms`` over all of them."""
    items = sorted(((str(q), float(v)) for q, v in by_rank.items()), key=lambda kv: -kv[1])
    out = {"waits_caused_ms": dict(items[:MAX_PEER_EVIDENCE])}
    if len(items) > MAX_PEER_EVIDENCE:
        out["waits_caused_count"] = len(items)
        out["waits_caused_median_ms"] = float(np.median([v for _, v in items]))
    return out


def _caused(run, fr, r: int, kept, excess: float) -> dict:
    """The waits rank ``r`` causes over ``kept``: per other rank and per op, and the ranks that
    wait for it (≥ WAITER_SHARE of its ``excess`` per step) with their median wait."""
    short = compact_steps(run, fr) if not fr.empty else set()
    c = _lateness.waits_caused(fr, r, kept, _lateness.compact_frame(run) if short else None,
                               short) if not fr.empty else {"by_rank": {}, "ops": {}}
    waiters = sorted(q for q, v in c["by_rank"].items()
                     if v >= judging.WAITER_SHARE * excess and v > 0)
    return {"by_rank": c["by_rank"], "ops": c["ops"], "waiters": waiters,
            "wait_ms": float(np.median([c["by_rank"][q] for q in waiters])) if waiters else 0.0}


def straggler_findings(run, per_rank, episodes, k, kept, cols, fr, starving, has_sched):
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
            full_waits(run)[("straggler", (p["rank"],), ep["first"] if ep else None)] = \
                dict(waits["by_rank"])
    return findings, input_late


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
               "step_ms": float(m["dur_ms"]), "peer_own_ms": opt_float(m["peer_own_ms"]),
               "peer_busy_ms": opt_float(m["peer_busy_ms"]),
               "rel_excess": opt_float(m["rel_excess"])}
        for c in cause.SCHED_FIELDS:
            if c in q and c in m.index:
                out[c] = opt_float(m[c])
        return out

    size = {"excess_ms": ep["excess_ms"], "score": ep["score"]} if ep["signal"] == "own_time" \
        else {"late_ms": ep["excess_ms"], "late_score": ep["score"]}
    me = {**over(p), **size, "signal": ep["signal"],
          "straggling_steps": ep["steps"], "steps": len(ep["steps"]), "episode": ep}
    peers = [over(q) for q in per_rank if q["group"] == p["group"] and q["rank"] != p["rank"]]
    return me, peers


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
    if not ep and kept and kept[0] >= LATE_DETAIL_STEP:
        # the per-step detail starts late (a long run's bounded capture keeps its last steps):
        # "chronic" is said of what was analysed, not of the steps before
        kind = (f"a straggler in every stretch of the analysed steps {kept[0]}–{kept[-1]} (the "
                f"run's per-step detail starts at step {kept[0]}; whether it was slow before is "
                f"not in it)")
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
          "peer_blocked_ms": (opt_float(np.median([q["blocked_ms"] for q in peers])) if peers
                              else None),
          "data_wait_ms": p["data_wait_ms"], "cause": why["cause"], "cause_parts": why["parts"],
          "waiters": waits["waiters"], "waiters_wait_ms": waits["wait_ms"],
          **capped_waits(waits["by_rank"]), "waits_caused_by_op_ms": waits["ops"]}
    if ep:  # straggling for part of the run: its stretch (onset / end on the finding)
        ev["episode"] = {"first": ep["first"], "last": ep["last"], "steps": len(ep["steps"]),
                         "excess_ms": ep["excess_ms"], "score": ep["score"]}
        ev["straggling_steps"] = _episodes.compact(p["straggling_steps"])
    for c in cause.SCHED_FIELDS:
        if c in p:
            ev[c] = p[c]
    if p.get("lateness_mean_ms") is not None:
        ev.update(lateness_mean_ms=p["lateness_mean_ms"], last_frac=p["last_frac"])
    if "telemetry" in p:
        ev["telemetry"] = p["telemetry"]
        ev["peer_telemetry"] = {q["rank"]: q["telemetry"] for q in peers if "telemetry" in q}
    return Finding("straggler", "warning", [p["rank"]], msg, evidence=ev)


def starvation_finding(starving, per_rank, input_late) -> Finding:
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
                  "others_median_ms": opt_float(np.median(others)) if others else None,
                  "threshold_share": judging.DATA_SHARE, "threshold_ms": judging.DATA_MIN_MS,
                  **capped_waits(sum_waits(input_late.values())),
                  "late_for_input": sorted(input_late)})


def sum_waits(waits) -> dict[str, float]:
    out: dict[str, float] = {}
    for w in waits:
        for q, v in w["by_rank"].items():
            out[str(q)] = out.get(str(q), 0.0) + v
    return out


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


def opt_float(x):
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return None if np.isnan(v) else v
