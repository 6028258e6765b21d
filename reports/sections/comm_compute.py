"""Comm vs compute: per-rank stacked bars, rank × step heatmaps, per-type and per-mesh-dim tables."""

from __future__ import annotations

from trainprof.reports import kit, ranks as rk, svg

TITLE = "Communication vs computation"
_PARTS = (("compute_fraction", "compute", "#2f9e44"), ("overlapped_fraction", "comm hidden under compute", "#74c0fc"),
          ("exposed_comm_fraction", "exposed comm", "#e03131"), ("data_fraction", "data loading", "#f59f00"),
          ("other_fraction", "other (GPU traces: memcpy/memset; CPU traces: host)", "#868e96"), ("idle_fraction", "idle", "#dee2e6"))


def _bars(per_rank: list, summary: dict) -> str:
    by_rank = {r["rank"]: [float(r.get(key) or 0) for key, _, _ in _PARTS] for r in per_rank}
    rows, n_single, note = rk.chart_rows(by_rank, summary, rk.named(summary))
    xs = [label for label, _ in rows]
    p = svg.Plot((-0.5, len(rows) - 0.5), (0, 1), width=min(1100, max(900, 18 * len(rows) + 440)),
                 height=230 if not note else 260, xlabel="rank" if not note else "rank / host",
                 ylabel="share of profiled steps", xticks=svg.category_ticks(xs),
                 yfmt=lambda v: f"{100 * v:.0f} %", xtick_size=svg.FONT if not note else 9,
                 legend_at="bottom" if note else "right")
    bottom = [0.0] * len(rows)
    for i, (key, label, color) in enumerate(_PARTS):
        # a group's bar: the mean of its ranks' shares (means of shares still add up to 1)
        vals = [sum(by_rank[r][i] for r in members) / len(members) for _, members in rows]
        for j, ((name, members), v) in enumerate(zip(rows, vals)):
            if v > 0:
                who = f"rank {name}" if not note else name if len(members) == 1 else \
                    f"{name} (mean of {len(members):,} ranks)"
                p.rect(j - 0.4, j + 0.4, bottom[j], bottom[j] + v, color, f"{who} — {label}: {kit.fmt_pct(v)}")
        p.key(label, color)
        bottom = [b + v for b, v in zip(bottom, vals)]
    if note:
        p.vline(n_single - 0.5, "#000", 1)
        note = note.replace("the median of", "the mean of")
    return svg.figure(p.render(), "Per-rank breakdown of the profiled steps") + (kit.para(note, "note") if note else "")


def _step_label(per_step: list, step) -> str:
    run = {r.get("run_step") for r in per_step if r["step"] == step} - {None}
    return f"{step} (job step {run.pop()})" if len(run) == 1 else str(step)


def _heatmaps(per_step: list, summary: dict) -> str:
    ranks = sorted({r["rank"] for r in per_step})
    steps = sorted({r["step"] for r in per_step})
    if len(steps) < 1 or len(ranks) < 1:
        return ""
    at = {(r["rank"], r["step"]): r for r in per_step}
    out = []
    labels = [_step_label(per_step, s) for s in steps]
    for key, title in (("compute_ms", "compute (ms)"), ("exposed_comm_ms", "exposed communication / wait (ms)")):
        by_rank = {r: [(at.get((r, s)) or {}).get(key) for s in steps] for r in ranks}
        out.append(rk.rank_heatmap(by_rank, labels, f"{title}, rank × profiled step", "ms", summary,
                                   alt=f"{title}, rank × profiled step", named=rk.named(summary)))
    return "".join(out)


def render(metrics: dict, summary: dict) -> str:
    job = metrics.get("job") or {}
    per_rank = metrics.get("per_rank") or []
    parts = [kit.kv({"traces": job.get("trace_kind"), "ranks": job.get("ranks"),
                     **{label: kit.fmt_pct(job.get(key)) for key, label, _ in _PARTS}}),
             kit.para("Definitions: docs/comm-compute.md. CPU traces: compute = aten ops on the "
                      "main thread; communication = gloo worker threads and main-thread waits.")]
    if per_rank:
        parts.append(_bars(per_rank, summary))
        parts.append(_heatmaps(metrics.get("per_step") or [], summary))
        rows = []
        for r in per_rank:
            row = {"rank": r["rank"], "coords": kit.coord_text(r.get("coords") or {}),
                   "step_ms": r.get("step_window_ms"), **{k: r.get(k) for k, _, _ in _PARTS}}
            if r.get("hta_view"):
                row["HTA idle/compute/non-compute/overlap %"] = " / ".join(
                    str(r["hta_view"][k]) for k in ("idle_pct", "compute_pct", "non_compute_pct", "overlap_pct"))
            rows.append(row)
        fmt = {k: kit.fmt_pct for k, _, _ in _PARTS}
        fmt["step_ms"] = kit.fmt_ms
        columns = list(dict.fromkeys(k for r in rows for k in r))
        parts.append(rk.rank_table(rows, [(k, k) for k in columns], fmt,
                                   worst=lambda r: r.get("exposed_comm_fraction"),
                                   worst_label="exposed communication", pinned=rk.named(summary)))
        types: dict[str, list] = {}
        for r in per_rank:
            for t, v in (r.get("comm_by_type_ms_per_step") or {}).items():
                types.setdefault(t, []).append(v)
        if types:
            parts.append(kit.table([{"collective": t, "ms per step (mean over ranks)": sum(v) / len(v)}
                                    for t, v in sorted(types.items())],
                                   fmt={"ms per step (mean over ranks)": kit.fmt_ms}))
    dims = metrics.get("by_mesh_dim") or []
    if dims:
        agg: dict[str, dict[str, list]] = {}
        for d in dims:
            a = agg.setdefault(str(d["mesh_dim"]), {"comm": [], "exposed": [], "blocked": []})
            for key, col in (("comm", "comm_ms_per_step"), ("exposed", "exposed_ms_per_step"),
                             ("blocked", "blocked_ms_per_step")):
                if d.get(col) is not None:
                    a[key].append(d[col])
        mean = lambda v: sum(v) / len(v) if v else None  # noqa: E731
        logged = any(v["blocked"] for v in agg.values())  # traces alone have no collective log
        parts.append(kit.para("Per mesh dimension, ms per profiled step (mean over ranks): "
                              "communication and its exposed part from the traces"
                              + ("; time blocked in collectives from the always-on collective log "
                                 "(all steps but 0)." if logged else ".")))
        cols = ("comm", "exposed", "worst rank exposed") + (("blocked (log)",) if logged else ())
        parts.append(kit.table(
            [{"mesh dim": k, "comm": mean(v["comm"]), "exposed": mean(v["exposed"]),
              "worst rank exposed": max(v["exposed"]) if v["exposed"] else None,
              **({"blocked (log)": mean(v["blocked"])} if logged else {})}
             for k, v in sorted(agg.items())],
            fmt={c: kit.fmt_ms for c in cols}))
    stalls = [r for r in per_rank if r.get("sync_calls_per_step")]
    if stalls:
        parts.append(kit.para("Host-side stalls (GPU): blocking synchronizations and device-to-host "
                              "copies inside the profiled steps."))
        cols = ("rank", "sync calls/step", "sync ms/step", "share of step", "D2H copies/step")
        parts.append(rk.rank_table([{"rank": r["rank"], "sync calls/step": r["sync_calls_per_step"],
                                     "sync ms/step": r["sync_ms_per_step"], "share of step": r["sync_fraction"],
                                     "D2H copies/step": r.get("d2h_copies_per_step")} for r in stalls],
                                   [(c, c) for c in cols],
                                   fmt={"sync ms/step": kit.fmt_ms, "share of step": kit.fmt_pct},
                                   worst=lambda r: r.get("share of step"), worst_label="share of step"))
    warm = job.get("warmup_steps") or []
    if warm:
        parts.append(kit.para(f"Warm-up profiled steps left out of the fractions: {', '.join(map(str, warm))}."))
    return "".join(parts)
