"""The whole run over time: throughput and per-rank time per step, downsampled, and the problems
that start (and stop) part-way — a throughput drop, memory growing across the run.

Series (metrics, for the report's whole-run view; at most MAX_BINS columns whatever the run's
length, at most MAX_ROWS rows whatever the number of ranks, so summary.json stays small):

- ``bins``: per bin of consecutive analysed steps, its first/last step, wall time of its first
  step, the job's step time (median and max over the bin of the slowest rank's time per step)
  and steps/s (steps ÷ the bin's wall time);
- ``heatmap``: per rank (or per block of ranks, the block's worst) and bin, the median of the
  rank's own time per step (step − its waits in collectives; the step time without a
  collective log), the rows ordered by rank.

Findings with onset / end (analyzers/_changepoint.py segments):

- ``throughput_drop``: the job's step time x(s) (slowest rank, analysed steps, every step from
  the step records), segmented;
  walking the segments in order, the baseline b is the median of x over the last steps before
  that were not in a drop (the run's first level is the first baseline); consecutive segments
  whose median is ≥ max((1 + DROP) × b, b + MIN_DROP_MS), lasting ≥ max(MIN_LEN, MIN_FRAC of
  the steps, at most MAX_MIN_LEN) steps with a median over the threshold, are a drop, with the
  stragglers that start in it named (analyzers/stragglers.py episodes): a warning when one of
  them is slow of its own making, `info` when every rank slowed alike or their cause is host
  contention.
- ``memory_growth``: per rank, allocated device memory (else RSS) per step from memory.jsonl;
  growth when the last tenth's median exceeds the first tenth's (after warm-up) by
  ≥ max(GROWTH_SHARE × first, GROWTH_MIN_BYTES) and, from its onset (the start of the run of
  segments, each above the one before by ≥ ONSET_TOL of the growth, that ends the series; the
  level before it that much below the end too) on, the series rises in
  ≥ GROWTH_MONOTONE of its tenths: a leak keeps climbing, a cache that fills once levels off.
"""

from __future__ import annotations

import contextlib
import math
import warnings

import numpy as np

from trainprof.analyzers import _changepoint as cp, step_time, stragglers
from trainprof.analyzers import _onset, step_time, stragglers
from trainprof.analyzers._memo import once
from trainprof.findings import AnalyzerResult, Finding

NAME = "whole_run"
MAX_BINS = 200          # columns of every series
MAX_ROWS = 64           # heatmap rows (blocks of ranks beyond)
DROP = 0.20             # a throughput drop: step time ≥ 1.2 × the baseline ...
MIN_DROP_MS = 2.0       # ... and ≥ 2 ms more (scheduler noise of small steps on shared cores)
MIN_LEN = 10            # ... for at least 10 analysed steps and 20 % of them (at most 2,000):
MIN_FRAC = 0.20         # shorter slow stretches are bursts (slow_steps), or a shared host's load
MAX_MIN_LEN = 2000      # (measured: 2-core CI hosts under load slow one rank for 4-11 % of a run)
BASE_WINDOW = 10        # the baseline: the last 10 × MIN_LEN-or-1 % steps before a drop
GROWTH_SHARE = 0.10     # memory growth: last tenth ≥ first tenth × 1.10 ...
GROWTH_MIN_BYTES = 64 << 20  # ... and ≥ 64 MiB more
GROWTH_MONOTONE = 0.7   # ... rising in ≥ 70 % of consecutive tenths
ONSET_TOL = 0.01        # memory growth onset: a segment above the one before it by ≥ 1 % of the growth
MEMORY_MIN_STEPS = 50   # memory growth needs this many steps with samples


def analyze(run) -> AnalyzerResult:
    return once(run, "analyzers.whole_run", _analyze)


def _analyze(run) -> AnalyzerResult:
    steps, x = _job_steps(run, step_time)
    if steps.size < 2:
        return AnalyzerResult()
    sm = stragglers.analyze(run).metrics or {}
    starts = _onset.step_starts(run)
    metrics = {"steps": int(steps.size), "first_step": int(steps[0]), "last_step": int(steps[-1]),
               "bins": _bins(steps, x, starts), "heatmap": _heatmap(sm, steps),
               "thresholds": {"drop": DROP, "min_drop_ms": MIN_DROP_MS, "min_len": MIN_LEN,
                              "min_frac": MIN_FRAC, "growth_share": GROWTH_SHARE,
                              "growth_min_bytes": GROWTH_MIN_BYTES,
                              "growth_monotone": GROWTH_MONOTONE}}
    findings = _drops(run, steps, x, sm, metrics)
    findings += _memory_growth(run, metrics)
    return AnalyzerResult(metrics=metrics, findings=findings)


def _job_steps(run, step_time) -> tuple[np.ndarray, np.ndarray]:
    """(analysed steps, the job's step time per step: the slowest rank's), every step at full
    resolution from the run's step records (summary.json's own per-step series may be thinned)."""
    st = run.steps()
    if st.empty or not {"step", "dur_ms"} <= set(st.columns):
        return np.array([], int), np.array([])
    st = st.drop_duplicates(["rank", "step"], keep="last")
    ex = step_time.excluded_steps(st, step_time.overhead_spans(run))
    st = st[~st["step"].isin(step_time.excluded_set(ex))]
    g = st.groupby("step")["dur_ms"].max().sort_index()
    return g.index.to_numpy(dtype=int), g.to_numpy(dtype=float)


def _edges(n: int) -> np.ndarray:
    """Bin edges (indices) of n points into at most MAX_BINS bins of equal size."""
    k = min(n, MAX_BINS)
    return np.unique(np.linspace(0, n, k + 1).round().astype(int))


def _bins(steps, x, starts: dict) -> list[dict]:
    out = []
    e = _edges(steps.size)
    for a, b in zip(e[:-1], e[1:]):
        v = x[a:b]
        v = v[np.isfinite(v)]
        t0, t1 = starts.get(int(steps[a])), starts.get(int(steps[b - 1]))
        n = b - a
        rate = None
        if t0 is not None and t1 is not None and t1 > t0 and n > 1:
            rate = (n - 1) / ((t1 - t0) / 1e9)
        elif v.size:
            rate = 1e3 / float(np.mean(v)) if float(np.mean(v)) > 0 else None
        out.append({"first": int(steps[a]), "last": int(steps[b - 1]),
                    "time": _onset.iso(t0) if t0 is not None else None,
                    "step_ms": _r(np.median(v)) if v.size else None,
                    "max_ms": _r(np.max(v)) if v.size else None,
                    "steps_per_s": _r(rate) if rate else None})
    return out


@contextlib.contextmanager
def _quiet():
    """numpy's nan-reductions over an all-NaN slice warn through ``warnings`` (not errstate)."""
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def _heatmap(sm: dict, steps) -> dict:
    """Per rank (block) × bin: median own time per step (busy + input wait)."""
    busy, data = sm.get("busy_ms_by_rank") or {}, sm.get("data_ms_by_rank") or {}
    cols = [int(s) for s in sm.get("steps") or []]
    if not busy or not cols:
        return {}
    want = set(int(s) for s in steps)
    idx = np.array([i for i, s in enumerate(cols) if s in want], dtype=int)
    if idx.size == 0:
        return {}
    ranks = sorted(int(r) for r in busy)
    m = np.full((len(ranks), idx.size), np.nan)
    for i, r in enumerate(ranks):
        b = np.array([np.nan if v is None else v for v in busy[str(r)]], dtype=float)[idx]
        d = np.array([0.0 if v is None else v for v in (data.get(str(r)) or [0.0] * len(cols))],
                     dtype=float)[idx]
        m[i] = b + d
    e = _edges(idx.size)
    with _quiet():  # a rank that stopped early (crash, hang) has empty bins: NaN, no warning
        binned = np.stack([np.nanmedian(m[:, a:b], axis=1) for a, b in zip(e[:-1], e[1:])], axis=1)
    block = max(1, math.ceil(len(ranks) / MAX_ROWS))
    rows, labels = [], []
    for i in range(0, len(ranks), block):
        with _quiet():
            rows.append(np.nanmax(binned[i:i + block], axis=0))
        rs = ranks[i:i + block]
        labels.append(str(rs[0]) if len(rs) == 1 else f"{rs[0]}–{rs[-1]}")
    sel = [cols[i] for i in idx]
    return {"value": "own time per step (ms): step − collective waits" + (
                "; the worst rank of each block" if block > 1 else ""),
            "rows": labels, "ranks_per_row": block,
            "bins": [[sel[a], sel[b - 1]] for a, b in zip(e[:-1], e[1:])],
            "ms": [[None if not np.isfinite(v) else _r(v) for v in row] for row in rows]}


def _drops(run, steps, x, sm: dict, metrics: dict) -> list[Finding]:
    ok = np.isfinite(x)
    if ok.sum() < 2 * MIN_LEN:
        return []
    need = max(MIN_LEN, min(MAX_MIN_LEN, int(math.ceil(MIN_FRAC * steps.size))))
    segs, _ = cp.segments(x, min_size=max(2, need // 4))
    eps, base, thr = _drop_episodes(x, segs, need)
    metrics["baseline_step_ms"] = _r(base)
    out = []
    episodic = {p["rank"]: p.get("episodes") or [] for p in sm.get("per_rank") or []}
    contention = {r for r, es in episodic.items() if es and all(q.get("external") for q in es)}
    for e in eps[:8]:
        first, last = int(steps[e["start"]]), int(steps[e["end"] - 1])
        med, base, thr = e["median"], e["base"], e["threshold"]
        # a straggler whose episode began with the drop (within its minimum length) caused it;
        # one that began well inside it came later and does not explain its start
        who = sorted(r for r, es in episodic.items()
                     if any(abs(q["first"] - first) <= need for q in es))
        later = {r: min(q["first"] for q in es if first + need < q["first"] <= last)
                 for r, es in episodic.items() if r not in who
                 and any(first + need < q["first"] <= last for q in es)}
        msg = (f"throughput dropped from step {first}"
               + (f" to step {last}" if e["end"] < steps.size else " on")
               + f": the job's step takes {med:.1f} ms (median) against {base:.1f} ms before "
               f"({base / med:.0%} of the steps per second; {e['end'] - e['start']} steps)")
        if who:
            msg += (f"; rank{'s' if len(who) > 1 else ''} {', '.join(map(str, who[:8]))} "
                    f"turned slow then (see the straggler finding)")
        else:  # no rank behind the others: the whole job slowed
            msg += ("; every rank slowed alike (no straggler): the hosts' load (other "
                    "processes), the input pipeline, storage or the network shared by all ranks")
        if later:
            msg += "; later in it " + ", ".join(
                f"rank {r} turned slow from step {s}" for r, s in sorted(later.items())[:8]) \
                + " (see the straggler finding)"
        own = [r for r in who if r not in contention]  # a straggler of the job's own making
        if who and not own:
            msg += "; its slowdown was another process competing for its CPUs (host contention)"
        f = Finding("throughput_drop", "warning" if own else "info", who, msg,
                    evidence={"first": first, "last": last, "steps": e["end"] - e["start"],
                              "step_ms": med, "baseline_ms": base, "threshold_ms": thr,
                              "ratio": med / base if base else None, "stragglers": who,
                              "later_stragglers": {str(r): s for r, s in later.items()}})
        _onset.stamp(f, run, first, last if e["end"] < steps.size else None,
                     over_after=max(1, need // 2))
        out.append(f)
    return out


def _drop_episodes(x, segs, need: int) -> tuple[list[dict], float, float]:
    """Stretches of segments slower than the level before them: walking the segments in order,
    the baseline is the median of x over the last ``BASE_WINDOW`` × need steps before, outside
    any drop; a segment at ≥ max((1 + DROP) × baseline, baseline + MIN_DROP_MS) starts or
    continues a drop. Returns (drops ≥ need steps long, the first baseline, its threshold)."""
    normal = np.zeros(x.size, bool)
    eps: list[dict] = []
    cur = None
    first_base = None
    for a, e, _ in segs:
        m = float(np.nanmedian(x[a:e]))  # a segment's level: its median (spikes skew a mean)
        idx = np.flatnonzero(normal[:a])[-BASE_WINDOW * need:]
        if idx.size < need:  # the run's first level is its baseline
            normal[a:e] = True
            cur = None
            continue
        base = float(np.median(x[idx])) if cur is None else cur["base"]
        first_base = base if first_base is None else first_base
        thr = max((1 + DROP) * base, base + MIN_DROP_MS)
        if m >= thr:
            if cur is None:
                cur = {"start": a, "end": e, "base": base, "threshold": thr}
                eps.append(cur)
            else:
                cur["end"] = e
        else:
            normal[a:e] = True
            cur = None
    out = []
    for ep in eps:
        v = x[ep["start"]:ep["end"]]
        if ep["end"] - ep["start"] >= need and float(np.nanmedian(v)) >= ep["threshold"]:
            out.append({**ep, "median": float(np.nanmedian(v))})
    base0 = float(np.nanmedian(x[normal])) if normal.any() else float(np.nanmedian(x))
    return out, (first_base if first_base is not None else base0), 0.0


def _memory_growth(run, metrics: dict) -> list[Finding]:
    out, seen = [], {}
    for rank in run.ranks:
        recs = [r for r in run.stream(rank, "memory") if r.get("event") is None
                and isinstance(r.get("step"), int)]
        key = "allocated_bytes" if any(isinstance(r.get("allocated_bytes"), int) for r in recs) \
            else "rss_bytes"
        pts = sorted((r["step"], r[key]) for r in recs if isinstance(r.get(key), int) and r["step"] >= 1)
        if len(pts) < MEMORY_MIN_STEPS:
            continue
        s = np.array([p[0] for p in pts])
        v = np.array([p[1] for p in pts], dtype=float)
        tenths = [float(np.median(c)) for c in np.array_split(v, 10)]
        grow = tenths[-1] - tenths[0]
        if grow < max(GROWTH_SHARE * tenths[0], GROWTH_MIN_BYTES):
            seen[str(rank)] = {"metric": key, "first_bytes": int(tenths[0]),
                               "last_bytes": int(tenths[-1])}
            continue
        # onset: the start of the rise that lasts to the end. Walking back from the last
        # segment while each one's level is above the one before it (by more than ONSET_TOL of
        # the growth: flat stretches cut into segments differ by less), the segment where that
        # stops is the level the memory grew from, and the onset is the next segment's start —
        # not a warm-up's rise long before, nor the start of a flat stretch. From there on the
        # level keeps rising (a cache that fills once levels off) and grows by the amount above
        segs, _ = cp.segments(v, min_size=max(2, len(v) // 50))
        k = len(segs) - 1
        while k > 0 and segs[k - 1][2] < segs[k][2] - ONSET_TOL * grow:
            k -= 1
        start = segs[k + 1][0] if k + 1 < len(segs) else segs[k][0]
        rising = _rising_share(v[start:])
        grew_since = float(np.median(v[-max(1, v.size // 10):])) - segs[k][2] \
            >= max(GROWTH_SHARE * tenths[0], GROWTH_MIN_BYTES)
        post = v[start:]
        seen[str(rank)] = {"metric": key, "first_bytes": int(tenths[0]), "last_bytes": int(tenths[-1]),
                           "rising_share": rising}
        if rising < GROWTH_MONOTONE or not grew_since:
            continue
        onset = int(s[start])
        per_step = (float(np.median(post[-max(1, post.size // 10):])) - float(v[max(0, start - 1)])) \
            / max(1, int(s[-1]) - onset)
        f = Finding("memory_growth", "warning", [rank],
                    f"rank {rank}: memory ({key.replace('_bytes', '')}) grows across the run, "
                    f"{tenths[0] / 2**20:.0f} MiB → {tenths[-1] / 2**20:.0f} MiB "
                    f"(+{grow / 2**20:.0f} MiB, ~{per_step / 2**10:.0f} KiB per step from step "
                    f"{onset}), rising in {rising:.0%} of the stretches since: a leak (tensors kept across steps: "
                    f"losses or outputs appended to a list, a growing cache)",
                    evidence={"metric": key, "first_bytes": tenths[0], "last_bytes": tenths[-1],
                              "growth_bytes": grow, "bytes_per_step": per_step,
                              "rising_share": float(rising)})
        out.append(_onset.stamp(f, run, onset, None))
    if seen:
        metrics["memory"] = seen if len(seen) <= MAX_ROWS else {
            k: seen[k] for k in sorted(seen, key=lambda k: -(seen[k]["last_bytes"] - seen[k]["first_bytes"]))[:MAX_ROWS]}
    if len(out) > 1:  # one finding for every rank that leaks
        ranks = sorted(r for f in out for r in f.ranks)
        f0 = max(out, key=lambda f: f.evidence["growth_bytes"])
        f0.ranks = ranks
        f0.message = f"{len(ranks)} ranks leak memory; worst " + f0.message
        f0.onset = min((f.onset for f in out), key=lambda o: o["step"])
        out = [f0]
    return out


def _rising_share(post: np.ndarray) -> float:
    """The share of consecutive parts of ``post`` (tenths; fewer, of at least 5 points, when
    short) whose median is above the previous part's."""
    parts = [float(np.median(c)) for c in np.array_split(post, min(10, max(2, post.size // 5)))]
    return float(np.mean(np.diff(parts) > 0))


def _r(v):
    try:
        v = float(v)
    except (TypeError, ValueError):
        return None
    return None if not np.isfinite(v) else round(v, 4)
