"""Step time: job statistics, per-rank table, step time per rank over the run."""

from __future__ import annotations

from trainprof.reports import kit, ranks as rk

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
        "tokens / s": job.get("tokens_per_s"),
        "steps recorded": job.get("steps_recorded"),
        "ranks reporting": job.get("ranks_reporting"),
    }
    return kit.kv({k: v for k, v in shown.items() if v is not None})


def _plot(by_rank: dict, first_step: int, excluded: set[int], summary: dict) -> str:
    rows = sorted(((int(r), v) for r, v in by_rank.items() if isinstance(v, list)), key=lambda x: x[0])
    if not rows:
        return ""
    n_steps = max(len(v) for _, v in rows)
    steps = list(range(first_step, first_step + n_steps))
    if len(rows) > 16:  # a line per rank is unreadable past a few dozen: rank × step heatmap
        return rk.rank_heatmap(dict(rows), steps, "Step time per rank (ms)", "ms", summary,
                               alt="Heatmap of step time by rank and step", named=rk.named(summary),
                               scale_cols=[i for i, s in enumerate(steps) if s not in excluded])
    plt = kit.plt()
    fig, ax = plt.subplots(figsize=(8, 3.4))
    for r, v in rows:
        xs = [s for s, x in zip(steps, v) if isinstance(x, (int, float))]
        ys = [x for x in v if isinstance(x, (int, float))]
        ax.plot(xs, ys, marker="o", markersize=3, linewidth=1.2, label=f"rank {r}")
    for s in sorted(excluded):
        if steps[0] <= s <= steps[-1]:
            ax.axvspan(s - 0.5, s + 0.5, color="#adb5bd", alpha=0.25, linewidth=0)
    # step 0 (set-up) can be 1000x a normal step: keep the axis on the analysed steps
    kept = [x for _, v in rows for s, x in zip(steps, v)
            if isinstance(x, (int, float)) and s not in excluded]
    every = [x for _, v in rows for x in v if isinstance(x, (int, float))]
    title = "Step time per rank (grey: excluded from statistics)"
    if kept and every and max(every) > 3 * max(kept):
        ax.set_ylim(0, 1.5 * max(kept))
        title += f"\nexcluded steps run off the scale, up to {kit.fmt_ms(max(every))}"
    ax.set_xlabel("step")
    ax.set_ylabel("step time (ms)")
    ax.grid(alpha=0.3)
    ax.set_title(title, fontsize=9)
    if len(rows) <= 16:
        ax.legend(fontsize=7, ncol=min(4, len(rows)), loc="upper right")
    return kit.figure(fig, "Step time per rank for every recorded step")


def render(metrics: dict, summary: dict) -> str:
    parts = [_job(metrics.get("job") or {})]
    excluded_map = metrics.get("excluded_steps") or {}
    excluded = {int(s) for v in excluded_map.values() if isinstance(v, list) for s in v
                if isinstance(s, (int, float))}
    by_rank = metrics.get("step_ms_by_rank") or {}
    if by_rank:
        parts.append(_plot(by_rank, int(metrics.get("first_step") or 0), excluded, summary))
    per_rank = metrics.get("per_rank") or []
    if per_rank:
        coords = {r.get("rank"): r.get("coords") for r in (summary.get("run") or {}).get("ranks", [])
                  if isinstance(r, dict)}
        rows = [{**p, "coords": " ".join(f"{k}{v}" for k, v in (coords.get(p.get("rank")) or {}).items())}
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
    parts.append(kit.para(
        "Excluded from statistics: "
        + "; ".join(f"{k}: {', '.join(str(s) for s in v) or 'none'}" for k, v in excluded_map.items())
        + ". The job's step time for a step is the slowest rank's.", "note"))
    return "".join(parts)
