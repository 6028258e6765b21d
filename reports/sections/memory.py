"""Memory: timeline per rank, model-state breakdown measured vs expected, snapshots."""

from __future__ import annotations

import statistics

from trainprof.reports import kit, ranks as rk

TITLE = "Memory"
STATE = (("params_bytes", "parameters"), ("grads_bytes", "gradients"),
         ("optimizer_state_bytes", "optimizer state"))


def _top(series: list, value, named: list, n: int = rk.OUTLIERS) -> list:
    """The series of the named ranks, then those with the largest value(series), in rank order."""
    first = [x for x in series if _int(x[0]) in named][:n]
    rest = sorted((x for x in series if x not in first), key=lambda x: -value(x))
    return sorted(first + rest[:max(0, n - len(first))], key=lambda x: _int(x[0]))


def _int(r) -> int:
    try:
        return int(r)
    except (TypeError, ValueError):
        return -1


def _median_line(ax, xs_ys: list, label: str) -> None:
    """Dashed median over ranks at each x (for a plot that draws only some of the ranks)."""
    by_x: dict = {}
    for xs, ys in xs_ys:
        for x, y in zip(xs, ys):
            if isinstance(y, (int, float)):
                by_x.setdefault(x, []).append(y)
    xs = sorted(by_x)
    ax.plot(xs, [statistics.median(by_x[x]) / 2**20 for x in xs], "--", color="black", linewidth=1.4,
            label=label)


def _timeline(metrics: dict, named: list) -> str:
    tl = metrics.get("timeline") or {}
    win = metrics.get("window_timeline") or {}
    series = []
    for r, t in sorted(tl.items(), key=lambda kv: int(kv[0]) if kv[0].isdigit() else 0):
        key = next((k for k in ("allocated_bytes", "rss_bytes") if t.get(k)), None)
        if key:
            series.append((r, t["step"], t[key], key))
    if not series and not win:
        return ""
    plt = kit.plt()
    n = 1 + bool(win)
    fig, axes = plt.subplots(1, n, figsize=(5 * n, 3.2), squeeze=False)
    ax = axes[0][0]
    many = len(series) > 16  # past a few dozen lines: the highest ranks and the median of all
    shown = _top(series, lambda x: max((y for y in x[2] if y is not None), default=0), named) \
        if many else series
    for r, steps, ys, key in shown:
        ax.plot(steps, [y / 2**20 if y is not None else None for y in ys], marker="o", markersize=3,
                linewidth=1.1, label=f"rank {r}")
    if many:
        _median_line(ax, [(steps, ys) for _, steps, ys, _ in series], f"median of {len(series):,} ranks")
    if series:
        ax.set_title(f"{series[0][3].replace('_bytes', '')} per step (MiB)"
                     + (f"\n{len(shown)} highest of {len(series):,} ranks" if many else ""), fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(series) <= 8 or many:
            ax.legend(fontsize=6 if many else 7)
    if win:
        ax2 = axes[0][1]
        wins = [(r, w) for r, w in sorted(win.items(), key=lambda kv: _int(kv[0]))
                if isinstance(w, dict) and w.get("t_ms") and w.get("allocated_bytes")]
        of = ""
        if len(wins) > 16:
            of = f"\n{rk.OUTLIERS} highest of {len(wins):,} ranks"
            wins = _top(wins, lambda x: max(v for v in x[1]["allocated_bytes"] if v is not None), named)
        for r, w in wins:
            ax2.plot(w["t_ms"], [y / 2**20 for y in w["allocated_bytes"]], linewidth=1, label=f"rank {r}")
        absolute = all(w.get("absolute") for w in win.values())
        ax2.set_title("allocated during the profiled steps (MiB" + ("" if absolute else
                      ", net of what existed before") + ")" + of, fontsize=9)
        if of:
            ax2.legend(fontsize=6)
        ax2.set_xlabel("ms since the window opened")
        ax2.grid(alpha=0.3)
    fig.tight_layout()
    return kit.figure(fig, alt="Memory per rank over the steps and inside the profiled window")


def _coords(c) -> str:
    return " ".join(f"{k}{v}" for k, v in c.items()) if isinstance(c, dict) else kit.fmt_value(c)


def _mismatch(r: dict) -> float:
    m = sum(r["measured"].get(k) or 0 for k, _ in STATE)
    e = sum(r["expected"].get(k) or 0 for k, _ in STATE)
    return abs(m / e - 1) if e else 0.0


def _bars(rows: list[dict]) -> str:
    rows = [r for r in rows if r.get("measured") and r.get("expected")]
    of = ""
    if len(rows) > 16:  # the ranks whose model state is farthest from the layout's expectation
        of = f"\nthe {rk.OUTLIERS} of {len(rows):,} ranks farthest from the expectation"
        rows = sorted(sorted(rows, key=lambda r: -_mismatch(r))[:rk.OUTLIERS],
                      key=lambda r: _int(r.get("rank")))
    if not rows:
        return ""
    plt = kit.plt()
    fig, ax = plt.subplots(figsize=(max(5, 1.2 * len(rows) + 2), 3.2))
    width = 0.38
    colors = ("#4c72b0", "#dd8452", "#55a868")
    for j, (side, off, hatch) in enumerate((("measured", -width / 2, ""), ("expected", width / 2, "//"))):
        bottom = [0.0] * len(rows)
        for (k, label), c in zip(STATE, colors):
            vals = [(r[side].get(k) or 0) / 2**20 for r in rows]
            ax.bar([i + off for i in range(len(rows))], vals, width, bottom=bottom, color=c,
                   hatch=hatch, edgecolor="white", label=label if j == 0 else None)
            bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks(range(len(rows)), [f"rank {r['rank']}" for r in rows], fontsize=8)
    ax.set_ylabel("MiB")
    ax.set_title("Model state per rank: measured (plain) vs expected from the layout (hatched)" + of,
                 fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    return kit.figure(fig, alt="Measured versus expected parameter, gradient and optimizer bytes per rank")


def render(metrics: dict, summary: dict) -> str:
    parts = []
    job = metrics.get("job") or {}
    if job:
        parts.append(kit.kv({"peak (" + str(job.get("peak_metric", "")).replace("_bytes", "") + ")":
                             kit.fmt_bytes(job.get("max_peak_bytes")),
                             "median rank peak": kit.fmt_bytes(job.get("median_peak_bytes")),
                             "worst rank": job.get("worst_rank"), "OOMs": metrics.get("ooms"),
                             "mismatch margin": kit.fmt_pct(metrics.get("margin"))}))
    named = rk.named(summary)
    parts.append(_timeline(metrics, named))
    rows = metrics.get("per_rank") or []
    parts.append(_bars(rows))
    table_rows = []
    for r in rows:
        m, e = r.get("measured") or {}, r.get("expected") or {}
        table_rows.append({"rank": r["rank"], "coords": r.get("coords"),
                           "params": m.get("params_bytes"), "params expected": e.get("params_bytes"),
                           "grads": m.get("grads_bytes"), "grads expected": e.get("grads_bytes"),
                           "optimizer": m.get("optimizer_state_bytes"),
                           "optimizer expected": e.get("optimizer_state_bytes"),
                           "activations + temporaries": r.get("activations_and_temporaries_bytes"),
                           "peak": r.get("peak_allocated_bytes") or r.get("peak_rss_bytes")})
    if table_rows:
        b = kit.fmt_bytes
        parts.append(rk.rank_table(table_rows, [(k, k) for k in table_rows[0]],
                                   fmt={**{k: b for k in table_rows[0] if k not in ("rank", "coords")},
                                        "coords": _coords},
                                   worst=lambda r: r.get("peak"), worst_label="peak", pinned=named))
        e = next((r["expected"] for r in rows if r.get("expected")), None)
        if e:
            parts.append(kit.para(f"Expected: {e.get('bytes_per_param')} B/param ({e.get('precision')}), "
                                  f"sharding {e.get('sharding')}, {e.get('basis')}."))
    snaps = metrics.get("snapshots") or []
    if snaps:
        parts.append(kit.table(snaps, columns=[("file", "snapshot"), ("rank", "rank"),
                                               ("allocated_bytes_now", "allocated at dump"),
                                               ("reserved_bytes_now", "reserved at dump"),
                                               ("peak_allocated_bytes_traced", "peak allocated (trace)")],
                               fmt={k: kit.fmt_bytes for k in ("allocated_bytes_now", "reserved_bytes_now",
                                                               "peak_allocated_bytes_traced")}))
    return "".join(p for p in parts if p)
