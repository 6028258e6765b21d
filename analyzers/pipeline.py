"""Pipeline parallelism: measured bubble per stage beside the schedule's theory, a Gantt chart of
one step, the critical stage, and stage imbalance — from the F/B/W spans in pipeline.jsonl.

Definitions (docs/stragglers-pipeline.md):
* A *pipeline* is the set of ranks that differ only in their pp coordinate (one per DP replica
  and TP index). Its *window* in a step runs from the first span start to the last span end
  over its ranks (clock-aligned): the optimizer step, data loading and the end-of-step
  collectives lie outside it.
* busy(rank) = the union of the rank's F/B/W spans in the window; bubble share = 1 − busy/window
  (the share of the window the device sat idle); bubble ratio = idle/busy, the "bubble time ÷
  ideal compute" of the papers. Theory: ratio (p−1)/m for GPipe and 1F1B, (p−1)/(v·m)
  interleaved; share = ratio/(1+ratio), i.e. (p−1)/(m+p−1) for GPipe/1F1B.
* compute per micro-batch of a stage = its span time minus the time the rank was blocked in
  collectives inside those spans (TP all-reduces, FSDP all-gathers: waiting for a slow peer is
  not the stage's own work); per step, the least over its micro-batches of each kind (F, B,
  W), summed over the kinds (a span the host descheduled is not the stage's work; a heavy
  stage is heavy in every micro-batch).
* The job's bubble needs every stage of every pipeline: when a rank left no spans (its files
  missing, a rank that never started) the job-level figures are withheld (``withheld`` says why,
  ``partial`` which ranks); per-rank and per-stage figures stay.
"""

from __future__ import annotations

import numpy as np

from trainprof._lazy import pd
from trainprof.analyzers import _intervals as iv
from trainprof.analyzers import _mb_cost
from trainprof.analyzers._clock import offsets
from trainprof.analyzers._pipeline_replay import replay_window
from trainprof.analyzers._pipeline_theory import ORDER_FORMULA, fbw_times, order_theory, theory
from trainprof.findings import AnalyzerResult, Finding
from trainprof.wording import ranks_phrase
from trainprof.analyzers.step_time import (excluded_set, excluded_steps, overhead_spans,
                                            partial_note)

NAME = "pipeline"
BUBBLE_MARGIN = 0.10       # finding when measured share > theory + 10 percentage points
HOST_BUBBLE_MARGIN = 0.15  # ... on host timelines, judged on the replay with typical spans:
                           # clean interleaved runs on 2 shared cores measured theory −3.4..+7.0
                           # points (1F1B, 20 runs) and −3.9..+7.4 (zero-bubble, 20 runs)
IMBALANCE_RATIO = 1.5      # a stage's compute per micro-batch ≥ 1.5 × the median of the others
                           # (clean 8-rank CPU runs under contention measured up to 1.26×)
CONSISTENT = 0.5           # ... in at least half of the analysed steps
MAX_GANTT_SPANS = 4000
NEED = ("step", "stage", "kind", "start_ns", "end_ns")
P2P_OPS = ("send", "recv", "isend", "irecv")


def _frame(run) -> pd.DataFrame:
    df = run.frame("pipeline")
    if df.empty:
        return df
    missing = [c for c in NEED if c not in df.columns]
    if missing:
        run.problems.append(f"{run.path}/ranks/*/pipeline.jsonl: records lack {missing}; "
                            "pipeline analysis skipped")
        return pd.DataFrame()
    df = df.dropna(subset=list(NEED)).copy()
    if "microbatch" not in df.columns:
        df["microbatch"] = -1
    df["microbatch"] = pd.to_numeric(df["microbatch"], errors="coerce").fillna(-1).astype(int)
    for c in ("step", "stage"):
        df[c] = df[c].astype(int)
    df["start_ns"] = df["start_ns"].astype(np.int64)
    df["end_ns"] = df["end_ns"].astype(np.int64)
    bad = df["end_ns"] < df["start_ns"]
    if bad.any():
        run.problems.append(f"{run.path}/ranks/*/pipeline.jsonl: {int(bad.sum())} spans end before "
                            "they start; ignored")
        df = df[~bad]
    align = offsets(run)
    df["a_start"] = df["start_ns"]
    df["a_end"] = df["end_ns"]
    for r in df["rank"].unique():
        m = (df["rank"] == r).to_numpy()
        df.loc[m, "a_start"] = np.asarray(align[int(r)](df.loc[m, "start_ns"].to_numpy()), np.int64)
        df.loc[m, "a_end"] = np.asarray(align[int(r)](df.loc[m, "end_ns"].to_numpy()), np.int64)
    return _device_times(df)


def _device_times(df) -> pd.DataFrame:
    """GPU stages: the host span only covers kernel launches, so where every span of a (rank,
    step) has CUDA event times, place them on the device timeline instead: device_start_ms is
    relative to the step's first span on the rank, anchored at that span's (aligned) host start.
    Positions within a rank are exact; between ranks only the anchors (host launch) line up."""
    df["device"] = False
    if "device_start_ms" not in df.columns or "device_ms" not in df.columns:
        return df
    ds = pd.to_numeric(df["device_start_ms"], errors="coerce")
    dd = pd.to_numeric(df["device_ms"], errors="coerce")
    has = ds.notna() & dd.notna()
    full = has.groupby([df["rank"], df["step"]]).transform("all")
    if not full.any():
        return df
    base = df.loc[full].groupby(["rank", "step"])["a_start"].transform("min")
    # int64 throughout: epoch ns in float64 would lose ~256 ns
    start = base.astype(np.int64) + (ds[full] * 1e6).round().astype(np.int64)
    df.loc[full, "a_start"] = start
    df.loc[full, "a_end"] = start + (dd[full] * 1e6).round().astype(np.int64)
    df.loc[full, "device"] = True
    return df


def _blocked(run, ranks) -> tuple[dict[int, iv.Set], dict[tuple[int, int], float]]:
    """rank -> union of the intervals (local ns) it spent blocked in collectives, and
    (rank, step) -> ms blocked in point-to-point ops (the stage hand-overs of the schedule)."""
    out, p2p = {}, {}
    for r in ranks:
        s, e = [], []
        for rec in run.stream(r, "collectives"):
            try:
                end, b = rec.get("end_ns"), float(rec.get("blocked_ms") or 0.0)
            except (TypeError, ValueError):
                continue
            if end is None or b <= 0 or rec.get("replay"):  # (a NaN replay's, not the job's)
                continue
            s.append(int(end) - int(b * 1e6))
            e.append(int(end))
            if rec.get("op") in P2P_OPS and isinstance(rec.get("step"), int):
                p2p[(r, rec["step"])] = p2p.get((r, rec["step"]), 0.0) + b
        out[r] = iv.union(s, e) if s else iv.EMPTY
    return out, p2p


def _overlap(sets: iv.Set, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Length of sets ∩ [start, end) for every span (prefix sums over the disjoint set)."""
    if sets[0].size == 0:
        return np.zeros(len(starts))
    s, e = sets
    cum = np.concatenate([[0], np.cumsum(e - s)])

    def covered(t):  # length of the set before t
        i = np.searchsorted(s, t, side="right")  # pieces starting at or before t
        j = np.maximum(i - 1, 0)
        return np.where(i > 0, cum[j] + np.clip(np.minimum(t, e[j]) - s[j], 0, None), 0)

    return (covered(ends) - covered(starts)).astype(float)


def _pipelines(run, ranks) -> dict[int, str]:
    """rank -> label of its pipeline: its coordinates other than pp ("dp0 tp1"; "" if unknown)."""
    out = {}
    for r in ranks:
        c = run.coords(r)
        out[r] = " ".join(f"{k}{v}" for k, v in sorted(c.items()) if k != "pp")
    return out


def _kept_steps(run, steps_in_spans):
    st = run.steps()
    drop = {0}
    excluded = {"warmup": [0], "profiler": []}
    if not st.empty:
        excluded = excluded_steps(st, overhead_spans(run))
        drop = excluded_set(excluded)
    kept = sorted(s for s in steps_in_spans if s not in drop)
    return (kept or sorted(steps_in_spans)), excluded


def _config(run, df) -> dict:
    info = {}
    for r in run.ranks:
        info = run.rank_meta(r).get("run_info") or {}
        if info:
            break
    meta_pp = {}
    for r in run.ranks:
        meta_pp = run.rank_meta(r).get("pipeline") or {}
        if meta_pp:
            break
    seen_stages = int(df["stage"].nunique())
    per_rank_stages = int(df.groupby("rank")["stage"].nunique().max())
    v = int(info.get("virtual_stages") or meta_pp.get("virtual_stages") or per_rank_stages or 1)
    n_stages = int(meta_pp.get("num_stages") or seen_stages)
    p = int(info.get("pp") or max(1, n_stages // max(v, 1)))
    mb_seen = int(df.groupby(["rank", "step", "stage"])["microbatch"].nunique().median())
    m = int(info.get("micro_batches") or meta_pp.get("micro_batches") or mb_seen)
    # run_info's name ("1f1b") or the schedule class the probe saw ("Schedule1F1B")
    schedule = info.get("schedule") or meta_pp.get("schedule")
    src = ("run_info" if info.get("micro_batches") else
           "meta.pipeline" if meta_pp.get("micro_batches") else "spans")
    return {"schedule": schedule, "pp": p, "micro_batches": m, "virtual_stages": v,
            "num_stages": n_stages, "source": src, "stage_layers": info.get("stage_layers")}


def _step_tables(df, blocked, p2p, pipes, kept):
    """Per (rank, step): window, busy, bubble; per (rank, step, stage): compute per micro-batch."""
    k = df[df["step"].isin(kept)].copy()
    k["pipe"] = k["rank"].map(lambda r: pipes[int(r)])
    w0s = k.groupby(["pipe", "step"])["a_start"].min().to_dict()  # int64 ns: no float rounding
    w1s = k.groupby(["pipe", "step"])["a_end"].max().to_dict()
    # device timelines are not aligned across ranks: the pipeline's window is then the longest
    # one rank spans (stage 0 runs the first forward and the last backward in GPipe/1F1B)
    own = k.groupby(["rank", "step"]).agg(a0=("a_start", "min"), a1=("a_end", "max"),
                                          dev=("device", "all"))
    own["pipe"] = [pipes[int(r)] for r, _ in own.index]
    own["w"] = own["a1"] - own["a0"]
    dev_w = own.groupby(["pipe", own.index.get_level_values("step")]).agg(
        dev=("dev", "all"), w=("w", "max")).to_dict("index")
    replayed = _replayed_windows(k)
    replayed_typical = _replayed_windows(k, typical=True)
    k["typical_ns"] = (k["a_end"] - k["a_start"]).groupby(
        [k["pipe"], k["step"], k["stage"], k["kind"].astype(str)]).transform("min")
    rows, stage_rows = [], []
    for (r, step), g in k.groupby(["rank", "step"]):
        key = (pipes[int(r)], step)
        dw = dev_w[key]
        window = int(dw["w"]) if dw["dev"] else int(w1s[key]) - int(w0s[key])
        busy = iv.length(iv.union(g["a_start"].to_numpy(), g["a_end"].to_numpy()))
        rw, rt = replayed.get(key), replayed_typical.get(key)
        rows.append({"rank": int(r), "step": int(step), "window_ms": window / 1e6,
                     "busy_ms": busy / 1e6, "p2p_wait_ms": p2p.get((int(r), int(step)), 0.0),
                     "replay_window_ms": rw / 1e6 if rw else np.nan,
                     "typical_busy_ms": float(g["typical_ns"].sum()) / 1e6,
                     "replay_typical_window_ms": rt / 1e6 if rt else np.nan,
                     "share": 1 - busy / window if window > 0 else np.nan,
                     "ratio": (window - busy) / busy if busy > 0 else np.nan})
        dur = (g["a_end"] - g["a_start"]).to_numpy(dtype=float)
        # host spans: time blocked in collectives inside them is waiting, not compute; device
        # spans are kernel time already
        blk = np.where(g["device"].to_numpy(), 0.0, _overlap(
            blocked.get(int(r), iv.EMPTY), g["start_ns"].to_numpy(), g["end_ns"].to_numpy()))
        g = g.assign(compute=dur - blk, span=dur)
        for stage, gs in g.groupby("stage"):
            nmb = max(1, gs["microbatch"].nunique())
            # per kind (F, B, W) the least over the micro-batches, summed: the host only ever
            # lengthens a span (a loaded CPU host: 0.6 ms spans at 5-11 ms, several of a step's
            # micro-batches at times), while a heavy stage is heavy in every micro-batch
            per_mb = gs.groupby(["kind", "microbatch"], observed=True)["compute"].sum()
            typical = float(per_mb.groupby(level="kind", observed=True).min().sum())
            stage_rows.append({"rank": int(r), "step": int(step), "stage": int(stage),
                               "compute_ms_per_mb": typical / 1e6,
                               "compute_mean_ms_per_mb": gs["compute"].sum() / 1e6 / nmb,
                               "span_ms_per_mb": gs["span"].sum() / 1e6 / nmb,
                               "microbatches": int(nmb)})
    return pd.DataFrame(rows), pd.DataFrame(stage_rows)


def _typical_durations(g) -> pd.Series:
    """Each span's duration replaced by the least of its (stage, kind) in the step: what the
    stage's compute takes when the host does not deschedule it (_step_tables)."""
    dur = g["a_end"] - g["a_start"]
    return dur.groupby([g["stage"], g["kind"].astype(str)]).transform("min")


def _replayed_windows(k, typical: bool = False) -> dict:
    """(pipeline, step) -> window in ns had every hand-over between stages been free
    (_pipeline_replay); ``typical``: with every span at its (stage, kind)'s least duration in
    the step as well. Missing where micro-batch numbers are unknown or the orders conflict."""
    out = {}
    for key, g in k.groupby(["pipe", "step"]):
        if (g["microbatch"] < 0).any():
            continue
        dur = _typical_durations(g) if typical else g["a_end"] - g["a_start"]
        w = replay_window(zip(g["rank"].tolist(), g["a_start"].tolist(), g["stage"].tolist(),
                              g["microbatch"].tolist(), g["kind"].astype(str).tolist(),
                              dur.tolist()))
        if w:
            out[key] = w
    return out


def _decomposition(per, bubble, th) -> dict | None:
    """Measured bubble = theory + uneven compute + hand-overs (points of the window, job values
    as medians over steps like bubble_fraction)."""
    ok = per.groupby("step")["replay_window_ms"].transform(lambda x: x.notna().all())
    p = per[ok]
    if p.empty:
        return None
    by_step = _idle_share_by_step(p, "replay_window_ms")
    replayed = float(by_step.median())
    out = {"measured": bubble, "replayed_free_handovers": replayed,
           "replayed_by_step": {str(int(s)): float(v) for s, v in by_step.items()},
           "handovers": bubble - replayed, "theory": th["share"] if th else None,
           "uneven_compute": replayed - th["share"] if th else None}
    if "replay_typical_window_ms" in p and p["replay_typical_window_ms"].notna().all():
        # each span at its (stage, kind)'s least time in the step as well: what the schedule
        # and the stages' typical compute leave idle; replayed − this is the micro-batch jitter
        typ = float(_idle_share_by_step(p, "replay_typical_window_ms", "typical_busy_ms").median())
        out.update(replayed_typical_compute=typ, varying_compute=replayed - typ)
    return out


def _idle_share_by_step(per, window_col, busy_col: str = "busy_ms") -> pd.Series:
    """step -> idle share of all ranks' windows together (1 − Σbusy / Σwindow)."""
    return per.groupby("step").apply(
        lambda g: 1 - g[busy_col].sum() / g[window_col].sum(), include_groups=False)


def _cause(d: dict | None) -> str:
    if not d or d.get("uneven_compute") is None:
        return ("; communication between stages or uneven stages stretch the pipeline: more "
                "micro-batches or an interleaved schedule shrink the bubble")
    h, u = 100 * d["handovers"], 100 * d["uneven_compute"]
    head = (f"; replayed with free hand-overs the step idles {100 * d['replayed_free_handovers']:.0f} %: "
            f"{h:.0f} points come from hand-overs and host work between the stages' actions, "
            f"{u:.0f} from uneven or varying micro-batch compute")
    if h >= u:
        return head + (": stage-to-stage transfers, the waits around them and whatever the host "
                       "does between two actions are on the critical path (see blocked in p2p): "
                       "check the link between the stages' devices and the host's work between "
                       "actions; larger micro-batches amortize each hand-over")
    return head + (": compare the stages' compute per micro-batch and its spread over steps; "
                   "move layers off the slower stage")


def _gantt(df, run, pipes, per, kept) -> dict:
    """Spans of one representative step (window closest to the median) of rank 0's pipeline."""
    first = min(pipes, key=lambda r: r)
    pipe = pipes[first]
    members = sorted(r for r in pipes if pipes[r] == pipe)
    pp_of = {r: run.coords(r).get("pp", i) for i, r in enumerate(members)}
    rows = {}  # one row per pp position: its lowest rank (TP peers run the same spans)
    for r in members:
        rows.setdefault(pp_of[r], r)
    shown = sorted(rows.values(), key=lambda r: pp_of[r])
    w = per[per["rank"].isin(shown)].groupby("step")["window_ms"].max()
    if w.empty:
        return {}
    step = int((w - w.median()).abs().idxmin())
    g = df[(df["step"] == step) & df["rank"].isin(shown)]
    t0 = int(g["a_start"].min())
    spans = [{"rank": int(x.rank), "pp": int(pp_of[int(x.rank)]), "stage": int(x.stage),
              "microbatch": int(x.microbatch), "kind": str(x.kind),
              "start_ms": (int(x.a_start) - t0) / 1e6, "dur_ms": (int(x.a_end) - int(x.a_start)) / 1e6}
             for x in g.sort_values("a_start").itertuples()][:MAX_GANTT_SPANS]
    timeline = "device" if bool(g["device"].all()) else "host"
    return {"step": step, "ranks": shown, "pipeline": pipe, "timeline": timeline,
            "window_ms": float((g["a_end"].max() - t0) / 1e6), "spans": spans}


def _imbalance(stage_df, cfg, stage_ranks) -> tuple[list[dict], list[Finding]]:
    per_step = stage_df.groupby(["step", "stage"])["compute_ms_per_mb"].median().unstack("stage")
    stages = []
    for s in per_step.columns:
        col = stage_df[stage_df["stage"] == s]
        stages.append({"stage": int(s), "ranks": stage_ranks.get(int(s), []),
                       "compute_ms_per_mb": float(col["compute_ms_per_mb"].median()),
                       **({"compute_mean_ms_per_mb": float(col["compute_mean_ms_per_mb"].median())}
                          if "compute_mean_ms_per_mb" in col.columns else {}),
                       "span_ms_per_mb": float(col["span_ms_per_mb"].median())})
    findings = []
    if per_step.shape[1] < 2:
        return stages, findings
    layers = cfg.get("stage_layers") or []
    for st in stages:
        s = st["stage"]
        others = per_step.drop(columns=[s])
        ratio = per_step[s] / others.median(axis=1)
        ratio = ratio.replace([np.inf, -np.inf], np.nan).dropna()
        st["ratio_to_others"] = float(ratio.median()) if len(ratio) else None
        if not len(ratio):
            continue
        hit = float((ratio >= IMBALANCE_RATIO).mean())
        if ratio.median() >= IMBALANCE_RATIO and hit >= CONSISTENT:
            other_med = float(np.median([x["compute_ms_per_mb"] for x in stages if x["stage"] != s]))
            ev = {"stage": s, "ranks": st["ranks"], "compute_ms_per_mb": st["compute_ms_per_mb"],
                  "others_median_ms_per_mb": other_med, "ratio": float(ratio.median()),
                  "steps_over_threshold": hit, "threshold": IMBALANCE_RATIO,
                  "per_stage": [{k: x[k] for k in ("stage", "compute_ms_per_mb")} for x in stages]}
            if layers:
                ev["stage_layers"] = layers
            lay = f" (layers per stage: {layers})" if layers else ""
            findings.append(Finding(
                "stage_imbalance", "warning", st["ranks"],
                f"pipeline stage {s} ({ranks_phrase(st['ranks'])}) computes "
                f"{st['compute_ms_per_mb']:.1f} ms per micro-batch, {ratio.median():.2f}× the median "
                f"of the other stages ({other_med:.1f} ms) in {100 * hit:.0f} % of steps{lay}; "
                "every other stage waits for it: move layers off stage "
                f"{s}", evidence=ev))
    return stages, findings


def _incomplete(run, df, cfg, ranks) -> tuple[str | None, dict | None]:
    """(why the job-level bubble is withheld, what is missing), or (None, None): ranks of the
    job without files, or a pipeline with fewer stages in its spans than the schedule has."""
    partial = partial_note(run, len(ranks))
    if partial:
        missing = partial.get("missing_ranks") or []
        return (f"spans from {len(ranks)} of {partial.get('world_size')} ranks"
                + (f" (missing: {', '.join(map(str, missing[:8]))})" if missing else "")), partial
    want = cfg.get("num_stages") or 0
    k = df[["rank", "stage"]].drop_duplicates()
    pipes = _pipelines(run, ranks)
    for pipe, g in k.groupby(k["rank"].map(lambda r: pipes[int(r)])):
        if g["stage"].nunique() < want:
            return (f"pipeline {pipe or '0'} has spans of {g['stage'].nunique()} of {want} "
                    f"stages"), {"world_size": run.world_size, "ranks_reporting": len(ranks),
                                 "missing_ranks": []}
    return None, None


def trace_digest(run, rank, trace) -> dict:
    """A CPU rank's micro-batch cost model from its profiled window's ops and its F/B spans
    (analyzers/_mb_cost.py); {} for GPU traces (host ops there are launches, not the work) and
    ranks without spans in the window."""
    ev = trace.tables.events
    if bool(ev["is_gpu"].any()):
        return {}
    spans = [s for s in run.stream(rank, "pipeline")
             if all(isinstance(s.get(k), int) for k in ("step", "stage", "start_ns", "end_ns"))]
    return (_mb_cost.window_digest(ev, spans) or {}) if spans else {}


def _micro_batch_cost(run) -> dict | None:
    if not run.profiler_traces():
        return None
    return _mb_cost.combine({r: d for r, d in run.trace_digests(NAME).items() if d})


def analyze(run) -> AnalyzerResult:
    df = _frame(run)
    if df.empty:
        return AnalyzerResult()
    kept, excluded = _kept_steps(run, set(df["step"].unique().tolist()))
    ranks = sorted(int(r) for r in df["rank"].unique())
    pipes = _pipelines(run, ranks)
    cfg = _config(run, df)
    blocked, p2p = _blocked(run, ranks)
    per, stage_df = _step_tables(df, blocked, p2p, pipes, kept)
    if per.empty:
        return AnalyzerResult()
    fbw = fbw_times(df)
    order_share, order_ms = order_theory(df, kept, pipes)
    th = theory(cfg["schedule"], cfg["pp"], cfg["micro_batches"], cfg["virtual_stages"], fbw,
                order_share)
    if th and th["formula"] == ORDER_FORMULA:
        th["span_ms"] = order_ms
    elif th and fbw and "F+B-W" in th["formula"]:
        th["span_ms"] = {k: round(v, 4) for k, v in fbw.items()}

    pp_of = {r: run.coords(r).get("pp") for r in ranks}
    stage_ranks: dict[int, list[int]] = {}
    for (r, s) in df[["rank", "stage"]].drop_duplicates().itertuples(index=False):
        stage_ranks.setdefault(int(s), []).append(int(r))
    stage_ranks = {s: sorted(v) for s, v in stage_ranks.items()}

    # job value per step: idle share of all ranks' windows together; job = median over steps
    by_step = _idle_share_by_step(per, "window_ms")
    bubble = float(by_step.median())
    ratio = bubble / (1 - bubble) if bubble < 1 else None
    # the same idle time as a share of the whole step (optimizer, data, end-of-step collectives
    # included): what the bubble costs the job's throughput
    st = run.steps()
    of_step = None
    if not st.empty and "dur_ms" in st.columns:
        dur = st.drop_duplicates(["rank", "step"], keep="last").set_index(["rank", "step"])["dur_ms"]
        j = per.join(dur.rename("step_ms"), on=["rank", "step"]).dropna(subset=["step_ms"])
        if not j.empty:
            of_step = float(j.groupby("step").apply(
                lambda g: (g["window_ms"] - g["busy_ms"]).sum() / g["step_ms"].sum(),
                include_groups=False).median())
    per["pp"] = per["rank"].map(lambda r: pp_of.get(r))
    per_stage = []
    for key, g in per.groupby(per["pp"].fillna(-1)):
        rs = sorted(g["rank"].unique().tolist())
        holds = sorted({s for s, v in stage_ranks.items() if set(v) & set(rs)})
        per_stage.append({"pp": int(key) if key >= 0 else None, "stages": holds, "ranks": rs,
                          "bubble_share": float(g["share"].median()),
                          "bubble_ratio": float(g["ratio"].median()),
                          "busy_ms": float(g["busy_ms"].median()),
                          "p2p_wait_ms": float(g["p2p_wait_ms"].median()),
                          "window_ms": float(g["window_ms"].median())})
    decomposition = _decomposition(per, bubble, th)
    stages, findings = _imbalance(stage_df, cfg, stage_ranks)
    critical = max(stages, key=lambda x: x["compute_ms_per_mb"]) if stages else None

    withheld, partial = _incomplete(run, df, cfg, ranks)
    if withheld:  # computed from part of the pipeline, the job's bubble would be wrong
        bubble = ratio = of_step = decomposition = None
        by_step = by_step.iloc[0:0]
    metrics = {
        "config": cfg, "theory": th, "steps_analysed": kept, "excluded_steps": excluded,
        "timeline": "device" if bool(df["device"].all()) else
                    ("mixed" if bool(df["device"].any()) else "host"),
        "bubble_fraction": bubble, "bubble_ratio": ratio, "bubble_share_of_step": of_step,
        "bubble_fraction_by_step": {str(int(s)): float(v) for s, v in by_step.items()},
        "excess_over_theory": (bubble - th["share"]) if th and bubble is not None else None,
        "decomposition": decomposition,
        "per_stage": per_stage, "stages": stages,
        "critical_stage": critical["stage"] if critical else None,
        "per_rank": [{"rank": int(r), "pp": pp_of.get(int(r)),
                      "bubble_share": float(g["share"].median()),
                      "busy_ms": float(g["busy_ms"].median()),
                      "p2p_wait_ms": float(g["p2p_wait_ms"].median()),
                      "window_ms": float(g["window_ms"].median())} for r, g in per.groupby("rank")],
        "gantt": _gantt(df, run, pipes, per, kept),
        "micro_batch_cost": _micro_batch_cost(run),
        **({"withheld": withheld, "partial": partial} if withheld else {}),
    }
    # what is judged against theory: the measured idle share; on a host timeline (CPU stages)
    # the idle share of the step replayed with free hand-overs and each stage's typical
    # micro-batch time: there the time between a stage's actions is the schedule's host work
    # and the hand-overs (transfers are judged by exposed_comm), and a loaded host stretches
    # spans at random (docs/stragglers-pipeline.md)
    judged, judged_as, margin = bubble, "measured", BUBBLE_MARGIN
    host = metrics["timeline"] == "host"
    if host and decomposition and decomposition.get("replayed_typical_compute") is not None:
        judged, judged_as = decomposition["replayed_typical_compute"], "replayed_typical_compute"
        margin = HOST_BUBBLE_MARGIN
    metrics["judged_bubble"] = {"share": judged, "as": judged_as, "margin": margin}
    if th and judged is not None and judged > th["share"] + margin:
        worst = max(per_stage, key=lambda x: x["bubble_share"])
        imbalanced = [f.evidence["stage"] for f in findings if f.kind == "stage_imbalance"]
        findings.append(Finding(
            "pipeline_bubble", "warning", [],
            f"pipeline devices sit idle {100 * bubble:.0f} % of the pipeline window (median over "
            f"steps), {100 * (bubble - th['share']):.0f} points above the {100 * th['share']:.0f} % "
            f"the {cfg['schedule']} schedule implies for p={cfg['pp']}, m={cfg['micro_batches']}"
            + (f", v={cfg['virtual_stages']}" if cfg["virtual_stages"] > 1 else "")
            + (f"; replayed with free hand-overs and each stage's typical micro-batch time "
               f"(host timeline) it idles {100 * judged:.0f} %" if judged_as != "measured" else "")
            + (f"; stage {imbalanced[0]} is the slow stage (see stage_imbalance): the others "
               "wait for it" if imbalanced else _cause(decomposition)),
            evidence={"measured_share": bubble, "judged_share": judged, "judged_as": judged_as,
                      "theory_share": th["share"],
                      "theory_ratio": th["ratio"], "measured_ratio": ratio,
                      "formula": th["formula"], "margin": margin, "worst_pp": worst,
                      "decomposition": decomposition, "config": cfg}))
    return AnalyzerResult(metrics=metrics, findings=findings)
