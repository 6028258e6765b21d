"""Stragglers in time: when a rank's excess over its peers starts and stops.

A rank that turns slow part-way through a run (a node that degrades: thermal throttling, a
failing disk, a noisy neighbour) is in the minority of the run's steps, so the whole-run median
of its excess (analyzers/stragglers.py) misses it. Here each rank's per-step series
``excess_ms`` (own time − the median own time of its other peers, over the analysed steps in
step order) is cut into segments of constant mean (analyzers/_changepoint.py: binary
segmentation on a running median, noise from step-to-step differences). Consecutive segments
whose mean is over the straggler floor, max(MIN_EXCESS × median step, MIN_EXCESS_MS), form an
*episode* (episodes less than ``min_len`` apart merge); an episode is a straggler when, over its
own steps, it passes the chronic tests of the whole run: median excess / scale ≥ SCORE,
score·√n ≥ SIGNIFICANCE, the excess over the floor in ≥ CHRONIC of its steps, and it lasts
≥ ``min_len`` = max(MIN_LEN, min(MIN_FRAC × analysed steps, MAX_MIN_LEN)) steps. Its onset is the episode's first
step, its end the step after its last one (when that is not the end of the run). A stretch
explained by another process competing for the rank's CPUs (host contention: runnable but
waiting for a CPU, from /proc schedstat) while its own on-CPU time did not grow is `info`:
shared hosts do this to clean runs.
"""

from __future__ import annotations

import math

import numpy as np

from trainprof._lazy import pd
from trainprof.analyzers import _changepoint as cp, _onset

MIN_LEN = 10        # an episode lasts at least 10 analysed steps ...
MIN_FRAC = 0.20     # ... and 20 % of them, at most MAX_MIN_LEN: shorter stretches are bursts
OWN_CPU_MS = 1.0     # host contention with the rank's own on-CPU time grown by less than this
OWN_CPU_SHARE = 0.1  # ... and this share of its excess: another process's doing (info)
MAX_MIN_LEN = 2000  # (slow_steps), or a shared host's load — measured on 2-core CI hosts under
                    # load (load average 15-30): one rank slowed for 4-11 % of a clean run


def min_len(n: int) -> int:
    return max(MIN_LEN, min(MAX_MIN_LEN, int(math.ceil(MIN_FRAC * n))))


def find_both(k, step_ms: float, noise: float, late_noise: float, th) -> dict[int, list[dict]]:
    """Episodes of the own-time excess, else (ranks without one) of arrival lateness: the signal
    when collectives do not block the host (NCCL), where every rank's own time is its step.
    A lateness episode needs its peers' host-side waits not to contradict it, as the chronic
    test does: where collectives block the host, the own-time excess shows the same stretch."""
    own = find(k, step_ms, noise, th, "excess_ms")
    late = {} if _host_blocks(k) else find(k, step_ms, late_noise, th, "late_ms")
    out = {r: [dict(e, signal="own_time") for e in eps] for r, eps in own.items()}
    for r, eps in late.items():
        if r not in out:
            out[r] = [dict(e, signal="lateness") for e in eps]
    return out


def _host_blocks(k) -> bool:
    """Collectives block the host: the median rank waits ≥ 25 % of its median arrival lateness
    per step in them (then lateness without own-time excess is a shared host's jitter)."""
    if "blocked_ms" not in k.columns or "late_ms" not in k.columns:
        return True
    late = k["late_ms"].abs().median()
    return not np.isfinite(late) or float(k["blocked_ms"].median()) >= 0.25 * float(late)


def find(k, step_ms: float, noise: float, th, col: str = "excess_ms") -> dict[int, list[dict]]:
    """rank -> its straggler episodes of signal ``col``, each {"first", "last" (steps), "steps"
    (analysed steps in it), "excess_ms" (median of the signal), "score", "over_frac"}. ``k``:
    the analysed-steps table (rank, step, col); ``th``: the thresholds
    (analyzers/_straggler_judge.py)."""
    if k.empty or col not in k.columns or k[col].isna().all():
        return {}
    floor = max(th.MIN_EXCESS * step_ms, th.MIN_EXCESS_MS)
    scale = max(0.0 if not np.isfinite(noise) else noise, th.FLOOR * step_ms, 1e-9)
    w = k.pivot_table(index="rank", columns="step", values=col, aggfunc="last")
    steps = np.asarray(w.columns, dtype=int)
    n = steps.size
    need = min_len(n)
    out: dict[int, list[dict]] = {}
    m = w.to_numpy(dtype=float)
    # an episode needs ≥ CHRONIC of ≥ need steps over the floor: most ranks are ruled out here
    candidates = np.flatnonzero((np.nan_to_num(m, nan=-np.inf) >= floor).sum(axis=1)
                                >= th.CHRONIC * need)
    contention = None
    for r, row in zip(w.index[candidates], m[candidates]):
        eps = []
        found = _merged(cp.episodes(row, floor, need // 2 or 1), need)
        if found and col == "excess_ms":
            if contention is None:
                contention = _contention(k, th)
            found = _split_at_own_onset(found, row, contention.get(int(r)), steps, floor, need)
        for e in found:
            v = row[e["start"]:e["end"]]
            v = v[np.isfinite(v)]
            if v.size < need:
                continue
            med = float(np.median(v))
            score = med / scale
            over = float(np.mean(v >= floor))
            if score >= th.SCORE and score * math.sqrt(v.size) >= th.SIGNIFICANCE \
                    and over >= th.CHRONIC and med >= floor:
                eps.append({"first": int(steps[e["start"]]), "last": int(steps[e["end"] - 1]),
                            "steps": [int(s) for s in steps[e["start"]:e["end"]]],
                            "excess_ms": med, "score": score, "over_frac": over,
                            # over: normal again for a while before the run's last step
                            "over": bool(n - e["end"] >= max(1, need // 2))})
        if eps:
            out[int(r)] = eps
    return out


def _contention(k, th) -> dict:
    """rank -> {step: its CPU wait − the median CPU wait of its other peers that step, ≥ 0}
    (the part of its excess another process's use of its cores explains); {} without CPU-wait
    samples."""
    if "cpu_wait_ms" not in k.columns or not k["cpu_wait_ms"].notna().any():
        return {}
    keys = [pd.factorize(k["group"])[0], k["step"].to_numpy()]
    wait = k["cpu_wait_ms"].to_numpy(float)
    c = np.clip(np.nan_to_num(wait - th.grouped_loo_median(keys, wait)), 0.0, None)
    out: dict = {}
    for r, s, v in zip(k["rank"].to_numpy().tolist(), k["step"].to_numpy().tolist(), c.tolist()):
        out.setdefault(int(r), {})[int(s)] = v
    return out


def _split_at_own_onset(eps: list[dict], row, contention: dict | None, steps, floor: float,
                        need: int) -> list[dict]:
    """Episodes cut where the rank's own work turned slow: on a shared host another process can
    take a rank's cores for a while before (its excess then is time runnable but waiting for a
    CPU). The excess less that contention is segmented as the excess is; an episode whose own
    work episode starts later is cut there, the stretch before it left to stand on its own
    (a contention stretch shorter than ``need`` is a burst). Measured: 2 ranks at load ~8, rank
    1 given 6 ms of extra compute from step 600: its excess rose at step 522, all of it CPU
    wait (its CPU wait − its peer's: 4.5 ms; excess less that: 0.3 ms), its own work at 600."""
    if not contention:
        return eps
    c = np.array([contention.get(int(s), 0.0) for s in steps])
    own_eps = cp.episodes(np.where(np.isfinite(row), row - c, row), floor, need // 2 or 1)
    out = []
    for e in eps:
        o = next((x for x in own_eps if x["start"] < e["end"] and x["end"] > e["start"]), None)
        if o is not None and o["start"] > e["start"]:
            out += [{**e, "end": o["start"]}, {**e, "start": o["start"]}]
        else:
            out.append(e)
    return out


def _merged(eps: list[dict], gap: int) -> list[dict]:
    """Episodes less than ``gap`` steps apart joined (a straggler's brief respite is one
    episode)."""
    out: list[dict] = []
    for e in eps:
        if out and e["start"] - out[-1]["end"] < gap:
            out[-1] = {**out[-1], "end": e["end"]}
        else:
            out.append(dict(e))
    return out


def overlaps(ep: dict, steps) -> bool:
    return any(ep["first"] <= s <= ep["last"] for s in steps)


def compact(steps) -> list[list[int]]:
    """Sorted steps as [first, last] runs of consecutive steps (summary.json stays small)."""
    out: list[list[int]] = []
    for x in sorted(set(int(v) for v in steps)):
        if out and x == out[-1][1] + 1:
            out[-1][1] = x
        else:
            out.append([x, x])
    return out


def stamp(finding, run, p: dict, ep: dict | None, kept) -> None:
    """onset / end of a straggler finding: its episode's, or for a chronic straggler the first
    episode's start (the first analysed step when it was slow throughout) and, when its last
    episode is over, the step after it."""
    eps = p.get("episodes") or []
    if ep is None:
        first = eps[0]["first"] if eps else (kept[0] if kept else 0)
        over = bool(eps) and _last_over(eps[-1], kept)
        ep = {"first": first, "last": eps[-1]["last"] if eps else None, "over": over}
    finding.onset = _onset.at(run, ep["first"])
    if ep.get("over") and ep.get("last") is not None:
        nxt = [s for s in kept if s > ep["last"]]
        finding.end = _onset.at(run, nxt[0] if nxt else ep["last"] + 1)


def _last_over(ep: dict, kept) -> bool:
    after = [s for s in kept if s > ep["last"]]
    return len(after) >= max(1, min_len(len(kept)) // 2)


def started_late(eps: list[dict], kept) -> bool:
    """The first episode starts after the first analysed step: the rank turned slow during the
    run (reported "from step N on" with its onset, its cause and waits over its episodes). The
    steps before it are a segment of their own whose mean excess is under the floor: the rank
    was not straggling there, and its onset (``stamp``) is the episode's first step either way."""
    kept = list(kept)
    return bool(eps) and len(kept) > 0 and eps[0]["first"] > kept[0]


def judge_cause(finding, p: dict, ep: dict, why: dict) -> None:
    """A stretch of another process taking the rank's CPUs (host contention, and the rank's own
    on-CPU time grew by less than max(OWN_CPU_MS, OWN_CPU_SHARE × its excess): nothing of its
    own work changed) is the host's, not the job's: `info`. The rank's episode records its
    cause and whether it was external (the whole-run view names it)."""
    on_cpu = (why.get("parts") or {}).get("cpu_ms")
    external = why["cause"] == "host_contention" and (
        on_cpu is None or on_cpu < max(OWN_CPU_MS, OWN_CPU_SHARE * ep["excess_ms"]))
    for e in p.get("episodes") or []:
        if e["first"] == ep["first"]:
            e.update(cause=why["cause"], external=external)
    if external:
        finding.severity = "info"
