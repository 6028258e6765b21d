"""The stragglers analysis's judgment (analyzers/stragglers.py has the definitions): each rank's
per-step excess over the median of its other peers, one step's noise, and per signal and rank
its median E, scale, score and status (chronic, transient, ok), with the thresholds they are
held to; lateness the peers' host-side waits contradict is no signal."""

from __future__ import annotations

import math

import numpy as np

from trainprof._lazy import pd

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


def residuals(t: pd.DataFrame, groups: dict[int, str]) -> pd.DataFrame:
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


def rank_status(r: int, ex: dict | None, lt: dict | None, med,
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
