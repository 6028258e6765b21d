"""Memory: timeline per rank, model-state breakdown measured vs expected, snapshots."""

from __future__ import annotations

from trainprof.reports import kit, ranks as rk, svg

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


def _median_line(p, xs_ys: list, label: str) -> None:
    """Dashed median over ranks at each x (for a plot that draws only some of the ranks)."""
    by_x: dict = {}
    for xs, ys in xs_ys:
        for x, y in zip(xs, ys):
            if isinstance(y, (int, float)):
                by_x.setdefault(x, []).append(y)
    xs = sorted(by_x)
    p.line(xs, [kit.median(by_x[x]) / 2**20 for x in xs], "#000", 1.6, dash="5 3", tip=label)
    p.key(label, "#000", "dash")


def _mib(y) -> float | None:
    return y / 2**20 if isinstance(y, (int, float)) else None


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
    plots = []
    if series:
        many = len(series) > 16  # past a few dozen lines: the highest ranks and the median of all
        shown = _top(series, lambda x: max((y for y in x[2] if y is not None), default=0), named) \
            if many else series
        xs = [x for _, steps, _, _ in series for x in steps]
        ys = [_mib(y) for _, _, v, _ in series for y in v]
        p = svg.Plot(svg.extent(xs, zero=False, pad=0.04), svg.extent(ys, zero=False), width=540,
                     height=200, title=f"{series[0][3].replace('_bytes', '')} per step (MiB)"
                     + (f"\n{len(shown)} highest of {len(series):,} ranks" if many else ""),
                     xlabel="step", grid="both")
        for i, (r, steps, v, key) in enumerate(shown):
            colour = svg.PALETTE[i % len(svg.PALETTE)]
            ys = [_mib(y) for y in v]
            p.line(steps, ys, colour, 1.3, tip=f"rank {r}", markers=2.5 if len(steps) <= 200 else 0,
                   tips=[f"rank {r}, step {s}: {kit.fmt_bytes(y)}" for s, y in zip(steps, v)])
            if len(series) <= 8 or many:
                p.key(f"rank {r}", colour, "line")
        if many:
            _median_line(p, [(steps, ys) for _, steps, ys, _ in series], f"median of {len(series):,} ranks")
        plots.append(p.render())
    wins = [(r, w) for r, w in sorted(win.items(), key=lambda kv: _int(kv[0]))
            if isinstance(w, dict) and w.get("t_ms") and w.get("allocated_bytes")]
    if wins:
        of = ""
        if len(wins) > 16:
            of = f"\n{rk.OUTLIERS} highest of {len(wins):,} ranks"
            wins = _top(wins, lambda x: max(v for v in x[1]["allocated_bytes"] if v is not None), named)
        absolute = all(w.get("absolute") for w in win.values() if isinstance(w, dict))
        xs = [x for _, w in wins for x in w["t_ms"]]
        ys = [_mib(y) for _, w in wins for y in w["allocated_bytes"]]
        p = svg.Plot(svg.extent(xs, zero=False, pad=0.03), svg.extent(ys, zero=False), width=540,
                     height=200, title="allocated during the profiled steps (MiB)" + (
                         "" if absolute else "\nnet of what existed before the window") + of,
                     xlabel="ms since the window opened", grid="both")
        for i, (r, w) in enumerate(wins):
            colour = svg.PALETTE[i % len(svg.PALETTE)]
            ys = [_mib(y) for y in w["allocated_bytes"]]
            peak = max((y for y in w["allocated_bytes"] if isinstance(y, (int, float))), default=None)
            p.line(w["t_ms"], ys, colour, 1.1, tip=f"rank {r}: peak {kit.fmt_bytes(peak)}")
            if of:
                p.key(f"rank {r}", colour, "line")
        plots.append(p.render())
    return svg.figure(plots, "Memory per rank over the steps and inside the profiled window")


def _coords(c) -> str:
    return kit.coord_text(c) if isinstance(c, dict) else kit.fmt_value(c)


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
    colors = ("#4c72b0", "#dd8452", "#55a868")
    totals = [sum((r[side].get(k) or 0) for k, _ in STATE) / 2**20 for r in rows
              for side in ("measured", "expected")]
    p = svg.Plot((-0.5, len(rows) - 0.5), svg.extent(totals), width=min(1000, max(520, 90 * len(rows) + 220)),
                 height=210, title="Model state per rank: measured (plain) vs expected from the layout (hatched)" + of,
                 ylabel="MiB", xticks=svg.category_ticks([f"rank {r['rank']}" for r in rows]))
    width = 0.38
    for side, off in (("measured", -width / 2), ("expected", width / 2)):
        for i, r in enumerate(rows):
            bottom = 0.0
            for (k, label), c in zip(STATE, colors):
                v = (r[side].get(k) or 0) / 2**20
                if v <= 0:
                    continue
                x0, x1 = i + off - width / 2, i + off + width / 2
                tip = f"rank {r['rank']}, {label} {side}: {kit.fmt_bytes(v * 2**20)}"
                p.rect(x0, x1, bottom, bottom + v, c, tip, ' stroke="#fff" stroke-width="0.8"')
                if side == "expected":
                    p.rect(x0, x1, bottom, bottom + v, p.hatch(), tip)
                bottom += v
    for (k, label), c in zip(STATE, colors):
        p.key(label, c)
    p.key("expected (hatched)", "#868e96", "hatch")
    return svg.figure(p.render(), alt="Measured versus expected parameter, gradient and optimizer bytes per rank")


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
