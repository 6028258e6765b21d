"""The bubble a pipeline schedule should have: the papers' closed forms (GPipe, 1F1B,
interleaved, zero-bubble) and, for schedules whose backward is split in B and W, the idle share
of the run's own recorded action order replayed with balanced stages."""

from __future__ import annotations

import numpy as np

from trainprof.analyzers._pipeline_replay import idle_share

ORDER_FORMULA = ("replay of the schedule's action order with free hand-overs, every stage at "
                 "each kind's median span time (F, B = input gradient, W; the first stage's B at "
                 "its own)")


def theory(schedule: str | None, p: int | None, m: int | None, v: int = 1,
           fbw: dict | None = None, order_share: float | None = None) -> dict | None:
    """Theoretical bubble of a schedule: ratio = bubble ÷ ideal compute, share = of the window.
    ``fbw``: the median F, B (input gradient) and W (weight gradient) span times of the run, for
    the zero-bubble closed form (equal times when absent). ``order_share``: the idle share of the
    schedule's own action order replayed with balanced stages (_order_theory): the theory of a
    schedule whose backward is split in B and W, the closed form kept as ``paper``."""
    if not p or not m:
        return None
    name = (schedule or "").lower().replace("_", "").replace("-", "")
    paper = None
    if name in ("gpipe", "1f1b", "schedulegpipe", "schedule1f1b"):
        ratio, formula = (p - 1) / m, "(p-1)/m"
    elif "zerobubble" in name and "zbv" not in name or name in ("zb1p", "zbh1"):
        # Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024, arXiv 2401.10241), ZB-H1
        # (torch implements its ZB1P): bubble (p-1)(T_F+T_B-T_W) against 1F1B's
        # (p-1)(T_F+T_B+T_W); interleaving v stages per rank divides the warm-up by v as for
        # interleaved 1F1B (Narayanan et al. 2021)
        f, b, w = ((fbw or {}).get(k) for k in "FBW")
        if not (f and b and w) or f + b - w < 0:
            f = b = w = 1.0
        ratio = (p - 1) * (f + b - w) / (max(v, 1) * m * (f + b + w))
        formula = "(p-1)(F+B-W)/(v*m*(F+B+W))"
        paper = {"ratio": ratio, "share": ratio / (1 + ratio), "formula": formula}
    elif "interleaved" in name and "zero" not in name:
        ratio, formula = (p - 1) / (max(v, 1) * m), "(p-1)/(v*m)"
    elif not (order_share is not None and ("zbv" in name or "dualpipe" in name)):
        return None  # ZB-V without spans (zero only when F = B = W), unknown schedules
    if order_share is not None and (paper or "zbv" in name or "dualpipe" in name):
        # the paper's figures assume every stage computes F, B and W alike; torch's first stage
        # computes no input gradient (its B spans ~0), which leaves its rank idle in the steady
        # state: the schedule's own order with the run's times says what it should idle
        out = {"ratio": order_share / (1 - order_share) if order_share < 1 else None,
               "share": order_share, "formula": ORDER_FORMULA}
        return {**out, "paper": paper} if paper else out
    return {"ratio": ratio, "share": ratio / (1 + ratio), "formula": formula}


def order_theory(df, kept, pipes) -> tuple[float | None, dict]:
    """Schedules with a split backward (W spans: zero-bubble): the idle share of each rank's
    recorded action order — the schedule's, torch's runtime runs its pipeline_order as is —
    replayed with free hand-overs and balanced stages: every span at its kind's median time
    over the analysed steps and all stages, but the first stage's B (input gradient) at its own
    median (it has no input to differentiate: ~0). Median over (pipeline, step). Also the times."""
    k = df[df["step"].isin(kept) & (df["microbatch"] >= 0)]
    kind = k["kind"].astype(str)
    if k.empty or not (kind == "W").any():
        return None, {}
    d = (k["a_end"] - k["a_start"]).astype(float) / 1e6
    first = (k["stage"] == 0) & (kind == "B")
    times = {x: float(d[(kind == x) & ~first].median()) for x in "FBW" if ((kind == x) & ~first).any()}
    if first.any():
        times["B_first_stage"] = float(d[first].median())
    dur = np.where(first, times.get("B_first_stage", 0.0), kind.map(times).fillna(0.0))
    k = k.assign(dur=dur, pipe=k["rank"].map(lambda r: pipes[int(r)]))
    shares = []
    for _, g in k.groupby(["pipe", "step"]):
        sh = idle_share(zip(g["rank"].tolist(), g["a_start"].tolist(), g["stage"].tolist(),
                            g["microbatch"].tolist(), g["kind"].astype(str).tolist(),
                            g["dur"].tolist()))
        if sh is not None:
            shares.append(sh)
    return (float(np.median(shares)) if shares else None), {x: round(v, 4) for x, v in times.items()}


def fbw_times(df) -> dict | None:
    """Median span time of each of F, B, W (ms), when the run has W spans (zero-bubble)."""
    if "W" not in set(df["kind"].unique().tolist()):
        return None
    d = (df["a_end"] - df["a_start"]) / 1e6
    return {k: float(d[df["kind"] == k].median()) for k in "FBW" if (df["kind"] == k).any()}
