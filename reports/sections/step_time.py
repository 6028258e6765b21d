"""Step time: job statistics, per-rank table, step time per rank over the run."""

from __future__ import annotations

from trainprof.reports import kit, ranks as rk, svg

TITLE = "Step time"


def _job(job: dict) -> str:
    if not isinstance(job, dict) or not job:
        return ""
    shown = {
        "steps analysed": job.get("steps"),
        "median step": kit.fmt_ms(job.get("median_ms")),
        "p90 step": kit.fmt_ms(job.get("p90_ms")),
        "mean step": kit.fmt_ms(job.get("mean_ms")),
        "tokens / step": job.get("tokens_per_step"),
        "tokens / s at the median step": job.get("tokens_per_s"),
        "tokens / s over all analysed steps": job.get("tokens_per_s_mean"),
        "steps recorded": job.get("steps_recorded"),
        "ranks reporting": job.get("ranks_reporting"),
    }
    return kit.kv({k: v for k, v in shown.items() if v is not None})


def _plot(by_rank: dict, first_step: int, excluded: set[int], summary: dict,
          axis: list | None = None) -> str:
    rows = sorted(((int(r), v) for r, v in by_rank.items() if isinstance(v, list)), key=lambda x: x[0])
    if not rows:
        return ""
    n_steps = max(len(v) for _, v in rows)
    steps = ([int(s) for s in axis] if isinstance(axis, list) and len(axis) == n_steps
             and all(isinstance(s, int) for s in axis) else list(range(first_step, first_step + n_steps)))
    if len(rows) > 16:  # a line per rank is unreadable past a few dozen: rank × step heatmap
        return rk.rank_heatmap(dict(rows), steps, "Step time per rank (ms)", "ms", summary,
                               alt="Heatmap of step time by rank and step", named=rk.named(summary),
                               scale_cols=[i for i, s in enumerate(steps) if s not in excluded])
    # step 0 (set-up) can be 1000x a normal step: keep the axis on the analysed steps
    kept = [x for _, v in rows for s, x in zip(steps, v)
            if isinstance(x, (int, float)) and s not in excluded]
    every = [x for _, v in rows for x in v if isinstance(x, (int, float))]
    title = "Step time per rank (grey: excluded from statistics)"
    top = svg.extent(every)[1]
    if kept and every and max(every) > 3 * max(kept):
        top = 1.5 * max(kept)
        title += f"\nexcluded steps run off the scale, up to {kit.fmt_ms(max(every))}"
    p = svg.Plot((steps[0] - 0.5, steps[-1] + 0.5), (0, top), width=860, height=240, title=title,
                 xlabel="step", ylabel="step time (ms)", grid="both",
                 xticks=_step_ticks(steps) if steps[-1] - steps[0] + 1 == len(steps) else None)
    for s in sorted(excluded):
        if steps[0] <= s <= steps[-1]:
            p.vspan(s - 0.5, s + 0.5, "#adb5bd", 0.3, tip=f"step {s}: excluded from statistics")
    markers = 3 if n_steps <= 200 else 0
    for i, (r, v) in enumerate(rows):
        colour = svg.PALETTE[i % len(svg.PALETTE)]
        ys = [x if isinstance(x, (int, float)) else None for x in v]
        p.line(steps[:len(ys)], ys, colour, tip=f"rank {r}", markers=markers,
               tips=[f"rank {r}, step {s}: {kit.fmt_ms(x)}" for s, x in zip(steps, ys)])
        p.key(f"rank {r}", colour, "line")
    return svg.figure(p.render(), "Step time per rank for every recorded step")


def _step_ticks(steps: list[int]) -> list[tuple[int, str]]:
    """Integer step ticks, about a dozen."""
    every = max(1, -(-len(steps) // 12))
    for nice in (1, 2, 5, 10, 20, 25, 50, 100, 200, 250, 500, 1000):
        if nice >= every:
            every = nice
            break
    return [(s, str(s)) for s in steps if s % every == 0]


def render(metrics: dict, summary: dict) -> str:
    parts = [_job(metrics.get("job") or {})]
    excluded_map = metrics.get("excluded_steps") or {}
    excluded = {int(s) for v in excluded_map.values() if isinstance(v, list) for s in v
                if isinstance(s, (int, float))}
    by_rank = metrics.get("step_ms_by_rank") or {}
    if by_rank:
        parts.append(_plot(by_rank, int(metrics.get("first_step") or 0), excluded, summary,
                           metrics.get("steps")))
        parts.append(rk.bounded_note(metrics))
    per_rank = metrics.get("per_rank") or []
    if per_rank:
        coords = {r.get("rank"): r.get("coords") for r in (summary.get("run") or {}).get("ranks", [])
                  if isinstance(r, dict)}
        rows = [{**p, "coords": kit.coord_text(coords.get(p.get("rank")) or {})}
                for p in per_rank if isinstance(p, dict)]
        cols = [("rank", "rank")] + ([("coords", "mesh")] if any(r["coords"] for r in rows) else [])
        parts.append("<h3>Per rank</h3>" + rk.rank_table(
            rows,
            cols + [("steps", "steps"), ("median_ms", "median"),
             ("p90_ms", "p90"), ("min_ms", "min"), ("max_ms", "max"), ("spread_pct", "spread (p90/median)")],
            fmt={"median_ms": kit.fmt_ms, "p90_ms": kit.fmt_ms, "min_ms": kit.fmt_ms,
                 "max_ms": kit.fmt_ms, "spread_pct": lambda x: kit.fmt_pct(x / 100)},
            worst=lambda r: r.get("median_ms"), worst_label="median step time",
            pinned=rk.named(summary)))
    reasons = metrics.get("excluded_reasons") or {}
    parts.append(kit.para(
        "Excluded from statistics: "
        + "; ".join(f"{k}: {', '.join(str(s) for s in v) or 'none'}"
                    + (f" ({reasons[k]})" if isinstance(reasons.get(k), str) and v else "")
                    for k, v in excluded_map.items() if isinstance(v, list))
        + ". The job's step time for a step is the slowest rank's.", "note"))
    return "".join(parts)
