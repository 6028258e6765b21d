"""Collectives: bandwidth per op / size / group, slowest groups, per mesh dim, arrival lateness."""

from __future__ import annotations

from trainprof.reports import kit, ranks as rk, svg
from trainprof.wording import plural

TITLE = "Collectives"


def _gbps(x) -> str:
    return "—" if not isinstance(x, (int, float)) else f"{x:.3g} GB/s"


def _lateness_plot(per_rank: list, summary: dict) -> str:
    rows = [p for p in per_rank if isinstance(p, dict) and isinstance(p.get("mean_ms"), (int, float))]
    if len(rows) < 2:
        return ""
    mean = {p["rank"]: p["mean_ms"] for p in rows}
    p90 = {p["rank"]: p.get("p90_ms") for p in rows}
    bars, n_single, note = rk.chart_rows(mean, summary, rk.named(summary))
    xs = [label for label, _ in bars]
    means = [rk.aggregate(mean, m) for _, m in bars]
    p90s = [rk.aggregate(p90, m) for _, m in bars]
    p = svg.Plot((-0.5, len(bars) - 0.5), svg.extent(list(means) + list(p90s)),
                 width=min(1100, max(760, 16 * len(bars) + 200)), height=200 if not note else 240,
                 title="Arrival lateness at collectives (aligned enqueue − group's first)",
                 xlabel="rank" if not note else "rank / host", ylabel="lateness (ms)",
                 xticks=svg.category_ticks(xs), xtick_size=svg.FONT if not note else 9)
    for j, ((name, members), mv, pv) in enumerate(zip(bars, means, p90s)):
        who = f"rank {name}" if not note else name if len(members) == 1 else \
            f"{name} (median of {len(members):,} ranks)"
        if svg.finite(mv) is not None:
            p.rect(j - 0.4, j + 0.4, 0, mv, "#4c6ef5",
                   f"{who}: mean {kit.fmt_ms(mv)}, p90 {kit.fmt_ms(pv)}")
    p.dots(range(len(bars)), p90s, "#e8590c", 4,
           [f"{name if note else 'rank ' + name}: p90 {kit.fmt_ms(v)}" for (name, _), v in zip(bars, p90s)])
    p.key("mean", "#4c6ef5")
    p.key("p90", "#e8590c", "dot")
    if note:
        p.vline(n_single - 0.5, "#000", 1)
    return svg.figure(p.render(), "Mean and p90 arrival lateness per rank") + (kit.para(note, "note") if note else "")


def _bandwidth_classes(bw: list) -> str:
    """One row per (op, mesh dim, size bucket) over its groups: counts and times summed, bus
    bandwidth as the median group's and the slowest group's."""
    classes: dict[tuple, list] = {}
    for b in bw:
        classes.setdefault((b.get("op"), b.get("mesh_dim"), b.get("size_bucket")), []).append(b)
    rows = []
    for (op, dim, size), bs in classes.items():
        bus = sorted((b for b in bs if isinstance(b.get("busbw_GBps"), (int, float))),
                     key=lambda b: b["busbw_GBps"])
        rows.append({"op": op, "mesh_dim": dim, "size_bucket": size, "groups": len(bs),
                     "count": sum(b.get("count") or 0 for b in bs),
                     "total_ms": sum(b.get("total_ms") or 0 for b in bs),
                     "busbw_median": bus[len(bus) // 2]["busbw_GBps"] if bus else None,
                     "busbw_min": bus[0]["busbw_GBps"] if bus else None,
                     "slowest": bus[0].get("group") if bus else None})
    rows.sort(key=lambda r: -r["total_ms"])
    return (f"<h3>Bandwidth by op, mesh dimension and message size ({len(bw):,} op × size × group "
            "rows summarized)</h3>" + kit.table(
                rows, [("op", "op"), ("mesh_dim", "dim"), ("size_bucket", "size ≤"),
                       ("groups", "groups"), ("count", "count"), ("total_ms", "total"),
                       ("busbw_median", "busbw (median group)"), ("busbw_min", "busbw (slowest)"),
                       ("slowest", "slowest group")],
                fmt={"size_bucket": kit.fmt_bytes, "total_ms": kit.fmt_ms, "busbw_median": _gbps,
                     "busbw_min": _gbps, "slowest": rk.group_label}, max_rows=60, what="rows"))


def render(metrics: dict, summary: dict) -> str:
    parts = [kit.kv({
        "records": metrics.get("records"), "ranks": metrics.get("ranks"),
        "groups": metrics.get("groups"),
        "time source": "GPU events" if metrics.get("device_timed") else
        "host, last arrival → first completion (clock-aligned)",
        "still in flight at the end": metrics.get("in_flight_at_end"),
    })]
    cons = metrics.get("consistency") or {}
    if cons and not cons.get("ok", True):
        parts.append(kit.para(
            f"Log consistency problems: {plural(len(cons.get('seq_gaps') or []), 'sequence gap')}, "
            f"{plural(len(cons.get('count_mismatches') or []), 'group')} whose ranks logged different "
            f"counts, {plural(len(cons.get('ranks_missing_group') or []), 'group')} missing on a member "
            "(a rank that skipped or never finished a collective).", "warn"))
        parts.append(kit.table(cons.get("count_mismatches") or [], max_rows=20))
    bw = [b for b in metrics.get("bandwidth") or [] if isinstance(b, dict)]
    max_rows = 60
    if len(bw) > max_rows:  # many groups: per op, dim and size over the groups, then the slowest
        parts.append(_bandwidth_classes(bw))
        bw = sorted(bw, key=lambda b: -(b.get("total_ms") or 0))
        max_rows = rk.TOP
    if bw:
        parts.append(("<h3>Bandwidth by op, message size and group</h3>" if max_rows == 60 else
                      f"<h3>Bandwidth per group: the {rk.TOP} that took the most time</h3>") + kit.table(
            bw, [("op", "op"), ("mesh_dim", "dim"), ("group", "group"), ("ranks", "n"),
                 ("size_bucket", "size ≤"), ("count", "count"), ("total_ms", "total"),
                 ("median_ms", "median"), ("algbw_GBps", "algbw"), ("busbw_GBps", "busbw")],
            fmt={"size_bucket": kit.fmt_bytes, "total_ms": kit.fmt_ms, "median_ms": kit.fmt_ms,
                 "algbw_GBps": _gbps, "busbw_GBps": _gbps, "group": rk.group_label}, max_rows=max_rows))
    slow = metrics.get("slowest_groups") or []
    if slow:
        parts.append("<h3>Slowest groups</h3>" + kit.table(
            slow, [("group", "group"), ("mesh_dim", "dim"), ("ranks", "n"), ("count", "ops"),
                   ("total_ms", "time"), ("blocked_ms", "blocked (mean of members)"),
                   ("bytes", "bytes"), ("ops", "ops by kind")],
            fmt={"total_ms": kit.fmt_ms, "blocked_ms": kit.fmt_ms, "bytes": kit.fmt_bytes,
                 "group": rk.group_label}))
    dims = metrics.get("per_dim") or []
    if dims:
        parts.append("<h3>Per mesh dimension</h3>" + kit.table(
            dims, [("mesh_dim", "dim"), ("count", "ops"), ("total_ms", "time"),
                   ("bytes", "bytes"), ("algbw_GBps", "algbw"), ("ops", "ops by kind")],
            fmt={"total_ms": kit.fmt_ms, "bytes": kit.fmt_bytes, "algbw_GBps": _gbps}))
    late = (metrics.get("lateness") or {}).get("per_rank") or []
    if late:
        parts.append("<h3>Arrival lateness per rank</h3>" + _lateness_plot(late, summary) + rk.rank_table(
            late, [("rank", "rank"), ("n", "collectives"), ("mean_ms", "mean"),
                   ("median_ms", "median"), ("p90_ms", "p90"), ("max_ms", "max"),
                   ("last_frac", "last to arrive"), ("by_dim_mean_ms", "mean by dim (ms)")],
            fmt={"mean_ms": kit.fmt_ms, "median_ms": kit.fmt_ms, "p90_ms": kit.fmt_ms,
                 "max_ms": kit.fmt_ms, "last_frac": kit.fmt_pct},
            worst=lambda r: r.get("mean_ms"), worst_label="mean lateness", pinned=rk.named(summary)))
    blocked = metrics.get("blocked") or {}
    if blocked.get("median_fraction") is not None:
        parts.append(kit.para(
            f"Ranks were blocked in collectives for {kit.fmt_pct(blocked['median_fraction'])} of "
            "the analysed step time (median over ranks; sync ops count their whole call, async "
            "ops the time in wait()).", "note"))
    parts.append(kit.para(
        "algbw = bytes / time and busbw = algbw × factor as in nccl-tests (all_reduce 2(n−1)/n; "
        "all_gather, reduce_scatter, all_to_all (n−1)/n; broadcast, send/recv 1). Bytes: output "
        "size for all_gather, input size for reduce_scatter and all_to_all.", "note"))
    return "".join(parts)
