"""Pipeline: measured bubble vs the schedule's theory, Gantt chart of one step, stage compute."""

from __future__ import annotations

from trainprof.reports import kit, ranks as rk

TITLE = "Pipeline"
COLORS = {"F": "#4c78a8", "B": "#f58518", "W": "#54a24b"}


def _points(x) -> str | None:
    return f"{100 * x:+.1f} points" if isinstance(x, (int, float)) else None


def _summary(m: dict) -> str:
    cfg = m.get("config") or {}
    th = m.get("theory") or {}
    dec = m.get("decomposition") or {}
    shown = {
        "schedule": cfg.get("schedule"),
        "stages (p) × micro-batches (m)": f"{cfg.get('pp')} × {cfg.get('micro_batches')}",
        "virtual stages per rank (v)": cfg.get("virtual_stages"),
        "measured bubble (share of the pipeline window)": kit.fmt_pct(m.get("bubble_fraction")),
        "theory (share)": kit.fmt_pct(th.get("share")) if th else "unknown for this schedule",
        "replayed with free hand-overs": kit.fmt_pct(dec.get("replayed_free_handovers"))
        if dec else None,
        "of which hand-overs / host work between actions": _points(dec.get("handovers")),
        "of which uneven or varying compute (replayed − theory)": _points(dec.get("uneven_compute")),
        "bubble as share of the whole step": kit.fmt_pct(m.get("bubble_share_of_step"))
        if m.get("bubble_share_of_step") is not None else None,
        "measured bubble ÷ compute": m.get("bubble_ratio"),
        f"theory bubble ÷ compute {th.get('formula', '')}".strip(): th.get("ratio") if th else None,
        "critical stage": m.get("critical_stage"),
        "span times": {"device": "GPU (CUDA events)", "host": "host wall clock",
                       "mixed": "GPU where recorded, else host"}.get(m.get("timeline")),
        "steps analysed": ", ".join(str(s) for s in m.get("steps_analysed") or []),
    }
    return kit.kv({k: v for k, v in shown.items() if v is not None})


def _gantt(g: dict) -> str:
    spans = [s for s in g.get("spans") or [] if isinstance(s, dict)]
    if not spans:
        return ""
    plt = kit.plt()
    rows = sorted({(s.get("pp") if s.get("pp") is not None else 0, s.get("rank")) for s in spans})
    ypos = {key: i for i, key in enumerate(rows)}
    fig, ax = plt.subplots(figsize=(9, 0.6 * len(rows) + 1.4))
    window = float(g.get("window_ms") or max(s["start_ms"] + s["dur_ms"] for s in spans))
    for s in spans:
        y = ypos[(s.get("pp") if s.get("pp") is not None else 0, s.get("rank"))]
        ax.broken_barh([(s["start_ms"], s["dur_ms"])], (y - 0.4, 0.8),
                       facecolors=COLORS.get(s.get("kind"), "#999999"), edgecolor="white", linewidth=0.5)
        if s["dur_ms"] > window / 60:
            ax.text(s["start_ms"] + s["dur_ms"] / 2, y, str(s.get("microbatch")), ha="center",
                    va="center", fontsize=6, color="white")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"pp {pp} (rank {r})" for pp, r in rows], fontsize=7)
    ax.invert_yaxis()
    if g.get("timeline") == "device":
        ax.set_xlabel("ms (GPU time per rank; rows anchored at each rank's first launch)")
    else:
        ax.set_xlabel("ms since the first span of the step")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    ax.legend(handles, ["forward", "backward", "weight grad"], fontsize=7, loc="upper center",
              bbox_to_anchor=(0.5, -0.3), ncol=3, frameon=False)
    pipe = f", pipeline {g['pipeline']}" if g.get("pipeline") else ""
    ax.set_title(f"Step {g.get('step')}{pipe}: spans per stage (numbers: micro-batch)", fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    return kit.figure(fig, f"Pipeline Gantt chart of step {g.get('step')}")


def render(metrics: dict, summary: dict) -> str:
    parts = [_summary(metrics), _gantt(metrics.get("gantt") or {})]
    th = metrics.get("theory") or {}
    per_stage = [dict(p, theory=th.get("share")) for p in metrics.get("per_stage") or []
                 if isinstance(p, dict)]
    if per_stage:
        parts.append("<h3>Bubble per pipeline rank (median over steps)</h3>" + kit.table(
            per_stage, [("pp", "pp"), ("stages", "stages"), ("ranks", "ranks"),
                        ("bubble_share", "measured bubble"), ("theory", "theory"),
                        ("bubble_ratio", "idle ÷ busy"), ("busy_ms", "busy"),
                        ("p2p_wait_ms", "blocked in p2p"), ("window_ms", "pipeline window")],
            fmt={"bubble_share": kit.fmt_pct, "theory": kit.fmt_pct, "busy_ms": kit.fmt_ms,
                 "p2p_wait_ms": kit.fmt_ms, "window_ms": kit.fmt_ms, "ranks": rk.rank_list}))
    stages = [s for s in metrics.get("stages") or [] if isinstance(s, dict)]
    if stages:
        parts.append("<h3>Compute per micro-batch and stage</h3>" + kit.table(
            stages, [("stage", "stage"), ("ranks", "ranks"), ("compute_ms_per_mb", "compute"),
                     ("span_ms_per_mb", "span (incl. blocked in collectives)"),
                     ("ratio_to_others", "÷ median of other stages")],
            fmt={"compute_ms_per_mb": kit.fmt_ms, "span_ms_per_mb": kit.fmt_ms, "ranks": rk.rank_list}))
    parts.append(kit.para(
        "Bubble = share of the pipeline window (first span start to last span end of the step, "
        "clocks aligned) in which a rank ran no forward/backward/weight-grad span. Theory: "
        "bubble ÷ compute = (p−1)/m for GPipe and 1F1B, (p−1)/(v·m) interleaved; as a share of "
        "the window ratio/(1+ratio), e.g. (p−1)/(m+p−1). Replayed with free hand-overs: the "
        "same step re-run on paper with the measured span durations, in each rank's order, every "
        "stage-to-stage dependency met the moment its producer ends; what the measured bubble has "
        "beyond it is hand-overs and host work between actions, what it has beyond theory is "
        "uneven or varying compute.", "note"))
    return "".join(parts)
