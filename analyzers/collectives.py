"""Collectives: bandwidth per op, size and group, the slowest groups, arrival lateness per rank,
log consistency, and exposed communication from the always-on collective log.

Input: every rank's collectives.jsonl and groups.jsonl (probes/collectives.py), aligned to
rank 0's clock with analyzers._clock. One *instance* of a collective is the same (group,
ordinal) on every member: the ordinal counts the group's collectives on that rank in seq
order, p2p ops excluded (p2p interleave differently on the two sides of a pipeline edge).

Time of an instance (docs/collectives.md): device_ms on GPU; on CPU the arrival-to-completion
time, from the last member's (aligned) enqueue to the earliest (aligned) end (an op cannot
finish before its last member arrives, and the first completion observed bounds it), which
is what the transfer itself took; each rank's own duration end − enqueue also includes its
wait for late members. Bandwidths follow nccl-tests: algbw = size / time, busbw = algbw × a
factor of the op and group size n (see BUS_FACTORS), with size = the bytes field (output size
for all_gather, input size for reduce_scatter / all_to_all, the buffer otherwise).
"""

from __future__ import annotations

import itertools

import math
from collections import Counter

import numpy as np

from trainprof._lazy import pd
from trainprof.analyzers._clock import offsets, uncertainty_ns
from trainprof.findings import AnalyzerResult, Finding
from trainprof.analyzers._memo import once
from trainprof.analyzers.step_time import excluded_set, excluded_steps, overhead_spans
from trainprof.analyzers import _ddp_buckets, estimates as est, step_time

NAME = "collectives"
P2P = ("send", "recv")
EXPOSED_FRACTION = 0.5  # blocked in collectives for at least this share of the step
NO_COMM_MIN_STEPS = 3   # a job of several ranks with no collective in this many steps each
TOP_GROUPS = 10
USED = ("rank", "step", "pg", "seq", "op", "bytes", "enqueue_ns", "end_ns", "blocked_ms",
        "device_ms", "peer", "async")


def bus_factor(op: str, n: int) -> float:
    """nccl-tests busbw / algbw ratio for op on a group of n ranks."""
    if n <= 1:
        return 0.0 if op not in P2P else 1.0
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"):
        return (n - 1) / n
    return 1.0  # broadcast, reduce, send/recv


def size_bucket(nbytes: float) -> int:
    """Upper bound of the power-of-two bucket holding nbytes (0 for empty messages)."""
    if not nbytes or nbytes <= 0:
        return 0
    return int(2 ** math.ceil(math.log2(nbytes)))


def _groups(run) -> dict[tuple[int, str], dict]:
    out = {}
    for r in run.ranks:
        for g in run.stream(r, "groups"):
            if "pg" in g:
                out[(r, str(g["pg"]))] = g
    return out


def _frame(run):
    """The aligned collectives frame (cached: the stragglers analyzer reads it too)."""
    return once(run, "analyzers.collectives.frame", _build_frame)


def _build_frame(run):
    df = run.collectives()
    if df.empty:
        return df
    need = ["step", "pg", "seq", "op", "bytes", "enqueue_ns", "end_ns", "blocked_ms"]
    missing = [c for c in need if c not in df.columns]
    if missing:
        run.problems.append(f"{run.path}/ranks/*/collectives.jsonl: records lack {missing}; "
                            "collective analysis skipped")
        return pd.DataFrame()
    # the columns the analyses use (a copy of every record's every field costs memory at scale)
    df = df[[c for c in USED if c in df.columns]].copy(deep=False)
    for c in ("device_ms", "peer", "async"):
        if c not in df.columns:
            df[c] = None
    # few groups, many records: codes; a record without a group is in group "None" (pandas'
    # string dtype would keep it missing, and missing keys fall out of the groupbys below)
    df["pg"] = df["pg"].astype(object).where(df["pg"].notna(), "None").astype(str).astype("category")
    if df["seq"].isna().any() or df["enqueue_ns"].isna().any():  # (a filter copies every column)
        df = df.dropna(subset=["seq", "enqueue_ns"])
    df["seq"] = df["seq"].astype(np.int64)
    groups = _groups(run)
    # group key, dim and size once per (rank, pg), not per record: a key names every member, so
    # building (or hashing) it per record costs records x group size (1,024-rank groups). The
    # key column is categorical: groupbys and merges work on its integer codes.
    df = df.reset_index(drop=True)
    gid = df.groupby(["rank", "pg"], sort=False, observed=True).ngroup().to_numpy()
    keys, dims, sizes, made, as_tuple = [], [], [], {}, {}
    for r, pg in df.drop_duplicates(["rank", "pg"])[["rank", "pg"]].itertuples(index=False):
        g = groups.get((int(r), pg))
        members = g.get("ranks") if g else None
        if type(members) is list:  # equal member lists are one object (rundir_streams)
            if id(members) not in as_tuple:
                as_tuple[id(members)] = (members, tuple(members))
            ranks = as_tuple[id(members)][1]
        else:
            ranks = tuple(members or ())
        if (pg, ranks) not in made:  # every member of a group names the same members
            made[(pg, ranks)] = f"{pg}:{','.join(map(str, ranks))}" if ranks else f"{pg}:?"
        keys.append(made[(pg, ranks)])
        dims.append(g.get("mesh_dim") if g else None)
        sizes.append(int(g.get("size") or len(ranks)) if g else 0)
    names = sorted(set(keys))
    code = {k: i for i, k in enumerate(names)}
    df["group"] = pd.Categorical.from_codes(np.array([code[k] for k in keys], dtype=np.int64)[gid]
                                            if len(keys) else np.zeros(0, np.int64),
                                            categories=names)
    df["gsize"] = np.array(sizes, dtype=np.int64)[gid]
    df["mesh_dim"] = pd.Series(np.array(dims, dtype=object)[gid], index=df.index, dtype=object)
    # clock alignment: offsets are applied to absolute ns, then made relative to keep float64 exact
    align = offsets(run)
    enq = df["enqueue_ns"].astype(np.int64).to_numpy()
    has_end = df["end_ns"].notna().to_numpy()
    end = np.where(has_end, pd.to_numeric(df["end_ns"], errors="coerce").fillna(0), enq)
    end = end.astype(np.int64)
    a_enq, a_end = enq.copy(), end.copy()
    ranks = df["rank"].to_numpy()
    # rows of one rank are contiguous (the frame is read rank by rank): align slice by slice
    order = np.argsort(ranks, kind="stable")
    bounds = np.flatnonzero(np.diff(ranks[order])) + 1
    for sl in np.split(order, bounds):
        if not len(sl):
            continue
        fn = align[int(ranks[sl[0]])]
        a_enq[sl] = np.asarray(fn(enq[sl]), dtype=np.int64)
        a_end[sl] = np.asarray(fn(end[sl]), dtype=np.int64)
    base = int(a_enq.min())
    df["t_enq"] = (a_enq - base) / 1e6  # ms since the first op, reference clock
    df["t_end"] = np.where(has_end, (a_end - base) / 1e6, np.nan)
    df["dur_ms"] = df["t_end"] - df["t_enq"]
    df["p2p"] = df["op"].isin(P2P)
    order = np.lexsort((df["seq"].to_numpy(), df["pg"].cat.codes.to_numpy(), df["rank"].to_numpy()))
    if not (order[1:] > order[:-1]).all():  # one group per rank is in order already: no copy
        df = df.take(order)
    df = df.reset_index(drop=True)
    ordinal = np.full(len(df), -1, dtype=np.int64)
    coll = ~df["p2p"].to_numpy(bool)
    ordinal[coll] = df[coll].groupby(["rank", "group"]).cumcount().to_numpy()
    df["ordinal"] = ordinal
    return df


MAX_LISTED = 20  # ranks listed per consistency problem (the count says how many in all)


def _consistency(df) -> dict:
    """Sequence gaps per (rank, group), ranks whose op counts differ from their group's, and
    members that logged nothing in a group; one vectorized pass, details only for what is off."""
    gaps, mismatches, missing = [], [], []
    g = df.groupby(["rank", "pg"], sort=True)["seq"]
    st = pd.DataFrame({"n": g.size(), "min": g.min(), "max": g.max(), "uniq": g.nunique()})
    off = st[(st["min"] != 0) | (st["max"] != st["n"] - 1) | (st["uniq"] != st["n"])]
    for (r, pg) in off.index:
        seqs = df.loc[(df["rank"] == r) & (df["pg"] == pg), "seq"].to_numpy()
        have = set(seqs.tolist())
        # the first 10 gaps, never a loop bounded by a value read from a file
        lost = list(itertools.islice((s for s in range(int(seqs.max()) + 1) if s not in have), 10))
        gaps.append({"rank": int(r), "pg": pg, "missing_seq": lost,
                     "duplicates": int(len(seqs) - len(have))})
    ranks_present = set(df["rank"].unique().tolist())
    # per (group, rank): count of each collective op, and of p2p ops
    kind = df["op"].astype(object).where(~df["p2p"], "p2p")
    counts = (df.assign(kind=kind).groupby(["group", "rank", "kind"], observed=True).size()
              .unstack("kind", fill_value=0))
    if "p2p" not in counts.columns:
        counts["p2p"] = 0
    for key, c in counts.groupby(level=0, sort=True, observed=True):
        c = c.droplevel(0)
        members = [int(x) for x in str(key).split(":", 1)[1].split(",") if x not in ("?", "")]
        logged = set(int(r) for r in c.index)
        absent = [m for m in members if m in ranks_present and m not in logged]
        if absent:
            missing.append({"group": key, "ranks": absent[:MAX_LISTED],
                            **({"ranks_count": len(absent)} if len(absent) > MAX_LISTED else {})})
        if len(c) > 1:
            tot = c.sum(axis=1).to_numpy()
            ref = c.iloc[int(np.argmax(tot))]  # the first rank with the most records
            bad = c[(c != ref).any(axis=1)]
            if len(bad):
                def counter(row):
                    return {op: int(v) for op, v in row.items() if v or op == "p2p"}
                listed = bad.iloc[:MAX_LISTED]
                mismatches.append({"group": key, "expected": counter(ref),
                                   "ranks": {str(int(r)): counter(row) for r, row in listed.iterrows()},
                                   **({"ranks_count": len(bad)} if len(bad) > MAX_LISTED else {})})
    return {"ok": not (gaps or mismatches or missing), "seq_gaps": gaps,
            "count_mismatches": mismatches, "ranks_missing_group": missing}


def _instances(df) -> pd.DataFrame:
    """One row per collective instance (group, ordinal) with all the members that logged it."""
    c = df.loc[~df["p2p"], ["group", "ordinal", "op", "mesh_dim", "gsize", "bytes", "step", "rank",
                            "t_enq", "t_end", "device_ms", "dur_ms", "blocked_ms"]]
    if c.empty:
        return pd.DataFrame()
    # numbers once for every record, not per instance (a Python call per instance: minutes
    # at a million instances)
    c = c.assign(device_ms=pd.to_numeric(c["device_ms"], errors="coerce").astype(float))
    agg = c.groupby(["group", "ordinal"]).agg(
        op=("op", "first"), mesh_dim=("mesh_dim", "first"), gsize=("gsize", "first"),
        bytes=("bytes", "max"), step=("step", "min"), members=("rank", "nunique"),
        first_enq=("t_enq", "min"), last_enq=("t_enq", "max"), first_end=("t_end", "min"),
        device_ms=("device_ms", "median"),
        rank_dur=("dur_ms", "median"), blocked_ms=("blocked_ms", "mean"))
    agg = agg.reset_index()
    a2c = (agg["first_end"] - agg["last_enq"]).clip(lower=0)
    complete = agg["members"] >= agg["gsize"]
    agg["a2c_ms"] = np.where(complete, a2c, np.nan)
    agg["time_ms"] = agg["device_ms"].where(agg["device_ms"].notna(),
                                            agg["a2c_ms"].where(complete, agg["rank_dur"]))
    return agg


def _p2p_pairs(df) -> pd.DataFrame:
    """Pair the k-th send a->b with the k-th recv on b from a (p2p ordering per pair)."""
    p = df[df["p2p"] & df["peer"].notna()].copy()
    if p.empty:
        return pd.DataFrame()
    p["peer"] = p["peer"].astype(int)
    p["src"] = np.where(p["op"] == "send", p["rank"], p["peer"])
    p["dst"] = np.where(p["op"] == "send", p["peer"], p["rank"])
    p["k"] = p.groupby(["group", "op", "src", "dst"]).cumcount()
    s = p[p["op"] == "send"].set_index(["group", "src", "dst", "k"])
    r = p[p["op"] == "recv"].set_index(["group", "src", "dst", "k"])
    j = s.merge(r, how="inner", left_index=True, right_index=True, suffixes=("_s", "_r"))
    if j.empty:
        return pd.DataFrame()
    out = pd.DataFrame({
        "group": j.index.get_level_values("group"), "op": "send_recv",
        "mesh_dim": j["mesh_dim_s"].to_numpy(), "gsize": 2, "bytes": j["bytes_s"].to_numpy(),
        "step": j["step_s"].to_numpy(),
        "device_ms": pd.to_numeric(j["device_ms_r"], errors="coerce").to_numpy(),
        "a2c_ms": (j["t_end_r"] - np.maximum(j["t_enq_s"], j["t_enq_r"])).clip(lower=0).to_numpy(),
        "blocked_ms": ((j["blocked_ms_s"] + j["blocked_ms_r"]) / 2).to_numpy(),
    })
    out["time_ms"] = np.where(np.isnan(out["device_ms"].astype(float)), out["a2c_ms"],
                              out["device_ms"])
    return out


def _dim(x):
    """mesh_dim as JSON: a name or None (pandas turns None into NaN in object columns)."""
    return x if isinstance(x, str) else None


def _bandwidth_table(inst: pd.DataFrame) -> list[dict]:
    rows = []
    inst = inst[inst["time_ms"].notna()]
    inst = inst.assign(bucket=inst["bytes"].map(size_bucket))
    for (op, bucket, group), g in inst.groupby(["op", "bucket", "group"]):
        t = g["time_ms"].to_numpy(dtype=float)
        b = g["bytes"].to_numpy(dtype=float)
        total_ms = float(t.sum())
        n = int(g["gsize"].iloc[0] or 0)
        wire_op = "send" if op == "send_recv" else op
        algbw = float(b.sum() / (total_ms / 1e3) / 1e9) if total_ms > 0 and b.sum() > 0 else None
        rows.append({"op": op, "size_bucket": int(bucket), "group": group,
                     "mesh_dim": _dim(g["mesh_dim"].iloc[0]), "ranks": n, "count": int(len(g)),
                     "bytes": float(np.median(b)), "total_ms": total_ms,
                     "median_ms": float(np.median(t)),
                     "algbw_GBps": algbw,
                     "busbw_GBps": algbw * bus_factor(wire_op, n) if algbw is not None else None})
    rows.sort(key=lambda x: -x["total_ms"])
    return rows


def _lateness(df, inst, kept_steps) -> dict:
    c = df.loc[~df["p2p"] & (df["gsize"] > 1), ["rank", "step", "group", "ordinal", "t_enq", "mesh_dim"]]
    if c.empty or inst.empty:
        return {"per_rank": []}
    full = inst[(inst["members"] >= inst["gsize"]) & (inst["gsize"] > 1)]
    full = full[full["step"].isin(kept_steps)] if kept_steps is not None else full
    m = c[["rank", "step", "group", "ordinal", "t_enq", "mesh_dim"]].merge(
        full[["group", "ordinal", "first_enq", "last_enq"]], on=["group", "ordinal"])
    if m.empty:
        return {"per_rank": []}
    m["late_ms"] = m["t_enq"] - m["first_enq"]
    m["last"] = (m["t_enq"] >= m["last_enq"]) & (m["last_enq"] > m["first_enq"])
    # the label of each distinct mesh_dim once (a per-record lambda costs seconds at 4,096 ranks)
    codes, uniq = pd.factorize(m["mesh_dim"].fillna("other"))
    m["dim"] = np.array([str(d if d is not None else "other") for d in uniq] + ["other"],
                        dtype=object)[codes]
    g = m.groupby("rank")["late_ms"]
    agg = pd.DataFrame({"n": g.size(), "mean_ms": g.mean(), "median_ms": g.median(),
                        "p90_ms": g.quantile(0.9), "max_ms": g.max(),
                        "last_frac": m.groupby("rank")["last"].mean()})
    by_dim: dict[int, dict] = {}
    for (r, d), v in m.groupby(["rank", "dim"])["late_ms"].mean().items():
        by_dim.setdefault(int(r), {})[d] = float(v)
    per_rank = [{"rank": int(r), "n": int(a.n), "mean_ms": float(a.mean_ms),
                 "median_ms": float(a.median_ms), "p90_ms": float(a.p90_ms),
                 "max_ms": float(a.max_ms), "last_frac": float(a.last_frac),
                 "by_dim_mean_ms": by_dim.get(int(r), {})}
                for r, a in zip(agg.index, agg.itertuples(index=False))]
    return {"per_rank": per_rank}


def _blocked(run, df, kept_steps):
    steps = run.steps()
    if steps.empty or kept_steps is None:
        return None
    steps = steps.drop_duplicates(["rank", "step"], keep="last")
    steps = steps[steps["step"].isin(kept_steps)]
    if steps.empty:
        return None
    k = df.loc[df["step"].isin(kept_steps), ["rank", "group", "mesh_dim", "blocked_ms"]]
    blocked = k.groupby("rank")["blocked_ms"].sum()
    step_ms = steps.groupby("rank")["dur_ms"].sum()
    per_rank = []
    for r, total in step_ms.items():
        b = float(blocked.get(r, 0.0))
        per_rank.append({"rank": int(r), "blocked_ms": b, "step_ms": float(total),
                         "fraction": b / float(total) if total > 0 else None})
    by_group = (k.groupby(["group", "mesh_dim"], dropna=False)["blocked_ms"].sum()
                / max(1, k["rank"].nunique()) / max(1, len(kept_steps)))
    top = [{"group": g, "mesh_dim": _dim(d), "blocked_ms_per_step": float(v)}
           for (g, d), v in by_group.sort_values(ascending=False).head(5).items()]
    fr = [p["fraction"] for p in per_rank if p["fraction"] is not None]
    return {"per_rank": per_rank, "median_fraction": float(np.median(fr)) if fr else None,
            "top_groups": top, "steps": len(kept_steps)}


def _kept_steps(run, df):
    steps = run.steps()
    if steps.empty:
        return None

    drop = excluded_set(excluded_steps(steps, overhead_spans(run)))
    kept = sorted(int(s) for s in steps["step"].unique() if int(s) not in drop)
    return kept or sorted(int(s) for s in steps["step"].unique())


def analyze(run) -> AnalyzerResult:
    df = _frame(run)
    if df.empty:
        return _no_communication(run)
    kept = _kept_steps(run, df)
    consistency = _consistency(df)
    inst = _instances(df)
    pairs = _p2p_pairs(df)
    stat_inst = inst[inst["step"].isin(kept)] if kept is not None and not inst.empty else inst
    stat_pairs = pairs[pairs["step"].isin(kept)] if kept is not None and not pairs.empty else pairs
    both = pd.concat([x for x in (stat_inst, stat_pairs) if not x.empty], ignore_index=True) \
        if not (stat_inst.empty and stat_pairs.empty) else pd.DataFrame()
    table = _bandwidth_table(both) if not both.empty else []

    slowest, per_dim = [], []
    if not both.empty:
        for group, g in both.groupby("group"):
            t = g["time_ms"].fillna(0)
            slowest.append({"group": group, "mesh_dim": _dim(g["mesh_dim"].iloc[0]),
                            "ranks": int(g["gsize"].iloc[0] or 0), "count": int(len(g)),
                            "total_ms": float(t.sum()), "bytes": float(g["bytes"].sum()),
                            "blocked_ms": float(g["blocked_ms"].sum()),
                            "ops": dict(Counter(g["op"]))})
        slowest.sort(key=lambda x: -x["total_ms"])
        for dim, g in both.groupby(both["mesh_dim"].fillna("other")):
            t = float(g["time_ms"].fillna(0).sum())
            b = float(g["bytes"].sum())
            per_dim.append({"mesh_dim": dim, "count": int(len(g)), "total_ms": t, "bytes": b,
                            "algbw_GBps": b / (t / 1e3) / 1e9 if t > 0 else None,
                            "ops": dict(Counter(g["op"]))})
        per_dim.sort(key=lambda x: -x["total_ms"])

    lateness = _lateness(df, inst, kept)
    blocked = _blocked(run, df, kept)
    unc = uncertainty_ns(run)
    metrics = {
        "records": int(len(df)), "ranks": int(df["rank"].nunique()),
        "groups": int(df["group"].nunique()),
        "device_timed": bool(pd.to_numeric(df["device_ms"], errors="coerce").notna().any()),
        "bandwidth": table, "slowest_groups": slowest[:TOP_GROUPS], "per_dim": per_dim,
        "lateness": lateness, "blocked": blocked, "consistency": consistency,
        "steps_analysed": kept,
        "clock_uncertainty_ms": {str(r): u / 1e6 for r, u in unc.items()},
        "in_flight_at_end": int(df["end_ns"].isna().sum()),
    }
    findings = []
    # With profiler traces, comm_compute judges exposed communication (it sees overlap with
    # compute); the collective log's blocked time is the fallback when no trace was captured.
    # Time spent waiting for a late rank (a straggler, a rank starved of input) is that rank's
    # finding, not communication: it is left out here.
    late = _late_waits(run, blocked)
    ddp = _ddp_buckets_finding(run, kept, metrics)
    if ddp is not None:
        findings.append(ddp)
    elif blocked and late["median_fraction"] is not None and not run.profiler_traces() \
            and late["median_fraction"] >= EXPOSED_FRACTION:
        top = blocked["top_groups"][:3]
        names = ", ".join(f"{t['group']} ({t['mesh_dim'] or 'world/other'}, "
                          f"{t['blocked_ms_per_step']:.1f} ms/step)" for t in top)
        findings.append(Finding(
            "exposed_comm", "warning", [],
            f"ranks spend {100 * late['median_fraction']:.0f} % of each step blocked in "
            f"collectives (median over ranks); most in {names}" + late["note"],
            evidence={"median_blocked_fraction": late["median_fraction"], "top_groups": top,
                      "per_rank": blocked["per_rank"], "source": "collective log",
                      "waiting_for_late_ranks_ms": late["wait_ms"], "late_ranks": late["late"]}))
    if blocked is not None:
        blocked["median_fraction_excl_late_ranks"] = late["median_fraction"]
    return AnalyzerResult(metrics=metrics, findings=findings)


def _ddp_buckets_finding(run, kept, metrics: dict) -> Finding | None:
    """DDP's gradient buckets (analyzers/_ddp_buckets.py) in ``metrics["ddp_buckets"]``, and
    the exposed_comm finding their merge to a larger bucket_cap_mb is worth: raised when the
    replay saves ≥ estimates.MIN_SAVING of the job's median step."""
    ddp = _ddp_buckets.measure(run.collectives(), kept, _ddp_cap(run),
                               run.steps().drop_duplicates(["rank", "step"], keep="last"))
    if ddp is None:
        return None
    step_ms = ((step_time.analyze(run).metrics or {}).get("job") or {}).get("median_ms")
    e = est.ddp_buckets_merged(ddp, step_ms)
    rows = ddp.pop("per_rank_step")
    metrics["ddp_buckets"] = {**ddp, "estimate": e,
                              "span_ms_per_step": round(float(np.median([r["span_ms"] for r in rows])), 3)}
    if not e or e["saving_fraction"] < est.MIN_SAVING:
        return None
    mb = lambda b: f"{b / 2 ** 20:.2g} MB"  # noqa: E731
    cap = ddp["cap_bytes"]
    now = f"bucket_cap_mb={mb(cap)}: " if cap else ""
    return Finding(
        "exposed_comm", "warning", [],
        f"DDP all-reduces its gradients in {ddp['buckets_per_step']:g} buckets per step "
        f"({now}median {ddp['median_bucket_bytes'] / 1024:.3g} KB), each paying "
        f"{ddp['alpha_ms']:.2f} ms of fixed cost: from the first bucket to the last one's "
        f"completion takes {metrics['ddp_buckets']['span_ms_per_step']:.1f} ms per step; in "
        f"{ddp['buckets_after']} bucket(s) of ≤ {mb(ddp['target_cap_bytes'])} the step would take "
        f"{e['saving_ms']:.1f} ms less",
        evidence={"source": "collective log (DDP buckets)", **{k: v for k, v in ddp.items()}},
        fix=(f"raise DDP's bucket_cap_mb to {mb(ddp['target_cap_bytes'])} or more "
             f"(DistributedDataParallel(..., bucket_cap_mb={ddp['target_cap_bytes'] / 2 ** 20:g})): "
             f"{ddp['buckets_per_step']:g} small all-reduces per step become "
             f"{ddp['buckets_after']}"),
        estimate=e)


def _ddp_cap(run) -> int | None:
    """The largest bucket_bytes_cap the ranks' DDP models report (meta.json ``ddp``)."""
    caps = []
    for r in list(run.ranks)[:64]:
        try:
            caps += [m.get("bucket_bytes_cap") for m in (run.rank_meta(r) or {}).get("ddp") or []]
        except Exception:  # noqa: BLE001 - meta is optional
            continue
    caps = [c for c in caps if isinstance(c, int) and not isinstance(c, bool)]
    return max(caps) if caps else None


def _late_waits(run, blocked) -> dict:
    """The blocked fraction without the waits for late ranks (stragglers analyzer)."""
    out = {"median_fraction": blocked["median_fraction"] if blocked else None, "late": [],
           "wait_ms": {}, "note": ""}
    if not blocked:
        return out
    # lazy: breaks a cycle analyzers.collectives<->analyzers.stragglers
    from trainprof.analyzers.stragglers import waits_or_problem

    w = waits_or_problem(run, NAME)
    if w is None or not w["wait_ms"]:
        return out
    n = max(1, blocked["steps"])
    fr = [max(0.0, p["blocked_ms"] - n * w["wait_ms"].get(p["rank"], 0.0)) / p["step_ms"]
          for p in blocked["per_rank"] if p["step_ms"]]
    waited = max(w["wait_ms"].values())
    out.update(median_fraction=float(np.median(fr)) if fr else None, late=w["late"],
               wait_ms={str(k): v for k, v in w["wait_ms"].items()},
               note=f" (not counting the waits for late rank{'s' if len(w['late']) > 1 else ''} "
                    f"{', '.join(map(str, w['late']))}, up to {waited:.0f} ms/step per rank: "
                    "see that rank's finding)")
    return out


def _no_communication(run) -> AnalyzerResult:
    """A job of several ranks (run directory) whose ranks each recorded ≥ NO_COMM_MIN_STEPS
    steps with the collective log on, and not one collective: nothing synchronizes the ranks,
    so each trains its own model (data parallelism not set up: no DDP / FSDP wrapping, or a
    launcher that never formed a group). A finding, with what the framework integration says of
    its data-parallel size."""
    try:
        ranks = list(run.ranks)
        world = int(run.world_size or 0)
        steps = run.steps()
    except Exception:  # noqa: BLE001 - bare traces, unreadable parts: nothing to say here
        return AnalyzerResult()
    if world < 2 or len(ranks) < 2 or steps is None or steps.empty or "step" not in steps:
        return AnalyzerResult()
    metas = {r: run.rank_meta(r) for r in ranks}
    if not all(m.get("activated_by") for m in metas.values()):
        return AnalyzerResult()  # not every rank's probes ran (or not written by them)
    if any("collectives" in (m.get("probes_off") or ()) for m in metas.values()):
        return AnalyzerResult()  # the log was off: its absence says nothing
    counts = steps.groupby("rank")["step"].nunique()
    if len(counts) < 2 or int(counts.min()) < NO_COMM_MIN_STEPS:
        return AnalyzerResult()
    dist = sorted(r for r, m in metas.items() if m.get("backend")
                  or m.get("activated_by") in ("init_process_group", "device_mesh"))
    dp = sorted({int(m["framework"]["data_parallel_size"]) for m in metas.values()
                 if isinstance(m.get("framework"), dict)
                 and isinstance(m["framework"].get("data_parallel_size"), int)})
    fw = next((m["framework"].get("name") for m in metas.values()
               if isinstance(m.get("framework"), dict) and m["framework"].get("name")), None)
    n = len(counts)
    lo, hi = int(counts.min()), int(counts.max())
    msg = (f"the job's {n} ranks issued no collective in {lo if lo == hi else f'{lo}-{hi}'} steps "
           f"each: nothing synchronizes them, so each rank trains its own model on its own data "
           f"(data-parallel training all-reduces gradients every step: DDP, FSDP)")
    if dist:
        msg += (f"; {'every rank' if len(dist) == n else f'{len(dist)} of the ranks'} called "
                "init_process_group, but no collective followed")
    else:
        msg += "; no rank called init_process_group: the processes never formed a group"
    if dp == [1]:
        msg += f"; {fw or 'the framework'} reports a data-parallel size of 1"
    msg += (" (communication outside torch.distributed and DDP's reducer, e.g. Horovod or MPI, "
            "is not seen)")
    ev = {"ranks": n, "world_size": world, "steps_per_rank": {str(r): int(c) for r, c in counts.items()},
          "init_process_group_ranks": dist, "framework_data_parallel_size": dp or None}
    return AnalyzerResult(metrics={"records": 0, "no_communication": ev},
                          findings=[Finding("no_communication", "warning", sorted(int(r) for r in counts.index),
                                            msg, evidence=ev)])
