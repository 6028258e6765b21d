"""Mixture-of-experts load balance under expert parallelism, from the always-on collective log.

With one or more experts per rank, a MoE layer moves tokens with all_to_all: a dispatch sends
each token to the rank of the expert its router chose, a combine sends the expert outputs back
(and their backward the gradients). The combine's input on a rank is what its experts computed:
the tokens it received in the dispatch. When routing is skewed these calls carry different
amounts on different ranks, and the busiest rank's experts compute the others' share while the
others wait for it inside the all_to_all.

Definitions: one *call* is the k-th all_to_all of a process group on each member (its ordinal,
as in analyzers/collectives.py). A call whose per-rank bytes differ across the group's ranks
carries routed tokens (dispatch, combine, their backward); calls with equal sizes on every rank
(the split-count exchange, a dispatch of equal batches) carry none of the imbalance and are left
out. Per step and rank: the bytes of those routed calls ÷ their number (``load``: what the rank's
experts received per call; the combine and the dispatch's backward each carry it). Imbalance factor = max load ÷
mean load over the group's ranks (the MoE literature's max/mean expert load; 1.0 = balanced).
A finding when the median step's factor ≥ IMBALANCE_FACTOR in at least half of the steps. Tokens
are bytes ÷ (hidden × dtype size) when run_info declares ``hidden``. The saving: with balanced
routing every rank carries the mean load, the busiest one (1 − mean/max) less; the time the other
ranks wait in these all_to_all calls (their ``blocked_ms``) is what it bounds.
"""

from __future__ import annotations

from trainprof._lazy import pd
from trainprof.findings import AnalyzerResult, Finding
from trainprof.wording import ranks_phrase

NAME = "expert_balance"
IMBALANCE_FACTOR = 1.5   # max/mean load; random top-1 routing of 512 tokens to 2 experts: ~1.04,
                         # of 512 to 8: ~1.25 (a capacity factor of 1.25 drops tokens beyond that)
CONSISTENT = 0.5         # ... in at least half of the steps with routed all_to_all
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4}


def _routed(df) -> pd.DataFrame:
    """The all_to_all records of calls whose bytes differ across the group's ranks."""
    a = df[df["op"] == "all_to_all"].copy()
    if "replay" in a:
        a = a[a["replay"].ne(True)]
    if a.empty:
        return a
    a["pg"] = a["pg"].astype(str)
    a = a.sort_values(["rank", "pg", "seq"])
    a["call"] = a.groupby(["rank", "pg"]).cumcount()
    members = a.groupby("pg")["rank"].nunique()
    per_call = a.groupby(["pg", "call"])["bytes"].agg(["min", "max", "count"])
    full = per_call["count"] == members.reindex(per_call.index.get_level_values("pg")).to_numpy()
    uneven = per_call[full & (per_call["max"] > per_call["min"])].index
    return a.set_index(["pg", "call"]).loc[lambda x: x.index.isin(uneven)].reset_index()


def _group(g: pd.DataFrame, steps_ms: float | None, hidden: int | None) -> dict | None:
    load = g.pivot_table(index="step", columns="rank", values="bytes", aggfunc="sum", fill_value=0)
    if load.empty or load.shape[1] < 2:
        return None
    mean = load.mean(axis=1)
    factor = (load.max(axis=1) / mean.where(mean > 0)).dropna()
    if factor.empty:
        return None
    calls = float(g.groupby("step")["call"].nunique().median())
    per_rank = load.median(axis=0) / max(calls, 1.0)  # per routed call: what its experts received
    busiest = [int(r) for r in per_rank.index if per_rank[r] >= IMBALANCE_FACTOR * per_rank.mean()]
    wait = g.pivot_table(index="step", columns="rank", values="blocked_ms", aggfunc="sum",
                         fill_value=0).median(axis=0)
    dtype = str(g["dtype"].mode().iloc[0]) if "dtype" in g and g["dtype"].notna().any() else None
    per_token = hidden * DTYPE_BYTES[dtype] if hidden and dtype in DTYPE_BYTES else None
    lo = float(per_rank.min())
    return {
        "imbalance_factor": round(float(factor.median()), 3),
        "max_over_min": round(float(per_rank.max()) / lo, 2) if lo > 0 else None,
        "steps": int(len(factor)),
        "steps_imbalanced": int((factor >= IMBALANCE_FACTOR).sum()),
        "bytes_per_call": {str(int(r)): int(v) for r, v in per_rank.items()},
        "tokens_per_call": {str(int(r)): int(v // per_token) for r, v in per_rank.items()}
        if per_token else None,
        "routed_calls_per_step": round(calls, 1),
        "busiest_ranks": busiest,
        "all_to_all_wait_ms_per_step": {str(int(r)): round(float(v), 2) for r, v in wait.items()},
        "busiest_share_cut": round(1 - float(per_rank.mean()) / float(per_rank.max()), 3),
        "step_ms": steps_ms,
    }


def analyze(run) -> AnalyzerResult:
    df = run.frame("collectives")
    if df.empty or not {"op", "pg", "seq", "bytes", "step", "rank"} <= set(df.columns):
        return AnalyzerResult()
    routed = _routed(df)
    if routed.empty:
        return AnalyzerResult()
    if "blocked_ms" not in routed:
        routed["blocked_ms"] = 0.0
    info = next((run.rank_meta(r).get("run_info") for r in run.ranks
                 if run.rank_meta(r).get("run_info")), None) or {}
    hidden = info.get("hidden") if isinstance(info.get("hidden"), int) else None
    st = run.steps()
    step_ms = float(pd.to_numeric(st["dur_ms"], errors="coerce").median()) \
        if not st.empty and "dur_ms" in st else None
    groups = {pg: m for pg, g in routed.groupby("pg")
              if (m := _group(g, step_ms, hidden)) is not None}
    findings = [_finding(pg, m) for pg, m in groups.items()
                if m["imbalance_factor"] >= IMBALANCE_FACTOR
                and m["steps_imbalanced"] >= CONSISTENT * m["steps"] and m["busiest_ranks"]]
    return AnalyzerResult(metrics={"groups": groups, "threshold": IMBALANCE_FACTOR},
                          findings=findings)


def _finding(pg: str, m: dict) -> Finding:
    busy = m["busiest_ranks"]
    others = {r: w for r, w in m["all_to_all_wait_ms_per_step"].items() if int(r) not in busy}
    wait = max(others.values(), default=0.0)
    load = m["tokens_per_call"] or m["bytes_per_call"]
    unit = "tokens" if m["tokens_per_call"] else "B"
    loads = ", ".join(f"rank {r} {v:,} {unit}" for r, v in sorted(load.items(), key=lambda kv: int(kv[0])))
    ratio = f" ({m['max_over_min']:.1f}× the least loaded)" if m["max_over_min"] else ""
    share = f", {wait / m['step_ms']:.0%} of the step" if m["step_ms"] else ""
    msg = (f"expert load imbalance: the router sends most tokens to the expert(s) of "
           f"{ranks_phrase(busy)}: each all_to_all of group {pg} that carries routed tokens "
           f"({m['routed_calls_per_step']:g} a step) moves what each rank's experts received: "
           f"{loads}; imbalance factor (max ÷ mean) {m['imbalance_factor']:.2f}"
           f"{ratio}, threshold {IMBALANCE_FACTOR}, in {m['steps_imbalanced']} of {m['steps']} "
           f"steps. The busiest expert computes the others' share while they wait for it in the "
           f"all_to_all (up to {wait:.1f} ms/step{share}). Balanced routing would cut its tokens "
           f"by {m['busiest_share_cut']:.0%} and save up to that wait: add an auxiliary "
           "load-balancing loss to the training loss (Switch Transformer, Fedus et al. 2022: "
           "α·E·Σ f_i·P_i, α ≈ 0.01) and cap each expert at a capacity factor of about 1.25 × "
           "tokens/experts (tokens over capacity are dropped or sent to their next choice)")
    return Finding(kind="expert_imbalance", severity="warning", ranks=busy, message=msg,
                   evidence={"process_group": pg, **m,
                             "estimate": {"saving_ms_per_step_up_to": round(wait, 2),
                                          "basis": "other ranks' wait in the routed all_to_all"}})
