"""Slow steps: some steps of the job take much longer than the typical one — a checkpoint, an
evaluation, a garbage collection every N steps — and cost a material share of the job's time,
which the median step (and the throughput computed from it) does not show.

The steps are step_time's analysed steps (warm-up, profiler window, and the steps trainprof's
own work — its trace export, a NaN replay — or the job's own profiler overlapped excluded:
step_time ``excluded_steps`` / ``excluded_reasons``); x(s) is the job's step time (the slowest
rank's, step_time ``per_step``), m its median and σ = 1.4826 · MAD(x) the spread of the typical
step. A step right after an excluded one (step 1 after the warm-up, the step after the profiler
window's export) is never counted as slow: it still pays first-time costs (DDP's bucket
rebuild, the trace export's after-effects).

- *Periodic*: a class of steps s ≡ φ (mod P), 2 ≤ P ≤ PERIODIC_MAX_STEPS, with at least 3
  steps in the analysed range (analyzers/_periodic.py), is slow when at least PERIODIC_MIN of its steps (and at least half of them) are over
  m + max(PERIODIC_K · σ, (PERIODIC_RATIO − 1) · m, MIN_EXTRA_MS) and every one of them is
  over m. The class with the largest mean excess wins.
- *Otherwise*: the steps over m + max(K · σ, (RATIO − 1) · m, MIN_EXTRA_MS), when at least
  MIN_SLOW of them (recurrence), or fewer holding ≥ SINGLE_SHARE of the analysed time.

Either is a finding when the slow steps' time over the typical step, Σ (x(s) − m), is at least
SHARE of the analysed time Σ x. Who is slow in them, from the stragglers analyzer's per-step
columns (own time = step − collective waits, data wait; analyzers/stragglers.py): per rank, its
own time in the slow steps over its own median in the other analysed steps, summed; a rank whose
own time grew by ≥ OWN_SHARE of the slow steps' extra time is slow there, a rank whose
collective waits grew by ≥ WAIT_SHARE of it waits (never blamed). Input when the slow ranks'
data wait is ≥ half their extra own time. The throughput over all analysed steps (tokens ÷ mean
step: what the framework's own figure counts) is stated next to the one at the median step.
"""

from __future__ import annotations

import numpy as np

from trainprof.analyzers import _periodic as _periodic_search
from trainprof.findings import AnalyzerResult, Finding
from trainprof.wording import plural, ranks_phrase, verb
from trainprof.analyzers import _lateness, step_time, stragglers

NAME = "slow_steps"
RATIO = 2.0            # a slow step: ≥ 2 × the median step ...
K = 4.0                # ... and ≥ median + 4 σ (jitter of tiny steps on shared cores)
MIN_SLOW = 2           # at least this many slow steps (one hiccup is not a pattern) ...
SINGLE_SHARE = 0.30    # ... or fewer holding ≥ 30 % of the analysed time
PERIODIC_RATIO = 1.5   # a periodic class: ≥ PERIODIC_MIN steps ≥ 1.5 × median ...
PERIODIC_K = 2.0       # ... and ≥ median + 2 σ
PERIODIC_MIN = 3       # (and at least half the class), every step of it over the median
PERIODIC_MAX_STEPS = 10_000  # P at most (three steps 40,000 apart in a long run are no period)
MIN_EXTRA_MS = 10.0    # and a slow step is ≥ 10 ms over the median (a few ms of scheduler
                       # jitter on shared cores make a 2 ms step "3×" the median)
SHARE = 0.10           # finding: the slow steps' time over the median ≥ 10 % of the analysed time
OWN_SHARE = 0.5        # a rank is slow in them: its own time grew by ≥ 50 % of the extra time
WAIT_SHARE = 0.25      # a rank waits for them: its collective waits grew by ≥ 25 % of it
MAX_LISTED = 12        # steps named in a message
MAX_RANKS_EVIDENCE = 32  # per-rank entries kept in the evidence (the largest: 1,000+ ranks)


def _analysed(run):
    """(steps, job step time per step, edge steps, step_time's job metrics) or None."""
    st = step_time.analyze(run).metrics
    job = st.get("job") or {}
    if not st or job.get("from_excluded_steps"):
        return None
    per = st.get("per_step") or []
    steps = [int(p["step"]) for p in per]
    x = np.array([float(p["max_ms"]) for p in per], dtype=float)
    excluded = {int(s) for v in (st.get("excluded_steps") or {}).values() for s in v}
    edges = {s for s in steps if s - 1 in excluded}
    return steps, x, edges, job


def _periodic(steps, x, edges, m, sigma):
    """The slow class (P, φ, its steps) with the largest mean excess, or None."""
    lo = m + max(PERIODIC_K * sigma, (PERIODIC_RATIO - 1) * m, MIN_EXTRA_MS)
    return _periodic_search.slow_class(steps, x, edges, m, lo, PERIODIC_MIN, PERIODIC_MAX_STEPS)


def _who(run, slow: list[int], typical: list[int], extra_ms: float) -> dict:
    """Per rank over the slow steps: own-time, wait and data-wait growth (sums over the slow
    steps of the value − the rank's median over the typical steps); the ranks slow there, the
    ranks waiting, the ops they wait in, and the cause."""
    m = stragglers.analyze(run).metrics or {}
    shown = m.get("steps") or []
    col = {s: i for i, s in enumerate(shown)}
    if not shown or any(s not in col for s in slow):
        return {}
    si = [col[s] for s in slow]
    ti = [col[s] for s in typical if s in col]

    def grow(name):
        by_rank = m.get(name) or {}
        if not by_rank:
            return {}
        ranks = list(by_rank)
        a = np.array([[np.nan if v is None else float(v) for v in by_rank[r]] for r in ranks])
        with np.errstate(all="ignore"):
            base = np.nanmedian(a[:, ti], axis=1) if ti else np.zeros(len(ranks))
        d = np.nansum(a[:, si] - np.nan_to_num(base)[:, None], axis=1)
        return {int(r): float(v) for r, v in zip(ranks, d)}

    busy, wait, data = grow("busy_ms_by_rank"), grow("wait_ms_by_rank"), grow("data_ms_by_rank")
    ranks = sorted(busy)
    own = {r: busy[r] + data.get(r, 0.0) for r in ranks}
    n = max(1, len(slow))
    slow_ranks = [r for r in ranks if own[r] >= OWN_SHARE * extra_ms]
    waiting = [r for r in ranks if r not in slow_ranks and wait.get(r, 0.0) >= WAIT_SHARE * extra_ms]
    out = {"ranks": ranks, "slow_ranks": slow_ranks, "waiting_ranks": waiting,
           "own_extra_ms": _top({r: own[r] / n for r in ranks}),
           "wait_extra_ms": _top({r: wait.get(r, 0.0) / n for r in ranks}),
           "data_extra_ms": _top({r: data.get(r, 0.0) / n for r in ranks}),
           "has_collectives": bool(m.get("has_collectives"))}
    if slow_ranks:  # medians over the slow / waiting ranks, per slow step
        out["slow_own_ms"] = float(np.median([own[r] for r in slow_ranks])) / n
        out["slow_data_ms"] = float(np.median([data.get(r, 0.0) for r in slow_ranks])) / n
    if waiting:
        out["waiting_wait_ms"] = float(np.median([wait.get(r, 0.0) for r in waiting])) / n
    if slow_ranks:
        d = sum(data.get(r, 0.0) for r in slow_ranks)
        o = sum(own[r] for r in slow_ranks)
        out["cause"] = "input" if o > 0 and d >= 0.5 * o else "own_work"
    if waiting:
        out["wait_ops"] = _wait_ops(run, waiting, slow)
    return out


def _top(by_rank: dict) -> dict:
    """{rank: ms} as JSON keys, every rank up to MAX_RANKS_EVIDENCE, else the largest ones."""
    items = sorted(by_rank.items(), key=lambda kv: -abs(kv[1]))[:MAX_RANKS_EVIDENCE]
    return {str(r): v for r, v in sorted(items)}


def _wait_ops(run, ranks, steps) -> list[str]:
    """The collectives the waiting ranks wait in during the slow steps, most time first."""
    try:
        fr = _lateness.frame(run)
    except Exception:  # noqa: BLE001 - the collectives analyzer reports an unreadable log
        return []
    if fr.empty:
        return []
    w = fr.loc[fr["rank"].isin(ranks) & fr["step"].isin(steps), ["op", "wait_ms"]]
    ops = w.groupby("op")["wait_ms"].sum().sort_values(ascending=False)
    return [str(o) for o, v in ops.items() if v > 0][:3]


def _steps_text(steps) -> str:
    shown = ", ".join(map(str, steps[:MAX_LISTED]))
    return f"step{'s' * (len(steps) != 1)} {shown}" + (f" … and {len(steps) - MAX_LISTED} more"
                                                     if len(steps) > MAX_LISTED else "")


def _ms(v: float) -> str:
    return f"{v / 1e3:.2f} s" if v >= 1000 else f"{v:.0f} ms" if v >= 10 else f"{v:.1f} ms"


def _range(a: float, b: float) -> str:
    """'86–247 ms', '0.93–1.57 s', '120 ms–1.57 s'."""
    x, y = _ms(a), _ms(b)
    if x.split()[-1] == y.split()[-1]:
        return f"{x.split()[0]}–{y}"
    return f"{x}–{y}"


def _who_text(w: dict) -> str:
    if not w:
        return ""
    ranks, slow = w["ranks"], w["slow_ranks"]
    if len(ranks) == 1:
        return ""
    if not w["has_collectives"]:
        return ("who is slow in them is unknown: no collective log, so waiting cannot be told "
                "from working")
    if not slow:
        return (f"no rank's own time grew by half the extra time: the ranks wait in "
                f"{', '.join(w.get('wait_ops') or ['collectives'])} (communication is slow in "
                f"these steps)")
    grown = w["slow_own_ms"]
    if w.get("cause") == "input":
        data = w["slow_data_ms"]
        what = f"waiting for input: data wait +{_ms(data)} per slow step"
    else:
        what = f"its own work: +{_ms(grown)} per slow step" if len(slow) == 1 else \
            f"their own work: +{_ms(grown)} per slow step (median)"
    if len(slow) == len(ranks):
        if w.get("cause") == "input":
            return f"slow on every rank ({what})"
        return (f"slow on every rank (each rank's own time +{_ms(grown)} per slow step: work "
                f"every rank does, e.g. evaluation or checkpointing on all ranks)")
    text = f"slow on {ranks_phrase(slow)} only ({what})"
    if w["waiting_ranks"]:
        wr = w["waiting_ranks"]
        waited = w["waiting_wait_ms"]
        ops = ", ".join(w.get("wait_ops") or ["collectives"])
        text += (f"; {ranks_phrase(wr)} {verb(len(wr), 'waits', 'wait')} +{_ms(waited)} per "
                 f"slow step in {ops}")
    return text


def analyze(run) -> AnalyzerResult:
    got = _analysed(run)
    if got is None:
        return AnalyzerResult()
    steps, x, edges, job = got
    if len(x) < 3:
        return AnalyzerResult()
    m = float(np.median(x))
    sigma = 1.4826 * float(np.median(np.abs(x - m)))
    total = float(x.sum())
    if m <= 0 or total <= 0:
        return AnalyzerResult()
    hi = m + max(K * sigma, (RATIO - 1) * m, MIN_EXTRA_MS)
    by_step = dict(zip(steps, x))
    period = _periodic(steps, x, edges, m, sigma)
    if period is not None:
        p, phi, slow = period
    else:
        p = phi = None
        slow = [s for s, v in zip(steps, x) if v >= hi and s not in edges]
    excess = float(sum(by_step[s] - m for s in slow))
    share = excess / total
    recurring = period is not None or len(slow) >= MIN_SLOW
    if not slow or share < SHARE or (not recurring and share < SINGLE_SHARE):
        return AnalyzerResult()

    typical = [s for s in steps if s not in set(slow) and s not in edges]
    who = _who(run, slow, typical, excess)
    vals = [by_step[s] for s in slow]
    tokens = job.get("tokens_per_step")
    tps_med = job.get("tokens_per_s")
    tps_mean = tokens / (float(x.mean()) / 1e3) if tokens else None
    n = len(steps)
    when = f" (every {p} steps)" if p else ""
    same = _ms(min(vals)) == _ms(max(vals))
    rng = _ms(min(vals)) if same else _range(min(vals), max(vals))
    mid = f" (median {_ms(float(np.median(vals)))})" if len(vals) > 2 and not same else ""
    msg = (f"{_steps_text(slow)}{when} take {rng}{mid} vs a typical {_ms(m)} (median step): "
           f"{len(slow)} of {plural(n, 'analysed step')}, {100 * share:.0f} % of the analysed "
           f"time ({_ms(excess)} over the median of {_ms(total)})")
    wt = _who_text(who)
    if wt:
        msg += f"; {wt}"
    if tps_mean and tps_med:
        msg += (f"; throughput over all analysed steps {tps_mean:,.0f} tokens/s vs "
                f"{tps_med:,.0f} tokens/s at the median step (a framework's own figure counts "
                f"every step)")
    elif float(x.mean()) >= 1.1 * m:
        msg += (f"; the mean step is {_ms(float(x.mean()))} ({float(x.mean()) / m:.2f}× the "
                f"median): the job's throughput over all steps is that much below the median "
                f"step's")
    ev = {"slow_steps": slow, "period": p, "phase": phi, "analysed_steps": n,
          "median_ms": m, "mean_ms": float(x.mean()), "noise_ms": sigma,
          "threshold_ms": hi if p is None else m + max(PERIODIC_K * sigma,
                                                       (PERIODIC_RATIO - 1) * m, MIN_EXTRA_MS),
          "slow_ms": {str(s): by_step[s] for s in slow},
          "excess_ms": excess, "total_ms": total, "share": share,
          "edge_steps": sorted(edges),
          "tokens_per_s_median": tps_med, "tokens_per_s_mean": tps_mean,
          **{k: v for k, v in who.items() if k not in ("ranks", "has_collectives")}}
    ranks = who.get("slow_ranks") or who.get("ranks") or []
    metrics = {k: ev[k] for k in ("slow_steps", "period", "share", "median_ms", "mean_ms",
                                  "threshold_ms", "excess_ms", "total_ms")}
    metrics["thresholds"] = {"ratio": RATIO, "k": K, "min_slow": MIN_SLOW,
                             "single_share": SINGLE_SHARE, "periodic_ratio": PERIODIC_RATIO,
                             "periodic_k": PERIODIC_K, "periodic_min": PERIODIC_MIN,
                             "min_extra_ms": MIN_EXTRA_MS,
                             "share": SHARE}
    return AnalyzerResult(metrics=metrics,
                          findings=[Finding("slow_steps", "warning", ranks, msg, evidence=ev)])
