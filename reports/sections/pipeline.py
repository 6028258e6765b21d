"""Pipeline: measured bubble vs the schedule's theory, Gantt chart of one step, stage compute."""

from __future__ import annotations

from trainprof.reports import kit, ranks as rk, svg

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
        (f"theory bubble ÷ compute {th.get('formula', '')}".strip() if len(th.get("formula", "")) < 40
         else "theory bubble ÷ compute"): th.get("ratio") if th else None,
        "how theory is computed": th.get("formula") if len(th.get("formula", "")) >= 40 else None,
        f"paper's closed form {(th.get('paper') or {}).get('formula', '')} (share)":
            kit.fmt_pct(th["paper"]["share"]) if th.get("paper") else None,
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
    rows = sorted({(s.get("pp") if s.get("pp") is not None else 0, s.get("rank")) for s in spans},
                  key=lambda k: (k[0], k[1] if isinstance(k[1], int) else -1))
    ypos = {key: i for i, key in enumerate(rows)}
    stages: dict = {}  # a rank holding several (virtual) stages: its spans name their stage
    for sp in spans:
        stages.setdefault(sp.get("rank"), set()).add(sp.get("stage"))
    virtual = any(len(v) > 1 for v in stages.values())
    window = float(g.get("window_ms") or max(s["start_ms"] + s["dur_ms"] for s in spans))
    pipe = f", pipeline {g['pipeline']}" if g.get("pipeline") else ""
    xlabel = ("ms (GPU time per rank; rows anchored at each rank's first launch)"
              if g.get("timeline") == "device" else "ms since the first span of the step")
    lo = min(0.0, min(s["start_ms"] for s in spans))
    p = svg.Plot((lo, window * 1.02 if window > 0 else 1.0), (len(rows) - 0.5, -0.5), width=900,
                 height=44 * len(rows) + 10, grid="x", legend_at="bottom", xlabel=xlabel,
                 title=f"Step {g.get('step')}{pipe}: spans per stage (numbers: "
                       + ("stage:micro-batch)" if virtual else "micro-batch)"),
                 yticks=[(i, f"pp {pp} (rank {r})") for i, (pp, r) in enumerate(rows)])
    names = {"F": "forward", "B": "backward", "W": "weight grad"}
    for s in spans:
        key = (s.get("pp") if s.get("pp") is not None else 0, s.get("rank"))
        y = ypos[key]
        x0, d = s["start_ms"], s["dur_ms"]
        what = names.get(s.get("kind"), str(s.get("kind")))
        p.rect(x0, x0 + d, y - 0.4, y + 0.4, COLORS.get(s.get("kind"), "#999999"),
               f"pp {key[0]} (rank {key[1]}) " + (f"stage {s.get('stage')} " if virtual else "")
               + f"{what}, micro-batch {s.get('microbatch')}: {kit.fmt_ms(d)} from {kit.fmt_ms(x0)}",
               ' stroke="#fff" stroke-width="0.6"')
        if d > window / 60:
            label = f"{s.get('stage')}:{s.get('microbatch')}" if virtual else s.get("microbatch")
            p.text(x0 + d / 2, y, label, size=10, anchor="middle", color="#fff",
                   extra=' dominant-baseline="central"')
    for kind, colour in COLORS.items():
        p.key(names[kind], colour)
    return svg.figure(p.render(), f"Pipeline Gantt chart of step {g.get('step')}")


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
